"""``LocalSettings.spill_base``: the trainer's frozen layer matrices out of memory while the
sampler decodes from its merged copy, read back for training (``base_spill``).

On the tiny random Llama of ``test_engine_local``: training with the spill is the same to
the bit as without (logprobs, metrics, every trained parameter after two steps), the
samples are the same tokens with logprobs within float rounding, and while the sampler
holds its copy the model's matrices are really gone (the same probe finds them in an
engine without the spill). The spill file gives back exactly what it took, a replaced
matrix is written again, a frozen copy for sampling during training turns the spill off
for good, and a temporary folder held in memory is refused.
"""

from __future__ import annotations

import os

import pytest
import torch

from retool.engines import LocalSettings, base
from retool.engines.local import LocalEngineConfig, LocalTrainingClient, base_spill, lean_decode
from tests.test_engine_local import one_torch_thread, rl_datums, tiny_model  # noqa: F401 - fixtures
from tests.test_sampler_fast import PROMPTS, STOPS, batch, flat, perturb_lora

pytestmark = pytest.mark.timeout(300)

PARAMS = base.SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, stop_token_ids=STOPS, seed=7)


def make(tiny_model: str, spill: bool) -> LocalTrainingClient:
    client = LocalTrainingClient(LocalEngineConfig(model=tiny_model, lora_rank=8, lora_alpha=16.0,
                                                   sampler=LocalSettings(spill_base=spill)))
    perturb_lora(client.model, seed=3)
    return client


def matrices_present(client: LocalTrainingClient) -> list[int]:
    return [m.numel() for m in lean_decode.layer_matrices(client.model)]


def test_training_with_the_spill_is_the_same_to_the_bit(tiny_model):
    plain, spilled = make(tiny_model, False), make(tiny_model, True)
    assert spilled.sampler.base_spill is not None and plain.sampler.base_spill is None
    originals = [m.detach().clone() for m in lean_decode.layer_matrices(spilled.model)]
    for step in range(2):
        a, b = flat(batch(plain, PROMPTS, 3, PARAMS)), flat(batch(spilled, PROMPTS, 3, PARAMS))
        assert [s.tokens for s in a] == [s.tokens for s in b]
        for x, y in zip(a, b):
            assert y.logprobs == pytest.approx(x.logprobs, abs=1e-4)
        # while the sampler holds its copy the matrices are gone; the same probe sees them otherwise
        assert spilled.sampler.base_spill.out and not any(matrices_present(spilled))
        assert all(matrices_present(plain))
        data = rl_datums(seed=step)
        out_a, out_b = plain.forward_backward(data, "ppo"), spilled.forward_backward(data, "ppo")
        assert not spilled.sampler.base_spill.out
        assert out_b.logprobs_D == out_a.logprobs_D and out_b.metrics == out_a.metrics
        assert spilled.optim_step().metrics == plain.optim_step().metrics
    for p_a, p_b in zip(plain.params, spilled.params, strict=True):
        assert torch.equal(p_a, p_b)
    for before, now in zip(originals, lean_decode.layer_matrices(spilled.model), strict=True):
        assert torch.equal(before, now)  # read back as written, after two releases
    assert plain.compute_logprobs(PROMPTS[0], 3) == spilled.compute_logprobs(PROMPTS[0], 3)


def test_the_spill_gives_back_what_it_took_and_writes_a_replaced_matrix_again(tmp_path):
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 7, generator=generator), requires_grad=False),
              torch.nn.Parameter(torch.randn(3, 4, generator=generator).to(torch.bfloat16), requires_grad=False)]
    kept = [p.detach().clone() for p in params]
    spill = base_spill.BaseSpill(params, str(tmp_path))
    assert spill.release() == 5 * 7 * 4 + 3 * 4 * 2 and spill.out
    assert all(p.numel() == 0 for p in params) and spill.release() == 0
    assert os.listdir(tmp_path) == []  # the file was unlinked at once
    spill.restore()
    assert all(torch.equal(p, k) and p.dtype == k.dtype for p, k in zip(params, kept))
    params[0].data = torch.full((5, 7), 2.5)  # replaced: the file's bytes are stale now
    spill.release()
    spill.restore()
    assert torch.equal(params[0], torch.full((5, 7), 2.5)) and torch.equal(params[1], kept[1])
    with pytest.raises(ValueError, match="frozen"):
        base_spill.BaseSpill([torch.nn.Parameter(torch.zeros(2, 2))], str(tmp_path))
    spill.close()


def test_a_frozen_copy_for_sampling_during_training_turns_the_spill_off(tiny_model):
    client = make(tiny_model, True)
    batch(client, PROMPTS, 2, PARAMS)
    assert client.sampler.base_spill.out
    copy = client.frozen_sampler()
    assert client.sampler.base_spill is None and all(matrices_present(client))
    assert flat(batch(client, PROMPTS, 2, PARAMS)) and all(matrices_present(client))  # stays in
    assert all(m.numel() for m in lean_decode.layer_matrices(copy.model))


def test_a_temporary_folder_in_memory_is_refused(tiny_model, monkeypatch, capsys):
    shm = "/dev/shm"
    if not (os.path.isdir(shm) and base_spill.in_memory(shm)):
        pytest.skip("no tmpfs at /dev/shm on this machine")
    assert not base_spill.in_memory(os.path.dirname(os.path.abspath(__file__))) or base_spill.in_memory("/")
    monkeypatch.setattr(base_spill.tempfile, "gettempdir", lambda: shm)
    assert base_spill.spill_directory() is None
    client = make(tiny_model, True)
    assert client.sampler.base_spill is None
    assert "spill_base off: the temporary folder is in memory" in capsys.readouterr().err
    batch(client, PROMPTS, 2, PARAMS)
    assert all(matrices_present(client))
