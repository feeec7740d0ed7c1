"""Issue 40, fresh-clone review: refused and plan-only launches each left an ``outputs/<date>/<time>/`` directory;
a refused launch into an earlier run's directory had Hydra rewrite that run's ``.hydra/`` and let log records
(library warnings) into its ``run.log``. A refused launch now leaves no new directory and does not touch an
earlier one; ``plan=true`` writes nothing under ``outputs/`` (with ``hydra.run.dir`` given it keeps its records
there)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from launch_util import BASE, LAUNCH


def _launch(cwd, *args, model=None):
    cmd = [sys.executable, LAUNCH, *( [f"model.path={model}"] if model else []), *args]
    env = {k: v for k, v in os.environ.items() if k != "NPT_FAULT"}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=str(cwd), env=env, timeout=300)


def test_a_refused_launch_and_a_plan_leave_no_outputs_dir(tmp_path, tiny_model):
    r = _launch(tmp_path, "backend=tpu:0")  # refused before any import
    assert r.returncode == 2 and "error:" in r.stderr, r.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)  # no outputs/<date>/<time>/, no outputs/
    r = _launch(tmp_path, "backend=cpu,cpu", *BASE, "plan=true", model=tiny_model)
    assert r.returncode == 0 and "predicted: step" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)
    # an outputs/ that was there stays, with what it held
    (tmp_path / "outputs" / "2026-01-01").mkdir(parents=True)
    r = _launch(tmp_path, "backend=tpu:0")
    assert r.returncode == 2
    assert sorted(os.listdir(tmp_path / "outputs")) == ["2026-01-01"], os.listdir(tmp_path / "outputs")
    # with hydra.run.dir given, plan=true keeps its records there (the user asked for that directory)
    d = tmp_path / "planned"
    r = _launch(tmp_path, "backend=cpu,cpu", *BASE, "plan=true", f"hydra.run.dir={d}", model=tiny_model)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    with open(d / "status.json") as f:
        assert json.load(f)["status"] == "ok"
    assert (d / ".hydra" / "overrides.yaml").is_file() and "predicted: step" in (d / "run.log").read_text()


def test_a_refused_launch_leaves_an_earlier_run_dir_as_it_was(tmp_path):
    """An earlier run's directory (its .hydra/, run.log, status.json): a launch refused there changes no byte
    and adds no file."""
    d = tmp_path / "earlier"
    (d / ".hydra").mkdir(parents=True)
    files = {".hydra/overrides.yaml": "- train.lr=0.001\n", ".hydra/config.yaml": "train: {}\n",
             ".hydra/hydra.yaml": "hydra: {}\n", "run.log": "the earlier run's lines\n",
             "status.json": json.dumps({"exit_code": 0, "status": "ok"})}
    for name, text in files.items():
        (d / name).write_text(text)
    r = _launch(tmp_path, "backend=tpu:0", f"hydra.run.dir={d}")
    assert r.returncode == 2, r.stderr[-2000:]
    now = {os.path.relpath(os.path.join(root, f), d) for root, _, fs in os.walk(d) for f in fs}
    assert now == set(files), now
    for name, text in files.items():
        assert (d / name).read_text() == text, name


def test_log_records_of_a_refused_launch_stay_out_of_the_earlier_log(tmp_path, monkeypatch):
    """The records of Hydra's file logger (a library's warning) go through the held log: dropped when the launch
    is refused, written after the earlier lines once it is accepted."""
    import logging

    from scripts import LAUNCH_RUN, load_script

    run = load_script(LAUNCH_RUN, "npt_launch_run_records")
    root = logging.getLogger()
    for accepted in (False, True):
        path = tmp_path / f"run{int(accepted)}.log"
        path.write_text("earlier\n")
        h = logging.FileHandler(str(path))
        h.setFormatter(logging.Formatter("%(message)s"))
        monkeypatch.setattr(root, "handlers", [h])
        held = run.hold_if_reused(open(path, "a", buffering=1))
        logging.getLogger("some.library").warning("a library warning")
        print("a line", file=held)
        if accepted:
            from npu_train.metrics.report import launch_accepted

            launch_accepted()
        else:
            from npu_train.metrics.report import LAUNCH_ACCEPTED

            LAUNCH_ACCEPTED.clear()
            held.drop()
        held.close()
        for x in root.handlers:
            x.close()
        want = "earlier\na library warning\na line\n" if accepted else "earlier\n"
        assert path.read_text() == want, (accepted, path.read_text())
