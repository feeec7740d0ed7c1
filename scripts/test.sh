#!/usr/bin/env bash
# Install test dependencies and run the whole suite: fast tests first, then the heavy marker.
set -euo pipefail
cd "$(dirname "$0")/.."
# Ctrl-C: pytest stops after the test that got it and stops what the tests left running (tests/conftest.py); the
# script then stops too (exit 130), instead of going on to the next phase
trap 'echo "test.sh: interrupted (SIGINT): stopped" >&2; exit 130' INT
VENV=${NPT_VENV:-.venv}
# NPT_SETUP=0: use the venv as it is (no pip run)
[ "${NPT_SETUP:-1}" = 0 ] || bash scripts/setup.sh --test
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the heavy tests write real checkpoints (~2 GB each, one test's at a time): say how much room there is
df -h "${TMPDIR:-/tmp}" | awk -v t="${TMPDIR:-/tmp}" 'NR==2 {print "disk: " $4 " free in " t " (a heavy test writes checkpoints of ~2 GB, one test at a time)"}'
# Each phase runs pytest with the same arguments. A phase that selects nothing (pytest's exit 5, e.g. the heavy
# phase under `-k doc_links`) goes on to the next; any other failure stops the script with pytest's code: 1 a test
# failed, 2 interrupted (Ctrl-C: the trap above exits 130), 3 internal error, 4 usage error. If no phase selected
# anything the script exits 5, as pytest does: a mistyped -k or path must not read as a pass.
SELECTED=0
phase() {  # phase TITLE PYTEST_ARGS...
    echo "== $1 =="
    shift
    local rc=0
    "$VENV/bin/python" -m pytest -q "$@" || rc=$?
    case $rc in
        0) SELECTED=1 ;;
        5) ;;
        *) exit "$rc" ;;
    esac
}
phase "fast tests" -m "not heavy and not contract" "$@"
phase "heavy tests (real SmolLM2 model, end-to-end default job, soak)" -m heavy "$@"
phase "furiosa-torch contract tests (skipped without furiosa-torch)" -m contract "$@"
if [ "$SELECTED" = 0 ]; then
    echo "test.sh: no phase selected a test (pytest exit 5 in each): check the -k expression or paths" >&2
    exit 5
fi
