"""Leftovers of dead jobs: the owner record of a job's shared memory and IPC directory, and the sweep
that removes them at the next launch.

A job's ``/dev/shm/npt_<job_id>_*`` segments and its private IPC directory (``<tmp>/npt-<job_id>-*``)
are removed on every exit path of the launcher and, if the launcher alone is killed, by its card
processes. Only when the launcher and every card process die at once (``kill -9`` of the whole
process group, the OOM killer, a node reboot without a tmpfs wipe) can they remain, and a few such
leftovers fill Docker's 64 MB ``/dev/shm``. So each launch records its owner in
``/dev/shm/npt_<job_id>_owner`` (launcher pid, process start time, host, IPC directory; JSON; it
matches the job's segment prefix, so every cleanup removes it too), and every launch first sweeps the
leftovers of jobs whose owner is gone (:func:`sweep_dead_jobs`). Jobs of live launchers, and jobs
owned on another host (a container with another host name sharing ``/dev/shm``), are never touched;
segments without an owner record (older versions) are left alone too.

Every node of a multi-node job records itself (``npt_<job_id>_owner`` on node 0 and on a single node,
``npt_<job_id>_owner-n<k>`` on node k): several "nodes" on one host (a test, a laptop trying
``runtime.nodes``) share one ``/dev/shm`` and one temporary directory, and one record for all of them
named only the node that wrote it last. A job's segments go when every node's owner is gone; a dead
node's IPC directory goes at once.
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
    """Record this process (node ``node``'s launcher) as an owner of ``job_id``'s segments and the owner of
    ``ipc_dir`` (mode 0600); returns the record's path (None where there is no ``/dev/shm``: nothing to record)."""
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
    """Remove ``ipc_dir`` and every ``/dev/shm`` entry of ``job_id`` (its owner record included): the
    launcher's clean-up when the launch fails after it made them and before the coordinator, whose
    teardown removes them from then on, took them over. Never raises."""
    shutil.rmtree(ipc_dir, ignore_errors=True)
    try:
        unlink_job_segments(job_id)
    except OSError:
        pass


def _remove_ipc_dir(job_id: str, rec) -> None:
    """Remove the IPC directory a dead owner's record names, if it is this job's (``<tmp>/npt-<job_id>-*``):
    never a path a record could point anywhere."""
    ipc = rec.get("ipc_dir") if isinstance(rec, dict) else None
    if (isinstance(ipc, str) and os.path.basename(ipc).startswith(f"npt-{job_id}-")
            and os.path.dirname(os.path.abspath(ipc)) == os.path.abspath(tempfile.gettempdir())):
        shutil.rmtree(ipc, ignore_errors=True)


def sweep_dead_jobs() -> list[str]:
    """Remove the leftovers of dead jobs on this host: the IPC directory of every node whose recorded owner
    no longer runs (and that node's record), and a job's segments once no recorded owner of it runs.
    Returns the job ids whose segments were removed. Never raises for a leftover it cannot read or remove."""
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
