"""A model's sequence-length limits read without torch or numpy, so that the launcher can refuse a
``data.seq_len`` the model cannot take before its heavy imports (:func:`check_seq_len_early`): a fresh-clone review
waited 14 s on a loaded 2-core host for ``data.seq_len=100000`` to be refused (issue 40).

Sources, the same values the loaders read: a shape preset's ``max_position_embeddings``; an HF directory's
``config.json`` (``max_position_embeddings``, default 2048 as ``hf.py``; ``sliding_window`` for Mistral and
Mixtral); a GGUF file's header (``<arch>.context_length``, default 2048 as ``gguf.py``), read key by key up to
that key (GGUF v2/v3 layout: magic, version, tensor count, key-value count, then the key-value pairs). Anything
this cannot read returns None: the full check after the imports (``runtime.job.pipeline_stages``) still runs.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Optional

from npu_train.errors import ConfigError
from npu_train.model.config import FAMILIES

__all__ = ["SequenceLimits", "sequence_limits", "gguf_context_length", "check_seq_len", "check_seq_len_early",
           "WINDOW_TYPES"]

#: GGUF value types: scalar type id -> struct format (8: string, 9: array)
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
#: the GGUF architectures the loader takes (``gguf.GGUF_FAMILIES``' keys, from the same table)
_GGUF_ARCHS = frozenset(f.gguf_arch for f in FAMILIES.values() if f.gguf_arch)
#: the ``config.json`` model types whose ``sliding_window`` the loader keeps (``hf.py`` reads this)
WINDOW_TYPES = ("mistral", "mixtral")


class SequenceLimits(tuple):
    """``(max_position_embeddings, sliding_window or None, source)``: tokens, tokens, where they were read."""

    @property
    def max_positions(self) -> int:
        return self[0]

    @property
    def window(self) -> Optional[int]:
        return self[1]


def _read_string(f) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    return f.read(n).decode("utf-8", "replace")


def _read_value(f, vtype: int):
    if vtype in _GGUF_SCALARS:
        fmt = _GGUF_SCALARS[vtype]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if vtype == 8:
        return _read_string(f)
    if vtype == 9:
        (itype,) = struct.unpack("<I", f.read(4))
        (n,) = struct.unpack("<Q", f.read(8))
        if itype in _GGUF_SCALARS:  # skipped whole: no array value is needed here
            f.seek(n * struct.calcsize(_GGUF_SCALARS[itype]), os.SEEK_CUR)
            return None
        for _ in range(n):
            _read_value(f, itype)
        return None
    raise ValueError(f"GGUF value type {vtype}")


def gguf_context_length(path: str) -> Optional[int]:
    """``<arch>.context_length`` of the GGUF file at ``path`` (2048 when the key is missing, as the loader reads
    it), read from the header alone; None when the file is not a GGUF of a supported architecture or cannot
    be read."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
            (version,) = struct.unpack("<I", f.read(4))
            if version < 2:
                return None
            _n_tensors, n_kv = struct.unpack("<QQ", f.read(16))
            arch = None
            for _ in range(n_kv):
                key = _read_string(f)
                (vtype,) = struct.unpack("<I", f.read(4))
                value = _read_value(f, vtype)
                if key == "general.architecture":
                    arch = value
                    if arch not in _GGUF_ARCHS:
                        return None
                elif arch is not None and key == f"{arch}.context_length":
                    return int(value)
            return 2048 if arch is not None else None
    except (OSError, ValueError, struct.error, UnicodeDecodeError):
        return None


def _embedded_path() -> Optional[str]:
    """The embedded GGUF's path (``files.embedded_model_path``: found without importing the package), or None."""
    from npu_train.model.files import embedded_model_path

    try:
        return embedded_model_path()
    except FileNotFoundError:
        return None


def sequence_limits(spec: str) -> Optional[SequenceLimits]:
    """The limits of ``model.path=spec`` (``embedded``, a shape preset, an HF directory, a GGUF file) read
    torch-free, or None when they cannot be read cheaply (the loader's own check then decides)."""
    s = str(spec).strip()
    path = _embedded_path() if s.lower() in ("embedded", "smollm2") else os.path.expanduser(s)
    if path is None:
        return None
    if os.path.isdir(path):
        try:
            with open(os.path.join(path, "config.json")) as f:
                raw = json.load(f)
            window = raw.get("sliding_window") if raw.get("model_type") in WINDOW_TYPES else None
            return SequenceLimits((int(raw.get("max_position_embeddings", 2048)),
                                   int(window) if window is not None else None, "config.json"))
        except (OSError, ValueError, TypeError):
            return None
    if os.path.isfile(path):
        n = gguf_context_length(path)
        return SequenceLimits((n, None, "GGUF context_length")) if n is not None else None
    from npu_train.model.presets import get_preset

    try:
        m = get_preset(s)
    except KeyError:
        return None
    return SequenceLimits((int(m.max_position_embeddings), getattr(m, "sliding_window", None), "preset"))


def check_seq_len(seq_len: int, max_positions: int, window: Optional[int], source: Optional[str] = None) -> None:
    """ConfigError naming the fix when ``seq_len`` (tokens) exceeds ``max_positions`` (``max_position_embeddings``,
    read from ``source`` when given) or the model's sliding ``window`` (below it sliding-window attention is full
    attention). One wording for the early check (:func:`check_seq_len_early`) and the one after the imports
    (``runtime.job.pipeline_stages``)."""
    if seq_len > max_positions:
        where = f"max_position_embeddings, {source}" if source else "max_position_embeddings"
        raise ConfigError(f"data.seq_len={seq_len} exceeds the model's maximum sequence length "
                          f"{max_positions} ({where}): lower data.seq_len to at most {max_positions}")
    if window is not None and seq_len > window:
        raise ConfigError(f"data.seq_len={seq_len} exceeds the model's sliding_window={window} "
                          f"(config.json), and sliding-window attention is not implemented yet: "
                          f"use data.seq_len<={window}")


def check_seq_len_early(seq_len: int, spec: str) -> None:
    """:func:`check_seq_len` against the limits of ``model.path=spec`` read torch-free (:func:`sequence_limits`);
    nothing when they cannot be read here."""
    lim = sequence_limits(spec)
    if lim is not None:
        check_seq_len(seq_len, lim.max_positions, lim.window, lim[2])
