"""Model configs and weights from HF safetensors directories or GGUF files (format dispatch).
Loaders return fp32 CPU tensors under HF names and read only the requested tensors."""
from __future__ import annotations

import os
from typing import Iterator, Optional

import torch

from .config import LlamaConfig
from .files import ModelFormatError, check_exists, expected_shape, hf_dir, is_gguf_path, shape_error
from .gguf import gguf_config, gguf_reader, hf_to_gguf_name, iter_gguf_tensors
from .hf import hf_config, iter_safetensors_tensors, safetensors_walk
from .llama import checkpoint_source_name

__all__ = ["load_config", "load_tensors", "iter_tensors", "check_weights", "model_fingerprint"]


def load_config(path: str) -> LlamaConfig:
    """The :class:`LlamaConfig` of the model at ``path`` (HF directory or ``.gguf``); raises
    ``FileNotFoundError`` or :class:`ModelFormatError`."""
    path = os.path.expanduser(path)
    check_exists(path)
    if is_gguf_path(path):
        return gguf_config(path)
    return hf_config(hf_dir(path))


def load_tensors(path: str, cfg: LlamaConfig, names: list[str], *, index: Optional[dict] = None,
                 _unpermute_qk: bool = True) -> dict[str, torch.Tensor]:
    """:func:`iter_tensors` as a dict ``{name: fp32 contiguous CPU tensor}``."""
    return dict(iter_tensors(path, cfg, names, index=index, _unpermute_qk=_unpermute_qk))


def iter_tensors(path: str, cfg: LlamaConfig, names: list[str], *, index: Optional[dict] = None,
                 _unpermute_qk: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Read ``names`` from the model at ``path`` one tensor at a time: yields ``(name, fp32 contiguous CPU
    tensor)`` (tied ``lm_head`` from the embedding; ``index``: a GGUF table). Raises ModelFormatError
    (absent, mis-shaped or non-finite tensor), ValueError (not a parameter of ``cfg``)."""
    path = os.path.expanduser(path)
    check_exists(path)
    wanted = {n: (checkpoint_source_name(cfg, n), expected_shape(cfg, n)) for n in names}
    if is_gguf_path(path):
        return iter_gguf_tensors(path, cfg, wanted, _unpermute_qk, index=index)
    return iter_safetensors_tensors(hf_dir(path), wanted)


def check_weights(model_path: str, cfg: LlamaConfig) -> None:
    """Check from the file headers only that the weights hold every parameter of ``cfg`` with the right
    shape (before any card process starts); :class:`ModelFormatError` names the tensor, file and fix."""
    names = list(cfg.param_shapes(None))
    for i in range(cfg.num_layers):
        names += list(cfg.param_shapes(i))
    wanted = {n: (checkpoint_source_name(cfg, n), expected_shape(cfg, n)) for n in names}
    path = os.path.expanduser(model_path)
    check_exists(path)
    if is_gguf_path(path):
        by_name = {t.name: t for t in gguf_reader(path).tensors}
        for n, (src, shape) in wanted.items():
            t = by_name.get(hf_to_gguf_name(src))
            if t is None:
                raise ModelFormatError(f"tensor {src!r} (GGUF {hf_to_gguf_name(src)!r}) not found in {path}: "
                                       "the file is incomplete or not this model; re-download or re-convert it")
            found = tuple(int(x) for x in reversed(t.shape))
            if found != tuple(shape):
                raise shape_error(n, src, path, shape, found)
        return
    for _ in safetensors_walk(hf_dir(path), wanted):  # headers only: presence and shape of each tensor
        pass


#: bytes per sampled block and blocks sampled per weight file by :func:`model_fingerprint`
_FP_BLOCK, _FP_BLOCKS = 1 << 16, 32


def _weight_files(path: str) -> list:
    if os.path.isfile(path):
        return [path]
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith((".safetensors", ".gguf")))


def model_fingerprint(model_path: str) -> str:
    """sha256 hex of the weights at ``model_path`` (an HF directory's ``*.safetensors`` or a ``.gguf`` file) that
    survives a move or copy and changes when the weights are replaced, even by others of the same shapes: per
    file its name, size, and its first, last and :data:`_FP_BLOCKS` evenly spaced 64 KiB blocks (the header and
    samples of every region of tensor data; about 2 MiB read per file, not the whole file). Raises OSError."""
    import hashlib

    path = os.path.expanduser(model_path)
    h = hashlib.sha256(b"npt model fingerprint 1\n")
    for f in _weight_files(path):
        size = os.path.getsize(f)
        h.update(f"{os.path.basename(f)} {size}\n".encode())
        with open(f, "rb") as fh:
            if size <= (_FP_BLOCKS + 2) * _FP_BLOCK:
                h.update(fh.read())
                continue
            for o in [0] + [size * (k + 1) // (_FP_BLOCKS + 1) for k in range(_FP_BLOCKS)] + [size - _FP_BLOCK]:
                fh.seek(o)
                h.update(fh.read(_FP_BLOCK))
    return h.hexdigest()
