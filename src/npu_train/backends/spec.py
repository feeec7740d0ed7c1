"""The ``backend`` list: which cards a job runs on. Entries (case-insensitive): ``cpu``, ``cuda[:auto]`` /
``cuda:N``, ``furiosa[:auto]`` / ``furiosa:N`` (alias ``rngd``); :func:`parse_backend_list` checks
syntax, :func:`resolve_cards` numbers auto entries and (``probe``) checks the devices exist. Main type: :class:`~npu_train.hardware.Card`.
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

from npu_train.errors import BackendSpecError, BackendUnavailableError
from npu_train.hardware import KINDS, Card, nominal_capacity

ALIASES = {"rngd": "furiosa", "gpu": None}  # None: recognised but refused with a hint
_VALID = "use cpu, cuda:N, cuda:auto, furiosa:N or furiosa:auto"
_ENTRY_RE = re.compile(r"^(?P<kind>[A-Za-z_][A-Za-z0-9_]*)(?::(?P<arg>.*))?$")


def _as_entries(value) -> list[str]:
    """Flatten a list / ListConfig / tuple of strings or one comma-separated string."""
    if value is None:
        raise BackendSpecError(f"backend list is empty: {_VALID} (e.g. backend=[furiosa:0,furiosa:1])")
    if isinstance(value, str):
        items: Iterable = [value]
    else:
        try:  # OmegaConf ListConfig, list, tuple ...
            items = list(value)
        except TypeError:
            raise BackendSpecError(f"backend list must be a list of strings or a comma-separated "
                                   f"string, got {type(value).__name__} {value!r}: {_VALID}") from None
    entries: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise BackendSpecError(f"backend entry {item!r} is not a string: {_VALID}")
        parts = item.split(",")
        if len(parts) > 1 and all(not p.strip() for p in parts):
            parts = [""]
        entries.extend(p.strip() for p in parts)
    if not entries or all(not e for e in entries):
        raise BackendSpecError(f"backend list is empty: {_VALID} (e.g. backend=[furiosa:0,furiosa:1])")
    for pos, e in enumerate(entries, 1):
        if not e:
            raise BackendSpecError(f"backend entry #{pos} is empty in {value!r}: "
                                   f"remove the stray comma; {_VALID}")
    return entries


def _parse_entry(text: str) -> Card:
    m = _ENTRY_RE.match(text)
    if not m:
        raise BackendSpecError(f"backend entry {text!r} is malformed: {_VALID}")
    raw_kind, arg = m.group("kind").lower(), m.group("arg")
    kind = ALIASES.get(raw_kind, raw_kind)
    if raw_kind in ALIASES and kind is None:
        raise BackendSpecError(f"unknown device kind {raw_kind!r} in backend entry {text!r}: "
                               f"write cuda:N for an NVIDIA GPU; {_VALID}")
    if kind not in KINDS:
        raise BackendSpecError(f"unknown device kind {raw_kind!r} in backend entry {text!r}: {_VALID}")
    if kind == "cpu":
        if arg is not None:
            raise BackendSpecError(f"backend entry {text!r} is malformed: cpu takes no index "
                                   f"(repeat 'cpu' once per CPU stage, e.g. cpu,cpu); {_VALID}")
        return Card("cpu", None, text=text)
    if arg is None or arg.strip().lower() == "auto":
        return Card(kind, None, text=text)
    arg = arg.strip()
    if not arg.isdigit():  # rejects '', 'x', '-1', '+1', '1.0'
        hint = " (device indices start at 0)" if arg.startswith("-") else ""
        raise BackendSpecError(f"backend entry {text!r} is malformed{hint}: {_VALID}")
    return Card(kind, int(arg), text=text)


def parse_backend_list(value) -> list[Card]:
    """Parse the backend list (list, ListConfig or ``"a,b,c"``). Raises BackendSpecError for an empty list, an
    unknown kind, a malformed entry or a device named twice."""
    reqs = [_parse_entry(e) for e in _as_entries(value)]
    seen: dict[tuple[str, int], tuple[int, str]] = {}
    for pos, r in enumerate(reqs, 1):
        if r.index is None:
            continue
        key = (r.kind, r.index)
        if key in seen:
            first_pos, first_text = seen[key]
            raise BackendSpecError(
                f"backend entry {r.text!r} (#{pos}) names {r.kind}:{r.index}, already named by entry "
                f"{first_text!r} (#{first_pos}): each card runs one stage, list it once "
                f"(use {r.kind}:auto for 'any other card')")
        seen[key] = (pos, r.text)
    return reqs


# ---------------------------------------------------------------------------- probing
def _no_cuda_build(entry: str, version: str) -> BackendUnavailableError:
    return BackendUnavailableError(
        f"backend entry {entry!r} names a device that does not exist: this machine has 0 CUDA "
        f"devices (this PyTorch build, {version}, has no CUDA support): use cpu or "
        f"furiosa:N, or install a CUDA build of torch")


def _no_cuda_device(entry: str) -> BackendUnavailableError:
    return BackendUnavailableError(
        f"backend entry {entry!r} names a device that does not exist: this machine has 0 CUDA "
        f"devices (torch.cuda.is_available() is False: no NVIDIA GPU/driver visible; check "
        f"nvidia-smi and CUDA_VISIBLE_DEVICES), or use cpu / furiosa:N")


def _no_such_card(entry: str, kind: str, n: int) -> BackendSpecError:
    valid = f" (valid: {kind}:0..{kind}:{n - 1})" if n else ""
    return BackendSpecError(f"backend entry {entry!r} names a device that does not exist: this machine has "
                            f"{n} {_LABEL[kind]} device{'s' if n != 1 else ''}{valid}")


def _cuda_device_count(entry: str) -> int:
    """Number of visible CUDA devices; BackendUnavailableError when this torch has no CUDA."""
    import torch

    if not torch.backends.cuda.is_built():
        raise _no_cuda_build(entry, torch.__version__)
    n = int(torch.cuda.device_count())
    if n == 0:
        raise _no_cuda_device(entry)
    return n


def _torch_version() -> "str | None":
    """The installed torch's version from its package metadata (``2.13.0+cpu``), without importing it."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def check_cuda_early(requests: Sequence[Card], proc: str = "/proc", dev: str = "/dev") -> None:
    """Refuse the ``cuda`` entries of ``requests`` (:func:`parse_backend_list`) where the machine certainly
    has no such device, before torch is imported (the launcher's :func:`resolve_cards` probe comes after seconds
    of imports: a fresh-clone review waited ~12 s for ``backend=cuda:7,cpu``'s line). Certain: a torch build
    without CUDA (its version ``+cpu``); no NVIDIA driver at all (no ``/proc/driver/nvidia``, no
    ``/dev/nvidia*``, no WSL ``/dev/dxg``); an index at or past the GPUs the driver lists
    (``/proc/driver/nvidia/gpus``; not checked under ``CUDA_VISIBLE_DEVICES``, which renumbers them). Raises
    the probe's own BackendUnavailableError / BackendSpecError; otherwise the probe decides later."""
    import glob
    import os

    cuda = [r for r in requests if r.kind == "cuda"]
    if not cuda:
        return
    version = _torch_version()
    if version and version.endswith("+cpu"):
        raise _no_cuda_build(cuda[0].text, version)
    driver = os.path.join(proc, "driver", "nvidia")
    if not (os.path.exists(driver) or glob.glob(os.path.join(dev, "nvidia[0-9]*"))
            or os.path.exists(os.path.join(dev, "dxg"))):
        raise _no_cuda_device(cuda[0].text)
    gpus = os.path.join(driver, "gpus")
    if "CUDA_VISIBLE_DEVICES" in os.environ or not os.path.isdir(gpus):
        return
    n = len(os.listdir(gpus))
    for r in cuda:
        if r.index is not None and r.index >= n:
            raise _no_such_card(r.text, "cuda", n)


