"""POSIX shared-memory segments (:class:`ShmSegment`) and tensor slot rings (:class:`SlotRing`): the
intra-node data plane of :mod:`npu_train.transport.channel`.

Segments are ``/dev/shm/npt_<job_id>_<name>``, mode 0600, created with ``O_EXCL`` and ``posix_fallocate`` so a
full ``/dev/shm`` raises :class:`ShmTooSmallError` at creation instead of ``SIGBUS`` later; not
``multiprocessing.shared_memory``, whose resource tracker unlinks segments under ``spawn``. ``job_id`` has no
``_``, so one job's prefix never matches another's (:func:`unlink_job_segments`)."""

from __future__ import annotations

import errno
import mmap
import os
import re
from typing import List, Optional, Sequence

import torch

from npu_train.errors import UserError

try:  # CPython's private module behind multiprocessing.shared_memory (POSIX only).
    import _posixshmem
except ImportError:  # pragma: no cover - non-POSIX platforms
    _posixshmem = None

__all__ = [
    "SHM_DIR",
    "SEGMENT_PREFIX",
    "SLOT_ALIGN",
    "DTYPES",
    "ShmTooSmallError",
    "ShmSegment",
    "SlotRing",
    "dtype_from_str",
    "dtype_to_str",
    "segment_name",
    "segment_names_for_job",
    "shm_free_bytes",
    "unlink_job_segments",
    "validate_job_id",
]

#: Directory where Linux exposes POSIX shared memory objects.
SHM_DIR = "/dev/shm"
#: Every segment created by npu-train starts with this prefix.
SEGMENT_PREFIX = "npt_"
#: Byte alignment of every slot inside a :class:`SlotRing`.
SLOT_ALIGN = 64

#: Wire dtype name -> torch dtype. Only these are accepted on either side.
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

_JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,63}$")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ShmTooSmallError(UserError, RuntimeError):
    """``/dev/shm`` has less free space (``available`` bytes) than a segment needs (``required``)."""

    def __init__(self, name: str, required: int, available: int, shm_dir: str = SHM_DIR):
        self.name = name
        self.required = int(required)
        self.available = int(available)
        mib = 1 << 20
        suggest_gib = max(1, -(-self.required * 2 // (1 << 30)))  # 2x headroom, rounded up
        super().__init__(
            f"shared memory segment {name!r} needs {self.required} bytes "
            f"({self.required / mib:.1f} MiB) but {shm_dir} has only {self.available} bytes "
            f"({self.available / mib:.1f} MiB) free. Fix: give the container a bigger "
            f"/dev/shm (docker run --shm-size={suggest_gib}g ...; on Kubernetes mount an "
            f"emptyDir volume with medium: Memory and sizeLimit: {suggest_gib}Gi at /dev/shm), "
            f"or lower micro_batch / seq_len (slot size = micro_batch * seq_len * hidden * "
            f"dtype bytes), or use transport mode 'inline'."
        )


def validate_job_id(job_id: str) -> str:
    """Return ``job_id`` if usable in segment names (1-64 of ``[A-Za-z0-9.-]``, not starting with
    ``.``/``-``), else raise ``ValueError``."""
    if not isinstance(job_id, str) or not _JOB_ID_RE.match(job_id):
        raise ValueError(
            f"invalid job_id {job_id!r}: use 1-64 characters from [A-Za-z0-9.-] "
            f"(no '_', which separates fields in shm segment names)"
        )
    return job_id


def segment_name(job_id: str, name: str) -> str:
    """Full segment name ``npt_<job_id>_<name>`` (no leading ``/``; ``name``: 1-128 of ``[A-Za-z0-9._-]``)."""
    validate_job_id(job_id)
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"invalid segment/link name {name!r}: use [A-Za-z0-9._-], 1-128 chars")
    return f"{SEGMENT_PREFIX}{job_id}_{name}"


def _check_full_name(name: str) -> str:
    if not isinstance(name, str) or not name or "/" in name or "\0" in name or len(name) > 250:
        raise ValueError(f"invalid shared memory name {name!r}")
    return name


def _require_posix() -> None:
    if _posixshmem is None:  # pragma: no cover
        raise RuntimeError("POSIX shared memory (_posixshmem) is not available on this platform")


def shm_free_bytes(shm_dir: str = SHM_DIR) -> int:
    """Bytes available to unprivileged users in ``shm_dir`` (``f_bavail * f_frsize``)."""
    st = os.statvfs(shm_dir)
    return int(st.f_bavail) * int(st.f_frsize)


class ShmSegment:
    """One POSIX shared memory object mapped read/write (``buf``: a memoryview of ``size`` bytes).

    :meth:`create` (owner) or :meth:`attach`; :meth:`close` unmaps, :meth:`unlink` removes the name. As a
    context manager it closes, and unlinks what it created."""

    def __init__(self, name: str, mm: mmap.mmap, size: int, owner: bool):
        self.name = name
        self.size = size
        self.owner = owner
        self._mmap: Optional[mmap.mmap] = mm
        self._buf: Optional[memoryview] = memoryview(mm)

    # -- construction -----------------------------------------------------------------
    @classmethod
    def create(cls, name: str, nbytes: int, *, reserve: bool = True) -> "ShmSegment":
        """Create segment ``name`` of ``nbytes`` > 0 bytes, mode 0600 (``reserve``: fallocate now).

        Raises ShmTooSmallError, FileExistsError, ValueError (bad name or size)."""
        _require_posix()
        _check_full_name(name)
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"segment size must be > 0 bytes, got {nbytes}")
        try:
            avail = shm_free_bytes()
        except OSError:
            avail = None  # no /dev/shm to inspect (non-Linux); let shm_open decide
        if avail is not None and nbytes > avail:
            raise ShmTooSmallError(name, nbytes, avail)

        fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
        try:
            os.fchmod(fd, 0o600)  # independent of the process umask
            os.ftruncate(fd, nbytes)
            if reserve and hasattr(os, "posix_fallocate"):
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.ENOMEM):
                        raise ShmTooSmallError(name, nbytes, _safe_free()) from e
                    if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                        raise
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            try:
                _posixshmem.shm_unlink("/" + name)
            except OSError:
                pass
            raise
        os.close(fd)
        return cls(name, mm, nbytes, owner=True)

    @classmethod
    def attach(cls, name: str) -> "ShmSegment":
        """Map the existing segment ``name`` (raises ``FileNotFoundError`` if absent)."""
        _require_posix()
        _check_full_name(name)
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        try:
            size = os.fstat(fd).st_size
            if size <= 0:
                raise RuntimeError(f"shared memory segment {name!r} has size 0 (not initialised yet?)")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(name, mm, size, owner=False)

    # -- access ----------------------------------------------------------------------
    @property
    def buf(self) -> memoryview:
        if self._buf is None:
            raise ValueError(f"shared memory segment {self.name!r} is closed")
        return self._buf

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        """Unmap the segment. Idempotent; live views keep the mapping until they are collected."""
        mm, buf = self._mmap, self._buf
        self._mmap = None
        self._buf = None
        if buf is not None:
            try:
                buf.release()
            except BufferError:
                pass
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # exported views still alive; freed with them

    def unlink(self) -> None:
        """Remove the segment's name from ``/dev/shm``. Idempotent."""
        _require_posix()
        try:
            _posixshmem.shm_unlink("/" + self.name)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "ShmSegment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"ShmSegment(name={self.name!r}, size={self.size}, owner={self.owner}, {state})"


def _safe_free() -> int:
    try:
        return shm_free_bytes()
    except OSError:
        return 0


def segment_names_for_job(job_id: str) -> List[str]:
    """Names (without ``/``) of all existing ``/dev/shm`` segments of ``job_id``, sorted."""
    prefix = f"{SEGMENT_PREFIX}{validate_job_id(job_id)}_"
    try:
        entries = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(e for e in entries if e.startswith(prefix))


def unlink_job_segments(job_id: str) -> int:
    """Unlink every ``/dev/shm`` segment of ``job_id``; returns how many were removed. Idempotent."""
    _require_posix()
    n = 0
    for name in segment_names_for_job(job_id):
        try:
            _posixshmem.shm_unlink("/" + name)
            n += 1
        except FileNotFoundError:
            pass
    return n


