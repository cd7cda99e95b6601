"""The launch folder of ``retool verl-config`` against verl's own config and dataset.

``run.sh``'s overrides are composed with verl's real ``ppo_trainer`` Hydra config (an
unknown key fails composition), validated by verl's own ``validate_config`` and
dataclasses, and every algorithm setting is compared with retool's preset value.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import verl
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.utils.dataset.rl_dataset import RLHFDataset

from retool.config import make_config
from retool.integrations.verl.launch import OFF, VerlConfig, write_launch_folder
from retool.protocol import build_messages
from tests.tokenizers import qwen35_tokenizer

CONFIG_DIR = str(Path(verl.__file__).parent / "trainer" / "config")
REPO = Path(__file__).resolve().parents[2]


def tiny_train(tmp_path: Path) -> str:
    path = tmp_path / "train.jsonl"
    path.write_text("".join(f'{{"id": "t{i}", "question": "What is {i}+{i}?", "answer": "{2 * i}"}}\n'
                            for i in range(20)))
    return str(path)


def run_sh_overrides(folder: Path, module: str = "verl.trainer.main_ppo") -> list[str]:
    """The Hydra overrides ``run.sh`` passes to verl's ``module``, with ``$HERE`` expanded as bash would."""
    text = (folder / "run.sh").read_text().replace("${HERE}", str(folder))
    command = text[text.index(f"python -m {module}"):].replace("\\\n", " ")
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", module] and words[-1] == "$@"
    return words[3:-1]


def validate(c) -> list[int]:
    """verl's own ``validate_config``; its vLLM LoRA-rank check imports vLLM (GPU-only,
    not installed here), so that one module is stubbed and the ranks it saw returned."""
    import sys
    import types

    seen: list[int] = []
    stub = types.ModuleType("verl.workers.rollout.vllm_rollout.utils")
    stub.get_vllm_max_lora_rank = lambda rank: seen.append(rank) or rank
    saved = sys.modules.get(stub.__name__)
    sys.modules[stub.__name__] = stub
    try:
        validate_config(c, use_reference_policy=False, use_critic=False)
    finally:
        if saved is None:
            del sys.modules[stub.__name__]
        else:
            sys.modules[stub.__name__] = saved
    return seen


def compose_verl(overrides: list[str]):
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launch")
    cfg = make_config(VerlConfig, train_data=tiny_train(tmp), output_dir=str(tmp / "out"), nnodes=2, gpus_per_node=8,
                      tensor_parallel=2)
    folder = write_launch_folder(cfg)
    return cfg, folder, compose_verl(run_sh_overrides(folder))


def test_every_key_exists_and_verl_validates_it(launched):
    _, _, c = launched
    assert validate(c) == [32]
    omega_conf_to_dataclass(c.algorithm)
    omega_conf_to_dataclass(c.actor_rollout_ref.rollout)
    omega_conf_to_dataclass(c.actor_rollout_ref.actor.optim)


def test_an_unknown_or_mistyped_key_fails(launched):
    _, folder, _ = launched
    good = run_sh_overrides(folder)
    with pytest.raises(ConfigCompositionException):
        compose_verl([*good, "actor_rollout_ref.actor.optim.learning_rate=1e-5"])
    with pytest.raises(ConfigCompositionException):
        compose_verl([*good, "algorithm.adv_estimater=grpo"])


