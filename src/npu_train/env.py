"""Environment variables and the cache root (one prefix: ``NPT_``).

=========================  ==================================================================
``NPT_CACHE``              cache root (default ``~/.cache/npu-train``): packed data, GGUF tensors,
                           calibration profiles, fitted figures; ``NPU_TRAIN_CACHE`` deprecated
``NPT_FURIOSA_FUSION``     RNGD fusion of every card process (``NPU_TRAIN_FURIOSA_FUSION`` deprecated)
``NPT_SHM_FREE_BYTES``     tests only: pretend ``/dev/shm`` has this many free bytes
``NPT_FAULT``              tests only: fault injection in a card process (``runtime/faults.py``)
``NPT_TORCH_SPEC``         ``scripts/setup.sh``: which torch to install
=========================  ==================================================================

:data:`RUN_VARIABLES` (those that change what a run computes or reads) are repeated in front of every
printed resume command (:func:`resume_env_prefix`)."""
from __future__ import annotations

import os
import shlex
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


#: variable names (after ``NPT_``) that change a run: a resume command sets them again
RUN_VARIABLES = ("CACHE", "FURIOSA_FUSION")


def run_environment() -> dict[str, str]:
    """``{"NPT_<name>": value}`` of the :data:`RUN_VARIABLES` set in this process's environment
    (a deprecated ``NPU_TRAIN_<name>`` under its ``NPT_`` name, without a warning); ``NPT_CACHE`` as
    an absolute path (a resume may start in another directory)."""
    out = {}
    for name in RUN_VARIABLES:
        v = os.environ.get(PREFIX + name, os.environ.get(_DEPRECATED_PREFIX + name))
        if v is None:
            continue
        if name == "CACHE" and v:
            v = os.path.abspath(os.path.expanduser(v))
        out[PREFIX + name] = v
    return out


def resume_env_prefix() -> str:
    """``env`` and the quoted assignments of :func:`run_environment`, then one space (e.g.
    ``env NPT_CACHE='/data/my cache' ``), so the command also runs without a shell; ``""`` when none is set."""
    env = run_environment()
    return ("env " + "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())) if env else ""
