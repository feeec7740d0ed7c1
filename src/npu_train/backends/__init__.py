"""Card backends (cpu, cuda, furiosa/RNGD), one per card process; importing it never imports furiosa-torch,
nor torch: its names are imported when first used, so that the launcher checks the ``backend`` list
(:mod:`~npu_train.backends.spec`) before its seconds of imports."""
from __future__ import annotations

from npu_train import lazy_exports

#: name -> the module that defines it
_WHERE = {
    "AllocLock": "npu_train.backends.base",
    "Backend": "npu_train.backends.base",
    "BackendUnavailableError": "npu_train.errors",
    "BackendSpecError": "npu_train.errors",
    "FURIOSA_CAPACITY_BYTES": "npu_train.hardware",
    "make_backend": "npu_train.backends.registry",
    "parse_backend_list": "npu_train.backends.spec",
    "resolve_cards": "npu_train.backends.spec",
}

__all__ = sorted(_WHERE)


__getattr__ = lazy_exports(__name__, _WHERE)
