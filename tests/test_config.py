"""Config machinery: defaults ← TOML preset ← flags, validation before anything loads."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from retool.config import (
    ConfigError,
    add_config_args,
    config_from_args,
    config_from_dict,
    config_to_dict,
    option,
    require,
)


@dataclass
class DemoConfig:
    model: str = option("bundled:smollm2", "model id")
    lr: float = option(4e-5, "learning rate")
    group_size: int = option(8, "samples per problem")
    loss: str = option("ppo", "loss", choices=("ppo", "importance_sampling"))
    std_norm: bool = option(False, "divide advantages by the group std")
    targets: tuple[str, ...] = option(("q_proj", "v_proj"), "LoRA targets")
    max_steps: int | None = option(None, "stop after this many steps")

    def validate(self) -> None:
        require(self.lr > 0, f"lr must be > 0, got {self.lr}")
        require(self.group_size >= 2, f"group_size must be >= 2, got {self.group_size}")


def parse(argv, tmp_path=None, toml=None):
    parser = argparse.ArgumentParser()
    add_config_args(parser, DemoConfig)
    if toml is not None:
        path = tmp_path / "preset.toml"
        path.write_text(toml)
        argv = ["--config", str(path), *argv]
    return config_from_args(DemoConfig, parser.parse_args(argv))


def test_defaults_when_nothing_given():
    assert parse([]) == DemoConfig()


def test_flags_override_preset_which_overrides_defaults(tmp_path):
    cfg = parse(["--lr", "1e-3", "--no-std-norm"], tmp_path,
                'lr = 2e-4\ngroup_size = 4\nstd_norm = true\ntargets = ["a", "b"]\n')
    assert cfg.lr == 1e-3 and cfg.group_size == 4 and cfg.std_norm is False
    assert cfg.targets == ("a", "b")


def test_list_and_optional_flags():
    cfg = parse(["--targets", "x,y,z", "--max-steps", "20"])
    assert cfg.targets == ("x", "y", "z") and cfg.max_steps == 20
    assert parse(["--max-steps", "none"]).max_steps is None


def test_validation_runs_before_use(tmp_path):
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        parse(["--group-size", "1"])


def test_preset_unknown_key_and_wrong_type_name_file_and_key(tmp_path):
    with pytest.raises(ConfigError, match="preset.toml.*unknown key.*learning_rate"):
        parse([], tmp_path, "learning_rate = 1.0\n")
    with pytest.raises(ConfigError, match="group_size must be int"):
        parse([], tmp_path, 'group_size = "eight"\n')
    with pytest.raises(ConfigError, match="invalid TOML"):
        parse([], tmp_path, "lr = = 3\n")


def test_missing_preset_file(tmp_path):
    parser = argparse.ArgumentParser()
    add_config_args(parser, DemoConfig)
    with pytest.raises(ConfigError, match="not found"):
        config_from_args(DemoConfig, parser.parse_args(["--config", str(tmp_path / "nope.toml")]))


def test_choices_rejected_by_argparse():
    with pytest.raises(SystemExit):
        parse(["--loss", "sgd"])


def test_dict_round_trip():
    cfg = parse(["--lr", "0.5"])
    assert config_from_dict(DemoConfig, config_to_dict(cfg)) == cfg


@pytest.mark.parametrize("argv, message", [
    (["train", "--lr", "abc"], "argument --lr: expected a float, got 'abc'"),
    (["train", "--batch-size", "1.5"], "argument --batch-size: expected an integer, got '1.5'"),
    (["eval", "--temperature", "hot"], "argument --temperature: expected a float, got 'hot'"),
])
def test_a_bad_flag_value_names_the_flag_and_the_expected_type(argv, message, capsys):
    from retool.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "<lambda>" not in err
