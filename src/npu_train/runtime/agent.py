"""Cross-node supervision: the node launchers' ZeroMQ channel (:class:`NodeLink`; node 0 binds a ROUTER,
the others connect DEALERs). Messages ``hb``, ``fail``, ``ckpt``, ``done``, ``finish``; failure semantics
equal one node's (docs/design.md §17).
"""
from __future__ import annotations

import hmac
import time
from typing import Callable, Optional

import msgpack
import zmq

from npu_train.errors import JobFailed


class NodeLink:
    """One node's end of the launchers' channel. ``addr``: node 0's ``tcp://host:port`` (node 0 may bind
    ``tcp://host:*``: the port the kernel picked is then in :attr:`addr`); ``token``: the job
    token (other messages are dropped); ``interval_s``/``timeout_s``/``startup_timeout_s``: heartbeat
    period and allowed silence after / before first contact (s). :meth:`pump` raises JobFailed when another
    node fails or goes silent."""

    def __init__(self, node: int, nnodes: int, addr: str, token: str, *, interval_s: float, timeout_s: float,
                 startup_timeout_s: float):
        self.node, self.nnodes, self.addr, self.token = node, nnodes, addr, token
        self.interval_s, self.timeout_s = float(interval_s), float(timeout_s)
        self.startup_timeout_s = max(float(startup_timeout_s), self.timeout_s)
        self.ctx = zmq.Context()
        if node == 0:
            self.sock = self.ctx.socket(zmq.ROUTER)
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
            self.sock.bind(addr)  # tcp://host:* : a port picked at the bind, read back as self.addr
            self.addr = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            self.peers = list(range(1, nnodes))
        else:
            self.sock = self.ctx.socket(zmq.DEALER)
            self.sock.setsockopt(zmq.IDENTITY, f"n{node}".encode())
            self.sock.connect(addr)
            self.peers = [0]
        self.sock.setsockopt(zmq.LINGER, 2000)
        now = time.monotonic()
        self.last_seen = {p: now for p in self.peers}
        self.contacted: set[int] = set()
        self.last_sent = 0.0
        self.ckpt_nodes: dict[int, set[int]] = {}   # node 0: step -> nodes whose shards are written
        self.ckpt_ready: list[int] = []              # node 0: steps every node has reported
        self.done_nodes: set[int] = set()
        self.local_done = False
        self.finished = False
        self.failed = False
        self.last_ckpt: Optional[str] = None         # the last published checkpoint (from node 0's finish)

    def forgive(self, gap: float, now: float) -> None:
        """This launcher did not run for ``gap`` seconds (paused): the other nodes' silence meanwhile is not
        theirs, so their heartbeat deadlines start again (at most from ``now``)."""
        for p in self.peers:
            self.last_seen[p] = min(self.last_seen[p] + gap, now)

    # ------------------------------------------------------------------ sending
    def _send(self, peer: int, msg: dict) -> None:
        data = msgpack.packb(dict(msg, tok=self.token, node=self.node), use_bin_type=True)
        try:
            if self.node == 0:
                self.sock.send_multipart([f"n{peer}".encode(), data], zmq.NOBLOCK)
            else:
                self.sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError:  # peer not connected (yet) or queue full: heartbeats cover it
            pass

    def _broadcast(self, msg: dict) -> None:
        for p in self.peers:
            self._send(p, msg)

    # ------------------------------------------------------------------ called by the coordinator
    def pump(self, now: float, publish: Callable[[int], None]) -> None:
        """Heartbeat when due, handle pending messages, check liveness; ``publish(step)`` (node 0) once every
        node wrote checkpoint ``step``'s shards, in message order. Raises JobFailed."""
        if now - self.last_sent >= self.interval_s:
            self._broadcast({"type": "hb"})
            self.last_sent = now
        while True:
            while self.ckpt_ready:
                publish(self.ckpt_ready.pop(0))
            if not self.sock.poll(0):
                break
            frames = self.sock.recv_multipart()
            self._handle(frames[-1], now)
        for p in self.peers:
            limit = self.timeout_s if p in self.contacted else self.startup_timeout_s
            if now - self.last_seen[p] > limit and not self.finished:
                who = "node 0 (the job's master node)" if p == 0 else f"node {p}"
                self.fail(f"{who} stopped responding: its node agent (launcher) sent no heartbeat for "
                          f"{now - self.last_seen[p]:.0f} s (runtime.heartbeat_timeout_s={self.timeout_s:g}; "
                          f"it died, hangs or the network between the nodes is down)")
                raise JobFailed(f"node {self.node}: {who} stopped responding "
                                f"(no heartbeat for {now - self.last_seen[p]:.0f} s)")

    def _handle(self, data: bytes, now: float) -> None:
        try:
            if len(data) > 1 << 20:
                return
            msg = msgpack.unpackb(data, raw=False)
            tok = msg.get("tok")
            if not (isinstance(tok, str) and hmac.compare_digest(tok.encode(), self.token.encode())):
                return
            src = int(msg["node"])
        except Exception:  # noqa: BLE001 - not ours: drop it
            return
        if src not in self.last_seen:
            return
        self.last_seen[src] = now
        self.contacted.add(src)
        t = msg.get("type")
        if t == "fail":
            text = str(msg.get("msg", "failed"))
            if self.node == 0:
                self._broadcast({"type": "fail", "msg": text})  # relay to every other node
            self.failed = True
            raise JobFailed(text)
        if t == "ckpt" and self.node == 0:
            self._shard_reported(int(msg["step"]), src)
        elif t == "done" and self.node == 0:
            self.done_nodes.add(src)
        elif t == "finish" and self.node != 0:
            self.finished = True
            self.last_ckpt = msg.get("ckpt")

    def _shard_reported(self, step: int, node: int) -> None:
        got = self.ckpt_nodes.setdefault(step, set())
        got.add(node)
        if len(got) == self.nnodes:
            del self.ckpt_nodes[step]
            self.ckpt_ready.append(step)

    def shards_written(self, step: int) -> None:
        """Every stage of this node has written its shard of checkpoint ``step``."""
        if self.node == 0:
            self._shard_reported(step, 0)
        else:
            self._send(0, {"type": "ckpt", "step": step})

    def all_done(self, last_ckpt: Optional[str] = None) -> bool:
        """This node finished: True once the whole job has (node 0 then sends ``finish``)."""
        if not self.local_done:
            self.local_done = True
            if self.node != 0:
                self._send(0, {"type": "done"})
        if self.node != 0:
            return self.finished
        if len(self.done_nodes) == self.nnodes - 1 and not self.ckpt_nodes and not self.ckpt_ready:
            if not self.finished:
                self._broadcast({"type": "finish", "ckpt": last_ckpt})
                self.finished = True
            return True
        return False

    def quiet_peers(self, now: float) -> list[int]:
        """Nodes not heard from for more than two heartbeat intervals (a failure there may be coming)."""
        return [p for p in self.peers if now - self.last_seen[p] > 2 * self.interval_s]

    def fail(self, message: str) -> None:
        """Tell the other nodes that the job is going down with ``message`` (node 0 tells all, others node 0)."""
        if self.failed:
            return
        self.failed = True
        self._broadcast({"type": "fail", "msg": message})

    def close(self) -> None:
        """Close the channel, giving queued messages (a final ``fail`` / ``finish``) up to 2 s to go out."""
        self.sock.close(linger=2000)
        self.ctx.term()
