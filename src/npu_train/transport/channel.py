"""Stage-to-stage tensor transport: ZeroMQ control plane + shared-memory (or inline) data plane.

Each worker owns one inbox (:class:`Mailbox`, ROUTER) and one :class:`Outbox` (DEALER) per peer; one direction
of a stage boundary is a :class:`TensorLink`. Headers are msgpack maps (never pickle) carrying the job token
(:func:`new_token`, checked in constant time; bad messages are dropped and counted in ``Mailbox.rejected``).
``mode="shm"``: the tensor sits in slot ``slot`` of a :class:`~npu_train.transport.shm.SlotRing`;
``mode="inline"``: it travels as the payload frame (``tcp://``). A link has K slots = K credits: ``send``
takes one, the receiver's ``recv`` copies the slot and returns it as a ``free:<link>`` message, so a slot is
never overwritten before it was read. Errors: :class:`TransportTimeout` (a dead or stalled peer),
:class:`TransportError` (protocol violation), ``ValueError`` (tensor too large, bad dtype or name).
One thread at a time per Mailbox/Outbox/TensorLink (ZeroMQ sockets are not thread-safe). Example use:
``tests/unit/test_transport.py``."""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import stat
import tempfile
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Set, Tuple, Union

import msgpack
import torch
import zmq

from .shm import SlotRing, dtype_from_str, dtype_to_str, segment_name

__all__ = [
    "TransportError",
    "TransportTimeout",
    "Endpoint",
    "Mailbox",
    "Outbox",
    "TensorLink",
    "Header",
    "Payload",
    "new_token",
    "pack_header",
    "MAX_HEADER_BYTES",
]

log = logging.getLogger(__name__)

Header = Dict[str, Any]
#: Payload frame as returned by :meth:`Mailbox.recv`: a read-only bytes-like object, or None.
Payload = Optional[memoryview]
AbortCheck = Optional[Callable[[], None]]

#: Headers larger than this are rejected unread (bytes).
MAX_HEADER_BYTES = 64 * 1024
#: Maximum tensor rank accepted in a header.
MAX_NDIM = 32
#: Poll granularity of blocking waits (seconds); abort_check runs this often.
POLL_INTERVAL_S = 0.1
# Keys a caller may not override through ``extra`` header fields.
_RESERVED = frozenset({"tok", "src", "kind", "step", "micro", "link", "slot", "shape", "dtype", "nbytes", "seq"})
# Warning rate limit for rejected messages: first N, then every Mth.
_WARN_FIRST, _WARN_EVERY = 20, 1000


class TransportError(RuntimeError):
    """Protocol violation by an (authenticated) peer, or use of a closed transport object."""


class TransportTimeout(TransportError):
    """Nothing matching arrived within the timeout (peer dead, stalled or misconfigured)."""


def new_token() -> str:
    """A fresh random job token (32 hex characters, 128 bits)."""
    return secrets.token_hex(16)


