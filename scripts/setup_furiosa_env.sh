#!/usr/bin/env bash
# Create .venv-furiosa: a separate virtualenv with furiosa-torch 2026.4.0 (which pins
# torch==2.10.0) plus this project installed editable, so that the furiosa contract tests
# can run:
#
#     bash scripts/setup_furiosa_env.sh && .venv-furiosa/bin/pytest -m contract tests/contract
#
# Why a separate venv: the main .venv uses a CPU torch 2.13 wheel; furiosa-torch's compiled
# extension (furiosa/torch/_C.*.so) links against libtorch of exactly torch 2.10.0.
#
# SIZE WARNING (measured on x86_64 Linux, Python 3.11, PyPI only):
#   torch==2.10.0 from PyPI is the CUDA 12.8 build and depends on ~15 nvidia-*-cu12 wheels,
#   triton and cuda-bindings: about 4.0 GB of downloads, about 7.3 GB installed. Took 100 s
#   here with a warm pip cache (the 4 GB download alone took ~30 s on a fast mirror).
#   A CPU-only torch 2.10.0 wheel is not on PyPI (only on the PyTorch wheel index).
#   Installing torch with --no-deps (skipping the nvidia libs) does NOT work: `import torch`
#   then fails with "libcudart.so.12: cannot open shared object file" / "libcublasLt.so.*
#   not found", so furiosa-torch cannot be imported either. The full install is needed
#   unless you point pip at a CPU wheel of torch 2.10.0 yourself:
#       TORCH_SPEC="torch==2.10.0+cpu" PIP_EXTRA_INDEX_URL=<pytorch cpu index> bash scripts/setup_furiosa_env.sh
#   (furiosa-torch itself is ~130 MB installed; furiosa-kernels pulls mypy==2.2.0.)
#
# Options (environment variables):
#   PYTHON=python3.11        interpreter for the venv (furiosa-torch wheels: CPython >= 3.10)
#   VENV=.venv-furiosa       target directory (relative to the repo root, or absolute)
#   FURIOSA_TORCH_VERSION=2026.4.0
#   TORCH_SPEC=torch==2.10.0 what to install for torch (see above)
#   FORCE=1                  delete and recreate the venv even if it already works
#
# Idempotent: if the venv already imports furiosa.torch and npu_train, it only re-installs the
# project (editable, --no-deps) and exits.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

FURIOSA_TORCH_VERSION="${FURIOSA_TORCH_VERSION:-2026.4.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.10.0}"
VENV="${VENV:-.venv-furiosa}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac

pick_python() {
  if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
  for cand in python3.11 python3.12 python3.10 python3.13 python3; do
    if command -v "$cand" >/dev/null 2>&1 \
       && "$cand" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else 1)' 2>/dev/null; then
      echo "$cand"; return
    fi
  done
  echo "setup_furiosa_env.sh: no python >= 3.10 found; set PYTHON=..." >&2
  exit 1
}

# The light runtime deps of npu-train (pyproject [project].dependencies minus torch) and the
# test runner. Installed normally; torch is held at the furiosa-torch pin by a constraint.
LIGHT_DEPS=(
  "hydra-core>=1.3" "omegaconf>=2.3" "pyzmq>=25" "msgpack>=1.0" "safetensors>=0.4"
  "gguf>=0.10" "tokenizers>=0.19" "numpy>=2.2.6" "rich>=13" "tensorboard>=2.15" "psutil>=5.9"
  "pytest>=8" "pytest-timeout>=2.3"
)

# editable install of the project; setuptools' deprecation chatter only shown on failure
install_project() {
  local logf
  logf="$(mktemp)"
  if ! "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT" >"$logf" 2>&1; then
    cat "$logf" >&2; rm -f "$logf"; return 1
  fi
  rm -f "$logf"
}

check_env() {
  "$VENV/bin/python" - <<'EOF' >/dev/null 2>&1
import torch, furiosa.torch, npu_train.backends  # noqa: F401
EOF
}

t0=$(date +%s)

if [[ "${FORCE:-0}" == "1" && -d "$VENV" ]]; then
  echo "[setup_furiosa_env] FORCE=1: removing $VENV"
  rm -rf "$VENV"
fi

if [[ -x "$VENV/bin/python" ]] && check_env; then
  echo "[setup_furiosa_env] $VENV already has furiosa-torch; refreshing the editable install only"
  install_project
  exit 0
fi

PY="$(pick_python)"
echo "[setup_furiosa_env] creating $VENV with $PY ($("$PY" -V 2>&1))"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip

CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
# torch is pinned by furiosa-torch; keep every later install from moving it.
echo "${TORCH_SPEC}" > "$CONSTRAINTS"

echo "[setup_furiosa_env] installing ${TORCH_SPEC} + furiosa-torch==${FURIOSA_TORCH_VERSION}" \
     "(PyPI torch 2.10.0 is the CUDA build: ~4 GB download, ~7.3 GB on disk)"
"${PIP[@]}" install -c "$CONSTRAINTS" "${TORCH_SPEC}" "furiosa-torch==${FURIOSA_TORCH_VERSION}"

echo "[setup_furiosa_env] installing npu-train (-e ., --no-deps) and its light deps"
"${PIP[@]}" install -q -c "$CONSTRAINTS" "${LIGHT_DEPS[@]}"
install_project

echo "[setup_furiosa_env] checking imports"
"$VENV/bin/python" - <<'EOF'
import torch
import furiosa.torch as ft
import npu_train.backends as nb
print(f"torch {torch.__version__}; furiosa-torch {ft.version().splitlines()[0] if ft.version() else '?'}")
print(f"npu_train.backends from {nb.__file__}")
EOF

t1=$(date +%s)
echo "[setup_furiosa_env] done in $((t1 - t0)) s; size: $(du -sh "$VENV" | cut -f1)"
echo "[setup_furiosa_env] run: $VENV/bin/pytest -m contract tests/contract"
