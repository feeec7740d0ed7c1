"""Backend registry: a backend entry (``cpu``, ``cuda:N``, ``furiosa:N``) -> its :class:`Backend` class.
The only module that knows every concrete backend (``base.py`` imports none)."""
from __future__ import annotations

from typing import Union

from npu_train.backends.base import Backend
from npu_train.backends.spec import BackendSpecError, parse_backend_list
from npu_train.hardware import Card


def make_backend(req: Union[Card, str], **kwargs) -> Backend:
    """Build the backend for a resolved :class:`~npu_train.hardware.Card` (or an entry string like ``"cuda:0"``);
    extra keyword arguments go to the class. Touches no device: call :meth:`Backend.setup` in the card process."""
    if isinstance(req, str):
        reqs = parse_backend_list(req)
        if len(reqs) != 1:
            raise BackendSpecError(f"make_backend takes one backend entry, got {req!r}")
        req = reqs[0]
    if not isinstance(req, Card):
        raise TypeError(f"make_backend expects a Card or a backend entry string, got {type(req).__name__}")
    text = req.text or req.name
    kind = req.kind
    if kind == "rngd":
        kind = "furiosa"
    if kind == "cpu":
        from npu_train.backends.cpu import CPUBackend

        return CPUBackend(**kwargs)
    if kind not in ("cuda", "furiosa"):
        raise BackendSpecError(f"unknown device kind {req.kind!r} in backend entry {text!r}: "
                               "use cpu, cuda:N, cuda:auto, furiosa:N or furiosa:auto")
    if req.index is None:
        raise BackendSpecError(f"backend entry {text!r} has no device index yet: "
                               "call npu_train.backends.spec.resolve_cards() before make_backend()")
    if kind == "cuda":
        from npu_train.backends.cuda import CUDABackend

        return CUDABackend(req.index, **kwargs)
    from npu_train.backends.furiosa import FuriosaBackend

    return FuriosaBackend(req.index, **kwargs)
