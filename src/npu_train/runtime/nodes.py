"""Multi-node layout and rendezvous: which node this launcher is (:class:`NodeLayout`, from ``NNODES``,
``NODE_RANK``/``JOB_COMPLETION_INDEX``, ``MASTER_ADDR``, ``MASTER_PORT``) and what the others have
(:class:`Rendezvous` over node 0's ``TCPStore``; :func:`join_nodes` -> :class:`NodePlan`). The topics and
the gloo setup are in docs/design.md §17.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping, Optional

from npu_train.errors import ConfigError, UserError


class RendezvousError(UserError):
    """The nodes cannot agree (node 0 unreachable, a node missing or failed, different settings or plans)."""


@dataclass(frozen=True)
class NodeLayout:
    """This launcher's place: node ``node_rank`` of ``nnodes``; node 0 hosts the store on
    ``master_addr:master_port``."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int

    @property
    def is_master(self) -> bool:
        return self.node_rank == 0

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> Optional["NodeLayout"]:
        """The layout from the environment; None when ``NNODES`` is unset or 1 (and this is not a Slurm step over
        several nodes: :mod:`npu_train.runtime.slurm`). Raises ConfigError naming a bad variable."""
        env = os.environ if env is None else env
        raw = env.get("NNODES", "").strip()
        if not raw:  # a Slurm step over several nodes (srun, one task per node): its variables
            from npu_train.runtime.slurm import slurm_layout_env

            slurm = slurm_layout_env(env)
            if slurm is None:
                return None
            env, raw = {**env, **slurm}, slurm["NNODES"]
        nnodes = _int_var("NNODES", raw)
        if nnodes < 1:
            raise ConfigError(f"NNODES={raw}: the number of nodes must be at least 1")
        if nnodes == 1:
            return None
        name = "NODE_RANK" if env.get("NODE_RANK", "").strip() else "JOB_COMPLETION_INDEX"
        if not env.get(name, "").strip():
            raise ConfigError(f"NNODES={nnodes} but neither NODE_RANK nor JOB_COMPLETION_INDEX is set: "
                              "set NODE_RANK to this node's index 0..NNODES-1")
        node = _int_var(name, env[name].strip())
        if not 0 <= node < nnodes:
            raise ConfigError(f"{name}={node} is outside 0..{nnodes - 1} (NNODES={nnodes})")
        addr = env.get("MASTER_ADDR", "").strip()
        if not addr:
            raise ConfigError(f"NNODES={nnodes} but MASTER_ADDR is not set: set it to node 0's host name or address")
        port = _int_var("MASTER_PORT", env.get("MASTER_PORT", "").strip() or "missing")
        if not 0 < port < 65536:
            raise ConfigError(f"MASTER_PORT={port} is not a TCP port (1..65535)")
        return cls(nnodes, node, addr, port)

    def ranks_of(self, counts: list[int]) -> list[range]:
        """Global ranks of every node's cards: node ``n`` gets ``sum(counts[:n]) .. + counts[n]``."""
        out, start = [], 0
        for c in counts:
            out.append(range(start, start + c))
            start += c
        return out