def _furiosa_device_count(entry: str) -> int:
    """Number of RNGD cards; BackendUnavailableError when furiosa-torch/runtime/devices are missing."""
    from npu_train.backends import furiosa as fur

    problem = fur.runtime_problem()
    if problem:
        raise BackendUnavailableError(f"backend entry {entry!r}: {problem}")
    return len(fur.list_rngd_cards())


_COUNTERS = {"cuda": _cuda_device_count, "furiosa": _furiosa_device_count}
_LABEL = {"cuda": "CUDA", "furiosa": "RNGD"}


def resolve_cards(requests: Sequence[Card], *, probe: bool = True) -> list[Card]:
    """Give each auto entry the lowest free index of its kind; ``probe``: check devices exist
    (BackendUnavailableError without a runtime, BackendSpecError for an index out of range)."""
    reqs = list(requests)
    if not reqs:
        raise BackendSpecError(f"backend list is empty: {_VALID}")
    taken: dict[str, set[int]] = {}
    for r in reqs:
        if r.kind not in KINDS:
            raise BackendSpecError(f"unknown device kind {r.kind!r} in backend entry {r.text!r}: {_VALID}")
        if r.index is not None:
            if r.index < 0:
                raise BackendSpecError(f"backend entry {r.text!r} is malformed (device indices start at 0): {_VALID}")
            if r.index in taken.setdefault(r.kind, set()):
                raise BackendSpecError(f"backend entry {r.text!r} names {r.kind}:{r.index} twice: list each card once")
            taken[r.kind].add(r.index)

    counts: dict[str, int] = {}
    if probe:
        for r in reqs:
            if r.kind != "cpu" and r.kind not in counts:
                counts[r.kind] = _COUNTERS[r.kind](r.text)

    out: list[Card] = []
    for r in reqs:
        if r.kind == "cpu":
            out.append(r)
            continue
        used = taken.setdefault(r.kind, set())
        label = _LABEL[r.kind]
        if r.index is None:
            idx = 0
            while idx in used:
                idx += 1
            if probe and idx >= counts[r.kind]:
                n = counts[r.kind]
                named = ", ".join(f"{r.kind}:{i}" for i in sorted(used)) or "none"
                raise BackendSpecError(
                    f"backend entry {r.text!r} cannot be placed: this machine has {n} {label} "
                    f"device{'s' if n != 1 else ''} and all are taken (already used: {named}); "
                    f"remove entries or add cards")
            used.add(idx)
            out.append(Card(r.kind, idx, r.capacity_bytes, text=r.text))  # named after its index
        else:
            if probe and r.index >= counts[r.kind]:
                raise _no_such_card(r.text, r.kind, counts[r.kind])
            out.append(r)
    return out


def default_capacity(kind: str, index: int | None = None) -> int:
    """Usable memory of one card of ``kind``, bytes: for ``cuda`` the device's
    ``torch.cuda.get_device_properties(index or 0).total_memory`` when CUDA is available, else
    :func:`npu_train.hardware.nominal_capacity` (cuda 80 GiB assumed, furiosa 47.5 GiB, cpu the whole
    host RAM: dividing it among cpu cards is the caller's job). Raises ``ValueError`` for an unknown kind."""
    if kind == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                return int(torch.cuda.get_device_properties(index or 0).total_memory)
        except Exception:  # pragma: no cover - torch without CUDA support
            pass
    return nominal_capacity(kind)
