"""Data-parallel collectives of one stage across its replicas (gloo, host tensors).

Used by :class:`~npu_train.runtime.trainer.StageTrainer` when ``parallel.dp > 1``; the groups are
those of :class:`~npu_train.runtime.layout.ParallelLayout` (the *stage group*: the ``dp`` ranks
holding the same stage, one per replica).

- :func:`allreduce_grad`: one gradient buffer summed over a group (also the tied embedding's between
  the first and the last stage).
- :func:`allreduce_grads`: the stage's accumulated gradients summed over the stage group (fp32 on
  the host, flat buckets of at most ``bucket_elems`` elements, parameters in sorted-name order, so
  every replica builds the same buckets). After it, every replica holds the gradient of the whole
  global batch (the loss was divided by the global batch's target tokens, so the sum is the mean
  gradient of a single process seeing all of it).
- ZeRO-1 (Rajbhandari et al. 2020, stage 1, partitioned by parameter as
  ``torch.distributed.optim.ZeroRedundancyOptimizer``): :func:`zero_owners` assigns each parameter
  of the stage to one replica (greedy by size, so the shards' element counts are balanced); only the
  owner keeps that parameter's fp32 master and AdamW moments and updates it;
  :func:`broadcast_weights` then sends the updated compute-dtype weights from each owner to the
  other replicas (one flat broadcast per owner); :func:`gather_state` collects the owners'
  master/moment tensors on replica 0 for the checkpoint (which therefore has the same format as
  without ZeRO: one shard per stage, written by replica 0, loadable with any ``dp``).
"""
from __future__ import annotations

import torch


def allreduce_grad(g: torch.Tensor, backend, group) -> None:
    """Sum one gradient buffer ``g`` (any shape; the tied embedding's ``[V, H]``) over ``group``, in place.

    An fp32, contiguous CPU tensor (a ``cpu`` card's gradient) is all-reduced where it lies; any other
    (a device tensor, bf16 ``.grad``) goes through an fp32 host copy (``backend.download``) that is
    all-reduced and copied back (``backend.upload``): for the SmolLM2-135M tied embedding on a ``cpu``
    card that is 2 copies of 113 MB fewer per step (``experiments/2026-11-30-bench.md``). The sum is
    the same either way (the same fp32 values go into the same gloo reduction).
    """
    import torch.distributed as dist

    if g.device.type == "cpu" and g.dtype == torch.float32 and g.is_contiguous():
        dist.all_reduce(g, group=group)
        return
    gh = backend.download(g.detach()).float()
    dist.all_reduce(gh, group=group)
    with torch.no_grad():
        g.copy_(backend.upload(gh.to(g.dtype)))


def allreduce_grads(grads: dict, backend, group, bucket_elems: int = 1 << 24) -> None:
    """Sum the gradient buffers ``grads`` over ``group`` (in place, on the card).

    ``grads``: ``{hf_name: tensor}`` holding each parameter's step gradient (the optimizer's fp32
    accumulator with bf16 compute, else ``.grad``; :meth:`~npu_train.optim.adamw.StageOptimizer.grad_buffer`),
    same names and shapes on every member. Buckets: fp32 host tensors of at most ``bucket_elems`` elements
    (64 MiB by default), one ``all_reduce(SUM)`` each.
    """
    import torch.distributed as dist

    names = sorted(grads)
    buckets, cur, size = [], [], 0
    for n in names:
        k = grads[n].numel()
        if cur and size + k > bucket_elems:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += k
    if cur:
        buckets.append(cur)
    for b in buckets:
        flat = torch.cat([backend.download(grads[n].detach()).float().reshape(-1) for n in b])
        dist.all_reduce(flat, group=group)
        off = 0
        with torch.no_grad():
            for n in b:
                g = grads[n]
                k = g.numel()
                g.copy_(backend.upload(flat[off:off + k].view(g.shape).to(g.dtype)))
                off += k


def zero_owners(numels: dict, dp: int) -> dict:
    """ZeRO-1 partition: ``{name: owning replica}`` for ``{name: element count}`` over ``dp`` replicas.

    Greedy largest-first onto the least-loaded replica (ties: the lower replica; names break size
    ties), deterministic, so every replica computes the same map.
    """
    load = [0] * dp
    out = {}
    for n in sorted(numels, key=lambda n: (-int(numels[n]), n)):
        k = min(range(dp), key=lambda i: (load[i], i))
        out[n] = k
        load[k] += int(numels[n])
    return out


def broadcast_weights(params: dict, owners: dict, replica: int, ranks: list, backend, group) -> None:
    """After the owners' AdamW step: copy each parameter's compute-dtype weight from its owner to
    every other replica of the stage (``ranks[k]`` = global rank of replica k in ``group``)."""
    import torch.distributed as dist

    for o, src in enumerate(ranks):
        names = sorted(n for n in params if owners[n] == o)
        if not names:
            continue
        dtype = params[names[0]].dtype
        total = sum(params[n].numel() for n in names)
        if replica == o:
            flat = torch.cat([backend.download(params[n].detach()).to(dtype).reshape(-1) for n in names])
        else:
            flat = torch.empty(total, dtype=dtype)
        dist.broadcast(flat, src=src, group=group)
        if replica != o:
            off = 0
            with torch.no_grad():
                for n in names:
                    p = params[n]
                    k = p.numel()
                    p.copy_(backend.upload(flat[off:off + k].view(p.shape)))
                    off += k


STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")


def gather_state(local: dict, shapes: dict, owners: dict, replica: int, ranks: list) -> dict:
    """Collect the ZeRO-1 optimizer state of a stage on replica 0 for the checkpoint.

    ``local``: this replica's ``StageOptimizer.state_tensors()`` (fp32 CPU, keys ``<kind>.<name>``
    for the parameters it owns); ``shapes``: ``{name: shape}`` of the stage's parameters. Replica k > 0
    sends its tensors (one flat fp32 buffer) to ``ranks[0]``; replica 0 returns the union over all
    replicas (every parameter of the stage), the others return ``{}``.
    """
    import torch.distributed as dist

    out = dict(local) if replica == 0 else {}
    for o in range(1, len(ranks)):
        names = sorted(n for n in shapes if owners[n] == o)
        if not names or replica not in (0, o):
            continue
        keys = [f"{kind}.{n}" for n in names for kind in STATE_KINDS]
        if replica == o:
            flat = torch.cat([local[k].float().reshape(-1) for k in keys])
            dist.send(flat, dst=ranks[0])
        else:
            numels = [int(torch.Size(shapes[k.split(".", 1)[1]]).numel()) for k in keys]
            flat = torch.empty(sum(numels), dtype=torch.float32)
            dist.recv(flat, src=ranks[o])
            off = 0
            for k, c in zip(keys, numels):
                out[k] = flat[off:off + c].view(shapes[k.split(".", 1)[1]]).clone()
                off += c
    return out
