"""A signal that reaches the launcher while it starts a card process is acted on (:meth:`Coordinator._spawn`):
the launcher used to set SIGINT/SIGTERM to SIG_IGN around ``Process.start()`` so that the card did not inherit a
half-set handler, and a signal in that window was discarded: a Ctrl-C while 8 cards started did nothing. The
signals are now blocked around ``start()`` (pending, then handled when the mask is restored) and the card
unblocks them itself (``worker_main``). Here a test double of the card process sends the signal from inside
``start()``; the job must stop at once (no further card started, the started one killed by the teardown) with
:class:`Interrupted` for that signal. SIGTERM, not SIGINT: a SIGINT to the test process stops the suite
(tests/conftest.py); the real-process test with SIGINT is tests/integration/test_signal_during_spawn_launch.py."""
from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from npu_train.errors import Interrupted
from npu_train.runtime import coordinator as coord_mod
from npu_train.runtime.coordinator import Coordinator


class _FakeProcess:
    """Stands in for ``multiprocessing``'s spawn Process: ``start()`` records the signal mask it ran under and,
    for the first card, sends ``signum`` to this (the launcher's) process, as a Ctrl-C in that window does."""

    started: list = []
    killed: list = []

    def __init__(self, target=None, args=(), name="", daemon=False, signum=signal.SIGTERM):
        self.name, self.signum, self.pid, self.exitcode, self._alive = name, signum, None, None, False

    def start(self):
        self.mask_in_start = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        self.pid, self._alive = 10_000_000 + len(_FakeProcess.started), True  # never a real pid
        _FakeProcess.started.append(self)
        if len(_FakeProcess.started) == 1:
            os.kill(os.getpid(), self.signum)

    def is_alive(self):
        return self._alive

    def kill(self):
        _FakeProcess.killed.append(self.name)
        self._alive, self.exitcode = False, -signal.SIGKILL

    def join(self, timeout=None):
        pass


def _spec(rank: int, addr: str, tmp_path):
    return SimpleNamespace(
        rank=rank, world_size=2, coord_addr=addr, card=SimpleNamespace(name=f"cpu{rank}", kind="cpu"),
        stage=SimpleNamespace(label=f"{rank}-{rank + 1}"), layout=SimpleNamespace(where=lambda r: f"stage {r}"),
        runtime=SimpleNamespace(threads=1, transport="shm"), inbox=(None, None),
        boundary_mode=lambda b: "shm")


def _coordinator(tmp_path) -> Coordinator:
    addr = f"ipc://{tmp_path}/coord.sock"
    return Coordinator([_spec(r, addr, tmp_path) for r in range(2)], run_dir=str(tmp_path), ipc_dir=str(tmp_path / "ipc"),
                       job_id="sigspawntest", token="t", heartbeat_timeout_s=1.0, startup_timeout_s=1.0, steps=4,
                       start_step=0, ckpt_root=str(tmp_path / "ck"), ckpt_keep=1, manifest_base={},
                       save_on_interrupt=True, reporter=None, coord_addr=addr)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_a_card_start_stops_the_job(tmp_path, monkeypatch, signum):
    _FakeProcess.started, _FakeProcess.killed = [], []
    ctx = SimpleNamespace(Process=lambda **kw: _FakeProcess(**kw, signum=signum))
    monkeypatch.setattr(coord_mod, "mp", SimpleNamespace(get_context=lambda method: ctx))
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    c = _coordinator(tmp_path)
    with pytest.raises(Interrupted) as got:
        c.run()
    assert got.value.signum == signum and c.interrupted == 1
    # the signal came inside start(), which ran with the card's signals blocked (inherited by a real card)
    assert set(Coordinator.SPAWN_BLOCKED) <= _FakeProcess.started[0].mask_in_start
    # acted on at once: the second card never started, the first was stopped by the teardown
    assert [p.name for p in _FakeProcess.started] == ["npu-train-cpu0"] and _FakeProcess.killed == ["npu-train-cpu0"]
    assert not os.path.exists(tmp_path / "job.json")
    # the launcher's mask and handlers are as before
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
    assert {s: signal.getsignal(s) for s in before} == before


def test_the_card_unblocks_what_the_launcher_blocks():
    from npu_train.runtime.worker import CARD_SIGNALS

    assert set(CARD_SIGNALS) == set(Coordinator.SPAWN_BLOCKED)
