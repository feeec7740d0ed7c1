"""Data-parallel collectives of one stage across its replicas (gloo, host tensors), when ``parallel.dp > 1``:
:func:`allreduce_grads`, and ZeRO-1 (Rajbhandari et al. 2020) by parameter: :func:`zero_owners`,
:func:`broadcast_weights`, :func:`gather_state`. docs/design.md §17.
"""
from __future__ import annotations

import torch


def allreduce_grads(grads: dict, backend, group, bucket_elems: int = 1 << 24) -> None:
    """Sum ``grads`` (``{hf_name: gradient buffer}``, same on every member) over ``group`` in place, in fp32 host
    buckets of at most ``bucket_elems`` elements (64 MiB), one ``all_reduce(SUM)`` each."""
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
    """ZeRO-1 partition ``{name: replica}`` of ``{name: elements}``: greedy largest-first, deterministic."""
    load = [0] * dp
    out = {}
    for n in sorted(numels, key=lambda n: (-int(numels[n]), n)):
        k = min(range(dp), key=lambda i: (load[i], i))
        out[n] = k
        load[k] += int(numels[n])
    return out


def broadcast_weights(params: dict, owners: dict, replica: int, ranks: list, backend, group) -> None:
    """Copy each parameter's compute-dtype weight from its owner to the other replicas (``ranks[k]``: replica k)."""
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
    """Collect the ZeRO-1 optimizer state (``local``: fp32 ``<kind>.<name>`` of owned parameters) on replica 0,
    which returns every parameter's; others return ``{}``."""
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