def pack_header(header: Header) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# --------------------------------------------------------------------------------------
# Endpoints
# --------------------------------------------------------------------------------------
class Endpoint:
    """Helpers that build ZeroMQ addresses for worker inboxes."""

    #: Longest usable AF_UNIX socket path on Linux (sun_path is 108 bytes incl. NUL).
    MAX_IPC_PATH = 107

    @staticmethod
    def make_run_dir(job_id: str, base: Optional[str] = None) -> str:
        """Create and return a private (0700) directory for a job's ipc sockets under ``base``
        (default ``$XDG_RUNTIME_DIR`` or the temp dir); socket paths must fit :attr:`MAX_IPC_PATH` bytes."""
        if base is None:
            base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        d = tempfile.mkdtemp(prefix=f"npt_{job_id}_", dir=base)  # mkdtemp: 0700
        os.chmod(d, 0o700)
        return d

    @classmethod
    def ipc(cls, run_dir: str, rank: int) -> str:
        """``ipc://{run_dir}/r{rank}.sock``; ``ValueError`` if the path is too long for AF_UNIX."""
        path = os.path.join(os.path.abspath(run_dir), f"r{int(rank)}.sock")
        if len(path.encode()) > cls.MAX_IPC_PATH:
            raise ValueError(
                f"ipc socket path {path!r} is {len(path.encode())} bytes; AF_UNIX allows "
                f"{cls.MAX_IPC_PATH}. Use a shorter run_dir (e.g. under /tmp)."
            )
        return f"ipc://{path}"

    @staticmethod
    def tcp(host: str, port: Union[int, str]) -> str:
        """``tcp://{host}:{port}`` (IPv6 literals are bracketed; ``port`` may be ``"*"`` for bind)."""
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"tcp://{host}:{port}"

    @staticmethod
    def free_tcp_port(host: str = "127.0.0.1") -> int:
        """A TCP port that was free a moment ago: racy (another process may bind it before the caller does), so
        the job never uses it; bind ``port="*"`` and read the bound address back (``zmq.LAST_ENDPOINT``), or host
        a store on port 0 (:mod:`npu_train.runtime.jobstore`)."""
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(fam, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]


# --------------------------------------------------------------------------------------
# Mailbox (inbox) and Outbox
# --------------------------------------------------------------------------------------
def _matches(h: Header, kind: Optional[str], step: Optional[int], micro: Optional[int]) -> bool:
    return (
        (kind is None or h["kind"] == kind)
        and (step is None or h["step"] == step)
        and (micro is None or h["micro"] == micro)
    )


