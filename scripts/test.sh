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
echo "== fast tests =="
"$VENV/bin/python" -m pytest -q -m "not heavy and not contract" "$@"
echo "== heavy tests (real SmolLM2 model, end-to-end default job, soak) =="
"$VENV/bin/python" -m pytest -q -m heavy "$@"
echo "== furiosa-torch contract tests (skipped without furiosa-torch) =="
"$VENV/bin/python" -m pytest -q -m contract "$@" || [ $? -eq 5 ]
