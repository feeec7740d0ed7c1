"""Checkpoints: per-stage safetensors shards, a manifest written last, atomic rename into place.

``<root>/step_NNNNNN/`` holds ``stage_NNN.safetensors`` (fp32 ``master.``/``exp_avg.``/``exp_avg_sq.<hf
name>``, ``rng.<rank>``), ``stage_NNN.json`` and ``manifest.json`` (step, config, split, sampler state,
``{tensor key: shard}``). Keys are HF names, so any split can resume. Writers: :func:`save_shard`,
:func:`finalize`; readers: :func:`find_checkpoint`, :class:`CheckpointReader`. The save protocol,
ordering, multi-node roots and root ownership are in docs/design.md §17.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from typing import Optional

import torch
from safetensors import safe_open

from npu_train.checkpoint.stream import Entry, write_stream
from npu_train.config import UserError
from npu_train.errors import fmt_disk_bytes, out_of_space
from npu_train.ownership import owner_alive, process_identity

STEP_RE = re.compile(r"^step_(\d{6,})$")
MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class CheckpointError(UserError):
    """A checkpoint cannot be used (missing, incomplete, or from another model)."""


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: str) -> None:
    try:
        _fsync_file(path)
    except OSError:
        pass


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


OWNER = "owner.json"


def tmp_dir(root: str, step: int, job_id: str, owner_pid: Optional[int] = None) -> str:
    """Staging directory for ``step`` (created under a ``.new-`` name with ``owner.json`` naming
    ``owner_pid``, then renamed, so no launch sees it without an owner)."""
    d = os.path.join(root, f".tmp-{step_dirname(step)}-{job_id}")
    if os.path.isdir(d):
        return d
    ident = process_identity(owner_pid if owner_pid is not None else os.getpid()) or {}
    new = os.path.join(root, f".new-{os.getpid()}-{step_dirname(step)}-{job_id}")
    os.makedirs(new, exist_ok=True)
    with open(os.path.join(new, OWNER), "w") as f:
        json.dump(dict(ident, job_id=job_id), f)
    try:
        os.rename(new, d)
    except OSError:  # another stage of the job created it first
        shutil.rmtree(new, ignore_errors=True)
    return d


class CheckpointSpaceError(CheckpointError):
    """Too little free space for a shard (before writing, or instead of a bare ``No space left on device``)."""


#: free space kept beyond a shard's tensor bytes: the safetensors header and the JSON file (bytes)
SHARD_MARGIN_BYTES = 16 << 20


def shard_bytes(tensors) -> int:
    """Bytes of a shard's tensor data (dict of tensors or list of :class:`~npu_train.optim.entry.Entry`)."""
    if isinstance(tensors, dict):
        return sum(t.numel() * t.element_size() for t in tensors.values())
    return sum(e.nbytes for e in tensors)


def entries_of(tensors: dict[str, torch.Tensor]) -> list[Entry]:
    """:class:`~npu_train.optim.entry.Entry` objects for tensors already in memory."""
    return [Entry(k, t.dtype, tuple(t.shape), (lambda t=t: t)) for k, t in tensors.items()]


def space_message(directory: str, need: int, free: int, what: str) -> str:
    """The error text for a checkpoint that does not fit in ``directory`` (a staging dir is named by its root)."""
    if os.path.basename(directory).startswith(".tmp-"):
        directory = os.path.dirname(directory)
    return (f"{what} needs {fmt_disk_bytes(need)} in {directory} but only {fmt_disk_bytes(free)} are free "
            "(the other stages' shards need room too): free disk space there (older step_* checkpoints can go: "
            "the file 'latest' names the newest) or point checkpoint.dir at a larger disk; an earlier complete checkpoint there "
            "is untouched")


def check_free_space(directory: str, need: int, what: str) -> None:
    """Raise :class:`CheckpointSpaceError` if ``directory`` has < ``need`` + :data:`SHARD_MARGIN_BYTES` bytes free."""
    free = shutil.disk_usage(directory).free
    if free < need + SHARD_MARGIN_BYTES:
        raise CheckpointSpaceError(space_message(directory, need + SHARD_MARGIN_BYTES, free, what))


