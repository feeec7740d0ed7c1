"""Reading a model file's tensors a few rows at a time straight into their final buffers (issue 43).

A card process that read a whole tensor, converted it to fp32 and copied it to its parameter held up to four
full-size buffers of the largest tensor at once (a bf16 embedding of Llama-3.2-1B: 0.5 GiB read, 1 GiB fp32,
0.25 GiB of the finite check, 1 GiB uploaded), and glibc kept the freed ones resident under the cpu card's heap
settings (:mod:`npu_train.hostmem`). :func:`iter_chunks` yields row slices of at most :data:`CHUNK_ELEMENTS`
elements in the stored dtype (safetensors: bf16/fp16/fp32 as stored; GGUF: dequantised to fp32), each checked
finite; the caller copies each into its parameter (``dest[a:b].copy_(part)`` converts in place). The transient
bytes of one chunk per checkpoint dtype: :func:`chunk_transient_bytes` (what the planner counts at load; this
module imports torch only inside its readers, so the planner stays torch-free).
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Iterator, Optional

from .config import LlamaConfig

if TYPE_CHECKING:
    import torch

__all__ = ["CHUNK_ELEMENTS", "CHECKPOINT_DTYPES", "Chunk", "iter_chunks", "row_ranges", "chunk_transient_bytes",
           "checkpoint_dtype"]

#: elements of one chunk (16 MiB of fp32); a tensor's rows are read in slices of at most this many elements
#: (one row at least, so a row wider than this is one chunk)
CHUNK_ELEMENTS = 1 << 22
#: the checkpoint dtypes the loaders accept, as the planner names them: safetensors ``bf16``/``fp16``/``fp32``,
#: ``gguf`` (any GGML type: F32/F16 or quantised, dequantised by ``gguf.quants``)
CHECKPOINT_DTYPES = ("bf16", "fp16", "fp32", "gguf")
#: bytes per element a chunk's reading holds at once besides its destination, per checkpoint dtype, on a cpu card's
#: kept heap (``hostmem``: freed blocks stay resident, so the figure is the heap's growth, holes included). Safetensors:
#: the slice as stored (``s`` = 2 or 4 B) + the finite check, ``torch.isfinite`` = ``(x == x) * (x.abs() != inf)``
#: (two bool masks, ``|x|`` in the stored dtype and their bool product alive at once: ``s + 3``), ``2s + 3`` in all;
#: measured as the heap's growth over the parameters after a whole load under the card's heap settings (Qwen2 shape,
#: hidden 1536, 2 layers, vocabulary 32000): bf16 27.4 MiB, fp32 43.3 MiB against 2**22 x 7 = 28 and x 11 = 44 MiB.
#: GGUF: ``gguf.quants.dequantize``'s temporaries (8.12 B/element at most by tracemalloc over a 2048 x 2048 tensor of
#: each of Q4_0, Q4_1, Q5_0, Q8_0, Q2_K-Q6_K, IQ1_S, IQ2_XXS, IQ3_S, IQ4_NL, IQ4_XS, TQ1_0, F16, BF16; gguf 0.19),
#: the fp32 result's C-order copy and its finite check, with numpy's and torch's buffers of different sizes placed
#: among each other: the heap grew 78.6 MiB = 19.6 B/element over the embedded SmolLM2-135M GGUF (Q4_1, Q8_0 and
#: F32 tensors), counted 20 (measured, not derived: other GGML types' placement is not measured)
_READ_BYTES = {"bf16": 2 * 2 + 3, "fp16": 2 * 2 + 3, "fp32": 2 * 4 + 3, "gguf": 20}
_SAFETENSORS_DTYPES = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}


class Chunk:
    """Rows ``[start, start + len(part))`` of tensor ``name`` (HF name; ``shape`` the whole tensor's HF shape):
    ``part`` a CPU tensor in the stored dtype (safetensors) or fp32 (GGUF), checked finite."""

    __slots__ = ("name", "start", "part", "shape")

    def __init__(self, name: str, start: int, part: "torch.Tensor", shape: tuple):
        self.name, self.start, self.part, self.shape = name, start, part, tuple(shape)

    @property
    def rows(self) -> slice:
        """The rows of the whole tensor this chunk holds (a 1-D tensor: its elements)."""
        return slice(self.start, self.start + self.part.shape[0])


def row_ranges(shape: tuple, max_elements: int = CHUNK_ELEMENTS, multiple: int = 1) -> list[tuple[int, int]]:
    """``[(start, stop)]`` row ranges of a tensor of ``shape`` (rows = ``shape[0]``; a 1-D tensor's rows are its
    elements) holding at most ``max_elements`` elements each, at least one row (``multiple`` rows: a count of
    rows each range is a multiple of, e.g. one attention head's rows). Raises ``ValueError`` for an empty shape
    or a non-positive limit."""
    if not shape or max_elements < 1 or multiple < 1:
        raise ValueError(f"row_ranges needs a shape with at least one dimension and positive limits, got "
                         f"{shape}, {max_elements}, {multiple}")
    rows = int(shape[0])
    per_row = math.prod(int(x) for x in shape[1:])
    step = max(multiple, (max_elements // max(1, per_row)) // multiple * multiple)
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


def chunk_transient_bytes(checkpoint: str, compute_bytes: int, upload_copy: bool = True,
                          max_elements: int = CHUNK_ELEMENTS) -> int:
    """Bytes a chunk's load holds at once beyond the destination buffers: reading (:data:`_READ_BYTES`) plus, on a
    card outside host memory, its cast to the compute dtype (``compute_bytes`` B, 2 or 4) and, ``upload_copy``, the
    upload's own copy, per element of ``max_elements``; ``compute_bytes=0``: a cpu card (``load_stage_weights``
    copies the chunk into the parameter, ``copy_`` casting in place: neither exists). Raises ``ValueError`` for a
    dtype outside :data:`CHECKPOINT_DTYPES`."""
    if checkpoint not in _READ_BYTES:
        raise ValueError(f"checkpoint dtype must be one of {CHECKPOINT_DTYPES}, got {checkpoint!r}")
    return max_elements * (_READ_BYTES[checkpoint] + compute_bytes * (2 if upload_copy else 1))


def checkpoint_dtype(path: str) -> str:
    """The :data:`CHECKPOINT_DTYPES` name of the model at ``path``: ``gguf`` for a GGUF file, else the widest
    floating dtype of the safetensors shards' headers (``fp32`` when any tensor is fp32: its chunks are the
    largest). Raises FileNotFoundError / :class:`ModelFormatError` as the loaders do."""
    from .files import ModelFormatError, check_exists, hf_dir, is_gguf_path

    path = os.path.expanduser(path)
    check_exists(path)
    if is_gguf_path(path):
        return "gguf"
    import json
    import struct

    from .hf import safetensors_index

    where, _ = safetensors_index(hf_dir(path))
    found = set()
    for fp in sorted(set(where.values())):
        try:
            with open(fp, "rb") as f:
                n = struct.unpack("<Q", f.read(8))[0]
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise ModelFormatError(f"{fp}: not a readable safetensors file ({e}); re-download the model") from e
        found |= {v.get("dtype") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    for st, name in (("F32", "fp32"), ("F16", "fp16"), ("BF16", "bf16")):
        if st in found:
            return name
    return "fp32"


def iter_chunks(path: str, cfg: LlamaConfig, names: list[str], *, index: Optional[dict] = None,
                max_elements: int = CHUNK_ELEMENTS) -> Iterator[Chunk]:
    """The tensors ``names`` of the model at ``path`` (HF directory or GGUF, ``index``: a GGUF table), one
    :class:`Chunk` of at most ``max_elements`` elements at a time, tensor after tensor in ``names``' order (a
    tied ``lm_head`` from the embedding; GGUF ``llama`` q/k rows un-permuted per head). Raises
    :class:`ModelFormatError` (absent, mis-shaped or non-finite tensor, unsupported GGML type), ValueError (not a
    parameter of ``cfg``)."""
    from .files import check_exists, expected_shape, hf_dir, is_gguf_path
    from .llama import checkpoint_source_name

    path = os.path.expanduser(path)
    check_exists(path)
    wanted = {n: (checkpoint_source_name(cfg, n), expected_shape(cfg, n)) for n in names}
    if is_gguf_path(path):
        return _gguf_chunks(path, cfg, wanted, index, max_elements)
    return _safetensors_chunks(hf_dir(path), wanted, max_elements)


def _safetensors_chunks(d: str, wanted: dict, max_elements: int) -> Iterator[Chunk]:
    from .files import check_finite
    from .hf import safetensors_walk

    for name, src, fp, f in safetensors_walk(d, wanted):
        shape = wanted[name][1]
        sl = f.get_slice(src)
        for a, b in row_ranges(shape, max_elements):
            part = sl[a:b]
            check_finite(part, src, fp)
            yield Chunk(name, a, part, shape)
            del part


def _gguf_chunks(path: str, cfg: LlamaConfig, wanted: dict, index: Optional[dict],
                 max_elements: int) -> Iterator[Chunk]:
    import gguf
    import numpy as np
    import torch

    from .files import ModelFormatError, check_finite
    from .gguf import gguf_unpermute, gguf_wanted_tensors

    unpermute = cfg.family in ("llama", "mistral")  # Qwen GGUFs keep HF row order
    for name, _, gname, t in gguf_wanted_tensors(path, wanted, index):
        shape = tuple(wanted[name][1])
        heads = {".attn_q.weight": cfg.num_heads, ".attn_k.weight": cfg.num_kv_heads}
        n_head = next((h for k, h in heads.items() if unpermute and gname.endswith(k)), 0)
        head_rows = shape[0] // n_head if n_head else 1
        # rows of block bytes (quantised) or of numbers; a 1-D tensor (a norm, a bias) is one chunk
        data = t.data.reshape(shape[0], -1) if len(shape) > 1 else t.data
        ranges = row_ranges(shape, max_elements, head_rows) if len(shape) > 1 else [(0, shape[0])]
        for a, b in ranges:
            try:
                arr = gguf.quants.dequantize(data[a:b] if len(shape) > 1 else data, t.tensor_type)
            except NotImplementedError as e:
                raise ModelFormatError(f"{path}: tensor {gname!r} uses unsupported GGML type "
                                       f"{t.tensor_type.name}") from e
            arr = np.asarray(arr, dtype=np.float32).reshape((b - a,) + tuple(shape[1:]))
            if n_head:
                arr = gguf_unpermute(arr, (b - a) // head_rows)
            part = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
            del arr
            check_finite(part, gname, path)
            yield Chunk(name, a, part, shape)
            del part
