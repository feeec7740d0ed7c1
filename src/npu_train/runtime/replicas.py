"""Data-parallel collectives of one stage across its replicas (gloo, host tensors), when ``parallel.dp > 1``:
:func:`allreduce_grads`, and ZeRO-1 (Rajbhandari et al. 2020) by parameter: :func:`zero_owners`,
:func:`broadcast_weights`, :func:`gathered_state_entries`. docs/design.md §17.
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


def _owner_keys(shapes: dict, owners: dict, o: int) -> list[str]:
    """The checkpoint keys of replica ``o``'s parameters, in the order they are sent and written."""
    return [f"{kind}.{n}" for n in sorted(n for n in shapes if owners[n] == o) for kind in STATE_KINDS]


def gathered_state_entries(local: list, shapes: dict, owners: dict, replica: int, ranks: list) -> list:
    """The ZeRO-1 optimizer state for replica 0's shard, streamed: replica 0 returns its own ``local``
    :class:`~npu_train.optim.entry.Entry` list followed by every other replica's parameters, each received
    inside its ``get()`` (fp32, one tensor at a time: the writer holds one); replica ``o > 0`` sends its
    tensors one by one in that order (blocking until replica 0 has read them) and returns ``[]``.
    ``shapes``: ``{name: shape}`` of the stage's parameters; ``ranks``: the stage's global ranks by replica."""
    import torch.distributed as dist

    from npu_train.optim.entry import Entry

    if replica != 0:
        mine = {e.name: e for e in local}
        for k in _owner_keys(shapes, owners, replica):
            dist.send(mine[k].get().float().contiguous(), dst=ranks[0])
        return []

    def receive(shape: tuple, src: int) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32)
        dist.recv(t, src=src)
        return t

    out = list(local)
    for o in range(1, len(ranks)):
        for k in _owner_keys(shapes, owners, o):
            shape = tuple(shapes[k.split(".", 1)[1]])
            out.append(Entry(k, torch.float32, shape, lambda shape=shape, src=ranks[o]: receive(shape, src)))
    return out