class Mailbox:
    """A worker's single inbox (ZeroMQ ROUTER, bound to ``bind_addr``: ``ipc://...``, ``tcp://host:port`` or
    ``tcp://host:*``, a port the kernel picks; :attr:`addr` is the bound address).

    Messages with another ``token`` are dropped and counted in :attr:`rejected`. ``max_msg_bytes``: ZeroMQ
    drops peers sending a larger frame (use ``slot_bytes + 64 KiB`` or more)."""

    def __init__(
        self,
        ctx: zmq.Context,
        bind_addr: str,
        token: str,
        logger: Optional[logging.Logger] = None,
        *,
        max_msg_bytes: Optional[int] = None,
    ):
        if not isinstance(token, str) or not token:
            raise ValueError("Mailbox needs a non-empty string token")
        self.token = token
        self._tok_b = token.encode()
        self.logger = logger or log
        self.rejected = 0
        self._pending: List[Tuple[Header, Payload]] = []
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if max_msg_bytes is not None:
            self._sock.setsockopt(zmq.MAXMSGSIZE, int(max_msg_bytes))
        if bind_addr.startswith("ipc://"):
            self._check_ipc_dir(bind_addr[len("ipc://") :])
        try:
            self._sock.bind(bind_addr)
        except BaseException:
            self._sock.close(0)
            raise
        self.addr: str = self._sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        if self.addr.startswith("ipc://"):
            try:
                os.chmod(self.addr[len("ipc://") :], 0o600)
            except OSError:
                pass

    def _check_ipc_dir(self, path: str) -> None:
        d = os.path.dirname(path) or "."
        try:
            st = os.stat(d)
        except FileNotFoundError:
            raise FileNotFoundError(f"ipc run_dir {d!r} does not exist (create it with Endpoint.make_run_dir)")
        if st.st_mode & 0o077 or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            self.logger.warning(
                "ipc run_dir %s has mode %o / owner %d: should be a private 0700 directory owned by us",
                d, stat.S_IMODE(st.st_mode), st.st_uid,
            )

    # -- receiving ---------------------------------------------------------------------
    def _reject(self, reason: str, ident: bytes, authenticated: bool = False) -> None:
        self.rejected += 1
        n = self.rejected
        if n <= _WARN_FIRST or n % _WARN_EVERY == 0:
            what = "malformed message from peer" if authenticated else "message from unauthenticated peer"
            self.logger.warning(
                "ignored %s (%s; zmq identity %s; %d rejected so far on %s)",
                what, reason, ident[:8].hex() if ident else "?", n, self.addr,
            )

    def _validate(self, frames: Sequence[zmq.Frame]) -> Optional[Tuple[Header, Payload]]:
        """Authenticate + decode one ROUTER message; None (after logging) if rejected."""
        if not frames:
            return None
        ident = frames[0].bytes if len(frames) else b""
        body = frames[1:]  # identity frame discarded
        if len(body) not in (1, 2):
            self._reject(f"{len(body)} frames, expected 1 or 2", ident)
            return None
        raw = body[0].buffer
        if len(raw) > MAX_HEADER_BYTES:
            self._reject(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}", ident)
            return None
        try:
            h = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
        except Exception as e:  # garbage, pickle, truncated data, ... - msgpack never executes code
            self._reject(f"undecodable header: {type(e).__name__}", ident)
            return None
        if not isinstance(h, dict):
            self._reject(f"header is {type(h).__name__}, not a map", ident)
            return None
        tok = h.get("tok")
        if not isinstance(tok, str) or not hmac.compare_digest(tok.encode(), self._tok_b):
            self._reject("bad or missing token", ident)
            return None
        if not isinstance(h.get("kind"), str) or not all(_is_int(h.get(k)) for k in ("src", "step", "micro")):
            self._reject("header lacks str 'kind' / int 'src','step','micro'", ident, authenticated=True)
            return None
        payload = body[1].buffer if len(body) == 2 else None
        return h, payload

    def _take_pending(self, kind, step, micro) -> Optional[Tuple[Header, Payload]]:
        for i, m in enumerate(self._pending):
            if _matches(m[0], kind, step, micro):
                return self._pending.pop(i)
        return None

    def _drain(self, kind, step, micro) -> Optional[Tuple[Header, Payload]]:
        """Read everything available without blocking; return the first match (rest buffered)."""
        sock = self._sock
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            msg = self._validate(frames)
            if msg is None:
                continue
            if _matches(msg[0], kind, step, micro):
                return msg
            self._pending.append(msg)

    def poll(self, kind: Optional[str] = None, step: Optional[int] = None,
             micro: Optional[int] = None) -> Optional[Tuple[Header, Payload]]:
        """Non-blocking :meth:`recv`: the matching message if one is already here, else None."""
        self._check_open()
        return self._take_pending(kind, step, micro) or self._drain(kind, step, micro)

    def recv(
        self,
        kind: Optional[str],
        step: Optional[int] = None,
        micro: Optional[int] = None,
        timeout_s: Optional[float] = 60.0,
        *,
        abort_check: AbortCheck = None,
    ) -> Tuple[Header, Payload]:
        """Wait for the message matching ``kind``/``step``/``micro`` (``None`` = any; others are buffered) and
        return ``(header, payload or None)``. ``timeout_s``: None = forever, 0 = only what arrived, else
        :class:`TransportTimeout`; ``abort_check`` is called about every 100 ms and may raise."""
        self._check_open()
        hit = self._take_pending(kind, step, micro)
        if hit is not None:
            return hit
        deadline = None if timeout_s is None else time.monotonic() + max(0.0, float(timeout_s))
        while True:
            hit = self._drain(kind, step, micro)
            if hit is not None:
                return hit
            if abort_check is not None:
                abort_check()
            wait = POLL_INTERVAL_S
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransportTimeout(self._timeout_msg(kind, step, micro, timeout_s))
                wait = min(wait, remaining)
            self._sock.poll(max(1, int(wait * 1000)), zmq.POLLIN)

    def _timeout_msg(self, kind, step, micro, timeout_s) -> str:
        kinds = sorted({f"{h['kind']}@{h['step']}/{h['micro']}" for h, _ in self._pending})
        shown = ", ".join(kinds[:10]) + (" ..." if len(kinds) > 10 else "")
        return (
            f"timed out after {timeout_s}s on {self.addr} waiting for kind={kind!r} step={step} "
            f"micro={micro}; {len(self._pending)} other message(s) buffered [{shown}]; "
            f"{self.rejected} rejected. Is the peer dead, stalled, or on another job token?"
        )

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _check_open(self) -> None:
        if self._sock is None:
            raise TransportError(f"mailbox {self.addr} is closed")

    def close(self) -> None:
        """Close the socket (pending messages are discarded). Idempotent."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
            self._pending.clear()

    def __enter__(self) -> "Mailbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Outbox:
    """Outbound connection to one peer's :class:`Mailbox` (ZeroMQ DEALER), stamping ``tok`` and ``src``.

    ``send_timeout_s``: longest block on a full peer queue (then :class:`TransportTimeout`; None = forever);
    ``linger_ms``: how long :meth:`close` keeps delivering queued messages."""

    def __init__(
        self,
        ctx: zmq.Context,
        peer_addr: str,
        token: str,
        src_rank: int,
        *,
        send_timeout_s: Optional[float] = 60.0,
        linger_ms: int = 2000,
    ):
        self.peer_addr = peer_addr
        self.token = token
        self.src_rank = int(src_rank)
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, int(linger_ms))
        if send_timeout_s is not None:
            self._sock.setsockopt(zmq.SNDTIMEO, max(0, int(send_timeout_s * 1000)))
        self._sock.connect(peer_addr)

    def header(self, kind: str, step: int = 0, micro: int = 0, **fields: Any) -> Header:
        h = {"tok": self.token, "src": self.src_rank, "kind": kind, "step": int(step), "micro": int(micro)}
        h.update(fields)
        return h

    def send(self, kind: str, step: int = 0, micro: int = 0, payload: Any = None, **fields: Any) -> None:
        """Send ``[header]`` or ``[header, payload]`` (payload copied); extra ``fields`` go into the header.
        Raises :class:`TransportTimeout` after ``send_timeout_s``."""
        self.send_header(self.header(kind, step, micro, **fields), payload)

    def send_header(self, header: Header, payload: Any = None) -> None:
        """Send a prebuilt header (``tok``/``src`` must already be set), optionally with a payload."""
        if self._sock is None:
            raise TransportError(f"outbox to {self.peer_addr} is closed")
        frames = [pack_header(header)]
        if payload is not None:
            frames.append(payload)
        try:
            self._sock.send_multipart(frames, copy=True)
        except zmq.Again:
            raise TransportTimeout(
                f"peer {self.peer_addr} did not accept a {header.get('kind')!r} message in time "
                f"(its queue is full: peer dead or stalled?)"
            ) from None

    def close(self) -> None:
        """Close the socket (queued messages get ``linger_ms`` to leave). Idempotent."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "Outbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------------------