def test_algorithm_settings_equal_the_preset(launched):
    cfg, _, c = launched
    actor, optim, model = c.actor_rollout_ref.actor, c.actor_rollout_ref.actor.optim, c.actor_rollout_ref.model
    rollout, val = c.actor_rollout_ref.rollout, c.actor_rollout_ref.rollout.val_kwargs
    assert c.algorithm.adv_estimator == "grpo"
    assert c.algorithm.norm_adv_by_std_in_grpo is cfg.normalize_std is False
    assert c.algorithm.use_kl_in_reward is False
    assert actor.use_kl_loss is False
    assert actor.entropy_coeff == 0.0
    assert actor.policy_loss.loss_mode == "vanilla"
    assert actor.loss_agg_mode == "token-mean"
    assert actor.clip_ratio_low == pytest.approx(1 - cfg.clip_low) == pytest.approx(0.2)
    assert actor.clip_ratio_high == pytest.approx(cfg.clip_high - 1) == pytest.approx(0.28)
    assert actor.clip_ratio_c == OFF and cfg.dual_clip is None
    assert actor.ppo_epochs == 1
    assert optim.lr == cfg.lr == 4e-5
    assert list(optim.betas) == [cfg.beta1, cfg.beta2] == [0.9, 0.95]
    assert optim.weight_decay == cfg.weight_decay == 0.0
    assert optim.clip_grad == actor.grad_clip == OFF and cfg.grad_clip_norm is None
    assert optim.lr_scheduler_type == "constant" and optim.lr_warmup_steps == 0
    assert model.lora_rank == cfg.lora_rank == 32
    assert model.lora_alpha == cfg.lora_alpha == 32
    assert model.target_modules == "all-linear"
    assert rollout.n == cfg.group_size == 8
    assert c.data.train_batch_size == cfg.batch_size == 8
    assert actor.ppo_mini_batch_size == cfg.batch_size  # one update per step over the whole batch
    assert c.data.max_response_length == rollout.response_length == cfg.max_trajectory_tokens == 8192
    assert rollout.prompt_length == c.data.max_prompt_length == 1024
    assert rollout.temperature == cfg.temperature == 1.0 and rollout.top_p == cfg.top_p == 1.0
    assert rollout.calculate_log_probs is True
    assert val.n == 12
    assert val.temperature == 1.0
    assert val.top_p == 0.7
    assert val.do_sample is True
    assert c.trainer.total_training_steps == cfg.max_steps == 200
    assert (c.trainer.nnodes, c.trainer.n_gpus_per_node, rollout.tensor_model_parallel_size) == (2, 8, 2)
    assert rollout.agent.default_agent_loop == "retool"
    assert c.reward.custom_reward_function.name == "compute_score"


def test_agent_loop_yaml_is_verls_registry_entry(launched):
    cfg, folder, c = launched
    (entry,) = OmegaConf.load(c.actor_rollout_ref.rollout.agent.agent_loop_config_path)
    assert entry.name == "retool"
    assert entry._target_ == "retool.integrations.verl.agent_loop.RetoolAgentLoop"
    assert (entry.max_code_calls, entry.max_assistant_turns, entry.max_trajectory_tokens, entry.max_turn_tokens,
            entry.max_tool_response_tokens) == (4, 6, 8192, 1024, 512)
    assert entry.sandbox_url is None and entry.sandbox_timeout_s == cfg.sandbox_timeout_s


def test_reward_hook_grades_with_retools_grader(launched):
    import importlib.util

    _, _, c = launched
    spec = importlib.util.spec_from_file_location("reward_fn", c.reward.custom_reward_function.path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, c.reward.custom_reward_function.name)
    assert fn("x", "so \\boxed{\\frac{1}{2}}", "0.5")["score"] == 1.0
    assert fn("x", "no box", "0.5") == {"score": -1.0, "reward/correct": 0.0, "reward/format": 0.0}


def test_parquet_loads_with_verls_dataset_and_carries_agent_name(launched):
    _, _, c = launched
    tok = qwen35_tokenizer()
    for files, rows in ((c.data.train_files, 20), (c.data.val_files, 30)):
        dataset = RLHFDataset(files, tok, c.data)
        assert len(dataset) == rows
        item = dataset[0]
        assert item["agent_name"] == "retool"
        assert item["raw_prompt"] == build_messages(item["extra_info"]["question"], tools=True)
        assert item["reward_model"]["ground_truth"]


