"""Card backends (cpu, cuda, furiosa/RNGD), one per card process; importing it never imports furiosa-torch."""

from npu_train.backends.base import AllocLock, Backend, BackendUnavailableError
from npu_train.backends.registry import make_backend
from npu_train.backends.spec import BackendSpecError, parse_backend_list, resolve_cards
from npu_train.hardware import FURIOSA_CAPACITY_BYTES

__all__ = [
    "AllocLock",
    "Backend",
    "BackendSpecError",
    "BackendUnavailableError",
    "FURIOSA_CAPACITY_BYTES",
    "make_backend",
    "parse_backend_list",
    "resolve_cards",
]
