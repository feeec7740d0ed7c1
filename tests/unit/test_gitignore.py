"""``.gitignore`` against what a user's checkout holds: a virtual environment is a directory or a symlink to one
(``ln -s ~/venvs/npt .venv``); git sees a symlink as a file, which a pattern with a trailing slash (``.venv/``)
never matches, so a fresh-clone review saw a symlinked ``.venv`` listed as untracked. Checked with git itself
(``git check-ignore``) in a scratch repository holding a copy of the project's ``.gitignore``."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from scripts import REPO

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _ignored(repo: str, name: str) -> bool:
    r = subprocess.run(["git", "check-ignore", "-q", name], cwd=repo, capture_output=True, text=True, timeout=60)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode == 0


@pytest.mark.parametrize("name", [".venv", ".venv-furiosa"])
@pytest.mark.parametrize("how", ["directory", "symlink"])
def test_a_virtual_environment_is_ignored_as_a_directory_or_a_symlink(tmp_path, name, how):
    repo = tmp_path / "clone"
    repo.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True, timeout=60)
    shutil.copyfile(os.path.join(REPO, ".gitignore"), repo / ".gitignore")
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    if how == "directory":
        shutil.copytree(tmp_path / "venv", repo / name)
    else:
        os.symlink(tmp_path / "venv", repo / name)
    assert _ignored(str(repo), name), f"{name} ({how}) is not ignored by .gitignore"
    status = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True,
                            timeout=60).stdout
    assert name not in status, status
