#!/usr/bin/env bash
# Fill .whl/ (git-ignored through .git/info/exclude) with the Python 3.12 x86-64 wheels that the lent
# NVIDIA machine's image lacks (its python3 has torch 2.11 + cu130, numpy, safetensors, tokenizers,
# msgpack, psutil, rich, tensorboard, transformers, pytest; not these). Run it HERE, then
# experiments/bench/device_cuda.sh THERE with carry=[".whl"] (record: experiments/rngd-runbook.md is
# for RNGD; the CUDA steps: experiments/bench/README.md, "On the lent GPU machine").
#   bash experiments/bench/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude)  # also in a worktree, where .git is a file
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
mkdir -p .whl
PY=${PYTHON:-python3}
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
# the versions the CPU venv of scripts/setup.sh resolves today (antlr4 4.9.3 is omegaconf 2.3's pin)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
  -d .whl hydra-core==1.3.8 omegaconf==2.3.1 pyzmq==27.3.0 gguf==0.19.0 hydra-joblib-launcher==1.2.0
# antlr4-python3-runtime 4.9.3 is a source distribution only: build its (pure-Python) wheel here
"$PY" -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
for w in hydra_core-1.3.8 omegaconf-2.3.1 pyzmq-27.3.0 gguf-0.19.0 hydra_joblib_launcher-1.2.0 antlr4_python3_runtime-4.9.3; do
  ls .whl/"$w"-*.whl >/dev/null 2>&1 || { echo "device_wheels: $w is missing from .whl/" >&2; exit 1; }
done
ls -la .whl
du -sh .whl
