#!/usr/bin/env python
"""Render the Kubernetes manifests of one npu-train job: one pod per node, an Indexed Job.

    python launch/k8s/render.py --nodes 4 --cards-per-node 2 --image registry/npu-train:0.1 \\
        --model /models/llama-3.1-8b --data /data/corpus --ckpt-pvc npt-ckpt --model-pvc npt-models \\
        --hidden 4096 -- train.steps=2000 train.lr=3e-5 > job.yaml
    kubectl apply -f job.yaml

Objects (one YAML stream):

- a headless ``Service`` (``clusterIP: None``, ``publishNotReadyAddresses``) named like the job:
  it gives every pod of the Indexed Job the stable DNS name ``<job>-<index>.<job>.<namespace>.svc``; node 0's
  name is ``MASTER_ADDR`` (the torch.distributed / gloo rendezvous host), ``MASTER_PORT`` its port;
- a ``batch/v1`` ``Job`` with ``completionMode: Indexed``, ``completions = parallelism = nodes``:
  pod *i* is node *i* (``JOB_COMPLETION_INDEX`` -> ``NODE_RANK`` in ``entrypoint.sh``). Each pod
  requests its RNGD cards through the device-plugin resource ``furiosa.ai/rngd`` (one per card),
  mounts ``/dev/shm`` as a memory-backed ``emptyDir`` (size below), the checkpoint PVC at
  ``/ckpt`` (ReadWriteMany for more than one node: every node writes its stages' shards into one
  root), an optional read-only model PVC at ``/models`` and a compiler-cache volume (PVC or
  emptyDir) at ``--cache-path`` (furiosa's compiled-graph cache) and ``/cache/npu-train``
  (``NPT_CACHE``: packed data, dequantized GGUF tensors).

Restarts: ``restartPolicy: Never`` with ``backoffLimit``; a failed pod is replaced with the same
index and the entry script passes ``train.resume=auto``, so the job resumes from the newest
complete checkpoint (a lost node costs at most ``train.save_every`` steps). Exit status 2 (bad
input) fails the Job at once (``podFailurePolicy``): retrying cannot fix it.

``/dev/shm`` size (bytes), from the slot rings of the stage boundaries inside one node (the
launcher's pre-spawn check in ``runtime/job.py`` uses the same formula for one node)::

    2 x (C - 1) x slots x (micro_batch x seq_len x hidden x bytes_per_element + 64) + margin

with C = cards (stages) on the node, so C - 1 stage boundaries inside it (the boundary to the
next node goes over TCP), 2 rings per boundary (activations forward, gradients backward),
``slots = min(accum, P) + 1`` (the launcher's default ring depth, P = nodes x C stages in all),
64 bytes of slot header, bytes_per_element = 2 (bf16, accelerator default) or 4 (fp32), and a
margin of 256 MiB (torch / gloo / ZeroMQ scratch in ``/dev/shm``). The emptyDir counts against
the pod's memory.

``terminationGracePeriodSeconds`` covers checkpoint-on-SIGTERM: on ``kubectl delete`` / a node
drain the launcher (PID 1 through ``exec``) finishes the current step, saves a checkpoint and
exits 143, so the grace period is ``max_step_s + save_s + 60`` seconds (60 s for tear-down).
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Optional

import yaml

MIB = 2 ** 20
SHM_MARGIN_BYTES = 256 * MIB
SLOT_HEADER_BYTES = 64
RNGD_RESOURCE = "furiosa.ai/rngd"
CKPT_MOUNT = "/ckpt"
MODEL_MOUNT = "/models"
NPT_CACHE_MOUNT = "/cache/npu-train"
DEFAULT_COMPILER_CACHE = "/root/.cache/furiosa/compiler"
ENTRYPOINT = "/opt/npu-train/launch/k8s/entrypoint.sh"


def shm_bytes(cards_per_node: int, nodes: int, accum: int, micro_batch: int, seq_len: int, hidden: int,
              bytes_per_element: int = 2, slots: Optional[int] = None) -> int:
    """Bytes of ``/dev/shm`` one node needs for its slot rings, plus :data:`SHM_MARGIN_BYTES`.

    Formula (module docstring): ``2 x (C-1) x slots x (b x S x H x e + 64) + margin`` with
    ``slots = min(accum, P) + 1`` and ``P = nodes x C`` unless ``slots`` is given.
    """
    stages = nodes * cards_per_node
    slots = slots or (min(accum, stages) + 1)
    slot = micro_batch * seq_len * hidden * bytes_per_element + SLOT_HEADER_BYTES
    return 2 * max(0, cards_per_node - 1) * slots * slot + SHM_MARGIN_BYTES


def quantity_mi(n_bytes: int) -> str:
    """A Kubernetes quantity in Mi, rounded up: ``"312Mi"``."""
    return f"{math.ceil(n_bytes / MIB)}Mi"


def grace_seconds(max_step_s: float, save_s: float) -> int:
    """``terminationGracePeriodSeconds``: one step to finish + one checkpoint save + 60 s tear-down."""
    return int(math.ceil(max_step_s + save_s + 60))


def render(a: argparse.Namespace) -> list[dict]:
    """The manifests (Service, Job) as dicts for the parsed command line ``a``."""
    name = a.name
    labels = {"app.kubernetes.io/name": "npu-train", "app.kubernetes.io/instance": name}
    shm = shm_bytes(a.cards_per_node, a.nodes, a.accum, a.micro_batch, a.seq_len, a.hidden, a.bytes_per_element,
                    a.slots)
    service = {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"job-name": name},
                 "ports": [{"name": "rendezvous", "port": a.port, "targetPort": a.port, "protocol": "TCP"}]},
    }
    if a.namespace:
        service["metadata"]["namespace"] = a.namespace
    env = [
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # node 0's stable DNS name through the headless Service: <job>-0.<service>.<namespace>.svc
        {"name": "MASTER_ADDR", "value": f"{name}-0.{name}.$(POD_NAMESPACE).svc"},
        {"name": "MASTER_PORT", "value": str(a.port)},
        {"name": "NNODES", "value": str(a.nodes)},
        {"name": "CARDS_PER_NODE", "value": str(a.cards_per_node)},
        {"name": "NPT_CARD_KIND", "value": a.card_kind},
        {"name": "NPT_CKPT_DIR", "value": f"{CKPT_MOUNT}/checkpoints"},
        {"name": "NPT_RUN_ROOT", "value": f"{CKPT_MOUNT}/runs"},
        {"name": "NPT_CACHE", "value": NPT_CACHE_MOUNT},
    ]
    args = [f"model.path={a.model}", f"data.source={a.data}", f"train.save_every={a.save_every}",
            f"train.micro_batch={a.micro_batch}", f"train.accum={a.accum}", f"data.seq_len={a.seq_len}",
            *a.overrides]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"},
              {"name": "checkpoints", "mountPath": CKPT_MOUNT},
              {"name": "cache", "mountPath": a.cache_path, "subPath": "furiosa-compiler"},
              {"name": "cache", "mountPath": NPT_CACHE_MOUNT, "subPath": "npu-train"}]
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": quantity_mi(shm)}},
               {"name": "checkpoints", "persistentVolumeClaim": {"claimName": a.ckpt_pvc}},
               ({"name": "cache", "persistentVolumeClaim": {"claimName": a.cache_pvc}} if a.cache_pvc
                else {"name": "cache", "emptyDir": {}})]
    if a.model_pvc:
        mounts.append({"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True})
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": a.model_pvc, "readOnly": True}})
    resources: dict = {"limits": {}, "requests": {}}
    if a.card_kind == "furiosa":
        resources["limits"][RNGD_RESOURCE] = a.cards_per_node
        resources["requests"][RNGD_RESOURCE] = a.cards_per_node
    if a.cpu:
        resources["requests"]["cpu"] = str(a.cpu)
    if a.memory:
        resources["requests"]["memory"] = a.memory
        resources["limits"]["memory"] = a.memory
    container = {
        "name": "trainer", "image": a.image, "imagePullPolicy": "IfNotPresent",
        "command": [ENTRYPOINT if not a.entrypoint else a.entrypoint], "args": args, "env": env,
        "ports": [{"name": "rendezvous", "containerPort": a.port, "protocol": "TCP"}],
        "resources": {k: v for k, v in resources.items() if v},
        "volumeMounts": mounts,
    }
    job = {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "completionMode": "Indexed", "completions": a.nodes, "parallelism": a.nodes,
            "backoffLimit": a.backoff_limit,
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2]}},
            ]},
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "subdomain": name, "restartPolicy": "Never",
                    "terminationGracePeriodSeconds": grace_seconds(a.max_step_s, a.save_s),
                    "containers": [container], "volumes": volumes,
                },
            },
        },
    }
    if a.namespace:
        job["metadata"]["namespace"] = a.namespace
    return [service, job]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                epilog="Arguments after -- are Hydra overrides passed to launch/run.py.")
    p.add_argument("--name", default="npu-train", help="Job and Service name (DNS label)")
    p.add_argument("--namespace", default=None)
    p.add_argument("--nodes", type=int, required=True, help="pods = nodes (one launcher each)")
    p.add_argument("--cards-per-node", type=int, required=True, help="RNGD cards per pod (furiosa.ai/rngd)")
    p.add_argument("--card-kind", default="furiosa", choices=["furiosa", "cuda", "cpu"],
                   help="backend of every card; only furiosa requests furiosa.ai/rngd")
    p.add_argument("--image", required=True, help="container image with npu-train at /opt/npu-train")
    p.add_argument("--entrypoint", default=None, help=f"entry script in the image (default {ENTRYPOINT})")
    p.add_argument("--model", required=True, help="model.path inside the pod (e.g. /models/<dir> on --model-pvc)")
    p.add_argument("--data", default="botchan", help="data.source inside the pod")
    p.add_argument("--ckpt-pvc", required=True, help="PVC for checkpoints and run dirs (ReadWriteMany if nodes > 1)")
    p.add_argument("--model-pvc", default=None, help="read-only PVC mounted at /models")
    p.add_argument("--cache-pvc", default=None, help="PVC for the compiler/data cache (default: an emptyDir)")
    p.add_argument("--cache-path", default=DEFAULT_COMPILER_CACHE, help="furiosa compiler cache path in the pod")
    p.add_argument("--port", type=int, default=29500, help="MASTER_PORT")
    p.add_argument("--hidden", type=int, default=576, help="model hidden size (for the /dev/shm size)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--slots", type=int, default=None, help="runtime.slots (default min(accum, P) + 1)")
    p.add_argument("--bytes-per-element", type=int, default=2, choices=[2, 4], help="2 = bf16, 4 = fp32")
    p.add_argument("--save-every", type=int, default=100, help="train.save_every (steps lost at most on a restart)")
    p.add_argument("--max-step-s", type=float, default=120.0, help="longest optimizer step, seconds")
    p.add_argument("--save-s", type=float, default=300.0, help="time to save one checkpoint, seconds")
    p.add_argument("--backoff-limit", type=int, default=None, help="pod restarts before the Job fails (default 3 x nodes)")
    p.add_argument("--cpu", default=None, help="CPU request per pod (e.g. 16)")
    p.add_argument("--memory", default=None, help="memory request = limit per pod (e.g. 256Gi; include /dev/shm)")
    p.add_argument("overrides", nargs="*", help="Hydra overrides for launch/run.py (after --)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    a = parser().parse_args(argv)
    if a.nodes < 1 or a.cards_per_node < 1:
        print("error: --nodes and --cards-per-node must be >= 1", file=sys.stderr)
        return 2
    if a.backoff_limit is None:
        a.backoff_limit = 3 * a.nodes
    sys.stdout.write(yaml.safe_dump_all(render(a), sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
