"""The one vLLM-CPU server the real-server tests of ``tests/test_engine_vllm.py`` share.

A server load costs 20-70 s here, so the session starts it once — as soon as collection
shows that a selected test needs it (``tests/conftest.py``), so the load overlaps the
tests that run first — and the first test that needs it waits until it is healthy.
SmolLM2 (the bundled model), LoRA up to rank 32, raw logprobs, float32. Stopped when the
session ends (and by the server's own exit handlers if pytest dies).
"""

from __future__ import annotations

from retool.engines.vllm import server as vserver

VENV = ".venv-vllm"
_server: vserver.ManagedServer | None = None


def start() -> vserver.ManagedServer:
    """The shared server, started now unless it already is (it loads in the background);
    :class:`~retool.engines.vllm.server.ServerError` when ``.venv-vllm`` is missing."""
    global _server
    if _server is None:
        from retool.bundled import smollm2_path

        _server = vserver.ManagedServer(vserver.ServerOptions(
            model_dir=str(smollm2_path()), venv=VENV, max_lora_rank=32, logprobs_mode="raw_logprobs",
            dtype="float32", kv_cache_gib=2, startup_timeout_s=900))
    return _server


def start_early() -> None:
    """:func:`start` if the environment is there (else the tests report why, one by one)."""
    if vserver.venv_problem(VENV) is None:
        start()


def stop() -> None:
    global _server
    if _server is not None:
        _server.stop()
        _server = None
