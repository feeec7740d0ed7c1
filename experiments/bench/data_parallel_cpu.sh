#!/bin/bash
# dp=2 x pp=2 vs dp=1 x pp=4 on the same 4 CPU cards, same global batch (8 micro-batches of 1 x 64 tokens)
OUT=${OUT:-/tmp/dp_bench}; mkdir -p "$OUT"
# each run starts fresh: a checkpoint.dir holding an earlier run's checkpoints is refused (checkpoint.existing)
rm -rf "$OUT/dp2pp2" "$OUT/dp1pp4"
cd "$(dirname "$0")/../.."
COMMON="model.path=embedded data.seq_len=64 train.micro_batch=1 train.steps=3 data.eval_batches=0 train.warmup_steps=1"
date -u
/usr/bin/time -v .venv/bin/python launch/run.py backend=cpu,cpu,cpu,cpu parallel.dp=2 train.accum=4 $COMMON hydra.run.dir=${OUT:-/tmp/dp_bench}/dp2pp2 > ${OUT:-/tmp/dp_bench}/dp2pp2.log 2>&1
date -u
/usr/bin/time -v .venv/bin/python launch/run.py backend=cpu,cpu,cpu,cpu parallel.dp=1 train.accum=8 $COMMON hydra.run.dir=${OUT:-/tmp/dp_bench}/dp1pp4 > ${OUT:-/tmp/dp_bench}/dp1pp4.log 2>&1
date -u
uptime