# TensorLink
# --------------------------------------------------------------------------------------
class TensorLink:
    """One direction of one stage boundary, with credit-based flow control.

    Both ends use the same arguments; the role is fixed by first use. ``mode``: ``"shm"`` or ``"inline"``;
    ``job_id``: ``[A-Za-z0-9.-]``; ``name``: unique in the job, e.g. ``"s0to1.act"``; ``slot_bytes``: the
    largest tensor in bytes; ``n_slots``: K >= 1 tensors in flight. Shared memory per link:
    ``n_slots * round_up(slot_bytes, 64)`` bytes."""

    MODES = ("shm", "inline")

    def __init__(self, mode: str, job_id: str, name: str, slot_bytes: int, n_slots: int = 2):
        if mode not in self.MODES:
            raise ValueError(f"TensorLink mode must be one of {self.MODES}, got {mode!r}")
        slot_bytes, n_slots = int(slot_bytes), int(n_slots)
        if slot_bytes <= 0 or n_slots <= 0:
            raise ValueError(f"slot_bytes and n_slots must be > 0 (got {slot_bytes}, {n_slots})")
        self.mode = mode
        self.job_id = job_id
        self.name = name
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.segment_name = segment_name(job_id, name)  # validates job_id and name
        self.credit_kind = f"free:{name}"
        self.role: Optional[str] = None
        self._ring: Optional[SlotRing] = None
        self._free: Deque[int] = deque(range(n_slots))
        self._busy: Set[int] = set()
        self._seq = 0
        self._slot_seq: Dict[int, int] = {}  # the sequence number reserve() gave each slot's tensor
        self._closed = False

    # -- lifecycle ---------------------------------------------------------------------
    def _set_role(self, role: str) -> None:
        if self._closed:
            raise TransportError(f"link {self.name!r} is closed")
        if self.role is None:
            self.role = role
        elif self.role != role:
            raise TransportError(f"link {self.name!r} is the {self.role} end in this process; cannot {role}")

    def open_sender(self) -> "TensorLink":
        """Become the sending end; in shm mode create the slot ring now (so a small ``/dev/shm``
        fails at start-up). Idempotent; returns ``self``. Raises ShmTooSmallError, FileExistsError."""
        self._set_role("sender")
        if self.mode == "shm" and self._ring is None:
            self._ring = SlotRing.create(self.segment_name, self.slot_bytes, self.n_slots)
        return self

    @property
    def in_flight(self) -> int:
        """Sender: tensors sent whose slot the receiver has not released yet."""
        return len(self._busy)

    def close(self) -> None:
        """Unmap the ring; the sender also unlinks it (an attached receiver keeps its mapping). Idempotent."""
        if self._closed:
            return
        self._closed = True
        ring, self._ring = self._ring, None
        if ring is not None:
            ring.close()
            if self.role == "sender":
                ring.unlink()

    def __enter__(self) -> "TensorLink":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- sender ------------------------------------------------------------------------
    def _absorb_credit(self, header: Header) -> None:
        slot = header.get("slot")
        if _is_int(slot) and slot in self._busy:
            self._busy.discard(slot)
            self._free.append(slot)
        else:
            log.warning("link %s: ignoring unexpected credit for slot %r (in flight: %s)",
                        self.name, slot, sorted(self._busy))

    def _acquire_slot(self, mailbox: Mailbox, timeout_s: Optional[float], abort_check: AbortCheck) -> int:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._free:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                h, _ = mailbox.recv(self.credit_kind, None, None, remaining, abort_check=abort_check)
            except TransportTimeout as e:
                raise TransportTimeout(
                    f"link {self.name!r}: all {self.n_slots} slots still held by the receiver after "
                    f"{timeout_s}s (no {self.credit_kind!r} credit returned) - receiver dead or stalled? [{e}]"
                ) from None
            self._absorb_credit(h)
        return self._free.popleft()

    def send(
        self,
        tensor: torch.Tensor,
        kind: str,
        step: int,
        micro: int,
        out: Outbox,
        mailbox: Mailbox,
        timeout_s: Optional[float] = 60.0,
        *,
        abort_check: AbortCheck = None,
        extra: Optional[Dict[str, Any]] = None,
    ) -> int:
        """Send ``tensor`` (any shape and device, a :data:`~npu_train.transport.shm.DTYPES` dtype, at most
        ``slot_bytes``) as ``(kind, step, micro)`` through ``out``; returns the slot used. Blocks while all K slots
        are in flight, collecting credits from ``mailbox``. Raises ``ValueError``, :class:`TransportTimeout`.
        :meth:`reserve` + :meth:`post` in one call."""
        slot = self.reserve(tensor, mailbox, timeout_s, abort_check=abort_check, extra=extra)
        try:
            self.post(slot, tensor, kind, step, micro, out, extra=extra)
        except BaseException:
            self.unreserve(slot)  # nothing was sent: the slot is still ours
            raise
        return slot

    def reserve(self, tensor: torch.Tensor, mailbox: Mailbox, timeout_s: Optional[float] = 60.0, *,
                abort_check: AbortCheck = None, extra: Optional[Dict[str, Any]] = None) -> int:
        """The first half of :meth:`send`, in the thread that owns ``mailbox``: check ``tensor`` against the slot
        size and ``extra``, take a free slot (blocking for a credit while all K are in flight) and count it in
        flight. Returns the slot for :meth:`post` (which may run in another thread with its own
        :class:`Outbox`), or :meth:`unreserve` if nothing will be sent. Raises ``ValueError``,
        :class:`TransportTimeout`."""
        self.open_sender()
        t = tensor.detach()
        dtype_name = dtype_to_str(t.dtype)
        nbytes = t.numel() * t.element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(
                f"link {self.name!r}: tensor {tuple(t.shape)} {dtype_name} is {nbytes} bytes but "
                f"slot_bytes is {self.slot_bytes}; size slots for the largest micro-batch "
                f"(micro_batch * seq_len * hidden * dtype bytes)"
            )
        if extra:
            bad = _RESERVED.intersection(extra)
            if bad:
                raise ValueError(f"extra header fields may not override {sorted(bad)}")
        slot = self._acquire_slot(mailbox, timeout_s, abort_check)
        self._busy.add(slot)
        self._slot_seq[slot] = self._seq
        self._seq += 1
        return slot

    def unreserve(self, slot: int) -> None:
        """Give back a slot :meth:`reserve` took when its :meth:`post` failed (nothing was sent)."""
        self._busy.discard(slot)
        self._free.appendleft(slot)

    def post(self, slot: int, tensor: torch.Tensor, kind: str, step: int, micro: int, out: Outbox, *,
             extra: Optional[Dict[str, Any]] = None) -> None:
        """The second half of :meth:`send`: copy ``tensor`` into ``slot`` (shm: card -> shared memory; inline: to a
        host payload) and send its header through ``out``. Touches no mailbox and no slot bookkeeping, so it may
        run in a copy thread that owns ``out`` (:mod:`npu_train.runtime.copies`)."""
        t = tensor.detach()
        payload = None
        if self.mode == "shm":
            self._ring.write(slot, t)
        else:
            payload = _tensor_bytes(t)
        header = out.header(
            kind, step, micro, link=self.name, slot=slot, shape=list(t.shape),
            dtype=dtype_to_str(t.dtype), nbytes=t.numel() * t.element_size(), seq=self._slot_seq.get(slot, 0), **(extra or {}),
        )
        out.send_header(header, payload)

    def wait_released(self, mailbox: Mailbox, timeout_s: Optional[float] = 60.0,
                      *, abort_check: AbortCheck = None) -> None:
        """Sender: block until the receiver has released every slot (e.g. before close)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._busy:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            h, _ = mailbox.recv(self.credit_kind, None, None, remaining, abort_check=abort_check)
            self._absorb_credit(h)

    # -- receiver ----------------------------------------------------------------------
    def recv(
        self,
        kind: str,
        step: int,
        micro: int,
        mailbox: Mailbox,
        reply: Outbox,
        timeout_s: Optional[float] = 60.0,
        device: Optional[Union[str, torch.device]] = None,
        *,
        abort_check: AbortCheck = None,
        return_header: bool = False,
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, Header]]:
        """Receive the tensor sent as ``(kind, step, micro)`` as a fresh copy on ``device`` (None = CPU); the
        slot credit goes back through ``reply`` first; ``return_header=True`` returns ``(tensor, header)``.
        Raises :class:`TransportTimeout`, :class:`TransportError`. :meth:`take` + :meth:`finish` in one call."""
        h, payload = self.take(kind, step, micro, mailbox, timeout_s, abort_check=abort_check)
        return self.finish(h, payload, reply, device, return_header=return_header)

    def take(self, kind: str, step: int, micro: int, mailbox: Mailbox, timeout_s: Optional[float] = 60.0, *,
             abort_check: AbortCheck = None, wait: bool = True) -> Optional[Tuple[Header, Payload]]:
        """The first half of :meth:`recv`, in the thread that owns ``mailbox``: the message ``(kind, step, micro)``
        as ``(header, payload)``; ``wait=False``: None unless it is already here (:meth:`Mailbox.poll`)."""
        self._set_role("receiver")
        if not wait:
            return mailbox.poll(kind, step, micro)
        return mailbox.recv(kind, step, micro, timeout_s, abort_check=abort_check)

    def finish(self, h: Header, payload: Payload, reply: Outbox, device: Optional[Union[str, torch.device]] = None,
               *, return_header: bool = False) -> Union[torch.Tensor, Tuple[torch.Tensor, Header]]:
        """The second half of :meth:`recv`: check the header, copy the tensor out (shm: slot -> ``device``) and
        return the slot's credit through ``reply``. Touches no mailbox, so it may run in a copy thread that owns
        ``reply`` (:mod:`npu_train.runtime.copies`). Raises :class:`TransportError`."""
        slot = h.get("slot")
        slot_ok = _is_int(slot) and 0 <= slot < self.n_slots
        try:
            shape, dtype = self._check_header(h, payload, slot_ok)
            if self.mode == "shm":
                if self._ring is None:
                    self._ring = SlotRing.attach(self.segment_name, self.slot_bytes, self.n_slots)
                view = self._ring.view(slot, shape, dtype)
                try:
                    out = _copy_out(view, device)
                finally:
                    del view
            else:
                out = _tensor_from_payload(payload, shape, dtype)  # one copy, owns its memory
                if device is not None and torch.device(device).type != "cpu":
                    out = out.to(device)
        finally:
            if slot_ok:
                reply.send(self.credit_kind, h["step"], h["micro"], slot=slot, link=self.name)
        return (out, h) if return_header else out

    def _check_header(self, h: Header, payload: Payload, slot_ok: bool) -> Tuple[Tuple[int, ...], torch.dtype]:
        def bad(why: str) -> TransportError:
            return TransportError(f"link {self.name!r}: bad {h.get('kind')!r} message from rank {h.get('src')}: {why}")

        if h.get("link", self.name) != self.name:
            raise bad(f"it belongs to link {h.get('link')!r} (two links share a kind?)")
        if not slot_ok:
            raise bad(f"slot {h.get('slot')!r} not in [0, {self.n_slots})")
        try:
            dtype = dtype_from_str(h.get("dtype"))
        except ValueError as e:
            raise bad(str(e)) from None
        shape = h.get("shape")
        if not isinstance(shape, list) or len(shape) > MAX_NDIM or not all(_is_int(s) and s >= 0 for s in shape):
            raise bad(f"invalid shape {shape!r}")
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if h.get("nbytes") != nbytes:
            raise bad(f"nbytes {h.get('nbytes')!r} != {nbytes} implied by shape {shape} {h.get('dtype')}")
        if nbytes > self.slot_bytes:
            raise bad(f"{nbytes} bytes exceed slot_bytes {self.slot_bytes} (slot_bytes differs between ends?)")
        if self.mode == "inline":
            if payload is None or len(payload) != nbytes:
                raise bad(f"payload of {None if payload is None else len(payload)} bytes, expected {nbytes}")
        elif payload is not None:
            raise bad("unexpected payload frame in shm mode (modes differ between ends?)")
        return tuple(shape), dtype


def _copy_out(view: torch.Tensor, device) -> torch.Tensor:
    if device is None or torch.device(device).type == "cpu":
        return view.clone(memory_format=torch.contiguous_format)
    return view.to(device, copy=True)


def _tensor_bytes(t: torch.Tensor):
    """A bytes-like view (C order) of tensor ``t``'s data, copied to host if needed."""
    t = t.to("cpu").contiguous()
    if t.numel() == 0:
        return b""
    return t.reshape(-1).view(torch.uint8).numpy()


def _tensor_from_payload(payload, shape: Tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Fresh CPU tensor from a (read-only) payload buffer: one copy into a private bytearray."""
    if len(payload) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(dtype).view(shape)