def space_warning(root: str, final: str) -> Optional[str]:
    """A warning when ``root`` has less free space than the checkpoint ``final`` takes, else None."""
    size = sum(e.stat().st_size for e in os.scandir(final) if e.is_file())
    free = shutil.disk_usage(root).free
    if free >= size:
        return None
    return (f"warning: {fmt_disk_bytes(free)} free in {root}, less than one checkpoint ({fmt_disk_bytes(size)}): "
            "the next save will fail; free disk space there or point checkpoint.dir at a larger disk")


def checkpoint_bytes(model_cfg, stages: int, mode: str, lora_params_per_layer: int = 0) -> int:
    """Bytes of one checkpoint's tensors, 12 per trained parameter (fp32 master + two AdamW moments): every
    parameter, plus ``V*H`` when the tied embedding spans two stages (``mode="full"``), or the LoRA adapters
    (``lora_params_per_layer`` x layers)."""
    if mode != "full":
        return 12 * int(lora_params_per_layer) * model_cfg.num_layers
    return 12 * (model_cfg.total_params() + (model_cfg.embedding_params()
                                             if model_cfg.tie_word_embeddings and stages > 1 else 0))


def checkpoints_needed_at_once(keep: int, existing: int, saves: int) -> int:
    """How many checkpoints' room this launch needs free at its peak: during a save the ``keep`` newest
    (0 = all) stay beside the one being written, and ``existing`` ones are already on disk."""
    if saves <= 0:
        return 0
    if keep <= 0:
        return saves
    return max(1, min(keep, existing + saves - 1) + 1 - existing)


def launch_space_message(root: str, size: int, count: int, free: int, keep: int) -> Optional[str]:
    """Why ``count`` new checkpoints of ``size`` bytes do not fit in ``free`` bytes of ``root``, or None."""
    if count <= 0 or free >= count * size:
        return None
    if count == 1:
        return (f"a checkpoint of this run takes about {fmt_disk_bytes(size)} but only {fmt_disk_bytes(free)} "
                f"are free in {root}: the first save will fail")
    return (f"this run holds up to {count} checkpoints of about {fmt_disk_bytes(size)} at once (checkpoint.keep={keep} "
            f"beside the one being written) = {fmt_disk_bytes(count * size)}, but only {fmt_disk_bytes(free)} are "
            f"free in {root}: a later save will fail (lower checkpoint.keep or raise train.save_every)")


def launch_space_warning(root: str, model_cfg, stages: int, mode: str) -> Optional[str]:
    """A warning when ``root`` cannot hold one full fine-tuning checkpoint (:func:`checkpoint_bytes`), else
    None (also for LoRA)."""
    if mode != "full":
        return None
    msg = launch_space_message(root, checkpoint_bytes(model_cfg, stages, mode), 1, shutil.disk_usage(root).free, 0)
    return f"warning: {msg}; free disk space there or point checkpoint.dir at a larger disk" if msg else None


class FiniteCheck:
    """Whether every floating-point tensor written so far is finite (``rng.*`` skipped), checked in chunks of
    :attr:`CHUNK` elements: a whole-tensor ``isfinite`` allocates ~1.6x its fp32 size (1.7 GiB for a 128k x
    2048 embedding), more than the save's memory bound."""

    CHUNK = 1 << 22  # elements: ~16 MiB of fp32 temporaries at a time

    def __init__(self):
        self.finite = True

    def visit(self, name: str, t: torch.Tensor) -> None:
        if not self.finite or name.startswith("rng.") or not t.is_floating_point():
            return
        self.finite = all(bool(torch.isfinite(c).all()) for c in t.reshape(-1).split(self.CHUNK))