def test_seed_preset_and_full_finetune_sglang(tmp_path):
    cfg = make_config(VerlConfig, train_data=tiny_train(tmp_path), output_dir=str(tmp_path / "out"), full_finetune=True,
                      rollout_engine="sglang", max_steps=20, save_every=5, gradient_checkpointing=True,
                      val_temperature=0.0)
    c = compose_verl(run_sh_overrides(write_launch_folder(cfg)))
    assert validate(c) == []  # full fine-tuning: no LoRA rank to check
    assert c.actor_rollout_ref.model.lora_rank == 0
    assert c.actor_rollout_ref.rollout.name == "sglang"
    assert (c.trainer.total_training_steps, c.trainer.save_freq) == (20, 5)
    assert c.actor_rollout_ref.model.enable_gradient_checkpointing is True
    assert c.actor_rollout_ref.rollout.val_kwargs.do_sample is False  # val temperature 0 = greedy


def test_command_line_with_the_repos_preset(tmp_path):
    from retool.cli import main

    out = tmp_path / "out"
    assert main(["verl-config", "--config", str(REPO / "configs" / "qwen35-4b-step20.toml"),
                 "--train-data", tiny_train(tmp_path), "--output-dir", str(out)]) == 0
    c = compose_verl(run_sh_overrides(out))
    assert c.trainer.total_training_steps == 20 and c.trainer.save_freq == 5
    assert c.actor_rollout_ref.model.path == "Qwen/Qwen3.5-4B"


# ---------------------------------------------------------------- --max-staleness 1: verl's one-step-off trainer

ONE_STEP_OFF = "verl.experimental.one_step_off_policy.main_ppo"
ONE_STEP_OFF_DIR = str(Path(verl.__file__).parent / "experimental" / "one_step_off_policy" / "config")


def test_max_staleness_1_writes_verls_one_step_off_trainer(tmp_path):
    """``--max-staleness 1`` runs verl 0.9.1's own one-step-off trainer: its module, its
    Hydra config (composed from the installed package, validated by verl), rollout GPUs
    apart from the trainer's, the rollout's logprobs as PPO's old ones, and every other
    setting as the synchronous launch writes it."""
    from importlib.util import find_spec

    assert find_spec(ONE_STEP_OFF) is not None
    common = dict(train_data=tiny_train(tmp_path), nnodes=2, gpus_per_node=8, tensor_parallel=2)
    cfg = make_config(VerlConfig, output_dir=str(tmp_path / "async"), max_staleness=1, rollout_gpus=2, **common)
    overrides = run_sh_overrides(write_launch_folder(cfg), ONE_STEP_OFF)
    with initialize_config_dir(config_dir=ONE_STEP_OFF_DIR, version_base=None):
        c = compose(config_name="one_step_off_ppo_trainer", overrides=overrides)
    assert validate(c) == [32]
    omega_conf_to_dataclass(c.algorithm)
    omega_conf_to_dataclass(c.actor_rollout_ref.rollout)
    rollout = c.actor_rollout_ref.rollout
    assert c.actor_rollout_ref.hybrid_engine is False  # OneStepOffRayTrainer asserts it
    assert (c.rollout.nnodes, c.rollout.n_gpus_per_node, c.trainer.nnodes, c.trainer.n_gpus_per_node) == (2, 2, 2, 6)
    assert rollout.mode == "async" and rollout.free_cache_engine is False and rollout.calculate_log_probs is True
    assert c.algorithm.rollout_correction.bypass_mode is True
    sync = compose_verl(run_sh_overrides(write_launch_folder(
        make_config(VerlConfig, output_dir=str(tmp_path / "sync"), **common))))
    for section in ("actor_rollout_ref.actor", "actor_rollout_ref.model", "data"):
        mine, theirs = OmegaConf.select(c, section), OmegaConf.select(sync, section)
        for key in ("clip_ratio_low", "clip_ratio_high", "loss_agg_mode", "ppo_mini_batch_size", "optim",
                    "lora_rank", "lora_alpha", "train_batch_size", "max_response_length"):
            if key in theirs:
                assert OmegaConf.to_container(mine)[key] == OmegaConf.to_container(theirs)[key], (section, key)
    assert (rollout.n, rollout.temperature, rollout.top_p) == (8, 1.0, 1.0)