def _int_var(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def route_address(dest: str, port: int = 9) -> str:
    """This host's source address for packets to ``dest`` (no packet sent). Raises ConfigError if unreachable."""
    try:
        infos = socket.getaddrinfo(dest, port, type=socket.SOCK_DGRAM)
    except socket.gaierror as e:
        raise ConfigError(f"MASTER_ADDR={dest!r} does not resolve ({e.strerror}): set it to node 0's address") from None
    fam, _, _, _, sa = infos[0]
    with socket.socket(fam, socket.SOCK_DGRAM) as s:
        try:
            s.connect(sa)
        except OSError as e:
            raise ConfigError(f"no route to MASTER_ADDR={dest!r} ({e.strerror}): set runtime.host to this "
                              "node's address that the other nodes reach") from None
        return s.getsockname()[0]


def interface_of(addr: str) -> Optional[str]:
    """Name of the network interface holding ``addr`` (e.g. ``eth0``), or None (psutil)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == addr for a in addrs):
            return name
    return None


#: settings every node must be given identically (sections of the config, and runtime keys)
SHARED_SECTIONS = ("model", "data", "train", "placement")
SHARED_RUNTIME = ("heartbeat_interval_s", "heartbeat_timeout_s", "startup_timeout_s", "slots", "transport")
#: checkpoint keys every node must share (one node saving alone would wait for the others' shards forever)
SHARED_CHECKPOINT = ("save",)


def config_digest(cfg) -> dict[str, str]:
    """Settings that must match on every node, flattened (JSON values); ``backend``, ``runtime.host/port/threads``
    and ``checkpoint.*`` but ``checkpoint.save`` may differ."""
    from omegaconf import OmegaConf

    out: dict[str, str] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k in sorted(v):
                walk(f"{prefix}.{k}", v[k])
        else:
            out[prefix] = json.dumps(v, sort_keys=True, default=str)

    for sec in SHARED_SECTIONS:
        walk(sec, OmegaConf.to_container(cfg[sec], resolve=True))
    for k in SHARED_RUNTIME:
        walk(f"runtime.{k}", cfg.runtime[k])
    for k in SHARED_CHECKPOINT:
        walk(f"checkpoint.{k}", cfg.checkpoint[k])
    return out


def differing_keys(mine: dict, theirs: dict) -> list[str]:
    """Keys whose values differ (or exist on one side only), sorted."""
    return sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))


class Rendezvous:
    """Discovery between node launchers through node 0's ``TCPStore``; ``timeout_s``: wait for the store and
    entries (s). Raises RendezvousError when the port is taken (node 0) or unreachable."""

    POLL_S = 0.1

    def __init__(self, layout: NodeLayout, timeout_s: float):
        from torch.distributed import TCPStore

        self.layout, self.timeout_s = layout, float(timeout_s)
        lo = layout
        try:
            self.store = TCPStore(lo.master_addr, lo.master_port, world_size=None, is_master=lo.is_master,
                                  timeout=timedelta(seconds=self.timeout_s), wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - DistNetworkError / RuntimeError / TimeoutError
            what = (f"cannot host the rendezvous store on port MASTER_PORT={lo.master_port}" if lo.is_master else
                    f"cannot reach node 0's rendezvous store at MASTER_ADDR:MASTER_PORT={lo.master_addr}:{lo.master_port} "
                    f"within runtime.startup_timeout_s={self.timeout_s:g}")
            fix = ("pick a free MASTER_PORT" if lo.is_master else
                   "start node 0's launcher, and check MASTER_ADDR/MASTER_PORT and the network")
            raise RendezvousError(f"node {lo.node_rank}: {what} ({str(e).splitlines()[0][:200]}): {fix}") from None

    # ------------------------------------------------------------------ primitives
    def publish(self, topic: str, value: Any) -> None:
        """Set ``<topic>/<this node>`` to ``value`` (JSON)."""
        self.store.set(f"{topic}/{self.layout.node_rank}", json.dumps(value))

    def abort(self, message: str) -> None:
        """Tell the other nodes that this node failed its preparation (they stop waiting and name it)."""
        try:
            self.store.set(f"abort/{self.layout.node_rank}", message[:2000])
        except Exception:  # noqa: BLE001 - best effort: node 0's store may be gone
            pass

    def _check_aborts(self, topic: str = "") -> None:
        for n in range(self.layout.nnodes):
            if n != self.layout.node_rank and self._check([f"abort/{n}"], topic):
                msg = self.store.get(f"abort/{n}").decode(errors="replace")
                raise RendezvousError(f"node {n} failed while preparing the job: {msg}")

    def collect(self, topic: str, nodes: Optional[list[int]] = None) -> list[Any]:
        """The values of ``topic`` from ``nodes`` (default all). Raises RendezvousError (a node aborted or
        timed out)."""
        nodes = list(range(self.layout.nnodes)) if nodes is None else nodes
        keys = [f"{topic}/{n}" for n in nodes]
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._check_aborts(topic)
            if self._check(keys, topic):
                break
            if time.monotonic() > deadline:
                missing = [n for n, k in zip(nodes, keys) if not self.store.check([k])]
                raise RendezvousError(
                    f"node(s) {', '.join(map(str, missing))} did not publish {topic!r} within "
                    f"runtime.startup_timeout_s={self.timeout_s:g} s: start one launcher per node with "
                    f"NNODES={self.layout.nnodes} and NODE_RANK=0..{self.layout.nnodes - 1}")
            time.sleep(self.POLL_S)
        try:
            return [json.loads(self.store.get(k)) for k in keys]
        except Exception as e:  # noqa: BLE001 - DistNetworkError / RuntimeError: node 0's store is gone
            raise self._store_gone(topic, e) from None

    def _check(self, keys: list, topic: str) -> bool:
        """``store.check(keys)``; node 0's store closing under a waiting node raises RendezvousError."""
        try:
            return self.store.check(keys)
        except Exception as e:  # noqa: BLE001 - DistNetworkError / RuntimeError
            raise self._store_gone(topic, e) from None

    def _store_gone(self, topic: str, e: Exception) -> RendezvousError:
        return RendezvousError(
            f"node {self.layout.node_rank}: node 0's rendezvous store closed while this node waited for {topic!r} "
            f"({str(e).splitlines()[0][:160]}): node 0's launcher stopped; its own error says why")

    def exchange(self, topic: str, value: Any) -> list[Any]:
        """Publish ``value`` and return every node's (index = node rank). Each node other than 0 then marks
        ``<topic>/read/<node>``, so that node 0, which hosts the store, can wait for every node to have read
        before it exits on what it read (:meth:`check_same`)."""
        self.publish(topic, value)
        out = self.collect(topic)
        if not self.layout.is_master:
            self.store.set(f"{topic}/read/{self.layout.node_rank}", "1")
        return out

    def _wait_read(self, topic: str, limit_s: float = 10.0) -> None:
        """Node 0, about to exit: wait up to ``limit_s`` (at most the rendezvous timeout) for every other node
        to have read ``topic``, so that each names the same refusal instead of finding the store gone."""
        keys = [f"{topic}/read/{n}" for n in range(1, self.layout.nnodes)]
        deadline = time.monotonic() + min(limit_s, self.timeout_s)
        while not self.store.check(keys) and time.monotonic() < deadline:
            time.sleep(self.POLL_S)

    def check_same(self, topic: str, flat: dict, what: str, fix: str) -> None:
        """Publish ``flat``, compare with node 0's. Raises RendezvousError naming nodes, keys, values and ``fix``."""
        all_ = self.exchange(topic, flat)
        diffs = []
        for n, other in enumerate(all_[1:], start=1):
            keys = differing_keys(all_[0], other)
            if keys:
                shown = "; ".join(f"{k} (node 0: {all_[0].get(k, 'unset')}, node {n}: {other.get(k, 'unset')})"
                                  for k in keys[:8])
                more = f" and {len(keys) - 8} more" if len(keys) > 8 else ""
                diffs.append(f"node {n} differs from node 0 in {shown}{more}")
        if diffs:
            if self.layout.is_master:  # the store goes with this process: let the others read first
                self._wait_read(topic)
            raise RendezvousError(f"{what} differ between nodes: {' | '.join(diffs)}: {fix}")


def exchange_cards(rdv: Rendezvous, local_cards: list, threads: int, host_ram: Optional[int]):
    """Publish this node's cards, threads and RAM (bytes); returns ``(cards, cards per node, plan threads, RAM
    per node)`` over all nodes: cards prefixed ``node<n>/`` with their own node's capacity, the smallest
    thread count."""
    from npu_train.hardware import Card

    mine = {"cards": [[c.kind, c.index, c.capacity_bytes, c.name] for c in local_cards],
            "threads": threads, "host_ram": host_ram}
    everyone = rdv.exchange("cards", mine)
    cards = [Card(kind=k, index=i, capacity_bytes=cap, name=f"node{n}/{name}")
             for n, e in enumerate(everyone) for k, i, cap, name in e["cards"]]
    return (cards, [len(e["cards"]) for e in everyone], min(e["threads"] for e in everyone),
            [e["host_ram"] for e in everyone])


def check_node_host_ram(plan, node_counts: list[int], host_ram: list[Optional[int]]) -> None:
    """Raise ConfigError naming the node whose offloaded optimizer state exceeds its RAM."""
    start = 0
    for n, (c, ram) in enumerate(zip(node_counts, host_ram)):
        need = sum(st.host_bytes for st in plan.stages[start:start + c])
        start += c
        if ram is not None and need > ram:
            raise ConfigError(f"node {n}: the offloaded optimizer state of its stages needs {need / 2**30:.2f} GiB "
                              f"of host RAM, the node has {ram / 2**30:.2f} GiB: add cards, make more layers "
                              "resident (train.resident_layers) or move layers to other nodes (train.split)")


def plan_digest(plan, data_fingerprint: str, start_step: int, resume_dir: Optional[str]) -> dict[str, str]:
    """What every node must agree on after planning: split, resident layers, data fingerprint, resume point."""
    out = {f"stage{r}.layers": json.dumps([st.first_layer, st.last_layer]) for r, st in enumerate(plan.stages)}
    out.update({f"stage{r}.resident": json.dumps(sorted(st.resident)) for r, st in enumerate(plan.stages)})
    out.update({f"stage{r}.card": json.dumps(st.card.name) for r, st in enumerate(plan.stages)})
    out.update({f"stage{r}.nonlayer_resident": json.dumps(st.nonlayer_resident) for r, st in enumerate(plan.stages)})
    out["data.fingerprint"] = json.dumps(data_fingerprint)
    out["resume.step"] = json.dumps(start_step)
    out["resume.dir"] = json.dumps(resume_dir)
    return out


@dataclass(frozen=True)
class NodePlan:
    """This node's share of the job for :func:`~npu_train.runtime.job.build_worker_specs`: ``node_of_rank``,
    ``inbox`` (``tcp://`` across nodes, else ``ipc://``), ``boundary_transport``, ``dist_init`` (gloo at
    node 0) and ``link_addr`` (node 0's NodeLink)."""

    node: int
    nnodes: int
    node_of_rank: tuple
    inbox: tuple
    boundary_transport: tuple
    dist_init: str
    link_addr: str

    @property
    def local_ranks(self) -> list[int]:
        return [r for r, n in enumerate(self.node_of_rank) if n == self.node]

    def local_shm_boundaries(self) -> int:
        """Boundaries with both stages on this node using shared memory (each has two rings)."""
        return sum(1 for b, m in enumerate(self.boundary_transport)
                   if m == "shm" and self.node_of_rank[b] == self.node)


def check_shared_root(ckpt_root: str, job_id: str, wait_s: float = 10.0) -> None:
    """Raise ConfigError unless node 0's marker ``.npt-shared-<job_id>`` shows in ``ckpt_root`` within
    ``wait_s`` s."""
    import time

    from npu_train.errors import ConfigError

    path = os.path.join(ckpt_root, f".npt-shared-{job_id}")
    t_end = time.monotonic() + wait_s
    while not os.path.exists(path):
        if time.monotonic() > t_end:
            raise ConfigError(f"checkpoint.dir={ckpt_root} is not the directory node 0 uses (its marker {path} is "
                              "not visible here): every node must write into one shared checkpoint.dir (a shared "
                              "filesystem, or a ReadWriteMany volume in Kubernetes)")
        time.sleep(0.2)


def share_job(rdv: Rendezvous, *, job_id: str, token: str, gloo_port: int) -> dict:
    """Node 0's ``{"job_id", "token", "gloo_port"}`` for every node (node 0 publishes its own; ``gloo_port``:
    the port of the job's store it hosts, :mod:`npu_train.runtime.jobstore`)."""
    if rdv.layout.is_master:
        rdv.publish("job", {"job_id": job_id, "token": token, "gloo_port": gloo_port})
    return rdv.collect("job", [0])[0]


def join_nodes(rdv, layout, node_of_rank: list[int], boundary: tuple, ipc_dir: str, host: str, job: dict, rt):
    """Publish this node's mailboxes, collect everyone's and open the launchers' channel: ``(NodePlan,
    NodeLink)``. TCP mailboxes are ``tcp://host:*`` (the card process binds a port the kernel picks and tells
    its peers through the job's store, :mod:`npu_train.runtime.jobstore`); node 0's channel is bound (same way)
    before its address goes out with node 0's mailboxes. Sets ``GLOO_SOCKET_IFNAME`` to ``host``'s interface
    when unset (other nodes may not reach the host name's address)."""
    from npu_train.runtime.agent import NodeLink
    from npu_train.transport.channel import Endpoint

    P = len(node_of_rank)
    mine = {}
    for r in range(P):
        if node_of_rank[r] != layout.node_rank:
            continue
        remote = any(boundary[b] == "inline" for b in (r - 1, r) if 0 <= b < P - 1)
        mine[str(r)] = (Endpoint.tcp(host, "*") if remote or rt.transport != "shm" else f"ipc://{ipc_dir}/r{r}.sock")
    kw = dict(interval_s=rt.heartbeat_interval_s, timeout_s=rt.heartbeat_timeout_s,
              startup_timeout_s=rt.startup_timeout_s)
    link = NodeLink(0, layout.nnodes, Endpoint.tcp(host, "*"), job["token"], **kw) if layout.is_master else None
    t0 = time.monotonic()
    try:
        everyone = rdv.exchange("inbox", {"host": host, "inbox": mine, "link": link.addr if link else None})
    except BaseException:
        if link is not None:
            link.close()
        raise
    inbox = {}
    for d in everyone:
        inbox.update(d["inbox"])
    if link is not None:  # the other nodes' start-up allowance counts from here, as theirs does
        link.forgive(time.monotonic() - t0, time.monotonic())
    else:
        link = NodeLink(layout.node_rank, layout.nnodes, everyone[0]["link"], job["token"], **kw)
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        ifname = interface_of(host)
        if ifname:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname  # inherited by the spawned card processes
    plan = NodePlan(node=layout.node_rank, nnodes=layout.nnodes, node_of_rank=tuple(node_of_rank),
                    inbox=tuple(inbox[str(r)] for r in range(P)), boundary_transport=boundary,
                    dist_init=Endpoint.tcp(layout.master_addr, job["gloo_port"]), link_addr=link.addr)
    return plan, link
