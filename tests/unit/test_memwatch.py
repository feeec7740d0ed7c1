"""tests/memwatch.py sees a child's anonymous memory and tags card processes from job.json."""
import json
import subprocess
import sys
import time

from memwatch import MemWatch


def test_child_peak_and_card_tag(tmp_path):
    n = 200 << 20
    code = f"import time; b = bytearray({n}); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)"
    p = subprocess.Popen([sys.executable, "-c", code])
    (tmp_path / "job.json").write_text(json.dumps({"cards": [{"pid": p.pid, "card": "cpu:0"}]}))
    (tmp_path / "run.log").write_text("step    1/4 | loss 1\n")
    w = MemWatch(p.pid, str(tmp_path), 0.1).start()
    p.wait()
    time.sleep(0.2)
    peaks = w.stop()
    cp = w.card_peaks()["cpu:0"]
    assert cp.anon_shared >= n and cp.hwm >= n, peaks
    assert cp.by_phase.get("after step 1", 0) >= n


def test_load_interval_while_loading_then_interval():
    """``load_interval`` paces the samples while the phase is ``load``, ``interval`` after it."""
    import os

    w = MemWatch(os.getpid(), None, 0.5, load_interval=0.1)
    waits = []

    class Stop:
        def is_set(self):
            return len(waits) >= 4

        def wait(self, s):
            waits.append(s)
            if len(waits) == 2:
                w.set_phase("after step 1")

    w._stop = Stop()
    w._run()
    assert waits == [0.1, 0.1, 0.5, 0.5]
    assert MemWatch(os.getpid(), None, 0.5).load_interval is None
