"""The DPO reference model's log-probabilities: one float64 per data row (its summed completion log-probability,
nats; NaN where not computed), computed by a forward pass of the whole pipeline before step 1 (TRL's
``precompute_ref_log_probs``) for the rows the run will use, and stored twice: beside the data cache (a later
run on the same data, model and dtype computes only the rows it lacks) and in the run's checkpoint root (a
resume reads it there: the weights on the cards are no longer the reference).

Full fine-tuning: the reference is the initial model, so a resume cannot add rows; LoRA: the frozen base
(adapters disabled during the pass, no second copy), which a resume can still compute. The launcher decides
with :func:`reference_spec` which rows the cards compute; the last stage reads and writes the files
(:func:`load_reference`, :func:`save_reference`). With data-parallel replicas each replica computes a share of
the rows (:func:`pass_shares`) and the last stages exchange the values
(:meth:`~npu_train.runtime.trainer.StageTrainer.reference`).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterable, Optional

import torch

from npu_train.errors import UserError
from npu_train.runtime.spec import ReferenceSpec

__all__ = ["ReferenceError", "reference_key", "reference_spec", "needed_rows", "load_reference",
           "save_reference", "read_values", "replica_shares", "pass_shares"]

_FORMAT = "npu-train-dpo-reference-v1"


class ReferenceError(UserError):
    """The stored reference log-probabilities are missing or do not match the data (exit 2, naming the fix)."""


def _model_files(model_path: str) -> list:
    p = Path(model_path)
    files = [p] if p.is_file() else sorted(x for x in p.iterdir() if x.suffix in (".safetensors", ".gguf", ".bin"))
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def reference_key(data_fingerprint: str, model_path: str, dtype: str, kinds: list) -> str:
    """sha256 hex of what the reference log-probabilities depend on: the data rows (fingerprint), the model
    weights (file names, sizes, mtimes), the compute dtype and the card kinds (kernels round differently)."""
    h = hashlib.sha256()
    h.update(f"{_FORMAT}\ndata {data_fingerprint}\nmodel {os.path.realpath(model_path)}\n".encode())
    h.update(f"files {_model_files(model_path)!r}\ndtype {dtype}\nkinds {sorted(set(kinds))!r}\n".encode())
    return h.hexdigest()


def needed_rows(samplers: Iterable, start: int, steps: int) -> list[int]:
    """Sorted training rows drawn by ``samplers`` (one per replica) in 0-based steps ``start .. steps - 1``."""
    rows = set()
    for smp in samplers:
        for step in range(start, steps):
            for idx in smp.micro_batches_for_step(step):
                rows.update(int(r) for r in idx)
    return sorted(rows)


def replica_shares(rows: list, micro_batch: int, dp: int, start: int = 0) -> list[list]:
    """``rows`` cut into micro-batches of ``micro_batch`` (the last one may be shorter), micro-batch ``j`` given to
    replica ``(start + j) % dp``: ``dp`` lists of rows (possibly empty: fewer micro-batches than replicas) whose
    union is ``rows``. Each micro-batch holds the rows it holds with one replica, so every value is computed in the
    same batch as with one replica (the same numbers as one replica's pass at the same thread count)."""
    chunks = [list(rows[a:a + micro_batch]) for a in range(0, len(rows), micro_batch)]
    return [[r for j, c in enumerate(chunks) if (start + j) % dp == k for r in c] for k in range(dp)]


def pass_shares(spec: ReferenceSpec, micro_batch: int, dp: int) -> tuple[list, list]:
    """``(train, val)``: each replica's rows of ``spec.train_rows`` and ``spec.val_rows`` (:func:`replica_shares`),
    the val micro-batches continuing the train ones' round (so the replicas' counts differ by one micro-batch at
    most). A function of its arguments only: every stage of a replica agrees on its share without messaging."""
    train = replica_shares(list(spec.train_rows), micro_batch, dp)
    n_train_mbs = -(-len(spec.train_rows) // micro_batch)
    return train, replica_shares(list(spec.val_rows), micro_batch, dp, start=n_train_mbs)


def read_values(path: Optional[str], key: str, n_train: int, n_val: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train [n_train], val [n_val])`` float64 of ``path`` (NaN where not computed; all NaN when ``path`` is
    None). Raises :class:`ReferenceError` for a file of another key or length."""
    if path is None:
        return torch.full((n_train,), float("nan"), dtype=torch.float64), torch.full((n_val,), float("nan"),
                                                                                      dtype=torch.float64)
    from safetensors import safe_open

    with safe_open(path, framework="pt") as fh:
        meta = fh.metadata() or {}
        train, val = fh.get_tensor("train"), fh.get_tensor("val")
    if meta.get("key") != key or train.shape != (n_train,) or val.shape != (n_val,):
        raise ReferenceError(f"{path} does not belong to this data and model ({train.shape[0]}/{val.shape[0]} rows, "
                             f"the data has {n_train}/{n_val}); delete it and start a fresh run")
    return train.double(), val.double()


def reference_spec(key: str, ckpt_root: str, saving: bool, cache: Optional[str], *, n_train: int, n_val: int,
                   train_rows: list, val_rows: list, resuming: bool, lora: bool) -> ReferenceSpec:
    """The run's :class:`ReferenceSpec`: the ``train_rows`` / ``val_rows`` it uses that no stored file holds.
    Raises :class:`ReferenceError` before any card starts when a full fine-tuning resume lacks rows (the cards
    hold trained weights, so the initial model's values cannot be recomputed)."""
    name = f"dpo_reference-{key[:16]}.safetensors"
    spec = ReferenceSpec(run_file=os.path.join(ckpt_root, name) if saving else None,
                         cache_file=os.path.join(cache, name) if cache else None, key=key)
    found = spec.existing()
    have_t, have_v = read_values(found, key, n_train, n_val)
    miss_t = tuple(r for r in train_rows if torch.isnan(have_t[r]))
    miss_v = tuple(r for r in val_rows if torch.isnan(have_v[r]))
    if (miss_t or miss_v) and resuming and not lora:
        why = (f"{name} is neither in {ckpt_root} nor in {cache}" if found is None else
               f"{found} lacks {len(miss_t) + len(miss_v)} of the rows it uses (more steps than the first launch?)")
        fix = ("restore the file, or start a fresh run" if found is None else
               "resume with the first launch's train.steps and data.eval_batches, or start a fresh run")
        raise ReferenceError(f"this DPO run resumes, but its reference log-probabilities are missing: {why}; the "
                             f"cards hold trained weights, so the initial model's values cannot be recomputed; {fix}")
    return ReferenceSpec(spec.run_file, spec.cache_file, key, miss_t, miss_v)


def save_reference(spec: ReferenceSpec, train: torch.Tensor, val: torch.Tensor) -> list[str]:
    """Write ``train`` ``[n_train]`` and ``val`` ``[n_val]`` float64 (NaN: not computed) to every file of
    ``spec`` (temporary name, then rename: a reader never sees half a file). Returns the paths written."""
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


def load_reference(spec: ReferenceSpec, n_train: int, n_val: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train [n_train], val [n_val])`` float64 from the run's file, else the cache's (NaN where not
    computed; all NaN when neither exists)."""
    return read_values(spec.existing(), spec.key, n_train, n_val)
