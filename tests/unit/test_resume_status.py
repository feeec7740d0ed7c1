"""``launch/run.py::mark_resumed``: after a resumed launch completes in another run directory, the
``status.json`` of the launch it continued says ``resumed`` and where, keeping every field it had; a file this
launcher did not write, a finished run and the same directory are left alone."""
from __future__ import annotations

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launcher():
    spec = importlib.util.spec_from_file_location("npt_launch_run_resumed", os.path.join(ROOT, "launch", "run.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(d, rec) -> str:
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, "status.json")
    with open(path, "w") as f:
        json.dump(rec, f)
    return path


def test_an_interrupted_launch_is_marked_resumed_with_its_fields_kept(tmp_path):
    run = _launcher()
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    rec = {"exit_code": 143, "status": "interrupted", "error": "interrupted by SIGTERM",
           "checkpoint": f"{a}/checkpoints/step_000002", "resume": "python launch/run.py ...",
           "overrides": ["train.steps=4"], "started": 1.0, "finished": 2.0, "pid": 7, "note_by_user": "keep"}
    path = _write(a, rec)
    assert run.mark_resumed(a, b, rec["checkpoint"], 2) == path
    with open(path) as f:
        got = json.load(f)
    assert got["status"] == "resumed" and got["status_before"] == "interrupted"
    assert got["resumed_in"] == b and got["resumed_from"] == rec["checkpoint"] and got["resumed_at_step"] == 2
    assert got["resumed_finished"] > 2.0
    assert {k: got[k] for k in rec if k != "status"} == {k: v for k, v in rec.items() if k != "status"}
    assert not os.path.exists(path + ".part")
    # resumed again later (its second resume): the first status stays in status_before
    assert run.mark_resumed(a, str(tmp_path / "c"), rec["checkpoint"], 2) == path
    with open(path) as f:
        again = json.load(f)
    assert again["status_before"] == "interrupted" and again["resumed_in"] == str(tmp_path / "c")


def test_what_is_not_a_continuable_launch_record_is_left_alone(tmp_path):
    run = _launcher()
    b = str(tmp_path / "b")
    cases = {"user": {"status": "interrupted"},  # no exit_code: not this launcher's record
             "done": {"exit_code": 0, "status": "ok"},  # a finished run
             "bad": None}
    for name, rec in cases.items():
        d = str(tmp_path / name)
        if rec is None:
            os.makedirs(d)
            with open(os.path.join(d, "status.json"), "w") as f:
                f.write("{not json")
        else:
            _write(d, rec)
        with open(os.path.join(d, "status.json")) as f:
            text = f.read()
        assert run.mark_resumed(d, b, "ck", 1) is None, name
        with open(os.path.join(d, "status.json")) as f:
            assert f.read() == text, name
    same = str(tmp_path / "same")
    path = _write(same, {"exit_code": 130, "status": "interrupted"})
    assert run.mark_resumed(same, same, "ck", 1) is None  # resumed in place: its records moved to previous-<k>
    with open(path) as f:
        assert json.load(f)["status"] == "interrupted"
    assert run.mark_resumed(str(tmp_path / "missing"), b, "ck", 1) is None


def test_the_launch_that_wrote_a_checkpoint_is_found(tmp_path):
    """The manifest's ``run_dir``; an older checkpoint without it: the default root's parent with a status."""
    from npu_train.runtime.job import saved_by_run_dir

    assert saved_by_run_dir({"run_dir": "/runs/a"}, str(tmp_path / "x" / "checkpoints")) == "/runs/a"
    a = tmp_path / "a"
    assert saved_by_run_dir({}, str(a / "checkpoints")) is None  # no status.json there
    _write(str(a), {"exit_code": 0, "status": "ok"})
    assert saved_by_run_dir({}, str(a / "checkpoints")) == str(a)
    assert saved_by_run_dir({}, str(tmp_path / "ckpt")) is None  # a checkpoint.dir of the user's
