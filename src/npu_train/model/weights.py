"""Model configs and weights from HF safetensors directories or GGUF files (format dispatch).
Loaders return fp32 CPU tensors under HF names and read only the requested tensors."""
from __future__ import annotations

import os
import sys
from dataclasses import replace
from typing import Iterator, Optional

import torch

from .config import LlamaConfig
from .files import ModelFormatError, check_exists, expected_shape, hf_dir, is_gguf_path, shape_error
from .gguf import gguf_config, gguf_reader, hf_to_gguf_name, iter_gguf_tensors
from .hf import hf_config, iter_safetensors_tensors, safetensors_index, safetensors_walk
from .llama import checkpoint_source_name

__all__ = ["load_config", "load_tensors", "iter_tensors", "check_weights", "model_fingerprint"]


def load_config(path: str) -> LlamaConfig:
    """The :class:`LlamaConfig` of the model at ``path`` (HF directory or ``.gguf``); raises
    ``FileNotFoundError`` or :class:`ModelFormatError`. An HF config with ``tie_word_embeddings=true`` whose
    weights hold their own ``lm_head.weight`` with other values than the embedding is untied, as transformers
    does (it keeps the file's head and warns): one note on stderr."""
    path = os.path.expanduser(path)
    check_exists(path)
    if is_gguf_path(path):
        return gguf_config(path)
    d = hf_dir(path)
    cfg = hf_config(d)
    if cfg.tie_word_embeddings and _distinct_head(d):
        _note_once(f"note: {os.path.join(d, 'config.json')} sets tie_word_embeddings=true, but the weights hold their "
                   "own lm_head.weight, different from model.embed_tokens.weight: training with the file's head, "
                   "untied, as transformers does (it warns the same); set tie_word_embeddings=false in config.json "
                   "to silence this note")
        cfg = replace(cfg, tie_word_embeddings=False)
    return cfg


_NOTED: set = set()


def _note_once(text: str) -> None:
    """Print ``text`` on stderr once per process (the launcher reads a model's config several times)."""
    if text not in _NOTED:
        _NOTED.add(text)
        print(text, file=sys.stderr, flush=True)


def _distinct_head(d: str, block_elems: int = 1 << 24) -> bool:
    """Whether the HF directory ``d``'s safetensors hold an ``lm_head.weight`` beside ``model.embed_tokens.weight``
    with other shape or values (compared ``block_elems`` elements of rows at a time: bounded memory, the first
    differing block ends it). False when either is absent or the weights cannot be read (check_weights says so)."""
    from safetensors import safe_open

    try:
        where, _ = safetensors_index(d)
        if "lm_head.weight" not in where or "model.embed_tokens.weight" not in where:
            return False
        with safe_open(where["lm_head.weight"], "pt") as fh, safe_open(where["model.embed_tokens.weight"], "pt") as fe:
            h, e = fh.get_slice("lm_head.weight"), fe.get_slice("model.embed_tokens.weight")
            shape = tuple(h.get_shape())
            if shape != tuple(e.get_shape()) or len(shape) != 2:
                return True
            rows = max(1, block_elems // max(1, shape[1]))
            return any(not torch.equal(h[r:r + rows], e[r:r + rows]) for r in range(0, shape[0], rows))
    except (ModelFormatError, OSError, ValueError, RuntimeError):
        return False


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
    _note_unused_layers(hf_dir(path), cfg)


def _note_unused_layers(d: str, cfg: LlamaConfig) -> None:
    """One note when the weights hold decoder layers beyond config.json's ``num_hidden_layers`` (they would be
    left out without a word; transformers warns about the unused weights the same way)."""
    from .files import LAYER_RE

    where, source = safetensors_index(d)
    layers = {int(m.group(1)) for m in map(LAYER_RE.match, where) if m}
    extra = sorted(i for i in layers if i >= cfg.num_layers)
    if extra:
        _note_once(f"warning: {source} holds weights of {max(layers) + 1} decoder layers but {d}/config.json has "
                   f"num_hidden_layers={cfg.num_layers}: layers {extra[0]}-{extra[-1]} are not used, so the model "
                   f"trained is the first {cfg.num_layers} layers only (transformers warns the same); if config.json "
                   f"is wrong, set num_hidden_layers={max(layers) + 1} there")


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
