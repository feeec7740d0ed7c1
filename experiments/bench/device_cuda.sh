#!/usr/bin/env bash
# The CUDA checks of issue 9 in one prepared run on the lent NVIDIA machine (one H200, 16 cores; its
# python3 has torch 2.11 + CUDA; the project's missing wheels travel in .whl/, made here by
# experiments/bench/device_wheels.sh). Sized for the 15-minute device budget: ~6 min expected, each phase
# under its own `timeout` (150 + 360 s at most, inside the call's timeout_s=560), so a slow phase still
# leaves the others' results in $OUT (offload.json is rewritten after every round).
#
#   1. the CUDA backend's equivalence tests (tests/integration/test_cuda_equivalence.py and the CUDA
#      cases of tests/unit/test_backends.py: losses and fp32 masters against the single-process
#      reference, record experiments/2026-11-30-cuda-equivalence.md);
#   2. the offload target "offloaded step <= 1.05x all-resident": experiments/bench/offload_timeline.py,
#      modes `on` (every decoder layer offloaded, host AdamW overlapped) and `resident`, interleaved over
#      ROUNDS rounds, one card (backend=[cuda:0]), a random SmolLM2-135M-shaped model, bf16, seq 512,
#      micro-batch 4 x accumulation 8, 8 host threads; prints the median of the per-round ratios;
#   3. (PHASES=pipeline, a call of its own: it does not fit beside 1 and 2 in one 600-s command) the pipeline
#      benchmark at P = 1, M = 8 against torch.distributed.pipelining on the GPU.
#   4. (PHASES=cpu-pipeline, a call of its own) issue 27's bar on this machine's CPUs, a quieter 16-core host
#      than the 2-vCPU VM of experiments/2026-12-04-cpu-heap.md: the default schedule (`auto`) on 2 cpu cards
#      against torch's Schedule1F1B with the even split, S=256, M=8, one thread each, interleaved rounds until
#      CPU_BENCH_S seconds are spent ($OUT/cpu-pipeline.json is rewritten after every run). The model is a
#      random SmolLM2-135M-shaped one (the embedded GGUF, 94 MB, is over the 64-MiB carry limit): the same
#      matrices, so the same work per step; the loss is not the embedded model's.
#
# From the session (device tool):  run(command="bash experiments/bench/device_cuda.sh", carry=[".whl"], timeout_s=560)
#   then, if device time is left:  run(command="PHASES=pipeline bash experiments/bench/device_cuda.sh", carry=[".whl"], timeout_s=400)
#   issue 27's bar on the host CPUs:  run(command="PHASES=cpu-pipeline bash experiments/bench/device_cuda.sh", carry=[".whl"], timeout_s=560)
# Results: $OUT/equivalence.txt, $OUT/offload.txt, $OUT/offload.json, $OUT/offload.png, ($OUT/pipeline.*).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/device-out}; mkdir -p "$OUT"
ROUNDS=${ROUNDS:-3}
PHASES=${PHASES:-equivalence offload}
# a smoke run of this script's plumbing on a CPU machine: DEVICE=cpu MODEL_PRESET=... SHAPE="data.seq_len=32 ..."
DEVICE=${DEVICE:-cuda}; MODEL_PRESET=${MODEL_PRESET:-smollm2-135m}
SHAPE=${SHAPE:-data.seq_len=512 train.micro_batch=4 train.accum=8 train.dtype=bf16}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())"
  git log -1 --format='code %h %s' 2>/dev/null | cut -c1-100; } 2>&1 | tee "$OUT/machine.txt"

has() { case " $PHASES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
if has equivalence; then
echo "== 1. CUDA equivalence =="
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/integration/test_cuda_equivalence.py \
  tests/unit/test_backends.py -k "cuda or Cuda or CUDA" 2>&1 | tee "$OUT/equivalence.txt" | tail -15
fi

if has offload || has pipeline || has cpu-pipeline; then
  [ -f /tmp/smol/config.json ] || python3 experiments/bench/make_random_model.py --preset "$MODEL_PRESET" --out /tmp/smol \
    >/dev/null || { echo "make_random_model.py failed"; exit 1; }
fi
if has offload; then
echo "== 2. offloaded vs all-resident (${ROUNDS} rounds) =="
# shellcheck disable=SC2086  # SHAPE is a list of overrides
timeout 360 python3 experiments/bench/offload_timeline.py --device "$DEVICE" --modes on resident --rounds "$ROUNDS" \
  --steps 6 --threads 8 --timeout 150 --plot "$OUT/offload.png" --json "$OUT/offload.json" -- \
  model.path=/tmp/smol $SHAPE checkpoint.save=false \
  2>&1 | tee "$OUT/offload.txt" | grep -v '^  ' | tail -25
fi

if has pipeline; then
  echo "== 3. pipeline P=1 M=8 vs torch.distributed.pipelining =="
  timeout 360 python3 experiments/bench/pipeline.py --device cuda --model /tmp/smol --P 1 --M 8 --rounds 3 --steps 4 \
    --seq-len 512 --project-schedules 1f1b --torch-schedules 1F1B --splits even --no-pin \
    --json "$OUT/pipeline.json" 2>&1 | tee "$OUT/pipeline.txt" | tail -20
fi

if has cpu-pipeline; then
  echo "== 4. cpu cards: default schedule vs torch Schedule1F1B even (P=2, S=${CPU_SEQ:-256}, M=8, 1 thread) =="
  lscpu 2>/dev/null | grep -E "^(Model name|Thread|Core|Socket|NUMA node\(s\))" | tee -a "$OUT/machine.txt"
  NPT_CACHE=${NPT_CACHE:-/tmp/npt-cache} timeout "${CPU_BENCH_S:-480}" python3 experiments/bench/pipeline.py \
    --device cpu --model /tmp/smol --P 2 --M 8 --seq-len "${CPU_SEQ:-256}" --rounds "${CPU_ROUNDS:-6}" \
    --steps "${CPU_STEPS:-4}" --project-schedules auto --torch-schedules 1F1B --splits even \
    --json "$OUT/cpu-pipeline.json" 2>&1 | tee "$OUT/cpu-pipeline.txt" | tail -30
  [ -f "$OUT/cpu-pipeline.json" ] && python3 experiments/bench/pipeline.py --resummarize "$OUT/cpu-pipeline.json" \
    2>&1 | tee "$OUT/cpu-pipeline-summary.txt" | tail -30
fi
