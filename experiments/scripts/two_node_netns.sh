#!/usr/bin/env bash
# Two "nodes" on one machine (issue 10): two launchers in two network namespaces joined by a veth
# pair (10.77.0.1/24, 10.77.0.2/24 -- only inside the namespaces made here), node 0 with one CPU
# card, node 1 with two; plus the same job on one node with three cards, for comparison.
# Same setup as tests/integration/test_multinode.py. Needs root and iproute2.
# Usage: experiments/scripts/two_node_netns.sh <tiny model dir> <output dir>
set -euo pipefail
MODEL=$1; OUT=$2
REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY=${PY:-/work/main/.venv/bin/python}
TAG=$$; NS0=npt-rec0-$TAG; NS1=npt-rec1-$TAG; VA=nptrec${TAG}a; VB=nptrec${TAG}b
BASE=(data.seq_len=32 train.micro_batch=2 train.accum=4 train.lr=1e-3 train.warmup_steps=1
      train.clip=0.5 train.dtype=fp32 train.weight_decay=0.01 runtime.heartbeat_timeout_s=20
      runtime.startup_timeout_s=120 runtime.threads=1 train.steps=4 model.path=$MODEL)
mkdir -p "$OUT"
# fresh runs: a checkpoint.dir holding an earlier run's checkpoints is refused (checkpoint.existing)
rm -rf "$OUT/single" "$OUT/node0" "$OUT/node1" "$OUT/shared_ckpt"

cleanup() { ip netns del "$NS0" 2>/dev/null || true; ip netns del "$NS1" 2>/dev/null || true; }
trap cleanup EXIT
ip netns add "$NS0"; ip netns add "$NS1"
ip link add "$VA" type veth peer name "$VB"
ip link set "$VA" netns "$NS0"; ip link set "$VB" netns "$NS1"
ip -n "$NS0" addr add 10.77.0.1/24 dev "$VA"; ip -n "$NS1" addr add 10.77.0.2/24 dev "$VB"
for n in "$NS0:$VA" "$NS1:$VB"; do
  ip -n "${n%%:*}" link set "${n##*:}" up; ip -n "${n%%:*}" link set lo up
done

cd "$REPO"
# reference: one node, three cards
timeout 300 "$PY" launch/run.py backend=cpu,cpu,cpu "${BASE[@]}" checkpoint.dir="$OUT/single/checkpoints" hydra.run.dir="$OUT/single" \
    > "$OUT/single.out" 2> "$OUT/single.err" || rcs=$?
echo "single node exit ${rcs:-0}"

# two nodes; node 1 finds its rank through JOB_COMPLETION_INDEX (the Indexed-Job fallback) as in the test
# both nodes write into ONE checkpoint.dir (without it the final checkpoint fails, see the record)
COMMON=(NNODES=2 MASTER_ADDR=10.77.0.1 MASTER_PORT=29531)
BASE+=(checkpoint.dir=$OUT/shared_ckpt)
ip netns exec "$NS0" env "${COMMON[@]}" NODE_RANK=0 timeout 300 "$PY" launch/run.py backend=cpu \
    "${BASE[@]}" hydra.run.dir="$OUT/node0" > "$OUT/node0.out" 2> "$OUT/node0.err" & P0=$!
ip netns exec "$NS1" env "${COMMON[@]}" JOB_COMPLETION_INDEX=1 timeout 300 "$PY" launch/run.py backend=cpu,cpu \
    "${BASE[@]}" hydra.run.dir="$OUT/node1" > "$OUT/node1.out" 2> "$OUT/node1.err" & P1=$!
rc0=0; rc1=0; wait $P0 || rc0=$?; wait $P1 || rc1=$?
echo "node 0 exit $rc0, node 1 exit $rc1"
# /dev/shm is shared by all helpers on this machine: look only for this script's job ids
for d in single node0 node1; do
  id=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["job_id"])' "$OUT/$d/job.json")
  echo "$d: job $id, /dev/shm/npt_${id}_* left: $(ls /dev/shm | grep -c "^npt_${id}_" || true)"
done
