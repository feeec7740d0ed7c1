"""The DPO reference model's log-probabilities: one float64 per data row (its summed completion log-probability,
nats), computed once by a forward pass of the whole pipeline before step 1 (TRL's ``precompute_ref_log_probs``)
and stored twice: beside the data cache (a later run on the same data, model and dtype skips the pass) and in
the run's checkpoint root (a resume reads it there: the weights on the cards are no longer the reference).

Full fine-tuning: the reference is the initial model; LoRA: the frozen base (adapters disabled during the
pass, no second copy). The launcher decides with :func:`reference_spec` whether the pass runs; the last stage
reads or writes the file (:func:`load_reference`, :func:`save_reference`).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

import torch

from npu_train.errors import UserError
from npu_train.runtime.spec import ReferenceSpec

__all__ = ["ReferenceSpec", "ReferenceError", "reference_key", "reference_spec", "load_reference", "save_reference"]

_FORMAT = "npu-train-dpo-reference-v1"


class ReferenceError(UserError):
    """The stored reference log-probabilities are missing or do not match the data (exit 2, naming the fix)."""


def _model_files(model_path: str) -> list:
    p = Path(model_path)
    files = [p] if p.is_file() else sorted(x for x in p.iterdir() if x.suffix in (".safetensors", ".gguf", ".bin"))
    out = []
    for f in files:
        st = f.stat()
        out.append((f.name, st.st_size, st.st_mtime_ns))
    return out


def reference_key(data_fingerprint: str, model_path: str, dtype: str, kinds: list) -> str:
    """sha256 hex of what the reference log-probabilities depend on: the data rows (fingerprint), the model
    weights (file names, sizes, mtimes), the compute dtype and the card kinds (kernels round differently)."""
    h = hashlib.sha256()
    h.update(f"{_FORMAT}\ndata {data_fingerprint}\nmodel {os.path.realpath(model_path)}\n".encode())
    h.update(f"files {_model_files(model_path)!r}\ndtype {dtype}\nkinds {sorted(set(kinds))!r}\n".encode())
    return h.hexdigest()


def reference_spec(key: str, ckpt_root: str, saving: bool, cache: Optional[str], resuming: bool) -> ReferenceSpec:
    """The run's :class:`ReferenceSpec`. A resume needs the file in the run (or the cache); raises
    :class:`ReferenceError` before any card starts when neither holds it (the cards now hold trained weights)."""
    name = f"dpo_reference-{key[:16]}.safetensors"
    run_file = os.path.join(ckpt_root, name) if saving else None
    cache_file = os.path.join(cache, name) if cache else None
    spec = ReferenceSpec(run_file=run_file, cache_file=cache_file, compute=False, key=key)
    if spec.existing() is not None:
        return spec
    if resuming:
        raise ReferenceError(
            f"this DPO run resumes, but its reference log-probabilities ({name}) are neither in {ckpt_root} nor "
            f"in {cache}: the cards hold trained weights, so they cannot be recomputed; start a fresh run "
            "(without train.resume), or restore the file")
    return ReferenceSpec(run_file=run_file, cache_file=cache_file, compute=True, key=key)


def save_reference(spec: ReferenceSpec, train: torch.Tensor, val: torch.Tensor) -> list[str]:
    """Write ``train`` ``[n_train]`` and ``val`` ``[n_val]`` float64 to every file of ``spec`` (temporary name,
    then rename: a reader never sees half a file). Returns the paths written."""
    from safetensors.torch import save_file

    written = []
    for f in (spec.run_file, spec.cache_file):
        if not f:
            continue
        os.makedirs(os.path.dirname(f), exist_ok=True)
        tmp = f"{f}.tmp{os.getpid()}"
        save_file({"train": train.double().contiguous(), "val": val.double().contiguous()}, tmp,
                  metadata={"format": _FORMAT, "key": spec.key})
        os.replace(tmp, f)
        written.append(f)
    return written


def load_reference(spec: ReferenceSpec, n_train: int, n_val: int, copy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train [n_train], val [n_val])`` float64 from the run's file (else the cache's; ``copy``: then written
    into the run too). Raises :class:`ReferenceError` when missing or of another length."""
    from safetensors import safe_open

    f = spec.existing()
    if f is None:
        raise ReferenceError(f"the DPO reference log-probabilities ({spec.run_file or spec.cache_file}) are missing; "
                             "start a fresh run to compute them")
    with safe_open(f, framework="pt") as fh:
        meta = fh.metadata() or {}
        train, val = fh.get_tensor("train"), fh.get_tensor("val")
    if meta.get("key") != spec.key or train.shape != (n_train,) or val.shape != (n_val,):
        raise ReferenceError(f"{f} does not belong to this data and model ({train.shape[0]}/{val.shape[0]} rows, "
                             f"the data has {n_train}/{n_val}); delete it and start a fresh run")
    if copy and spec.run_file and f != spec.run_file:
        save_reference(ReferenceSpec(spec.run_file, None, False, spec.key), train, val)
    return train, val
