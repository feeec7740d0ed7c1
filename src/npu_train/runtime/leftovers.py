"""Leftovers of dead jobs: each launch records its owner in ``/dev/shm/npt_<job_id>_owner`` (per node
``_owner-n<k>``) and first sweeps the ``/dev/shm`` segments and IPC directories of jobs whose owners are
gone on this host (:func:`sweep_dead_jobs`). docs/design.md §17.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from typing import Optional

from npu_train.ownership import owner_alive, process_identity
from npu_train.transport.shm import SEGMENT_PREFIX, SHM_DIR, unlink_job_segments, validate_job_id

OWNER_SUFFIX = "_owner"
_OWNER_RE = re.compile(re.escape(SEGMENT_PREFIX) + r"(.+)" + re.escape(OWNER_SUFFIX) + r"(?:-n([1-9][0-9]{0,3}))?$")


def owner_path(job_id: str, node: int = 0) -> str:
    """``/dev/shm/npt_<job_id>_owner`` (node 0, a single node) or ``.../npt_<job_id>_owner-n<node>``."""
    tail = f"-n{int(node)}" if node else ""
    return os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{validate_job_id(job_id)}{OWNER_SUFFIX}{tail}")


def write_job_owner(job_id: str, ipc_dir: str, node: int = 0) -> Optional[str]:
    """Record this launcher (node ``node``) as owner of ``job_id``'s segments and ``ipc_dir``; returns the path
    or None."""
    if not os.path.isdir(SHM_DIR):
        return None
    path = owner_path(job_id, node)
    rec = dict(process_identity(os.getpid()) or {}, job_id=job_id, ipc_dir=ipc_dir, node=int(node))
    fd = os.open(path + ".part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(rec, f)
    os.replace(path + ".part", path)
    return path


def discard_job_ipc(job_id: str, ipc_dir: str) -> None:
    """Remove ``ipc_dir`` and ``job_id``'s /dev/shm entries (a launch failing before the coordinator). Never
    raises."""
    shutil.rmtree(ipc_dir, ignore_errors=True)
    try:
        unlink_job_segments(job_id)
    except OSError:
        pass


def _remove_ipc_dir(job_id: str, rec) -> None:
    """Remove a dead owner's IPC directory only if it is this job's (``<tmp>/npt-<job_id>-*``)."""
    ipc = rec.get("ipc_dir") if isinstance(rec, dict) else None
    if (isinstance(ipc, str) and os.path.basename(ipc).startswith(f"npt-{job_id}-")
            and os.path.dirname(os.path.abspath(ipc)) == os.path.abspath(tempfile.gettempdir())):
        shutil.rmtree(ipc, ignore_errors=True)


def sweep_dead_jobs() -> list[str]:
    """Remove dead owners' IPC directories and records, and a job's segments once no owner runs; returns the
    job ids removed. Never raises for a leftover it cannot read or remove."""
    swept: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return swept
    jobs: dict[str, list] = {}
    for fn in sorted(names):
        m = _OWNER_RE.match(fn)
        if not m:
            continue
        job_id = m.group(1)
        try:
            validate_job_id(job_id)
            with open(os.path.join(SHM_DIR, fn)) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        jobs.setdefault(job_id, []).append((fn, rec))
    for job_id, recs in jobs.items():
        dead = [(fn, rec) for fn, rec in recs if owner_alive(rec) is False]
        for _, rec in dead:
            _remove_ipc_dir(job_id, rec)
        if len(dead) < len(recs):  # another node of the job still runs (or cannot be told): its segments stay
            for fn, _ in dead:
                try:
                    os.remove(os.path.join(SHM_DIR, fn))
                except OSError:
                    pass
            continue
        try:
            unlink_job_segments(job_id)  # includes the owner records
        except OSError:
            continue
        swept.append(job_id)
    return swept
