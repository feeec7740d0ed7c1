"""``plan=true`` with a ``data.source`` that is not on this machine: one ``warning:`` line before it plans
(a real run refuses it then; a dry run may be for another machine), as docs/bad-input.md says (issue 40)."""
from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from npu_train.config import Config
from npu_train.runtime import job


class _Planned(Exception):
    pass


def _cfg(source: str):
    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.from_dotlist([f"data.source={source}", "plan=true"]))


def test_missing_source_warns_once_before_the_plan(tmp_path, monkeypatch, capsys):
    missing = tmp_path / "nope.txt"

    def planned(*a, **k):  # the plan starts here: the warning must already be out
        print("PLANNING", file=__import__("sys").stderr)
        raise _Planned

    monkeypatch.setattr(job, "prepare", planned)
    with pytest.raises(_Planned):
        job._dry_run(_cfg(str(missing)), str(tmp_path / "run"))
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "PLANNING" and err[0].startswith("warning: data.source="), err
    # one warning, folded at words within 100 columns (a fresh-clone review saw it as one line of 391)
    assert all(ln.startswith("  ") and len(ln) <= 100 for ln in err[1:-1]) and len(err[0]) <= 100, err
    flat = " ".join(ln.strip() for ln in err[:-1])
    assert str(missing) in flat, err
    assert "no such file" in flat and "a real run here refuses it" in flat, err


def test_source_found_gives_no_warning(tmp_path):
    f = tmp_path / "mine.txt"
    f.write_text("some text\n")
    assert job.dry_run_data_warning(_cfg(str(f))) is None
