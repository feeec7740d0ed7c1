"""Slurm: a job step with one task per node (``srun``) read as a multi-node layout.

Start at :func:`slurm_layout_env`: from ``SLURM_NNODES``, ``SLURM_NODEID`` (else ``SLURM_PROCID``),
``SLURM_NTASKS`` and ``SLURM_JOB_NODELIST`` it gives the ``NNODES`` / ``NODE_RANK`` / ``MASTER_ADDR`` /
``MASTER_PORT`` that :class:`~npu_train.runtime.nodes.NodeLayout` reads. Node 0 is the allocation's first
host (``scontrol show hostnames``, else :func:`expand_hostlist`, the same hostlist syntax); the port is
``$MASTER_PORT`` or 20000 + job id mod 20000, so two jobs on one node do not collide. ``launch/slurm/``
has the ``sbatch`` script.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from typing import Mapping, Optional

from npu_train.errors import ConfigError

__all__ = ["expand_hostlist", "slurm_layout_env", "first_host"]


def _split_top(text: str) -> list[str]:
    """``"a[1-2],b,c[3,5]"`` -> ``["a[1-2]", "b", "c[3,5]"]`` (commas outside brackets)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ValueError(f"unbalanced brackets in hostlist {text!r}")
    out.append(cur)
    return [x for x in out if x]


def _expand_one(item: str) -> list[str]:
    """One hostlist term, the first bracket expanded and the rest recursively: ``n[01-02]x[1,3]``."""
    m = re.match(r"^([^\[]*)\[([^\]]+)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    names = []
    for part in ranges.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            width = len(lo)  # Slurm keeps leading zeros: node[08-10] -> node08 node09 node10
            for i in range(int(lo), int(hi) + 1):
                names.append(f"{prefix}{i:0{width}d}")
        else:
            names.append(prefix + part)
    return [n + tail for n in names for tail in _expand_one(rest)]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed hostlist (``node[01-03,07],gpu5``) as host names in order. ValueError if malformed."""
    hosts = []
    for item in _split_top(text.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def first_host(nodelist: str) -> str:
    """The first host of ``nodelist``: ``scontrol show hostnames`` when Slurm's tools are on PATH, else
    :func:`expand_hostlist`."""
    if shutil.which("scontrol"):
        r = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        if r.returncode == 0 and r.stdout.split():
            return r.stdout.split()[0]
    return expand_hostlist(nodelist)[0]


def slurm_layout_env(env: Mapping[str, str]) -> Optional[dict[str, str]]:
    """``{"NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"}`` for a Slurm step spanning several nodes, or None
    when this is not a Slurm job (no ``SLURM_JOB_ID``) or it has one node. Raises ConfigError for a step with
    more than one task per node (npu-train runs one launcher per node, which starts one process per card), and at
    once for a launch in a multi-node allocation outside ``srun`` (no ``SLURM_STEP_ID`` / ``SLURM_NODEID`` /
    ``SLURM_PROCID``: the other nodes run no launcher; it waited ``runtime.startup_timeout_s`` for them)."""
    if not env.get("SLURM_JOB_ID", "").strip() or not env.get("SLURM_NNODES", "").strip():
        return None
    try:
        nnodes = int(env["SLURM_NNODES"])
        ntasks = int(env.get("SLURM_NTASKS", nnodes) or nnodes)
        node = int(env.get("SLURM_NODEID") or env.get("SLURM_PROCID") or 0)
        job = int(env["SLURM_JOB_ID"])
    except ValueError:
        raise ConfigError("SLURM_NNODES / SLURM_NTASKS / SLURM_NODEID / SLURM_JOB_ID are not integers: run the "
                          "launcher through srun inside an sbatch allocation (launch/slurm/npu-train.sbatch)") from None
    if nnodes <= 1:
        return None
    if not any(env.get(k, "").strip() for k in ("SLURM_STEP_ID", "SLURM_STEPID", "SLURM_NODEID", "SLURM_PROCID")):
        # the allocation's shell (sbatch script, salloc) without srun: one launcher here, none on the other nodes
        raise ConfigError(f"this runs inside a Slurm allocation of {nnodes} nodes (SLURM_JOB_ID={job}, SLURM_NNODES="
                          f"{nnodes}) but was not started by srun (no SLURM_STEP_ID / SLURM_NODEID), so no launcher "
                          "runs on the other nodes and this one would wait for them: launch it on every node through "
                          "srun --ntasks-per-node=1 python launch/run.py ... (launch/slurm/npu-train.sbatch does), or "
                          "set NNODES=1 to train on this node alone")
    if ntasks != nnodes:
        raise ConfigError(f"the Slurm step has {ntasks} tasks on {nnodes} nodes: npu-train needs one task per node "
                          "(srun --ntasks-per-node=1; the launcher starts one process per card itself)")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    if not nodelist.strip():
        raise ConfigError("SLURM_JOB_NODELIST is not set: run the launcher through srun inside an sbatch allocation")
    try:
        master = first_host(nodelist)
    except ValueError as e:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r}: {e}") from None
    port = env.get("MASTER_PORT", "").strip() or str(20000 + job % 20000)
    return {"NNODES": str(nnodes), "NODE_RANK": str(node), "MASTER_ADDR": env.get("MASTER_ADDR", "").strip() or master,
            "MASTER_PORT": port}
