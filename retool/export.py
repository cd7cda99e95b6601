"""``retool export RUN --output-dir DIR``: a run's trained LoRA adapter as a PEFT folder.

``RUN`` is a run folder (its newest complete checkpoint), a ``checkpoints/step_N``
folder or an engine folder. A local-engine checkpoint already holds a PEFT folder
(``adapter/``), which is copied; a service checkpoint (``--engine tinker|pytrio``) holds
only pointers, so the adapter is downloaded from the service
(:func:`retool.engines.tinker.export_adapter`). The result loads with PEFT, the local
engine (``--init-from DIR``) and vLLM.

Not covered: full fine-tuned weights (a ``model.safetensors``, copy it yourself),
merging the adapter into the base model.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from retool.config import ConfigError
from retool.engines.base import EngineCheckpoint
from retool.engines.tinker import FLAVOURS, export_adapter
from retool.flag_checks import output_folder, refuse_renamed
from retool.runs import resolve_checkpoint


def export(run: str | Path, output: str | Path, base_url: str | None = None) -> Path:
    """Write the adapter of ``run``'s checkpoint to the folder ``output``; return it."""
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise ConfigError(f"--output-dir {output}: the folder exists and is not empty")
    checkpoint = resolve_checkpoint(run, flag="RUN")
    record = EngineCheckpoint.read(checkpoint.engine_dir)
    if record.full_finetune:
        raise ConfigError(f"RUN {run}: a full fine-tune has no adapter (copy {checkpoint.engine_dir}/model.safetensors)")
    if record.engine == "local":
        shutil.copytree(Path(checkpoint.engine_dir) / record.weights, output, dirs_exist_ok=True)
        return output

    if record.engine not in FLAVOURS:
        raise ConfigError(f"RUN {run}: cannot export a checkpoint of the {record.engine} engine")
    return export_adapter(FLAVOURS[record.engine], checkpoint.engine_dir, output, base_url=base_url)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("export", description=__doc__.split("\n\n")[0])
    p.add_argument("run", metavar="RUN", help="a run folder, a checkpoints/step_N folder or an engine folder")
    p.add_argument("--output-dir", required=True, help="the folder to write (must be new or empty)")
    refuse_renamed(p, "--output", "--output-dir", "export writes a folder")
    p.add_argument("--base-url", default=None, help="service URL for a service checkpoint (default: the SDK's "
                                                    "environment variable or its default)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        folder = export(args.run, output_folder(args.output_dir, "--output-dir"), base_url=args.base_url)
    except (ConfigError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"adapter: {folder}")
    return 0
