"""Write safetensors files tensor by tensor (:func:`write_stream`: one host copy at a time) and check host
memory before a large transient (:func:`check_memory`).
"""
from __future__ import annotations

import json
import os
import struct
from typing import Callable, Iterable, Optional

import torch

from npu_train.errors import UserError
from npu_train.optim.entry import Entry

#: safetensors dtype names (https://github.com/huggingface/safetensors, format description)
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8",
          torch.int64: "I64", torch.int32: "I32", torch.float64: "F64", torch.int8: "I8", torch.bool: "BOOL"}


def header_bytes(entries: list[Entry], metadata: Optional[dict] = None) -> bytes:
    """The safetensors header: 8-byte little-endian length, then JSON padded with spaces to 8 bytes."""
    head: dict = {"__metadata__": dict(metadata or {})} if metadata else {}
    off = 0
    for e in entries:
        head[e.name] = {"dtype": DTYPES[e.dtype], "shape": [int(s) for s in e.shape],
                        "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    js = json.dumps(head, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    return struct.pack("<Q", len(js)) + js


def write_stream(path: str, entries: Iterable[Entry], metadata: Optional[dict] = None,
                 visit: Optional[Callable[[str, torch.Tensor], None]] = None) -> None:
    """Write ``entries`` to the safetensors file ``path`` one tensor at a time and fsync; ``visit(name,
    tensor)`` sees each. Raises ValueError when a tensor's dtype or shape differs from its entry."""
    entries = list(entries)
    with open(path, "wb") as f:
        f.write(header_bytes(entries, metadata))
        for e in entries:
            t = e.get()
            if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
                raise ValueError(f"{e.name}: got {t.dtype} {tuple(t.shape)}, header says {e.dtype} {tuple(e.shape)}")
            t = t.detach()
            if t.device.type != "cpu" or not t.is_contiguous():
                t = t.to("cpu").contiguous()
            if visit is not None:
                visit(e.name, t)
            if t.numel():
                f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
            del t
        f.flush()
        os.fsync(f.fileno())


class MemoryCheckError(UserError):
    """A save, export or resume would need more host memory than is available."""


def available_bytes() -> int:
    """Host memory available (bytes): ``psutil`` available, capped by the cgroup v2 headroom."""
    import psutil

    free = int(psutil.virtual_memory().available)
    lim = cgroup_headroom()
    return min(free, lim) if lim is not None else free


def cgroup_dir() -> Optional[str]:
    """``/sys/fs/cgroup/<path>`` of this process's cgroup v2 (from ``/proc/self/cgroup``), or None."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return "/sys/fs/cgroup" + line.strip()[3:]
    except OSError:
        pass
    return None


def cgroup_headroom(base: Optional[str] = None) -> Optional[int]:
    """cgroup v2 ``memory.max - memory.current`` (bytes) of ``base`` (default: this process's), or None."""
    base = base or cgroup_dir()
    if not base:
        return None
    try:
        with open(os.path.join(base, "memory.max")) as f:
            mx = f.read().strip()
        if mx == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            cur = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return max(0, int(mx) - cur)


def check_memory(need: int, what: str, fix: str, available: Optional[int] = None) -> None:
    """Raise :class:`MemoryCheckError` (with ``fix``) when ``need`` bytes exceed :func:`available_bytes`."""
    have = available_bytes() if available is None else available
    if need > have:
        raise MemoryCheckError(f"{what} needs {need / 2**30:.2f} GiB more host memory but only "
                               f"{have / 2**30:.2f} GiB are available: {fix}")