def save_shard(staging: str, rank: int, tensors, meta: dict) -> str:
    """Write one stage's shard (safetensors + JSON) into ``staging`` tensor by tensor, fsync; returns its path.
    ``tensors``: a list of :class:`~npu_train.optim.entry.Entry` (or a dict); extra host memory: the largest
    ``get()``. ``meta["finite"]`` records nan/inf. Raises :class:`CheckpointSpaceError` (partial file removed)."""
    if isinstance(tensors, dict):
        tensors = entries_of(tensors)
    st = os.path.join(staging, f"stage_{rank:03d}.safetensors")
    what = f"the checkpoint shard of stage {rank}"
    need = shard_bytes(tensors)
    check_free_space(staging, need, what)
    check = FiniteCheck()
    try:
        write_stream(st, tensors, {"format": "pt"}, check.visit)
    except Exception as e:
        if not out_of_space(e):
            raise
        try:
            os.remove(st)
        except OSError:
            pass
        raise CheckpointSpaceError(space_message(staging, need, shutil.disk_usage(staging).free, what)) from None
    js = os.path.join(staging, f"stage_{rank:03d}.json")
    with open(js, "w") as f:
        json.dump(dict(meta, finite=check.finite and bool(meta.get("finite", True))), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return st


def missing_shards(staging: str, world_size: int) -> list[int]:
    """Stages ``0 .. world_size-1`` whose shard is not in ``staging`` (a node writing to an unshared root)."""
    return [r for r in range(world_size)
            if not (os.path.isfile(os.path.join(staging, f"stage_{r:03d}.safetensors"))
                    and os.path.isfile(os.path.join(staging, f"stage_{r:03d}.json")))]


def finalize(root: str, staging: str, step: int, manifest: dict, keep: int = 0) -> str:
    """Write the manifest, publish the checkpoint atomically, keep the ``keep`` newest (> 0); returns its path."""
    index = {}
    for fn in sorted(os.listdir(staging)):
        if fn.endswith(".safetensors"):
            with safe_open(os.path.join(staging, fn), "pt") as f:
                for k in f.keys():
                    index[k] = fn
    finite = True
    for fn in sorted(os.listdir(staging)):
        if fn.startswith("stage_") and fn.endswith(".json"):
            with open(os.path.join(staging, fn)) as f:
                finite = finite and bool(json.load(f).get("finite", True))
    seq = 1 + max((_manifest(p).get("seq", 0) for p in complete_checkpoints(root)), default=0)
    manifest = dict(manifest, step=step, format=FORMAT_VERSION, index=index, saved_at=time.time(), seq=seq,
                    finite=finite)
    try:
        os.remove(os.path.join(staging, OWNER))
    except OSError:
        pass
    mp = os.path.join(staging, MANIFEST)
    with open(mp + ".part", "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(mp + ".part", mp)
    _fsync_dir(staging)
    final = os.path.join(root, step_dirname(step))
    if os.path.exists(final):  # a re-save of the same step (e.g. resumed run): replace atomically-ish
        old = final + f".old-{os.getpid()}"
        os.replace(final, old)
        os.replace(staging, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, final)
    _fsync_dir(root)
    latest = os.path.join(root, "latest")
    with open(latest + ".part", "w") as f:
        f.write(step_dirname(step) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest + ".part", latest)
    _fsync_dir(root)
    if keep > 0:
        done = complete_checkpoints(root)
        finite = [p for p in done if _manifest(p).get("finite", True)]
        spare = finite[-1] if finite else None  # the newest finite checkpoint is never deleted
        for d in done[:-keep]:
            if d != spare:
                shutil.rmtree(d, ignore_errors=True)
    return final


def _manifest(path: str) -> dict:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            m = json.load(f)
        return m if isinstance(m, dict) else {}
    except (OSError, ValueError):
        return {}


def checkpoint_split(path: str) -> Optional[list]:
    """Decoder layers per stage of the checkpoint at ``path``, or None. A stage's entry is ``[first, last]``, or
    ``[first, last, first2, last2]`` for a card of a two-chunk schedule."""
    try:
        out = []
        for e in _manifest(path)["split"]:
            if len(e) not in (2, 4):
                return None
            out.append(sum(int(e[k + 1]) - int(e[k]) for k in range(0, len(e), 2)))
        return out
    except (KeyError, TypeError, ValueError):
        return None


#: names of a save in progress or being replaced (:func:`tmp_dir`, :func:`finalize`): never a checkpoint to read,
#: even once the manifest is in them
_STAGING_RE = re.compile(r"^\.(tmp|new)-|\.old-\d+$")


def is_complete(path: str) -> bool:
    """A directory is a checkpoint iff it holds ``manifest.json`` (written last, when every shard is in) and is no
    staging directory. Any name: a ``step_N`` copied to ``best/`` is read as well (its step is in the manifest);
    only a checkpoint root's own ``step_N`` directories are listed, kept or rotated (:func:`complete_checkpoints`)."""
    name = os.path.basename(os.path.normpath(path))
    return not _STAGING_RE.search(name) and os.path.isfile(os.path.join(path, MANIFEST))


def complete_checkpoints(root: str) -> list[str]:
    """Complete checkpoints under ``root``, oldest first in write order (manifest ``seq``, ``saved_at``, step)."""
    if not os.path.isdir(root):
        return []
    out = []
    for fn in os.listdir(root):
        m = STEP_RE.match(fn)
        p = os.path.join(root, fn)
        if m and is_complete(p):
            man = _manifest(p)
            out.append((int(man.get("seq", 0) or 0), float(man.get("saved_at", 0.0) or 0.0), int(m.group(1)), p))
    return [t[-1] for t in sorted(out)]


def remove_stale_staging(root: str) -> list[str]:
    """Delete staging directories (``.tmp-*``, ``.new-*``) whose owner on this host is gone or unknown (owners
    alive or on another host are kept); returns the removed paths."""
    removed = []
    if os.path.isdir(root):
        for fn in os.listdir(root):
            if not fn.startswith((".tmp-", ".new-")):
                continue
            p = os.path.join(root, fn)
            try:
                with open(os.path.join(p, OWNER)) as f:
                    owner = json.load(f)
            except (OSError, ValueError):
                owner = None
            if owner_alive(owner) is False:
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


def interrupted_note(root: str, interrupted=()) -> str:
    """Why ``root`` holds no complete checkpoint when saves were begun there: ``interrupted`` (staging dirs
    just removed) and the ``.tmp-step_*`` dirs still in it; "" when there were none."""
    names = [os.path.basename(p) for p in interrupted]
    if os.path.isdir(root):
        names += [fn for fn in os.listdir(root) if fn.startswith(".tmp-step_") and fn not in names]
    if not names:
        return ""
    steps = sorted({int(m.group(1)) for m in (re.match(r"\.tmp-step_(\d+)-", n) for n in names) if m})
    which = f"step {steps[0]}" if len(steps) == 1 else f"steps {', '.join(map(str, steps))}"
    gone = " (removed now: its job is gone)" if interrupted else ""
    return (f"{'the only save' if len(steps) <= 1 else 'every save'} ({which}) was interrupted before it completed: {root!r} held just the staging "
            f"directory {', '.join(sorted(names))}{gone}")


def run_dir_error(path: str, what: str = "checkpoint") -> Optional[str]:
    """The error for a run directory (one holding ``checkpoints/``) passed where a checkpoint or ``what`` is
    expected, naming ``<path>/checkpoints`` to pass instead; None when ``path`` is no run directory.
    Shared by ``export`` and ``generate`` so both say the same."""
    if not os.path.isdir(os.path.join(path, "checkpoints")):
        return None
    return (f"{path} is a run directory, not a {what}: pass {os.path.join(path, 'checkpoints')} (its newest "
            "checkpoint) or one of the step_N directories in it")


def find_checkpoint(spec: str, root: Optional[str], arg: Optional[str] = None, interrupted=()) -> Optional[str]:
    """Resolve ``train.resume``: ``latest``/``auto`` (newest complete under ``root``), a checkpoint dir or a
    root. ``auto`` returns None when there is none (a fresh start); ``arg`` names the setting in errors;
    ``interrupted``: staging dirs of dead jobs the caller just removed (named by the error). Raises
    CheckpointError when nothing complete is found or the named directory is incomplete."""
    if spec == "auto":  # the last one written if there is one, else None (a fresh start)
        cands = complete_checkpoints(root) if root else []
        return cands[-1] if cands else None
    if spec == "latest":  # the last one written (manifest seq), not the highest step
        cands = complete_checkpoints(root) if root else []
        if not cands:
            why = interrupted_note(root, interrupted) if root else ""
            if why:
                raise CheckpointError(f"train.resume=latest: no complete checkpoint to resume: {why}; start the run "
                                      "again without train.resume (train.resume=auto starts fresh when there is none)")
            raise CheckpointError(f"train.resume=latest: no complete checkpoint under {root!r}; "
                                  "set checkpoint.dir to the run's checkpoint directory or drop train.resume")
        return cands[-1]
    arg = arg or f"train.resume={spec!r}"
    path = os.path.abspath(os.path.expanduser(spec))
    if is_complete(path):
        return path
    cands = complete_checkpoints(path)
    if cands:
        return cands[-1]
    fix = ("give a checkpoint directory (step_XXXXXX, or a copy under any name) with a manifest.json, or a "
           "checkpoint root holding one "
           "(the run's checkpoint.dir, default <run dir>/checkpoints)")
    run_dir = run_dir_error(path)
    if run_dir:
        raise CheckpointError(f"{arg}: {run_dir}")
    if os.path.isdir(path) and _STAGING_RE.search(os.path.basename(os.path.normpath(path))):
        raise CheckpointError(f"{arg}: {path} is the staging directory of a save that did not complete (or is "
                              f"still under way), not a checkpoint; {fix}")
    if os.path.isdir(path):
        raise CheckpointError(f"{arg}: {path} holds no complete checkpoint (no manifest.json); {fix}")
    beside = complete_checkpoints(os.path.dirname(path))
    if beside:  # e.g. a step that checkpoint.keep rotated away: the ones there, to pick from
        names = [os.path.basename(c) for c in beside]
        shown = ", ".join(names[-6:]) if len(names) <= 6 else f"{len(names)} of them, the newest {', '.join(names[-6:])}"
        raise CheckpointError(f"{arg}: {path} does not exist (checkpoint.keep may have rotated it away); "
                              f"{os.path.dirname(path)} holds {shown}: give one of them, or "
                              f"train.resume={os.path.dirname(path)} for the newest")
    raise CheckpointError(f"{arg}: {path} does not exist; {fix}")


def open_resume_checkpoint(path: str, root: str, auto: bool = False) -> "CheckpointReader":
    """The verified :class:`CheckpointReader` of ``train.resume``; ``auto`` skips a damaged newest checkpoint
    with a note. Raises CheckpointError naming the damage and an earlier checkpoint."""
    cands = [path]
    if auto:
        cands += [p for p in reversed(complete_checkpoints(root)) if os.path.abspath(p) != os.path.abspath(path)]
    first = None
    for p in cands:
        try:
            reader = CheckpointReader(p)
            reader.verify()
        except CheckpointError as e:
            first = first or e
            if auto:
                print(f"note: train.resume=auto skips {p}: {e}", flush=True)
            continue
        return reader
    raise first


#: ``checkpoint.existing``: what a new run does with another run's checkpoints in its checkpoint root
EXISTING = ("refuse", "set_aside")


def check_reused_root(root: str, resume_dir: Optional[str], existing: str = "refuse") -> list[str]:
    """The complete checkpoints under ``root`` of another run: the run continues them only when ``resume_dir``
    is directly under ``root``. Moves nothing. Raises CheckpointError if there are any and ``existing`` is
    ``"refuse"``; with ``"set_aside"`` returns them for :func:`set_aside`."""
    cks = complete_checkpoints(root)
    if not cks or (resume_dir is not None
                   and os.path.realpath(os.path.dirname(os.path.abspath(resume_dir))) == os.path.realpath(root)):
        return []
    if existing == "refuse":
        start = "a fresh run" if resume_dir is None else f"a run resuming from {resume_dir}"
        raise CheckpointError(
            f"{root} (checkpoint.dir) already holds {len(cks)} checkpoint(s) of an earlier run (newest "
            f"{os.path.basename(cks[-1])}), which {start} would mix with its own: continue that run with "
            "train.resume=latest, or start anew with checkpoint.existing=set_aside (moves them to "
            f"{os.path.join(root, 'previous-<k>')}/, deletes nothing) or another checkpoint.dir / hydra.run.dir")
    return cks


#: a run's own files in its checkpoint root besides the checkpoints: tracker run ids (metrics/trackers.py) and
#: DPO reference log-probabilities (runtime/reference.py), set aside with them
RUN_FILES = ("trackers.json",)
RUN_FILE_PREFIXES = ("dpo_reference-",)


def set_aside(root: str) -> Optional[str]:
    """Move ``root``'s ``step_*`` directories, ``latest`` and the run's own files (:data:`RUN_FILES`, the DPO
    reference values) into the first free ``<root>/previous-<k>/`` and return it (None if there are no
    checkpoints to move); nothing is deleted. The set-aside run stays whole: its tracker runs' ids go with it
    instead of being overwritten by the new run's."""
    from npu_train.metrics.report import move_to_previous

    names = [fn for fn in os.listdir(root) if STEP_RE.match(fn) or fn == "latest"] if os.path.isdir(root) else []
    if names:
        names += [fn for fn in os.listdir(root) if fn in RUN_FILES or fn.startswith(RUN_FILE_PREFIXES)]
    dest = move_to_previous(root, names)
    if dest:
        _fsync_dir(root)
    return dest


def earlier_checkpoint_hint(path: str) -> str:
    """The fix for a damaged checkpoint ``path``: the newest other complete checkpoint beside it, or what else to do."""
    root = os.path.dirname(os.path.abspath(path))
    others = [c for c in complete_checkpoints(root) if os.path.realpath(c) != os.path.realpath(path)]
    if others:
        which = "an earlier" if os.path.basename(others[-1]) < os.path.basename(os.path.normpath(path)) else "another"
        return f"use {which} checkpoint, e.g. {others[-1]} (to resume from it: train.resume={others[-1]})"
    return f"there is no other checkpoint in {root}: restore the checkpoint from a copy or train again"


class CheckpointReader:
    """Read a complete checkpoint's tensors by key (``master.``/``exp_avg.``/``exp_avg_sq.<hf name>``) as fp32
    CPU tensors; a tied ``lm_head.weight`` falls back to the embedding's entries."""

    def __init__(self, path: str):
        if not is_complete(path):
            raise CheckpointError(f"{path} is not a complete checkpoint (no manifest.json)")
        self.path = path
        mp = os.path.join(path, MANIFEST)
        try:
            with open(mp) as f:
                self.manifest = json.load(f)
            self.index: dict[str, str] = dict(self.manifest["index"])
            self.step: int = int(self.manifest["step"])
        except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
            what = f"no key {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            raise CheckpointError(f"{mp}: not a readable checkpoint manifest ({what}): the checkpoint is damaged "
                                  f"(a truncated copy?); {earlier_checkpoint_hint(path)}") from None
        m = STEP_RE.match(os.path.basename(os.path.normpath(path)))
        if m and int(m.group(1)) != self.step:
            raise CheckpointError(f"checkpoint {path}: its manifest says step {self.step}, its directory name step "
                                  f"{int(m.group(1))}: the checkpoint was edited or mixed up; {earlier_checkpoint_hint(path)}")

    def verify(self) -> None:
        """Check without reading tensor data that every indexed shard exists, its header parses, its length
        matches and it holds its tensors (no checksums). Raises CheckpointError naming the shard and the fix."""
        by_file: dict[str, list[str]] = {}
        for k, fn in self.index.items():
            by_file.setdefault(fn, []).append(k)
        for fn, keys in sorted(by_file.items()):
            sp = os.path.join(self.path, fn)
            if os.path.basename(fn) != fn or not os.path.isfile(sp):
                raise CheckpointError(f"checkpoint {self.path}: shard {sp} is missing; {earlier_checkpoint_hint(self.path)}")
            try:
                with safe_open(sp, "pt") as f:
                    have = set(f.keys())
            except Exception as e:  # safetensors raises its own SafetensorError (header, length) or OSError
                raise CheckpointError(f"checkpoint {self.path}: shard {sp} is damaged ({type(e).__name__}: "
                                      f"{str(e).splitlines()[0] if str(e) else ''}); {earlier_checkpoint_hint(self.path)}") from None
            lost = [k for k in keys if k not in have]
            if lost:
                raise CheckpointError(f"checkpoint {self.path}: shard {sp} lacks {len(lost)} tensor(s) its manifest "
                                      f"lists (e.g. {lost[0]!r}); {earlier_checkpoint_hint(self.path)}")

    def has(self, key: str) -> bool:
        return key in self.index

    def get(self, key: str) -> torch.Tensor:
        """The tensor ``key`` (fp32, CPU); CheckpointError for a missing key or a truncated/corrupt shard."""
        if key not in self.index:
            prefix, _, name = key.partition(".")
            if name == "lm_head.weight" and f"{prefix}.model.embed_tokens.weight" in self.index:
                key = f"{prefix}.model.embed_tokens.weight"
            else:
                raise CheckpointError(f"checkpoint {self.path} has no tensor {key!r}")
        shard = os.path.join(self.path, self.index[key])
        try:
            with safe_open(shard, "pt") as f:
                return f.get_tensor(key)
        except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError (truncated file), OSError (missing)
            if not os.path.isfile(shard) or not is_complete(self.path):  # was readable when opened (verify, index)
                raise CheckpointError(self._deleted_message(shard)) from None
            first = (str(e).strip().splitlines() or [""])[0]
            raise CheckpointError(f"{shard}: cannot read tensor {key!r} ({type(e).__name__}: {first}): the shard "
                                  f"is truncated or corrupt; {earlier_checkpoint_hint(self.path)}") from None

    def _deleted_message(self, shard: str) -> str:
        """The error for a checkpoint deleted while it was read: most likely a live job's rotation
        (``checkpoint.keep``) removing it once newer ones were saved; names the newest kept one."""
        root = os.path.dirname(os.path.abspath(self.path))
        kept = [c for c in complete_checkpoints(root) if os.path.realpath(c) != os.path.realpath(self.path)]
        fix = (f"export a checkpoint that is kept, e.g. the newest, {kept[-1]} (or the root {root}, which takes the "
               "newest)" if kept else f"no complete checkpoint is left in {root}")
        return (f"checkpoint {self.path} was deleted while it was being read ({os.path.basename(shard)} is gone): it "
                "was rotated away, most likely by the running job's checkpoint.keep rotation, which deletes all but "
                f"the newest checkpoints as new ones are saved; {fix}; to keep more, raise checkpoint.keep")

    #: run settings a resume must repeat (the LR schedule depends on all of them)
    RUN_KEYS = ("steps", "lr", "warmup_steps", "min_lr_ratio")

    def check_mode(self, mode: str, lora_rank: int, lora_targets) -> None:
        """Refuse a resume whose ``train.mode``, ``lora.rank`` or ``lora.targets`` differ from the checkpoint's
        (they decide which tensors it holds). Raises CheckpointError naming the overrides that match it."""
        saved = self.manifest.get("train") or {}
        if "mode" not in saved:
            return
        was = saved.get("mode") or "full"
        if was == "lora":
            want = f"train.mode=lora lora.rank={saved.get('lora_rank')} lora.targets=[{','.join(saved.get('lora_targets') or [])}]"
        else:
            want = "train.mode=full"
        if was != mode:
            raise CheckpointError(f"train.resume: {self.path} holds a train.mode={was} run's state but this run is "
                                  f"train.mode={mode}: resume with {want}, or start without train.resume "
                                  + ("(to fine-tune a LoRA run's merged weights in full: python -m npu_train.checkpoint.export "
                                     f"{self.path} <out dir>, then model.path=<out dir>)" if was == "lora" else ""))
        if mode != "lora":
            return
        diff = []
        if saved.get("lora_rank") is not None and int(saved["lora_rank"]) != int(lora_rank):
            diff.append(f"lora.rank: checkpoint {saved['lora_rank']}, now {lora_rank}")
        if saved.get("lora_targets") is not None and sorted(saved["lora_targets"]) != sorted(lora_targets):
            diff.append(f"lora.targets: checkpoint [{','.join(saved['lora_targets'])}], now [{','.join(lora_targets)}]")
        if diff:
            raise CheckpointError(f"train.resume: {self.path} holds LoRA adapters of another shape ({'; '.join(diff)}): "
                                  f"resume with {want}, or start without train.resume")

    def check_objective(self, objective: str) -> None:
        """Refuse a resume whose ``train.objective`` (sft / dpo) differs from the checkpoint's: its data order
        counts preference pairs, not rows (the sampler's own check would speak of ``n_sequences`` and
        ``micro_batch``). Older manifests without ``objective``: the sampler state's ``pairs`` flag decides."""
        saved = self.manifest.get("train") or {}
        was = saved.get("objective") or ("dpo" if (self.manifest.get("sampler") or {}).get("pairs") else None)
        if was is None or was == objective:
            return
        if was == "dpo":
            raise CheckpointError(
                f"train.resume: {self.path} is a DPO run's checkpoint (train.objective=dpo on preference pairs) but "
                f"this run is train.objective={objective}: resume it with train.objective=dpo data.format=preference "
                "and its data.source, or start without train.resume (to fine-tune its weights with SFT: python -m "
                f"npu_train.checkpoint.export {self.path} <out dir>, then model.path=<out dir>)")
        raise CheckpointError(
            f"train.resume: {self.path} is a train.objective={was} run's checkpoint but this run is "
            f"train.objective={objective}: resume it with train.objective={was} and its data, or start without "
            f"train.resume (to tune its weights with DPO: python -m npu_train.checkpoint.export {self.path} <out dir>, "
            "then model.path=<out dir>)")

    def check_base(self, fingerprint: Optional[str], model_path: str, allow: bool = False) -> list[str]:
        """A LoRA resume: refuse a base model whose weights differ from the ones the adapters were trained on
        (``model_fingerprint`` in the manifest; same shapes pass :meth:`check_model`). Returns the difference
        (one string) when ``allow``, else raises CheckpointError; nothing for a manifest without a fingerprint."""
        saved = self.manifest.get("model_fingerprint")
        if not saved or not fingerprint or saved == fingerprint:
            return []
        was = self.manifest.get("model_path")
        diff = (f"the base model's weights at model.path={model_path} differ from those the checkpoint's LoRA "
                f"adapters were trained on (recorded model.path={was}; the files were replaced or are another model)")
        if allow:
            return [diff]
        raise CheckpointError(f"train.resume: {self.path}: {diff}: resume with the original base weights, or set "
                              "train.resume_mismatch=allow to continue the adapters on this base")

    def check_run(self, train: dict, data_fingerprint: Optional[str], allow: bool = False,
                  lora: Optional[dict] = None, data_change: str = "") -> list[str]:
        """Differences of this run's :data:`RUN_KEYS`, LoRA ``alpha``/``dropout`` and data fingerprint from the
        manifest (one string each; ``data_change``: the data files added, removed or changed, named instead of the
        fingerprint). Raises CheckpointError naming them unless ``allow``."""
        saved = self.manifest.get("train") or {}
        diff = [f"train.{k}: checkpoint {saved[k]!r}, now {train.get(k)!r}" for k in self.RUN_KEYS
                if k in saved and saved[k] != train.get(k)]
        for k, now in (lora or {}).items():
            was = saved.get(f"lora_{k}")
            if was is not None and float(was) != float(now):
                diff.append(f"lora.{k}: checkpoint {was!r}, now {now!r}")
        fp = self.manifest.get("data_fingerprint")
        if fp is not None and data_fingerprint is not None and fp != data_fingerprint:
            diff.append(f"data.source changed since: {data_change}" if data_change else
                        "the data (data.source, data.seq_len, data.val_fraction or the tokenizer) differs from "
                        "the checkpoint's run: its data fingerprint does not match")
        if diff and not allow:
            raise CheckpointError(f"train.resume: {self.path} was written by a run with other settings "
                                  f"({'; '.join(diff)}): repeat the original run's settings "
                                  f"(in {os.path.join(self.path, MANIFEST)}), or set train.resume_mismatch=allow "
                                  "to continue with the new ones")
        return diff

    def check_model(self, model_cfg: dict) -> None:
        """Raise :class:`CheckpointError` if the checkpoint was saved for a different model shape."""
        saved = self.manifest.get("model", {})
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                "tie_word_embeddings", "num_experts", "moe_intermediate_size")
        dense = {"num_experts": 0, "moe_intermediate_size": 0}  # a manifest from before mixtures of experts
        diff = [f"{k}: checkpoint {saved.get(k, dense.get(k))!r} vs model {model_cfg.get(k, dense.get(k))!r}"
                for k in keys if saved.get(k, dense.get(k)) != model_cfg.get(k, dense.get(k))]
        fam = saved.get("family", "llama"), model_cfg.get("family", "llama")
        if diff and fam[0] != fam[1]:  # named with the shapes (a llama checkpoint resumes on mistral alone)
            diff.insert(0, f"family (model_type): checkpoint {fam[0]} vs model {fam[1]}")
        if diff:
            raise CheckpointError(f"checkpoint {self.path} is from another model ({'; '.join(diff)}); "
                                  "resume with the same model.path or start without train.resume")
