#!/usr/bin/env bash
# Pod entry point of an npu-train Indexed Job (launch/k8s/render.py): one pod = one node.
#
#   NODE_RANK    = $NODE_RANK, else $JOB_COMPLETION_INDEX (set by Kubernetes in an Indexed Job)
#   needs        MASTER_ADDR, MASTER_PORT (1-65535), NNODES (>= 1), NODE_RANK in [0, NNODES),
#                CARDS_PER_NODE (>= 1)
#   optional     NPT_CARD_KIND (furiosa | cuda | cpu; default furiosa), NPT_CKPT_DIR (default
#                /ckpt/checkpoints), NPT_RUN_ROOT (default /ckpt/runs), POD_IP (runtime.host when
#                NNODES > 1), NPT_LAUNCHER (the launcher command; default
#                "python <repo>/launch/run.py"; tests point it at a stub)
#
# Runs (exec, so the launcher is PID 1 and receives Kubernetes' SIGTERM itself: it finishes the
# current step, saves a checkpoint and exits 143):
#
#   <launcher> backend=<kind>:auto,... (CARDS_PER_NODE entries) train.resume=auto
#              checkpoint.dir=$NPT_CKPT_DIR hydra.run.dir=$NPT_RUN_ROOT/node<rank>/<UTC time>
#              [runtime.host=$POD_IP] "$@"
#
# train.resume=auto resumes from the newest complete checkpoint under checkpoint.dir, or starts
# fresh when there is none; so a replaced pod (backoffLimit, drained node) resumes the whole job
# by itself. Bad environment: one "entrypoint: error: ..." line, exit 2 (the Job's
# podFailurePolicy fails the Job at once on exit 2).
set -euo pipefail

die() { echo "entrypoint: error: $*" >&2; exit 2; }
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

NODE_RANK="${NODE_RANK:-${JOB_COMPLETION_INDEX:-}}"
[[ -n "$NODE_RANK" ]] || die "neither NODE_RANK nor JOB_COMPLETION_INDEX is set: run this script as an Indexed Job pod (completionMode: Indexed) or set NODE_RANK"
[[ -n "${MASTER_ADDR:-}" ]] || die "MASTER_ADDR is not set: set it to node 0's address (<job>-0.<headless service>)"
[[ -n "${MASTER_PORT:-}" ]] || die "MASTER_PORT is not set: set it to a free TCP port on node 0 (e.g. 29500)"
[[ -n "${NNODES:-}" ]] || die "NNODES is not set: set it to the Job's completions (number of pods)"
[[ -n "${CARDS_PER_NODE:-}" ]] || die "CARDS_PER_NODE is not set: set it to the furiosa.ai/rngd cards of this pod"
is_uint "$NNODES" && (( NNODES >= 1 )) || die "NNODES=$NNODES must be a positive integer"
is_uint "$NODE_RANK" && (( NODE_RANK < NNODES )) || die "NODE_RANK=$NODE_RANK must be an integer in [0, NNODES=$NNODES)"
is_uint "$MASTER_PORT" && (( MASTER_PORT >= 1 && MASTER_PORT <= 65535 )) || die "MASTER_PORT=$MASTER_PORT must be a TCP port (1-65535)"
is_uint "$CARDS_PER_NODE" && (( CARDS_PER_NODE >= 1 )) || die "CARDS_PER_NODE=$CARDS_PER_NODE must be a positive integer"
KIND="${NPT_CARD_KIND:-furiosa}"
case "$KIND" in furiosa|cuda|cpu) ;; *) die "NPT_CARD_KIND=$KIND: use furiosa, cuda or cpu";; esac
export NODE_RANK MASTER_ADDR MASTER_PORT NNODES

entry="$KIND"; [[ "$KIND" == cpu ]] || entry="$KIND:auto"
BACKEND="$entry"
for ((i = 1; i < CARDS_PER_NODE; i++)); do BACKEND="$BACKEND,$entry"; done

CKPT_DIR="${NPT_CKPT_DIR:-/ckpt/checkpoints}"
RUN_DIR="${NPT_RUN_ROOT:-/ckpt/runs}/node${NODE_RANK}/$(date -u +%Y%m%d-%H%M%S)"
mkdir -p "$CKPT_DIR"

# for the log only (the launcher resolves train.resume=auto itself): the newest complete checkpoint
latest=""
for d in "$CKPT_DIR"/step_*; do
    [[ -f "$d/manifest.json" ]] && latest="$d"
done
if [[ -n "$latest" ]]; then
    echo "entrypoint: node $NODE_RANK/$NNODES: resuming from $latest (train.resume=auto)"
else
    echo "entrypoint: node $NODE_RANK/$NNODES: no complete checkpoint in $CKPT_DIR, starting fresh (train.resume=auto)"
fi
echo "entrypoint: MASTER_ADDR=$MASTER_ADDR MASTER_PORT=$MASTER_PORT backend=$BACKEND run dir $RUN_DIR"

extra=()
if (( NNODES > 1 )) && [[ -n "${POD_IP:-}" ]]; then extra+=("runtime.host=$POD_IP"); fi

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# shellcheck disable=SC2206  # NPT_LAUNCHER is a command line: word splitting intended
launcher=(${NPT_LAUNCHER:-python "$REPO/launch/run.py"})
exec "${launcher[@]}" "backend=$BACKEND" train.resume=auto "checkpoint.dir=$CKPT_DIR" "hydra.run.dir=$RUN_DIR" \
    "${extra[@]}" "$@"
