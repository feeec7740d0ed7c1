"""Environment variables and the cache root (one prefix: ``NPT_``).

=========================  ==================================================================
``NPT_CACHE``              cache root (default ``~/.cache/npu-train``): packed data, dequantized
                           GGUF tensors, calibration profiles. ``NPU_TRAIN_CACHE`` is still read
                           (deprecated, with a warning).
``NPT_FURIOSA_FUSION``     RNGD fusion setting for every card process (see ``backends/furiosa.py``);
                           ``NPU_TRAIN_FURIOSA_FUSION`` is still read (deprecated).
``NPT_CALIBRATE``          ``auto``/``never``/``always``: replaces ``placement.calibrate=auto``
                           (the test suite sets ``never``, ``tests/conftest.py``).
``NPT_CALIBRATE_QUICK``    tests only: ``1`` = the automatic calibration uses tiny sizes.
``NPT_SHM_FREE_BYTES``     tests only: pretend ``/dev/shm`` has this many free bytes.
``NPT_FAULT``              tests only: fault injection in a card process (``runtime/faults.py``).
``NPT_TORCH_SPEC``         ``scripts/setup.sh``: which torch to install.
=========================  ==================================================================
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Optional

PREFIX = "NPT_"
_DEPRECATED_PREFIX = "NPU_TRAIN_"


def getenv(name: str, default: Optional[str] = None) -> Optional[str]:
    """``$NPT_<name>``; falls back to the deprecated ``$NPU_TRAIN_<name>`` with a DeprecationWarning."""
    v = os.environ.get(PREFIX + name)
    if v is not None:
        return v
    old = os.environ.get(_DEPRECATED_PREFIX + name)
    if old is not None:
        warnings.warn(f"${_DEPRECATED_PREFIX}{name} is deprecated; set ${PREFIX}{name} instead",
                      DeprecationWarning, stacklevel=2)
        return old
    return default


def cache_root() -> Path:
    """The cache root: ``$NPT_CACHE`` or ``~/.cache/npu-train`` (not created here)."""
    v = getenv("CACHE")
    return Path(v).expanduser() if v else Path.home() / ".cache" / "npu-train"


def cache_dir(*parts: str) -> Path:
    """A sub-directory of :func:`cache_root` (not created here), e.g. ``cache_dir("data")``."""
    return cache_root().joinpath(*parts)
