"""The ``torch.distributed.pipelining`` side of ``pipeline.py``: one worker process per rank.

``pipeline.py`` starts P of these per torch run (``pipeline.py --torch-worker <cfg.json> --rank <r>``,
from ``run_torch``); each pins itself to its core before ``import torch`` (:func:`worker_main`),
trains as the module docstring of ``pipeline.py`` describes (``PipelineStage`` around the
project's ``StageModule``, the project's step: summed token loss / target tokens, tied gradient
all-reduce, grad-norm clip, LR warm-up + cosine, fused AdamW) and writes ``<out_dir>/rank<r>.json``
(``step_s``, ``loss``, ``phases`` per step, or ``error`` and ``traceback``).

Also the schedule families and training constants both sides use.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

SINGLE = ("1F1B", "GPipe")
LOOPED = ("Interleaved1F1B", "InterleavedZeroBubble")
VSHAPE = ("ZBVZeroBubble", "DualPipeV")
LR, BETAS, EPS, CLIP, WARMUP, MIN_LR_RATIO, SEED = 1e-4, (0.9, 0.95), 1e-8, 1.0, 2, 0.1, 1234


def torch_refusal(kind: str, P: int, M: int) -> str | None:
    """Why torch's ``Schedule<kind>`` refuses M micro-batches on P ranks (its constructor raises
    ``ValueError`` on every rank, so a run could only fail), or None when it accepts them.

    The conditions are those of the schedules' ``__init__`` in ``torch/distributed/pipelining/schedules.py``
    (torch 2.13), for the stage layouts of this benchmark (:data:`SINGLE`: P stages, one per rank;
    :data:`LOOPED` and :data:`VSHAPE`: 2P stages, two per rank):

    - ``Schedule1F1B``: ``n_microbatches < num_stages`` (M < P);
    - ``ScheduleInterleaved1F1B`` / ``ScheduleInterleavedZeroBubble``: rounds = ``max(1, M // P)`` and
      ``M % rounds != 0`` (e.g. M=5 on P=2);
    - ``ScheduleDualPipeV``: ``n_microbatches < num_stages`` (M < 2P).

    ``ScheduleGPipe`` and ``ScheduleZBVZeroBubble`` check nothing about M there. ``tests/unit/
    test_bench_pipeline.py`` checks these rules against the installed torch's constructors.
    """
    why = "torch raises ValueError"
    if kind == "1F1B" and M < P:
        return f"torch Schedule1F1B needs M >= P (M={M} < P={P} stages; {why})"
    if kind in LOOPED:
        rounds = max(1, M // P)
        if M % rounds:
            return (f"torch Schedule{kind} needs M to be a multiple of its rounds max(1, M // P) "
                    f"(M={M}, P={P}: {rounds} rounds; {why})")
    if kind == "DualPipeV" and M < 2 * P:
        return f"torch ScheduleDualPipeV needs M >= 2P stages (M={M} < {2 * P}; {why})"
    return None


def worker_main(argv: list[str]) -> int:
    """``--torch-worker <cfg.json> --rank <r>`` in ``argv``: pin this process to the rank's core
    (``cfg["cores"][r]``, unless ``cfg["pin"]`` is false) before torch and its threads exist (see
    ``_common.pin_self``), then run :func:`torch_worker`; returns its exit status."""
    cfg_path = argv[argv.index("--torch-worker") + 1]
    rank = int(argv[argv.index("--rank") + 1])
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("pin", True):
        os.sched_setaffinity(0, {int(cfg["cores"][rank])})
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    return torch_worker(cfg_path, rank)


def torch_worker(cfg_path: str, rank: int) -> int:
    """One rank of a ``torch.distributed.pipelining`` run; writes ``<out>/rank<r>.json``."""
    cfg = json.load(open(cfg_path))
    out_file = os.path.join(cfg["out_dir"], f"rank{rank}.json")
    res: dict = {"rank": rank, "step_s": [], "loss": []}
    try:
        _torch_train(cfg, rank, res)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-4000:]
    with open(out_file + ".part", "w") as f:
        json.dump(res, f)
    os.replace(out_file + ".part", out_file)
    return 1 if "error" in res else 0


def _torch_train(cfg: dict, rank: int, res: dict) -> None:
    from datetime import timedelta

    if cfg.get("keep_host_memory"):  # pipeline.py --host-memory both: as the project's card processes
        from npu_train.hostmem import keep_freed_memory

        if not keep_freed_memory():
            raise RuntimeError("keep_freed_memory() did not apply (glibc only; MALLOC_* set?)")

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed import pipelining as pp

    from npu_train.data.batches import micro_batch_tensors
    from npu_train.data.packfile import load_packed
    from npu_train.data.sampler import StepSampler
    from npu_train.model.llama import IGNORE_INDEX, StageModule
    from npu_train.model import load_config, load_tensors, resolve_model_path
    from npu_train.optim.lr import lr_at

    torch.set_num_threads(int(cfg["threads"]))
    P, M, kind = int(cfg["P"]), int(cfg["M"]), cfg["schedule"]
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(cfg["pg"], init_method=f"tcp://127.0.0.1:{cfg['port']}", rank=rank, world_size=P,
                            timeout=timedelta(seconds=float(cfg["timeout_s"])))
    small = dist.new_group(backend="gloo") if cfg["pg"] != "gloo" else None  # CPU scalars
    path = resolve_model_path(cfg["model"])
    mcfg = load_config(path)
    layers = [tuple(x) for x in cfg["layers"]]
    ranks = cfg["stage_ranks"]
    S = len(layers)
    mods: dict[int, torch.nn.Module] = {}
    for s in range(S):
        if ranks[s] != rank:
            continue
        a, b = layers[s]
        m = StageModule(mcfg, a, b, has_embed=s == 0, has_head=s == S - 1)
        m.load_named_tensors(load_tensors(path, mcfg, m.param_names()))
        mods[s] = m.to(device)
    tied = bool(mcfg.tie_word_embeddings) and S > 1
    if tied and 0 in mods and S - 1 in mods:  # both ends on this rank (V shape, or P = 1): share it
        mods[S - 1].lm_head.weight = mods[0].model.embed_tokens.weight
    tie_pair = tied and ranks[0] != ranks[S - 1]
    tie_group = dist.new_group([ranks[0], ranks[S - 1]], backend="gloo") if tie_pair else None
    stages = [pp.PipelineStage(mods[s], s, S, device) for s in sorted(mods)]

    n_tok = [1]

    def loss_fn(out, target):  # summed token CE / target tokens of the whole step
        V = out.shape[-1]
        return F.cross_entropy(out.reshape(-1, V).float(), target.reshape(-1), ignore_index=IGNORE_INDEX,
                               reduction="sum") / n_tok[0]

    # compute inside schedule.step (as the project's compute_s): module forwards, the loss, full backwards
    comp = [0.0]

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                comp[0] += time.perf_counter() - t
        return wrapper

    if kind in SINGLE:  # split-backward schedules use other entry points: not timed
        import torch.distributed.pipelining.stage as pp_stage

        pp_stage.stage_backward = timed(pp_stage.stage_backward)
        for m in mods.values():
            m.forward = timed(m.forward)
        loss_fn = timed(loss_fn)
    cls = getattr(pp, "Schedule" + kind)
    sched = cls(stages[0] if kind in SINGLE else stages, n_microbatches=M, loss_fn=loss_fn, scale_grads=False)
    seen, params = set(), []
    for s in sorted(mods):
        for p in mods[s].parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    excl = {id(mods[S - 1].lm_head.weight)} if (tie_pair and S - 1 in mods) else set()
    fused = device.type in ("cpu", "cuda")
    opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, fused=fused)

    data = load_packed(cfg["data_file"])
    sampler = StepSampler(data.train.shape[0], int(cfg["micro_batch"]), M, SEED)
    has_first, has_last = 0 in mods, S - 1 in mods
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in range(int(cfg["steps"])):
        mbs = [micro_batch_tensors(data, i) for i in sampler.micro_batches_for_step(step)]
        x = torch.cat([a for a, _ in mbs]).to(device)
        y = torch.cat([b for _, b in mbs]).to(device)
        n_tok[0] = int((y != IGNORE_INDEX).sum())
        sync()
        t0, c0 = time.perf_counter(), time.process_time()
        comp[0] = 0.0
        opt.zero_grad(set_to_none=True)
        losses: list = []
        kw = {"target": y, "losses": losses} if has_last else {}
        sched.step(*((x,) if has_first else ()), return_outputs=False, **kw)
        t1, c1 = time.perf_counter(), time.process_time()
        if tie_pair and (0 in mods or S - 1 in mods):
            p = mods[0].model.embed_tokens.weight if 0 in mods else mods[S - 1].lm_head.weight
            g = p.grad.detach().float().cpu() if p.grad is not None else torch.zeros(p.shape)
            dist.all_reduce(g, group=tie_group)
            p.grad = g.to(device=device, dtype=p.dtype)
        grads = [p.grad for p in params if p.grad is not None]
        sq = sum(float(g.detach().float().pow(2).sum()) for p, g in zip(params, grads) if id(p) not in excl)
        loss_sum = float(sum(float(l.detach()) for l in losses)) if has_last else 0.0
        red = torch.tensor([sq, loss_sum], dtype=torch.float64)
        t2 = time.perf_counter()
        dist.all_reduce(red, group=small)
        t3, c3 = time.perf_counter(), time.process_time()
        gnorm = float(red[0]) ** 0.5
        coef = min(1.0, CLIP / (gnorm + 1e-6))
        if coef < 1.0:
            torch._foreach_mul_(grads, coef)
        lr = lr_at(step, lr=LR, warmup_steps=WARMUP, total_steps=int(cfg["steps"]), min_lr_ratio=MIN_LR_RATIO)
        for g_ in opt.param_groups:
            g_["lr"] = lr
        opt.step()
        sync()
        t4, c4 = time.perf_counter(), time.process_time()
        res["step_s"].append(t4 - t0)
        # phases (seconds) as the project's metrics.jsonl splits them: the schedule (forward/backward
        # and its waits), tied all-reduce + grad norm, the norm/loss all-reduce (waits for the slower
        # rank), clip + AdamW; CPU seconds of the process (all threads) in the schedule, the collectives
        # (tied + norm + all-reduce) and the optimizer, as the project's metrics.jsonl cpu_phases_s
        res.setdefault("phases", []).append({"schedule_s": t1 - t0, "tied_norm_s": t2 - t1,
                                             "allreduce_s": t3 - t2, "optimizer_s": t4 - t3,
                                             "cpu_phases_s": [c1 - c0, c3 - c1, c4 - c3], "time": time.time(),
                                             "compute_s": comp[0] if kind in SINGLE else None})
        res["loss"].append(float(red[1]))
    dist.barrier(group=small)
    dist.destroy_process_group()
