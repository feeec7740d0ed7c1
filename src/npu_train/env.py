"""Environment variables (prefix ``NPT_``) and the cache root: ``NPT_CACHE`` (default ``~/.cache/npu-train``;
checked writable at launch: :func:`writable_cache_dir`),
``NPT_FURIOSA_FUSION``; tests only: ``NPT_SHM_FREE_BYTES``, ``NPT_FAULT``; ``NPT_TORCH_SPEC``,
``NPT_VENV`` and ``NPT_SETUP_PROGRESS_S`` (seconds between its pip progress lines) for ``scripts/setup.sh``. :data:`RUN_VARIABLES` are repeated before printed resume commands.
"""
from __future__ import annotations

import os
import shlex
import warnings
from pathlib import Path
from typing import Optional

from npu_train.errors import UserError

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


class CacheDirError(UserError):
    """The cache root cannot be written (a read-only filesystem, no permission): exit 2 naming ``NPT_CACHE``."""


def writable_cache_dir(*parts: str) -> Path:
    """:func:`cache_dir` created, with a probe file created and removed in it. Raises :class:`CacheDirError`
    naming ``NPT_CACHE`` and the fix."""
    d = cache_dir(*parts)
    probe = d / f".npt-probe-{os.getpid()}"
    try:
        d.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.remove(probe)
    except OSError as e:
        v = getenv("CACHE")
        now = f"NPT_CACHE={v}" if v else "NPT_CACHE is unset: the default ~/.cache/npu-train"
        raise CacheDirError(f"the cache directory {d} cannot be written ([Errno {e.errno}] {e.strerror}; {now}): "
                            "set NPT_CACHE to a writable directory, e.g. NPT_CACHE=/tmp/npt-cache "
                            "(it holds the tokenized data, calibration and fitted figures)") from None
    return d


#: variable names (after ``NPT_``) that change a run: a resume command sets them again
RUN_VARIABLES = ("CACHE", "FURIOSA_FUSION")


def run_environment() -> dict[str, str]:
    """``{"NPT_<name>": value}`` of the set :data:`RUN_VARIABLES` (deprecated ``NPU_TRAIN_`` names mapped;
    ``NPT_CACHE`` made absolute)."""
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
    """``env NPT_X='...' `` for :func:`run_environment` (runs without a shell); ``""`` when none is set."""
    env = run_environment()
    return ("env " + "".join(f"{k}={shlex.quote(v)} " for k, v in env.items())) if env else ""
