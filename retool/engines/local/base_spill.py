"""The trainer's frozen base matrices, out of memory while the sampler decodes (``BaseSpill``).

With LoRA and the lean decode loop, the sampler decodes from its own merged copy of the
layers' matrices (``lean_decode``): base + LoRA, fused and packed. While it samples, the
trainer's frozen base matrices of those layers are not read at all, yet they are
resident: the same weights twice (425 MB for SmolLM2-135M in fp32, the larger part of
what an RL stage holds above an eval). ``BaseSpill`` writes them once to a file of its own
(unlinked at once, so that it goes with the process however that ends) and, while the
sampler holds its copy, frees them; the trainer reads them back before its next forward
pass. The bytes read back are the bytes written, so training is the same to the bit.

What it costs: one write of the matrices per process, and per RL step one read (from the
page cache, ~0.1-0.2 s for 425 MB) and one free. The file's pages stay in the page
cache, which the kernel drops under memory pressure (the next read then comes from
disk): on a machine short of memory that is the point.

Not covered: a folder in memory (tmpfs, ramfs) would hold the bytes in memory all the
same, so such a folder is refused (:func:`in_memory`) and the matrices stay; a sampler
that runs at the same time as training (``--max-staleness``'s frozen copies share these
matrices) turns it off (``LocalSamplingClient.stop_spilling``).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

IN_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})
"""Filesystems whose files are memory: spilling there saves nothing."""


def in_memory(directory: str) -> bool:
    """Whether ``directory`` lies on a filesystem held in memory (``/proc/mounts``: the
    mount point that is the longest prefix of its real path); ``False`` where
    ``/proc/mounts`` cannot be read."""
    path = os.path.realpath(directory)
    best, kind = "", ""
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, fields[2]
    except OSError:
        return False
    return kind in IN_MEMORY_FILESYSTEMS


def spill_directory() -> str | None:
    """Where the matrices go: the system's temporary folder (``TMPDIR`` sets it), or
    ``None`` when that lies in memory."""
    directory = tempfile.gettempdir()
    return None if in_memory(directory) else directory


class BaseSpill:
    """``parameters`` (frozen matrices) moved between memory and a file of their own:
    :meth:`release` frees them (writing each to the file the first time, or again if it was
    replaced since), :meth:`restore` reads them back. ``out`` says where they are now."""

    def __init__(self, parameters: list[Any], directory: str) -> None:
        if any(p.requires_grad for p in parameters):
            raise ValueError("only frozen parameters can be spilled (a trained one changes at every step)")
        self.parameters = parameters
        self._file = tempfile.TemporaryFile(dir=directory, prefix="retool-base-", buffering=0)
        self._slots: list[tuple[int, tuple[int, ...], Any]] = []  # offset, shape, dtype per parameter
        offset = 0
        for p in parameters:
            self._slots.append((offset, tuple(p.shape), p.dtype))
            offset += p.numel() * p.element_size()
        self.bytes = offset
        """What a release frees."""
        self._written: list[tuple[int, int] | None] = [None] * len(parameters)  # (data_ptr, _version) on file
        self.out = False

    def release(self) -> int:
        """Free the matrices (after writing those the file does not hold as they are); the
        bytes freed (0 when they were out already)."""
        if self.out:
            return 0
        for i, p in enumerate(self.parameters):
            state = (p.data_ptr(), p._version)
            if self._written[i] != state:
                offset, shape, dtype = self._slots[i]
                if tuple(p.shape) != shape or p.dtype != dtype:
                    raise RuntimeError("a spilled base matrix changed shape or dtype; the spill cannot hold it")
                self._write(offset, p.detach())
                self._written[i] = state
        for p in self.parameters:
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.out = True
        return self.bytes

    def restore(self) -> None:
        """Read the matrices back (nothing to do when they are in)."""
        if not self.out:
            return
        for i, (p, (offset, shape, dtype)) in enumerate(zip(self.parameters, self._slots)):
            tensor = torch.empty(shape, dtype=dtype)
            self._read(offset, tensor)
            p.data = tensor.to(p.device)
            self._written[i] = (p.data_ptr(), p._version)
        self.out = False

    def close(self) -> None:
        """Read the matrices back and drop the file."""
        self.restore()
        self._file.close()

    def _write(self, offset: int, tensor: Any) -> None:
        view = memoryview(_bytes_of(tensor.cpu().contiguous()))
        done = 0
        while done < len(view):
            done += os.pwrite(self._file.fileno(), view[done:], offset + done)

    def _read(self, offset: int, tensor: Any) -> None:
        view = memoryview(_bytes_of(tensor))
        done = 0
        while done < len(view):
            got = os.preadv(self._file.fileno(), [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"the base-weight spill file ended early ({done} of {len(view)} bytes read)")
            done += got


def _bytes_of(tensor: Any) -> Any:
    """A writable numpy view of a contiguous CPU tensor's bytes (bf16 has no numpy dtype)."""
    return tensor.view(torch.uint8).reshape(-1).numpy()
