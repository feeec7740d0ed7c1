"""Suite-wide settings.

Every test gets its own ``NPT_CACHE`` (inherited by its subprocesses) holding no calibration
profile and no fitted figures, so plans start from the assumed defaults whatever ran before; the
cached data, tokenizers, compiled modules and the host AdamW kernel are shared (links to the real cache's
folders).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import tempfile

from npu_train.env import cache_root

_SHARED = ("data", "tokenizers", "furiosa", "kernels")
_REAL_CACHE = cache_root()
_CACHES = tempfile.mkdtemp(prefix="npt-test-caches-")

# ---- disk: a passed test's temp dir goes at once (checkpoints of the real model are ~2 GB each), so the
# suite's peak disk use is one test's, not the whole session's; a failed test's dir stays for inspection.
import shutil  # noqa: E402

atexit.register(shutil.rmtree, _CACHES, True)  # the per-test caches' parent (ignore_errors)

import pytest  # noqa: E402


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        item._npt_failed = True
    return report


@pytest.fixture(autouse=True)
def _remove_tmp_path_of_passed_test(request):
    path = request.getfixturevalue("tmp_path") if "tmp_path" in request.fixturenames else None
    yield
    if path is not None and not getattr(request.node, "_npt_failed", False):
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _private_cache():
    """``NPT_CACHE`` set to a fresh directory (shared folders linked) for the ``with`` block."""
    root = tempfile.mkdtemp(dir=_CACHES)
    for name in _SHARED:
        (_REAL_CACHE / name).mkdir(parents=True, exist_ok=True)
        os.symlink(_REAL_CACHE / name, os.path.join(root, name))
    old = os.environ.get("NPT_CACHE")
    os.environ["NPT_CACHE"] = root
    try:
        yield root
    finally:
        if old is None:
            os.environ.pop("NPT_CACHE", None)
        else:
            os.environ["NPT_CACHE"] = old
        shutil.rmtree(root, ignore_errors=True)


#: ``NPT_CACHE`` directory -> what ran with it (a test's node id), so a process left running names its test
_CACHE_OWNER: dict = {}


@pytest.fixture(scope="session", autouse=True)
def _session_cache():
    """A fresh ``NPT_CACHE`` for what runs outside a test's own (module- and session-scoped fixtures),
    so nothing a test runs reads or writes the user's real cache."""
    with _private_cache() as root:
        _CACHE_OWNER[root] = "a module- or session-scoped fixture"
        yield root


@pytest.fixture(autouse=True)
def _own_cache(request):
    """A fresh ``NPT_CACHE`` per test (module docstring)."""
    with _private_cache() as root:
        _CACHE_OWNER[root] = request.node.nodeid
        yield root


# ---- Ctrl-C: stop the suite, leave nothing running (issue 40: pytest kept launching jobs after a SIGINT to the
# process group, because a launcher run in-process (tests/integration/conftest.py::run_pipeline) handles SIGINT
# itself: the job stops, exit 130, that test fails, and the next test started). Every delivered SIGINT also
# writes its number to a wakeup pipe, whichever handler the code under test installed; after the test that
# got it the session stops (exit status 2, "Interrupted"), and at the session's end the processes this run
# started that are still alive (their NPT_CACHE lies under this session's caches) are stopped and the
# shared-memory segments of dead jobs removed.
import signal  # noqa: E402
import threading  # noqa: E402

_WAKEUP: list = []  # [read fd, write fd] of the wakeup pipe
_SIGINT_SEEN: list = []


def _arm_sigint_pipe() -> None:
    """(Re)install the wakeup pipe (code under test may have replaced it; main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if not _WAKEUP:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        _WAKEUP.extend((r, w))
    try:
        signal.set_wakeup_fd(_WAKEUP[1], warn_on_full_buffer=False)
    except ValueError:
        pass


def sigint_seen() -> bool:
    """True once a SIGINT reached this process (read from the wakeup pipe)."""
    if _WAKEUP and not _SIGINT_SEEN:
        try:
            while True:
                got = os.read(_WAKEUP[0], 4096)
                if not got:
                    break
                if signal.SIGINT in got:
                    _SIGINT_SEEN.append(True)
        except (BlockingIOError, OSError):
            pass
    return bool(_SIGINT_SEEN)


def pytest_configure(config):
    _arm_sigint_pipe()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _arm_sigint_pipe()
    try:
        return (yield)
    finally:
        if sigint_seen():
            item.session.shouldstop = "interrupted by SIGINT (Ctrl-C)"


def _own_leftover_processes() -> list:
    """Processes still alive whose ``NPT_CACHE`` lies under this session's caches (launchers and card
    processes the tests started, orphaned or not), other than this one."""
    import psutil

    out = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.environ().get("NPT_CACHE", "").startswith(_CACHES + os.sep) and not _own_helper(p):
                out.append(p)
        except (psutil.Error, OSError):
            pass
    return out


def _own_helper(p) -> bool:
    """True for this process's own ``multiprocessing`` resource tracker: the first spawned card process of an
    in-process launch starts it as a child of pytest, and it exits when pytest does (its pipe closes); it is
    no process a test left running, and stopping it early would make the shared-memory clean-up at exit warn."""
    return p.ppid() == os.getpid() and "multiprocessing.resource_tracker" in " ".join(p.cmdline())


def _leftover_line(p) -> str:
    """``pid (test that started it): command line`` of a leftover process (its ``NPT_CACHE`` names the test)."""
    import psutil

    try:
        cache, cmd = p.environ().get("NPT_CACHE", ""), " ".join(p.cmdline())
    except (psutil.Error, OSError):
        return f"{p.pid} (gone)"
    owner = next((t for root, t in _CACHE_OWNER.items() if cache == root or cache.startswith(root + os.sep)),
                 "unknown test")
    return f"{p.pid} ({owner}): {cmd[:300]}"


def _stop_wandb_service() -> None:
    """Stop W&B's service (``wandb-core``, started in this process by the tests of ``metrics.logger=wandb``) as
    wandb's own exit hook would, before the sweep below: the sweep stopped it as a process left running, and
    wandb's exit hook then printed a ``ConnectionResetError: Connection lost`` traceback at the session's end."""
    import sys

    teardown = getattr(sys.modules.get("wandb"), "teardown", None)
    if teardown is not None:
        teardown()


def pytest_sessionfinish(session, exitstatus):
    """Stop what the tests left running (SIGTERM, then SIGKILL after 10 s) and remove the shared-memory
    segments of jobs whose launcher is gone (``runtime/leftovers.py``, as the next launch would)."""
    import psutil

    _stop_wandb_service()
    left = _own_leftover_processes()
    if left:
        print(f"\nstopping {len(left)} process(es) the tests left running:", flush=True)
        for p in left:
            print(f"  {_leftover_line(p)}", flush=True)
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(left, timeout=10)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=10)
    from npu_train.runtime.leftovers import sweep_dead_jobs

    sweep_dead_jobs()


@pytest.fixture
def one_torch_thread():
    """torch's intra-op threads set to 1 for the test, restored after (tests that run several card threads in
    one process: ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
