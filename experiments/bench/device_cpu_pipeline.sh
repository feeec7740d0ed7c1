#!/usr/bin/env bash
# The pipeline benchmark on a quiet many-core host (run on the lent GPU machine's 16 CPU cores, where
# nothing else runs): P=2, M=8, SmolLM2-135M shape with random weights, seq 128, fp32, 1 thread per
# process, every process pinned to its own core. Usage: bash experiments/bench/device_cpu_pipeline.sh OUTDIR [ROUNDS]
set -euo pipefail
out=${1:?out dir}; rounds=${2:-2}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:$PWD/src
python3 experiments/bench/make_random_model.py --out /tmp/smol
python3 experiments/bench/pipeline.py --model /tmp/smol --P 2 --M 8 --rounds "$rounds" --steps 3 --seq-len 128 \
  --project-schedules 1f1b zb zb-h1 --torch-schedules 1F1B --splits even project \
  --json "$out/bench-pipeline-p2m8.json" 2>&1 | tee "$out/bench-pipeline-p2m8.txt"
