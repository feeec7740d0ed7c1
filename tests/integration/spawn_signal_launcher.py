"""``launch/run.py`` (its arguments as given) in which starting the first card process sends SIGINT to the launcher
from inside ``Process.start()``, after the child exists: the window in which the coordinator used to ignore
SIGINT (tests/integration/test_signal_during_spawn_launch.py). Each card process started is recorded in
``$NPT_TEST_SPAWN_LOG`` as a JSON line ``{"pid", "job_id"}``."""
import json
import multiprocessing.context as mpc
import os
import runpy
import signal
import sys

LAUNCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "launch", "run.py")
_start = mpc.SpawnProcess.start


def _start_and_signal(self):
    if not self.name.startswith("npu-train-"):  # the card processes only
        return _start(self)
    job_id = self._args[0].job_id  # (start() drops its arguments)
    _start(self)
    with open(os.environ["NPT_TEST_SPAWN_LOG"], "a") as f:
        f.write(json.dumps({"pid": self.pid, "job_id": job_id}) + "\n")
    with open(os.environ["NPT_TEST_SPAWN_LOG"]) as f:
        if len(f.readlines()) == 1:
            os.kill(os.getpid(), signal.SIGINT)


mpc.SpawnProcess.start = _start_and_signal
sys.argv = [os.path.abspath(LAUNCH), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
