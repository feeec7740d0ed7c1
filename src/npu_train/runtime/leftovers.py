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
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Optional

from npu_train.ownership import owner_alive, process_identity
from npu_train.transport.shm import SEGMENT_PREFIX, SHM_DIR, unlink_job_segments, validate_job_id

OWNER_SUFFIX = "_owner"


def owner_path(job_id: str) -> str:
    """``/dev/shm/npt_<job_id>_owner``."""
    return os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{validate_job_id(job_id)}{OWNER_SUFFIX}")


def write_job_owner(job_id: str, ipc_dir: str) -> Optional[str]:
    """Record this process (the launcher) as the owner of ``job_id``'s segments and ``ipc_dir`` (mode 0600);
    returns the record's path (None where there is no ``/dev/shm``: nothing to record)."""
    if not os.path.isdir(SHM_DIR):
        return None
    path = owner_path(job_id)
    rec = dict(process_identity(os.getpid()) or {}, job_id=job_id, ipc_dir=ipc_dir)
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


def sweep_dead_jobs() -> list[str]:
    """Remove the segments and IPC directory of every job whose recorded owner no longer runs on this
    host. Returns the job ids swept. Never raises for a leftover it cannot read or remove."""
    swept = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return swept
    for fn in names:
        if not (fn.startswith(SEGMENT_PREFIX) and fn.endswith(OWNER_SUFFIX)):
            continue
        job_id = fn[len(SEGMENT_PREFIX):-len(OWNER_SUFFIX)]
        try:
            validate_job_id(job_id)
            with open(os.path.join(SHM_DIR, fn)) as f:
                rec = json.load(f)
        except (OSError, ValueError):
            continue
        if owner_alive(rec) is not False:
            continue
        ipc = rec.get("ipc_dir") if isinstance(rec, dict) else None
        # only a directory that is this job's IPC directory (never a path a record could point anywhere)
        if (isinstance(ipc, str) and os.path.basename(ipc).startswith(f"npt-{job_id}-")
                and os.path.dirname(os.path.abspath(ipc)) == os.path.abspath(tempfile.gettempdir())):
            shutil.rmtree(ipc, ignore_errors=True)
        try:
            unlink_job_segments(job_id)  # includes the owner record
        except OSError:
            continue
        swept.append(job_id)
    return swept
