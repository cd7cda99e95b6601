"""The engine registry: settings sections, capability checks, sampler-only loading,
futures and checkpoint records (the local engine's own behaviour is in test_engine_local)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from retool import engines
from retool.config import ConfigError, add_config_args, config_from_args, config_from_dict, config_to_dict, markdown_table
from retool.engines import (
    Capabilities,
    EngineCheckpoint,
    EngineSpec,
    LocalSettings,
    Requirements,
    capabilities_table,
    check_supported,
    run_now,
)
from retool.rollout import RolloutError
from retool.train import TrainConfig
from retool.types import Problem

REPO = Path(__file__).resolve().parent.parent


def parse(cls, argv, tmp_path=None, toml=None):
    parser = argparse.ArgumentParser()
    add_config_args(parser, cls)
    if toml is not None:
        path = tmp_path / "preset.toml"
        path.write_text(toml)
        argv = ["--config", str(path), *argv]
    return config_from_args(cls, parser.parse_args(argv))


def test_settings_section_from_flags_preset_and_saved_config(tmp_path):
    cfg = parse(TrainConfig, ["--local-kv-cache-mb", "0", "--no-local-prefix-cache"], tmp_path,
                "[local]\nkv_cache_mb = 512\nmax_sample_rows = 8\n")
    assert cfg.local == LocalSettings(kv_cache_mb=0, max_sample_rows=8, prefix_cache=False)
    assert cfg.engine_settings() is cfg.local
    saved = json.loads(json.dumps(config_to_dict(cfg)))
    assert saved["local"]["max_sample_rows"] == 8
    assert config_from_dict(TrainConfig, saved) == cfg


def test_settings_section_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key\(s\) local.kv_cache"):
        parse(TrainConfig, [], tmp_path, "[local]\nkv_cache = 1\n")
    with pytest.raises(ConfigError, match="max_sample_rows must be int"):
        parse(TrainConfig, [], tmp_path, '[local]\nmax_sample_rows = "many"\n')
    with pytest.raises(ConfigError, match="local_max_sample_rows must be >= 1"):
        parse(TrainConfig, ["--local-max-sample-rows", "0"])


def test_saved_configs_without_a_section_still_load():
    saved = config_to_dict(TrainConfig())
    del saved["local"]
    assert config_from_dict(TrainConfig, saved).local == LocalSettings()


def test_help_shows_each_section_under_its_own_heading(capsys):
    from retool.cli import main

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = capsys.readouterr().out
    assert "local settings:" in out and "--local-kv-cache-mb" in out


@pytest.fixture
def limited_engine(monkeypatch):
    """A registry entry that supports little, as a remote service would."""
    caps = Capabilities(full_finetune=False, losses=("ppo", "importance_sampling", "cross_entropy"),
                        dual_clip=False, packings=("bucketed",), train_top_p=False, train_temperature=False)
    monkeypatch.setitem(engines.ENGINES, "service", EngineSpec("no.such.module", "a service", caps,
                                                              install="pip install retool-rl[service]"))
    return "service"


@pytest.mark.parametrize("needs, refusal", [
    (Requirements(full_finetune=True), "full fine-tuning"),
    (Requirements(loss="ppo", dual_clip=True), "PPO dual-clip"),
    (Requirements(packing="shared-prefix"), "--packing shared-prefix"),
    (Requirements(train_top_p=0.7), "top_p < 1 in training"),
    (Requirements(train_temperature=0.8), "a training temperature other than 1"),
])
def test_an_unsupported_setting_is_refused_in_one_line(limited_engine, needs, refusal):
    with pytest.raises(ConfigError) as err:
        check_supported(limited_engine, needs)
    assert str(err.value).startswith(f"engine {limited_engine} does not support {refusal}")
    assert "\n" not in str(err.value)
    check_supported(limited_engine, Requirements(loss="ppo"))  # what it supports passes


def test_train_config_checks_its_engine_before_anything_loads(limited_engine):
    with pytest.raises(ConfigError, match="engine service does not support top_p < 1"):
        TrainConfig(engine=limited_engine, top_p=0.7).validate()
    with pytest.raises(ConfigError, match="unknown engine 'nope'"):
        TrainConfig(engine="nope").validate()


def test_a_missing_engine_module_says_how_to_install_it(limited_engine):
    with pytest.raises(ConfigError, match=r"engine service: cannot import no.such.module .*pip install retool-rl"):
        engines.create_training_client(limited_engine)


def test_docs_show_the_capabilities_and_settings_tables():
    docs = (REPO / "docs" / "engines.md").read_text()
    assert capabilities_table() in docs
    assert markdown_table(LocalSettings, "local_") in docs


def test_submitted_calls_return_futures_that_carry_errors():
    assert run_now(lambda x: x + 1, 1).result() == 2
    future = run_now(lambda: 1 / 0)
    assert future.done() and isinstance(future.exception(), ZeroDivisionError)


def test_engine_checkpoint_record_reads_old_and_new_folders(tmp_path):
    old = {"format": 1, "model": "m", "full_finetune": False, "lora": {"rank": 4, "alpha": 8.0},
           "optim_steps": 3, "config": {"model": "m"}}
    (tmp_path / "engine.json").write_text(json.dumps(old))
    record = EngineCheckpoint.read(tmp_path)
    assert record == EngineCheckpoint(engine="local", model="m", weights="adapter", optimizer="optimizer.pt",
                                      lora={"rank": 4, "alpha": 8.0})
    (tmp_path / "engine.json").write_text(json.dumps({**old, "engine": "service", "weights": "tinker://run/1",
                                                      "optimizer": "tinker://run/1/state"}))
    assert dataclasses.replace(record, engine="service", weights="tinker://run/1",
                               optimizer="tinker://run/1/state") == EngineCheckpoint.read(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a checkpoint folder"):
        EngineCheckpoint.read(tmp_path / "nope")


def test_only_transient_sampler_failures_are_retried(monkeypatch):
    from retool import train

    calls = []

    class FakeRollout:
        def __init__(self, errors):
            self.errors = errors

        async def group(self, problem, group_size, **kwargs):
            calls.append(1)
            if self.errors:
                raise self.errors.pop(0)
            return ["trajectory"]

    def trainer(errors):
        cfg = TrainConfig(max_retries=2)
        return train.Trainer(cfg, engine=None, rollout=FakeRollout(errors), problems=[], sandbox=None)

    problem = Problem("p0", "question", "1")
    assert train._rollout_with_retries(trainer([RolloutError("x", transient=True)]), [problem], 1, 0, sampler=None) == [
        ["trajectory"]]
    assert len(calls) == 2
    calls.clear()
    with pytest.raises(train.StepError, match="step 3: rollout failed: a bug"):
        train._rollout_with_retries(trainer([RolloutError("a bug")]), [problem], 3, 0, sampler=None)
    assert len(calls) == 1


# ---------------------------------------------------------------- closing a training client


def test_close_with_a_status_is_part_of_every_engines_training_client():
    """``close(status)`` is in the protocol and every engine's client takes it, so
    ``close_training_client`` never calls one with an argument it does not take."""
    import inspect

    from retool.engines.base import CLOSE_STATUSES, TrainingClient
    from retool.engines.local import LocalTrainingClient
    from retool.engines.tinker import ServiceTrainingClient
    from retool.engines.vllm import VLLMTrainingClient

    assert "close" in TrainingClient.__dict__ and CLOSE_STATUSES == ("success", "errored", "interrupted")
    for cls in (LocalTrainingClient, VLLMTrainingClient, ServiceTrainingClient):
        status = inspect.signature(cls.close).parameters["status"]
        assert status.default == "success", cls


def test_closing_the_local_engine_frees_its_kv_caches_and_a_second_close_is_harmless(caplog):
    import asyncio

    from retool.engines.base import SamplingParams
    from retool.engines.local import LocalEngineConfig, LocalTrainingClient
    from tests.tiny import boxed_digit_model_dir

    client = LocalTrainingClient(LocalEngineConfig(model=str(boxed_digit_model_dir()), lora_rank=4, seed=0))
    prompt = client.get_tokenizer().encode("What is 2 + 3? Answer with one digit. " * 4)  # >= 16 tokens: stored
    asyncio.run(client.sampler.sample(prompt, 2, SamplingParams(max_tokens=4, temperature=1.0)))
    assert client.sampler.kv_store.size > 0  # the prompt's KV cache is stored for the next request
    with caplog.at_level("WARNING", logger="retool.engines"):
        engines.close_training_client(client)
        engines.close_training_client(client, KeyboardInterrupt())
    assert client.sampler.kv_store.size == 0 and not caplog.records


class _RefusesToClose:
    """A training client whose close fails (a service that is already gone)."""

    def close(self, status: str = "success") -> None:
        raise ConnectionError(f"cannot report {status}: connection refused")


def test_a_failing_close_is_logged_once_and_the_run_goes_on(caplog):
    with caplog.at_level("WARNING", logger="retool.engines"):
        engines.close_training_client(_RefusesToClose(), RuntimeError("the step failed"))
    [record] = caplog.records
    assert "_RefusesToClose" in record.getMessage() and "errored" in record.getMessage()
    assert "ConnectionError: cannot report errored" in record.getMessage()