def dtype_from_str(name: str) -> torch.dtype:
    """Wire dtype name (e.g. ``"bfloat16"``) -> ``torch.dtype``; ``ValueError`` if unsupported."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported dtype {name!r}; supported: {sorted(DTYPES)}") from None


def dtype_to_str(dtype: torch.dtype) -> str:
    """``torch.dtype`` -> wire name; ``ValueError`` if unsupported."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype}; supported: {sorted(DTYPES)}") from None


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class SlotRing:
    """``n_slots`` slots of ``slot_bytes`` bytes in one :class:`ShmSegment`, each at ``i * round_up(slot_bytes, 64)``.
    No synchronisation: ``TensorLink``'s credits decide who may write a slot."""

    def __init__(self, segment: ShmSegment, slot_bytes: int, n_slots: int):
        slot_bytes, n_slots = int(slot_bytes), int(n_slots)
        if slot_bytes <= 0 or n_slots <= 0:
            raise ValueError(f"slot_bytes and n_slots must be > 0 (got {slot_bytes}, {n_slots})")
        self.segment = segment
        self.slot_bytes = slot_bytes
        self.n_slots = n_slots
        self.stride = _round_up(slot_bytes, SLOT_ALIGN)
        need = self.stride * n_slots
        if segment.size < need:
            raise ValueError(
                f"segment {segment.name!r} has {segment.size} bytes, ring needs {need} "
                f"({n_slots} slots x stride {self.stride}); sender/receiver disagree on slot_bytes/n_slots?"
            )
        # One uint8 tensor over the whole segment; slots are views of it.
        self._bytes: Optional[torch.Tensor] = torch.frombuffer(segment.buf, dtype=torch.uint8, count=need)

    @staticmethod
    def segment_bytes(slot_bytes: int, n_slots: int) -> int:
        """Bytes of shared memory a ring of ``n_slots`` x ``slot_bytes`` needs."""
        return _round_up(int(slot_bytes), SLOT_ALIGN) * int(n_slots)

    @classmethod
    def create(cls, name: str, slot_bytes: int, n_slots: int) -> "SlotRing":
        """Create (own) the backing segment ``name``; see :meth:`ShmSegment.create` for errors."""
        seg = ShmSegment.create(name, cls.segment_bytes(slot_bytes, n_slots))
        try:
            return cls(seg, slot_bytes, n_slots)
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def attach(cls, name: str, slot_bytes: int, n_slots: int) -> "SlotRing":
        seg = ShmSegment.attach(name)
        try:
            return cls(seg, slot_bytes, n_slots)
        except BaseException:
            seg.close()
            raise

    def _slot_bytes_view(self, slot: int, nbytes: int) -> torch.Tensor:
        if self._bytes is None:
            raise ValueError(f"slot ring {self.segment.name!r} is closed")
        if not isinstance(slot, int) or not 0 <= slot < self.n_slots:
            raise IndexError(f"slot {slot!r} out of range [0, {self.n_slots})")
        if nbytes > self.slot_bytes:
            raise ValueError(
                f"tensor of {nbytes} bytes does not fit a slot of {self.slot_bytes} bytes "
                f"(ring {self.segment.name!r}); raise slot_bytes or lower micro_batch/seq_len"
            )
        off = slot * self.stride
        return self._bytes[off : off + nbytes]

    def write(self, slot: int, tensor: torch.Tensor) -> int:
        """Copy ``tensor``'s bytes (C order, blocking copy from any device) into ``slot``; returns bytes
        written. Raises ValueError (dtype not in :data:`DTYPES`, too large), IndexError (bad slot)."""
        dtype_to_str(tensor.dtype)  # validates
        src = tensor.detach()
        nbytes = src.numel() * src.element_size()
        dst = self._slot_bytes_view(slot, nbytes)
        if nbytes:
            dst.view(src.dtype).view(src.shape).copy_(src)
        return nbytes

    def view(self, slot: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Zero-copy tensor of ``shape``/``dtype`` aliasing ``slot``: copy it before releasing the slot."""
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"negative dimension in shape {shape}")
        dtype_to_str(dtype)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        raw = self._slot_bytes_view(slot, nbytes)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return raw.view(dtype).view(shape)

    def close(self) -> None:
        """Drop the ring's tensor over the segment and unmap it (does not unlink)."""
        self._bytes = None
        self.segment.close()

    def unlink(self) -> None:
        self.segment.unlink()

    def __enter__(self) -> "SlotRing":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if self.segment.owner:
            self.unlink()
