"""One training job, from the parsed configuration to the run summary: :func:`run_job`.

Phases over typed objects: :func:`prepare` (:class:`Prepared`) -> data -> :class:`ResumePoint` ->
:class:`LaunchIdentity` -> :func:`build_worker_specs` + Coordinator -> supervise -> finish. Every check
that can reject the job runs before anything is written and raises a UserError naming the fix.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

from npu_train.env import cache_dir, getenv, writable_cache_dir
from npu_train.errors import ConfigError, Interrupted, JobFailed, UserError, console_columns, raise_pending_signal
from npu_train.runtime.saving import (check_checkpoint_dir_writable, end_of_run_line, interrupt_note,
                                      last_checkpoint_note, prepare_checkpoint_root)
from npu_train.runtime.spec import (ReferenceSpec, RuntimeSpec, StageInfo, TrainSpec, WorkerSpec, eval_micro_batches,
                                   eval_note)


def __getattr__(name: str):
    """``Coordinator`` on first use (PEP 562): the coordinator and the transport import torch, which a dry run
    (``plan=true`` with a preset) and a refusal before the start never need."""
    if name == "Coordinator":
        from npu_train.runtime.coordinator import Coordinator

        return Coordinator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _coordinator_class():
    """The coordinator class: a stand-in a test set as ``job.Coordinator``, else the real one."""
    return globals().get("Coordinator") or __getattr__("Coordinator")


def check_port(host: str, port: int) -> None:
    """Raise :class:`ConfigError` if ``port`` on ``host`` is already taken."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise ConfigError(f"runtime.port={port} on {host} is in use ({e.strerror}): "
                              "pick another runtime.port or use runtime.port=0 for a free one") from None


def as_list(v):
    """A Hydra/OmegaConf list value (or a plain one) as a Python list; scalars and None unchanged."""
    if v is None:
        return None
    if isinstance(v, (list, tuple)):
        return list(v)
    try:
        from omegaconf import ListConfig, OmegaConf

        if isinstance(v, ListConfig):
            return list(OmegaConf.to_container(v))
    except ImportError:
        pass
    return v


def card_specs(reqs, cfg, prefix: str = "") -> list:
    """One node's resolved cards (:class:`~npu_train.hardware.Card`): the backend's capacity
    (``placement.capacity_gib`` overrides; CPU cards share the RAM left after the launcher's
    :data:`~npu_train.hardware.LAUNCHER_RESERVE_BYTES`), names after ``prefix`` (multi-node: ``node1/``)."""
    from npu_train.backends.spec import default_capacity
    from npu_train.hardware import LAUNCHER_RESERVE_BYTES

    n_cpu = sum(1 for r in reqs if r.kind == "cpu")
    cards = []
    for r in reqs:
        cap = default_capacity(r.kind)
        if r.kind == "cpu" and n_cpu:
            cap = (cap - LAUNCHER_RESERVE_BYTES) // n_cpu
        if cfg.placement.capacity_gib:
            want = int(cfg.placement.capacity_gib * 2 ** 30)
            if r.kind == "cpu" and want > cap and not cfg.plan:  # cpu cards split this host's RAM
                raise ConfigError(f"placement.capacity_gib={cfg.placement.capacity_gib:g} is more than a cpu card's "
                                  f"share of this host's RAM ({cap / 2 ** 30:.2f} GiB = ({default_capacity('cpu') / 2 ** 30:.1f} GiB "
                                  f"- {LAUNCHER_RESERVE_BYTES / 2 ** 30:.1f} GiB for the launcher) / {n_cpu} cpu card(s)): set it to at most {cap / 2 ** 30:.2f}, or leave it unset")
            cap = want
        name = r.kind if r.kind == "cpu" and n_cpu == 1 else (f"cpu:{len([c for c in cards if c.kind == 'cpu'])}" if r.kind == "cpu" else f"{r.kind}:{r.index}")
        cards.append(replace(r, capacity_bytes=cap, name=prefix + name))
    return cards


@dataclass
class Prepared:
    """What the launcher knows before any card process starts (the result of :func:`prepare`)."""

    cards: list  # Card of every card of the job (node order, then card order)
    requests: list  # this node's resolved card requests
    model_cfg: object  # LlamaConfig
    plan: object  # placement Plan
    shape: object  # RunShape
    dtype: str  # compute dtype: "fp32" or "bf16"
    model_path: Optional[str]  # None for a shape preset (plan=true only)
    threads: int  # torch threads per card process on this node
    node_counts: list  # cards per node
    dp: int  # data-parallel replicas
    zero: int  # ZeRO stage (0 or 1)


def prepare(cfg, run_dir: str, *, probe: bool = True, nodes=None) -> "Prepared":
    """Validate ``cfg`` and build everything needed before a card process starts (:class:`Prepared`).
    Multi-node (``nodes``): the nodes exchange cards, threads and RAM and all plan over every card with the
    smallest thread count, so they get the same plan. Raises UserError on bad input."""
    from npu_train.backends.spec import parse_backend_list, resolve_cards
    from npu_train.config import compute_dtype, validate
    from npu_train.planner import PlacementError, make_plan

    validate(cfg)
    reqs = resolve_cards(parse_backend_list(as_list(cfg.backend)), probe=probe)
    # one thread count for the plan's step time and the card processes (WorkerSpec.runtime.threads)
    threads, elsewhere = _card_threads(cfg, reqs, nodes)
    plan_threads = threads
    try:
        import psutil

        host_ram = psutil.virtual_memory().total
    except Exception:
        host_ram = None
    cards, node_counts, node_ram = card_specs(reqs, cfg), [len(reqs)], [host_ram]
    if nodes is not None:  # every node's cards, in node order (runtime/nodes.py)
        from npu_train.runtime.nodes import exchange_cards

        cards, node_counts, plan_threads, node_ram = exchange_cards(nodes, cards, threads, host_ram)
    dtype = compute_dtype(cfg.train.dtype, [c.kind for c in cards])
    from npu_train.metrics.report import still_saying

    with still_saying("reading the model's header (the torch import, a GGUF's tokenizer vocabulary)"):
        mcfg, model_path = _model_header(cfg)
    check_moe(cfg, mcfg)
    check_vocab(cfg, mcfg)
    with search_heartbeat():
        P, dp, zero = _layout_and_schedule(cfg, run_dir, mcfg, dtype, cards, plan_threads,
                                           None if (cfg.plan or nodes is not None) else host_ram,
                                           multinode=nodes is not None, elsewhere=elsewhere)
        # A dry run plans for the target server, not this machine: its host RAM is not checked then
        # (the table shows the host GiB the offloaded state needs). Multi-node: checked per node below.
        req = plan_request(cfg, mcfg, dtype, cards[:P], threads=plan_threads, dp=dp, zero=zero,
                           host_ram_bytes=None if (cfg.plan or nodes is not None) else host_ram,
                           multinode=nodes is not None, host_cores=P * dp if elsewhere else None,
                           cards_per_host=max(node_counts))
        shape = req.shape
        resumed = None if req.split else _resumed_split(cfg, run_dir, P)
        try:
            plan = make_plan(replace(req, split=req.split or resumed))
        except PlacementError:
            if resumed is None:
                raise
            plan = make_plan(req)  # the checkpoint's split no longer fits
    if not cfg.plan:  # a dry run plans for the target server, not this shell's limits
        check_address_space(plan)
    if any(c.kind == "furiosa" for c in cards):
        plan.compiler_cache_dir = furiosa_cache_dir(cfg)
    if elsewhere:
        plan.host_cores = 0  # not known: the plan table says so instead of naming this machine's
    if nodes is not None:
        from npu_train.runtime.nodes import check_node_host_ram

        check_node_host_ram(plan, node_counts, node_ram)
    return Prepared(cards=cards, requests=reqs, model_cfg=mcfg, plan=plan, shape=shape, dtype=dtype,
                    model_path=model_path, threads=threads, node_counts=node_counts, dp=dp, zero=zero)


def _model_header(cfg) -> tuple:
    """``(model config, absolute model path or None)`` of ``model.path``: a shape preset (plan=true only), an HF
    directory or a GGUF file, whose weights a training launch checks against the config. Raises ConfigError."""
    mcfg, model_path = _preset_config(cfg.model.path), None
    if mcfg is None:
        from npu_train.model import resolve_model_path  # (torch: not for a preset's dry run)

        # absolute: the checkpoints record it (an export or resume from another directory finds the same model)
        model_path = os.path.abspath(resolve_model_path(cfg.model.path))
    elif not cfg.plan:
        raise ConfigError(f"model.path={cfg.model.path} is a shape preset without weights: use it with plan=true, "
                          "or point model.path at an HF directory or a GGUF file")
    if model_path is not None:
        from npu_train.model import check_weights, load_config

        mcfg = load_config(model_path)
        if not cfg.plan:
            check_weights(model_path, mcfg)
    return mcfg, model_path


def check_vocab(cfg, mcfg) -> None:
    """Refuse ``parallel.vocab=true`` where it is not built (ConfigError naming the fix, :func:`vocab_refusal`);
    ``parallel.vocab=auto`` there becomes false."""
    from omegaconf import open_dict

    if not getattr(cfg.parallel, "vocab", False):
        return
    why = vocab_refusal(cfg, mcfg)
    if why is None:
        return
    if cfg.parallel.vocab == "auto":
        with open_dict(cfg):
            cfg.parallel.vocab = False
        return
    raise ConfigError(why)


def vocab_refusal(cfg, mcfg) -> Optional[str]:
    """Why ``parallel.vocab=true`` cannot run ``cfg`` (the message, naming the fix), or None: a tied embedding and
    head (its gradient slices would have to be summed with the embedding's), the DPO objective, the
    mixture-of-experts load-balancing loss, ZeRO-1, and one-slot boundary rings (``simulate`` finds deadlocks)."""
    from npu_train.pipeline.moeaux import aux_loss_weight

    if mcfg.tie_word_embeddings:
        return ("parallel.vocab=true shards an untied output layer over the cards; this model ties its embedding and "
                "head (tie_word_embeddings): use parallel.vocab=false")
    if str(getattr(cfg.train, "objective", "sft")) == "dpo":
        return ("parallel.vocab=true computes the next-token cross-entropy only: use parallel.vocab=false with "
                "train.objective=dpo")
    if mcfg.is_moe and aux_loss_weight(cfg.train.moe_aux_loss, mcfg) > 0:
        return ("parallel.vocab=true does not run with the mixture-of-experts load-balancing loss: use "
                "parallel.vocab=false or train.moe_aux_loss=0")
    if int(cfg.parallel.zero) == 1:
        return "parallel.vocab=true does not combine with parallel.zero=1 yet: use parallel.zero=0"
    if cfg.runtime.slots is not None and int(cfg.runtime.slots) < 2:
        return ("parallel.vocab=true needs runtime.slots >= 2 (with one slot per boundary ring a card can wait for a "
                "slot that frees only after the next joint vocabulary action): raise runtime.slots or leave it unset")
    return None


#: seconds between two ``plan: searching ...`` lines while the placement search runs (:func:`search_heartbeat`)
SEARCH_HEARTBEAT_S = 10.0


@contextlib.contextmanager
def search_heartbeat(every: Optional[float] = None, out: Optional[Callable[[str], None]] = None):
    """While the placement search runs, a line every ``every`` seconds (default :data:`SEARCH_HEARTBEAT_S`; 0:
    at every plan and every :data:`~npu_train.planner.search.TICK_TIMELINES` timelines) to ``out`` (default:
    stdout), folded at words to 100 columns: the seconds so far, the plans made and timelines simulated, what is
    planned now (:data:`npu_train.planner.search.PROGRESS`). An 8-card ``train.schedule=auto`` plan took 21-138 s
    on a loaded 2-core host with no line before its table."""
    import time

    from npu_train.metrics.report import fold_long_line
    from npu_train.planner.search import PROGRESS

    every = SEARCH_HEARTBEAT_S if every is None else float(every)
    out = out or (lambda text: print(text, flush=True))
    t0 = time.monotonic()
    last, plans0, timelines0 = [t0], PROGRESS.plans, PROGRESS.timelines

    def listen() -> None:
        now = time.monotonic()
        if now - last[0] < every:
            return
        last[0] = now
        out(fold_long_line(f"plan: searching ({now - t0:.0f} s, {PROGRESS.plans - plans0} plan(s), "
                           f"{PROGRESS.timelines - timelines0:,} timelines so far): {PROGRESS.current}"))

    prev, PROGRESS.listener = PROGRESS.listener, listen
    try:
        yield
    finally:
        PROGRESS.listener = prev


def check_moe(cfg, mcfg) -> None:
    """Refuse what a mixture-of-experts model does not train with (ConfigError naming the fix): the load-balancing
    loss with a split-backward or two-chunk schedule."""
    if not mcfg.is_moe or cfg.plan:
        return
    from npu_train.pipeline.moeaux import aux_loss_weight, check_aux_schedule

    check_aux_schedule(aux_loss_weight(cfg.train.moe_aux_loss, mcfg), cfg.train.schedule)


def _card_threads(cfg, reqs, nodes) -> tuple[int, bool]:
    """``(torch threads per card process, elsewhere)``: ``runtime.threads``, else this machine's cores divided
    among its cards; a dry run for accelerator cards only (``elsewhere``) plans another machine, whose cores
    this one does not know: 1 thread unless ``runtime.threads`` says (the plan table says so)."""
    from npu_train.planner import threads_per_card

    elsewhere = bool(cfg.plan) and nodes is None and not cfg.runtime.threads and all(r.kind != "cpu" for r in reqs)
    return (1 if elsewhere else threads_per_card(cfg.runtime.threads, len(reqs))), elsewhere


def check_address_space(plan, limit: Optional[int] = None) -> None:
    """Refuse a plan whose card processes cannot fit in the per-process address-space limit (``ulimit -v``,
    ``RLIMIT_AS``; ``limit`` overrides it): every card process needs its planned host memory (a cpu card's whole
    planned total, an accelerator card's offloaded host state) plus
    :data:`~npu_train.hardware.ADDRESS_SPACE_OVERHEAD_BYTES` of address space reserved beyond what it touches.
    Without this the plan said "fits" and the card failed with ``DefaultCPUAllocator: can't allocate memory``."""
    from npu_train.hardware import ADDRESS_SPACE_OVERHEAD_BYTES, address_space_limit

    limit = address_space_limit() if limit is None else limit
    if limit is None:
        return
    need = [(s.mem["total"] if s.card.kind == "cpu" else s.host_bytes) + ADDRESS_SPACE_OVERHEAD_BYTES
            for s in plan.stages]
    worst = max(range(len(need)), key=need.__getitem__)
    if need[worst] <= limit:
        return
    g, st = 2 ** 30, plan.stages[worst]
    raise ConfigError(f"the address-space limit of this shell (ulimit -v, RLIMIT_AS) is {limit / g:.2f} GiB per "
                      f"process, but card {st.card.name} is planned to use {(need[worst] - ADDRESS_SPACE_OVERHEAD_BYTES) / g:.2f} "
                      f"GiB plus about {ADDRESS_SPACE_OVERHEAD_BYTES / g:.2f} GiB of address space that torch, its "
                      f"threads and the allocator reserve: raise the limit to at least {need[worst] / g:.2f} GiB "
                      f"(ulimit -v {-(-need[worst] // 1024)}, or ulimit -v unlimited), or plan less memory per card "
                      "(more cards, train.recompute=true, a smaller train.micro_batch or data.seq_len)")


def _layout_and_schedule(cfg, run_dir: str, mcfg, dtype: str, cards: list, threads: int,
                         host_ram: Optional[int], multinode: bool, elsewhere: bool) -> tuple[int, int, int]:
    """``(P, dp, zero)`` after ``parallel.dp=auto`` and ``train.schedule=auto`` are resolved in ``cfg``
    (``elsewhere``: a dry run for another machine, whose cores are one per card)."""
    unset = cfg.parallel.dp is None
    default_dp(cfg, [c.kind for c in cards])
    if cfg.parallel.dp == "auto":
        _choose_layout(cfg, run_dir, mcfg, dtype, cards, threads, host_ram, multinode, elsewhere, unset=unset)
    P, dp, zero = pipeline_stages(cfg, mcfg, [c.kind for c in cards])
    _check_interleaved(cfg, P)
    off = None  # parallel.vocab=true under train.schedule=auto: auto's choice without it
    if cfg.train.schedule == "auto":
        off = _choose_schedule(cfg, run_dir, mcfg, dtype, cards[:P], threads, dp, zero, host_ram,
                               multinode=multinode, host_cores=P * dp if elsewhere else None)
    if cfg.parallel.vocab == "auto" or cfg.parallel.vocab is True:  # the schedule given: planned with and without
        _choose_vocab(cfg, run_dir, mcfg, dtype, cards[:P], threads, dp, zero, host_ram,
                      multinode=multinode, host_cores=P * dp if elsewhere else None, off=off)
    return P, dp, zero


def _choose_vocab(cfg, run_dir: str, mcfg, dtype: str, cards: list, threads: int, dp: int, zero: int,
                  host_ram: Optional[int], multinode: bool = False, host_cores: Optional[int] = None,
                  off=None) -> None:
    """``parallel.vocab=auto`` with a given schedule: set ``parallel.vocab`` to whether the plan with vocabulary
    parallelism is predicted :data:`~npu_train.planner.schedule_choice.VOCAB_MARGIN` faster, and say so; a resume
    keeps the checkpoint's. ``parallel.vocab=true``: say in one line how its predicted step compares with the
    plan without it (a fresh-clone review's vocab plan was slower and did not say so): ``off``, the plan
    ``train.schedule=auto`` chooses without it (what the same command without the flag prints), else the same
    schedule's."""
    from omegaconf import open_dict

    from npu_train.planner.schedule_choice import VOCAB_MARGIN

    asked = cfg.parallel.vocab is True
    saved = None if asked else _resumed_train(cfg, run_dir)
    if saved:
        on, why = bool(saved.get("vocab", False)), "the resumed checkpoint's"
    else:
        from npu_train.planner import make_plan

        req = replace(plan_request(cfg, mcfg, dtype, cards, threads=threads, dp=dp, zero=zero, host_ram_bytes=host_ram,
                                   multinode=multinode, host_cores=host_cores), strict=False)
        same, with_v = (make_plan(replace(req, shape=replace(req.shape, vocab_parallel=v))) for v in (False, True))
        off = off if asked and off is not None else same
        if asked:
            print(vocab_comparison(with_v, off), flush=True)
            return
        on = with_v.fits and (not off.fits or with_v.step_time_s < off.step_time_s * (1.0 - VOCAB_MARGIN))
        why = (f"predicted step {with_v.step_time_s:.3g} s with it, {off.step_time_s:.3g} s without; kept when "
               f"{VOCAB_MARGIN * 100:.0f} % faster")
    with open_dict(cfg):
        cfg.parallel.vocab = on
    print(f"parallel.vocab=auto: {'true' if on else 'false'} ({why})", flush=True)


def vocab_comparison(with_v, off) -> str:
    """One line: ``parallel.vocab=true``'s predicted step against the plan without it (``with_v``, ``off``:
    :class:`~npu_train.planner.Plan`; ``off`` of another schedule: the one ``train.schedule=auto`` takes without
    it, named), ``slower`` / ``faster`` by how much, and the setting that avoids a slower one."""
    import math

    a, b = with_v.step_time_s, off.step_time_s
    d = max(0, 2 - math.floor(math.log10(max(min(a, b), 1e-9))))  # 3 significant digits of the shorter
    head = f"parallel.vocab=true: predicted step {a:.{d}f} s, {b:.{d}f} s without it"
    other = ""
    if off.shape.schedule != with_v.shape.schedule:  # train.schedule=auto chose another schedule without it
        head = f"parallel.vocab=true: predicted step {a:.{d}f} s ({with_v.shape.schedule}), {b:.{d}f} s without it"
        core = " + attention recompute" if off.shape.recompute_attention else ""
        other = f"auto takes {off.shape.schedule}{core} without it; "
    if not off.fits:
        return head + f" ({other}which does not fit)"
    if not with_v.fits:
        return head + f" ({other}it does not fit; without it does)"
    if abs(a / b - 1) < 0.005:
        return head + f" ({other}about the same)"
    if a > b:
        return head + f" ({other}{(a / b - 1) * 100:.0f} % slower with it: parallel.vocab=false or auto)"
    return head + f" ({other}{(1 - a / b) * 100:.0f} % faster with it)"


def default_dp(cfg, kinds: list) -> None:
    """``parallel.dp`` unset (null, the default): ``auto`` where every card of ``kinds`` is an accelerator (the
    planner chooses the layout, :func:`_choose_layout`), 1 where any is a cpu card (there auto keeps the default
    job's and the pipeline bench's layouts anyway, and re-splits small models on predictions that per-action
    costs the plan leaves out dominate: experiments/2026-12-06-eight-cards.md §16.4). ConfigError for
    ``parallel.zero=1`` left with one replica."""
    from omegaconf import open_dict

    if cfg.parallel.dp is not None:
        return
    dp = "auto" if kinds and all(k != "cpu" for k in kinds) else 1
    if dp == 1 and int(cfg.parallel.zero) == 1:
        raise ConfigError("parallel.zero=1 needs parallel.dp >= 2 (it shards the optimizer state across replicas; "
                          "with cpu cards parallel.dp defaults to 1): set parallel.dp=2 (or auto) or use "
                          "parallel.zero=0")
    with open_dict(cfg):
        cfg.parallel.dp = dp


def _eval_rows_kept(cfg, written_mb: int) -> str:
    """After a re-split from micro-batch ``written_mb``: set ``data.eval_batches`` so that the held-out evaluation
    reads the same ``eval_batches x written_mb`` first validation rows (:func:`~npu_train.runtime.spec.eval_micro_batches`)
    in the new micro-batches; returns a note when they cannot be the same rows (not a multiple), else ``""``."""
    from omegaconf import open_dict

    mb, eb = int(cfg.train.micro_batch), int(cfg.data.eval_batches or 0)
    if mb == written_mb or eb <= 0:
        return ""
    rows = eb * written_mb
    with open_dict(cfg):
        cfg.data.eval_batches = max(1, -(-rows // mb))
    if rows % mb:
        return (f"  held-out evaluation: data.eval_batches={cfg.data.eval_batches} of micro-batch {mb}, "
                f"{cfg.data.eval_batches * mb} rows instead of the {rows} as written")
    return ""


def _layout_candidates(cfg, mcfg, n_cards: int) -> tuple[list, Optional["Layout"], str]:
    """``(layouts, the layout as written or None, schedule to plan each with)`` for ``parallel.dp=auto`` on
    ``n_cards`` cards: the global batch ``train.micro_batch x train.accum``, ``train.split`` fixing the depth; with
    the MoE load-balancing loss (a mean over micro-batches of a per-micro-batch statistic) only dp may change
    (the same micro-batches, shared out) and the schedule is 1f1b; DPO micro-batches hold whole pairs (even)."""
    from npu_train.planner.layout_choice import Layout, layouts

    split, mb, accum = as_list(cfg.train.split), int(cfg.train.micro_batch), int(cfg.train.accum)
    aux = _aux_needs_1f1b(cfg, mcfg)
    sizes = (mb,) if aux else tuple(b for b in (1, 2, 4, 8) if b % 2 == 0 or cfg.train.objective != "dpo")
    cands = layouts(n_cards, mcfg.num_layers, mb * accum, micro_batches=sizes, pp=len(split) if split else None)
    sched = "1f1b" if cfg.train.schedule == "auto" and aux else cfg.train.schedule  # _choose_schedule's fallback
    given = Layout(1, len(split) if split else n_cards, mb, accum)  # as written: one pipeline
    return cands, (given if given in cands else None), sched


def _choose_layout(cfg, run_dir: str, mcfg, dtype: str, cards: list, threads: int, host_ram: Optional[int],
                   multinode: bool = False, elsewhere: bool = False, unset: bool = False) -> None:
    """``parallel.dp=auto``: set ``parallel.dp``, ``train.micro_batch``, ``train.accum`` (same global batch) and,
    for ``train.schedule=auto``, the schedule (:func:`npu_train.planner.layout_choice.choose_layout`), and print
    the choice, why and the next two; a resume keeps the checkpoint's layout. ``train.split`` fixes the depth.
    When no layout fits and ``parallel.dp`` was left unset (``unset``), the layout as written is planned as
    before the default was auto, so its refusal names the card, the GiB and the fixes."""
    from omegaconf import OmegaConf, open_dict

    from npu_train.planner.layout_choice import choose_layout
    from npu_train.planner.spec import PlacementError

    written_mb = int(cfg.train.micro_batch)
    saved = _resumed_manifest(cfg, run_dir)
    if saved and isinstance(saved.get("parallel"), dict) and saved.get("train"):
        t = saved["train"]
        with open_dict(cfg):
            cfg.parallel.dp = int(saved["parallel"]["dp"])
            cfg.train.micro_batch, cfg.train.accum = int(t["micro_batch"]), int(t["accum"])
            if cfg.parallel.vocab == "auto":
                cfg.parallel.vocab = bool(t.get("vocab", False))
        note = _eval_rows_kept(cfg, written_mb)
        print(f"parallel.dp=auto: dp={cfg.parallel.dp}, micro-batch {cfg.train.micro_batch} x accum "
              f"{cfg.train.accum}, the resumed checkpoint's layout" + ("\n" + note if note else ""), flush=True)
        return
    cands, given, sched = _layout_candidates(cfg, mcfg, len(cards))

    def request(lay):
        c = OmegaConf.merge(cfg, OmegaConf.from_dotlist([
            f"parallel.dp={lay.dp}", f"train.micro_batch={lay.micro_batch}", f"train.accum={lay.accum}",
            f"train.schedule={'1f1b' if sched == 'auto' else sched}"]))
        return plan_request(c, mcfg, dtype, cards[:lay.pp], threads=threads, dp=lay.dp,
                            zero=int(cfg.parallel.zero) if lay.dp > 1 else 0, host_ram_bytes=host_ram,
                            multinode=multinode, host_cores=len(cards) if elsewhere else None)

    try:
        choice = choose_layout(cands, request, sched, cfg.train.recompute_attention, cfg.parallel.vocab == "auto",
                               given=given)
    except PlacementError:
        if not unset:
            raise
        with open_dict(cfg):
            cfg.parallel.dp, cfg.parallel.zero = 1, 0
        print("parallel.dp (unset, auto on these cards): no layout of the global batch fits; the layout as written "
              "is planned", flush=True)
        return
    o = choice.chosen
    with open_dict(cfg):
        if cfg.parallel.vocab == "auto":
            cfg.parallel.vocab = bool(o.plan is not None and o.plan.shape.vocab_parallel)
        cfg.parallel.dp = o.layout.dp
        if o.layout.dp == 1:
            cfg.parallel.zero = 0
        cfg.train.micro_batch, cfg.train.accum = o.layout.micro_batch, o.layout.accum
        cfg.train.schedule, cfg.train.recompute = o.schedule, o.recompute
        if o.plan is not None and o.plan.shape.recompute_fewest:
            cfg.train.recompute_layers = "fewest"
        cfg.train.recompute_attention = bool(o.recompute_attention or cfg.train.recompute_attention is True)
    from npu_train.metrics.report import fold_long_line

    note = _eval_rows_kept(cfg, written_mb)
    print("\n".join(fold_long_line(l) for l in choice.lines + ([note] if note else [])), flush=True)


def _check_interleaved(cfg, P: int) -> None:
    """ConfigError for a two-chunk ``train.schedule`` (zbv, interleaved) on one pipeline stage (chunk 0 hands its
    activations to chunk 1 over the link to another card: there is none), and for ``interleaved`` with
    ``train.accum`` not a multiple of the stages ``P``."""
    from npu_train.pipeline.schedule import stages_needed

    if P < stages_needed(cfg.train.schedule):
        raise ConfigError(f"train.schedule={cfg.train.schedule} needs at least 2 pipeline stages (its two layer "
                          f"chunks per card pass activations between cards); this launch has {P}: use "
                          "train.schedule=1f1b (or auto), or give more cards (backend=[...])")
    if cfg.train.schedule == "interleaved" and cfg.train.accum % P:
        raise ConfigError(f"train.schedule=interleaved needs train.accum ({cfg.train.accum}) to be a multiple of the "
                          f"{P} pipeline stage(s): set train.accum={P * max(1, -(-cfg.train.accum // P))} or use "
                          "train.schedule=zbv")


def _choose_schedule(cfg, run_dir: str, mcfg, dtype: str, cards: list, threads: int, dp: int, zero: int,
                     host_ram: Optional[int], multinode: bool = False, host_cores: Optional[int] = None):
    """``train.schedule=auto``: set ``cfg.train.schedule`` (and ``recompute`` when only that fits) to the
    fastest schedule that fits (:func:`npu_train.planner.schedule_choice.choose_schedule`) and say why; a
    resume keeps its checkpoint's schedule (another one sums the micro-batches' gradients in another order).
    Returns, under ``parallel.vocab=true``, the plan auto chooses without it (for :func:`vocab_comparison`), else
    None."""
    from omegaconf import open_dict

    from npu_train.pipeline.schedule import ALL_SCHEDULES, CHUNKED_SCHEDULES, SPLIT_BACKWARD, stages_needed
    from npu_train.planner.schedule_choice import choose_schedule

    saved = _resumed_train(cfg, run_dir)
    off = None
    if saved and len(cards) < stages_needed(str(saved.get("schedule"))):  # a resume onto one stage
        print(f"train.schedule=auto: the resumed checkpoint's schedule {saved['schedule']} needs at least 2 pipeline "
              f"stages and this launch has {len(cards)}: choosing anew (the micro-batches' gradients are summed in "
              "another order)", flush=True)
        saved = None
    if saved and saved.get("schedule") in ALL_SCHEDULES:
        schedule, recompute = saved["schedule"], bool(saved.get("recompute", cfg.train.recompute))
        core = bool(saved.get("recompute_attention", cfg.train.recompute_attention is True))
        which = (_resumed_recompute_layers(cfg, _resumed_manifest(cfg, run_dir) or {}, len(cards)) if recompute
                 else cfg.train.recompute_layers)
        why = (f"train.schedule=auto: {schedule}, the resumed checkpoint's schedule (a resume keeps it: another "
               "schedule sums the micro-batches' gradients in another order)")
        if recompute and not isinstance(which, str):
            why += f"; layers recomputed whole per card {'/'.join(map(str, which))}, as the checkpoint's launch"
        if cfg.parallel.vocab == "auto":
            with open_dict(cfg):
                cfg.parallel.vocab = bool(saved.get("vocab", False))
    else:
        with open_dict(cfg):
            cfg.train.schedule = "1f1b"  # a valid RunShape; each candidate replaces it
        req = plan_request(cfg, mcfg, dtype, cards, threads=threads, dp=dp, zero=zero, host_ram_bytes=host_ram,
                           multinode=multinode, host_cores=host_cores)
        vocab = cfg.parallel.vocab == "auto"  # (the request's RunShape plans without it; choose_schedule both)
        choice = choose_schedule(req, cfg.train.recompute_attention, vocab)
        schedule, recompute, why = choice.schedule, choice.recompute, choice.why
        if req.shape.vocab_parallel:  # parallel.vocab=true: what auto chooses without it, for its comparison
            off = choose_schedule(replace(req, strict=False, shape=replace(req.shape, vocab_parallel=False)),
                                  cfg.train.recompute_attention).plan
        if vocab:
            with open_dict(cfg):
                cfg.parallel.vocab = bool(choice.plan is not None and choice.plan.shape.vocab_parallel)
        core = choice.recompute_attention or cfg.train.recompute_attention is True
        which = "fewest" if choice.recompute_fewest else cfg.train.recompute_layers
    if schedule in SPLIT_BACKWARD + CHUNKED_SCHEDULES and _aux_needs_1f1b(cfg, mcfg):
        schedule, why = "1f1b", aux_schedule_line(why)
    with open_dict(cfg):
        cfg.train.schedule = schedule
        cfg.train.recompute = recompute
        cfg.train.recompute_attention = core
        cfg.train.recompute_layers = which
    print(why, flush=True)
    return off


def aux_schedule_line(why: str) -> str:
    """The ``train.schedule=auto`` line when the mixture-of-experts load-balancing loss overrides the choice
    ``why`` names: it leads with the schedule used (1f1b) and the reason, then what auto would choose without
    the loss. It named zb-h2 first and ran 1f1b (issue 40)."""
    head = "train.schedule=auto: "
    rest = why[len(head):] if why.startswith(head) else why
    return (f"{head}1f1b, as the mixture-of-experts load-balancing loss (train.moe_aux_loss) needs a full backward "
            f"on one chunk per card; without the loss: {rest}")


def _resumed_recompute_layers(cfg, manifest: dict, stages: int):
    """``train.recompute_layers`` for a resumed ``train.schedule=auto`` launch under recompute: the user's, when
    given (not ``all``); else the per-card counts the checkpoint's launch planned (its manifest's
    ``recompute_layers``, one int per stage: the fewest that fit), so the resume recomputes the same layers and
    keeps the first launch's plan; ``all`` for a checkpoint written before the counts were recorded, or whose
    launch recomputed every layer."""
    given = cfg.train.recompute_layers
    if not (isinstance(given, str) and given == "all"):
        return given
    counts = manifest.get("recompute_layers")
    if (isinstance(counts, list) and len(counts) == stages and counts
            and all(isinstance(k, int) and not isinstance(k, bool) and k >= 0 for k in counts)):
        return list(counts)
    return "all"


def _aux_needs_1f1b(cfg, mcfg) -> bool:
    """Whether the mixture-of-experts load-balancing loss is on, so ``train.schedule=auto`` (alone or under
    ``parallel.dp=auto``) must plan 1f1b: the loss needs a full backward on one chunk per card."""
    if not getattr(mcfg, "is_moe", False):  # (moeaux imports torch: not for a dense model's dry run)
        return False
    from npu_train.pipeline.moeaux import aux_loss_weight

    return aux_loss_weight(cfg.train.moe_aux_loss, mcfg) > 0


def _resumed_train(cfg, run_dir: str) -> Optional[dict]:
    """The ``train`` settings recorded in the checkpoint ``train.resume`` names, or None (no resume, none found)."""
    saved = _resumed_manifest(cfg, run_dir)
    return (saved.get("train") or None) if saved else None


def _resumed_manifest(cfg, run_dir: str) -> Optional[dict]:
    """The manifest of the checkpoint ``train.resume`` names, or None (no resume, none found)."""
    if not cfg.train.resume or cfg.plan:
        return None
    from npu_train.checkpoint.store import find_checkpoint

    try:
        found = find_checkpoint(cfg.train.resume, checkpoint_root(cfg, run_dir))
        with open(os.path.join(found, "manifest.json")) as f:
            out = json.load(f)
        return out if isinstance(out, dict) else None
    except (UserError, OSError, TypeError, ValueError):
        return None


def _resumed_split(cfg, run_dir: str, stages: int) -> Optional[list]:
    """Layers per stage of the checkpoint being resumed (if it has ``stages`` stages), else None: a resume keeps
    its split, since another split sums the grad norm in another order (not bit-exact)."""
    if not cfg.train.resume or cfg.plan:
        return None
    from npu_train.checkpoint.store import checkpoint_split, find_checkpoint

    try:
        found = find_checkpoint(cfg.train.resume, checkpoint_root(cfg, run_dir))
    except UserError:
        return None
    split = checkpoint_split(found) if found is not None else None
    return split if split is not None and len(split) == stages else None


def checkpoint_root(cfg, run_dir: str) -> str:
    """The absolute checkpoint root: ``checkpoint.dir``, else ``<run dir>/checkpoints``."""
    return os.path.abspath(cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints"))


def _preset_config(path: str):
    """The preset's LlamaConfig when ``path`` names a preset (and no such file exists), else None."""
    from npu_train.model.presets import get_preset

    if os.path.exists(os.path.expanduser(path)) or path in ("embedded", "smollm2"):
        return None
    try:
        return get_preset(path)
    except KeyError:
        return None


def _shm_free_bytes() -> int:
    """Free bytes in /dev/shm (``NPT_SHM_FREE_BYTES`` overrides it, for tests)."""
    from npu_train.transport.shm import shm_free_bytes

    override = getenv("SHM_FREE_BYTES")
    return int(override) if override else shm_free_bytes()


def resident_param_names(model_cfg, stage, lora_targets=(), train_router: bool = False) -> list[str]:
    """HF names of a stage's resident parameters: layers as planned, non-layer weights per the plan's
    ``nonlayer_resident``; with LoRA also the resident layers' adapter names."""
    from npu_train.model.lora import lora_param_names

    names = []
    for i in stage.resident:
        names += model_cfg.layer_param_names(i)
        if lora_targets:
            names += lora_param_names(i, lora_targets, model_cfg, train_router)
    if stage.nonlayer_resident:
        if stage.has_embed:
            names.append("model.embed_tokens.weight")
        if stage.has_head:
            names += ["model.norm.weight", "lm_head.weight"]
    return names


#: modules a card process imports (calibration measures their resident memory as the process baseline)
CARD_PROCESS_MODULES = ("npu_train.runtime.worker", "npu_train.runtime.trainer", "npu_train.backends",
                        "npu_train.optim.adamw", "npu_train.pipeline.stage", "npu_train.data.packfile",
                        "npu_train.data.batches", "npu_train.checkpoint.store", "npu_train.transport")


def build_worker_specs(plan, prep: Prepared, *, train: TrainSpec, runtime: RuntimeSpec, job_id: str, token: str,
                       data_file: str, start_step: int, resume_dir: Optional[str], ckpt_root: str, ipc_dir: str,
                       host: str, port: int, slot_bytes: int, slots: int, nodes=None,
                       reference: Optional[ReferenceSpec] = None) -> list[WorkerSpec]:
    """The one place :class:`~npu_train.runtime.spec.WorkerSpec` objects are built: global rank ``r = replica
    * P + stage`` runs stage ``r % P`` on ``prep.cards[r]``. Addresses: ipc sockets in ``ipc_dir`` (``shm``)
    or ``tcp://host:*`` (``inline``: ports picked at the bind, :mod:`npu_train.runtime.jobstore`); gloo at the
    store the launcher hosts on ``host:port``; multi-node (``nodes``): this node's cards only, with the job's
    mailboxes, per-boundary transports and gloo rendezvous."""
    from npu_train.transport.channel import Endpoint

    from npu_train.runtime.layout import ParallelLayout

    P = len(plan.stages)
    dp, zero = prep.dp, prep.zero
    layout = ParallelLayout(dp, P)
    mcfg, index = prep.model_cfg, model_index(prep.model_path)  # GGUF: the tensor table, parsed once
    if runtime.transport == "shm":
        inbox = tuple(f"ipc://{ipc_dir}/r{r}.sock" for r in range(layout.world))
        coord_addr = f"ipc://{ipc_dir}/coord.sock"
    else:
        inbox = (Endpoint.tcp(host, "*"),) * layout.world
        coord_addr = Endpoint.tcp(host, "*")
    ranks, boundary, dist_init = range(layout.world), (), Endpoint.tcp(host, port)
    if nodes is not None:
        ranks, inbox, boundary, dist_init = nodes.local_ranks, nodes.inbox, nodes.boundary_transport, nodes.dist_init
    lora_targets = train.lora_targets if train.mode == "lora" else ()
    specs = []
    for r in ranks:
        st, card = plan.stages[layout.stage(r)], prep.cards[r]
        specs.append(WorkerSpec(
            rank=r, world_size=layout.world, dp=dp, zero=zero, job_id=job_id, token=token, parent_pid=os.getpid(),
            card=card, model_path=prep.model_path, model_cfg=mcfg.to_dict(),
            stage=StageInfo(st.first_layer, st.last_layer, st.has_embed, st.has_head, st.layers_label,
                            second=tuple(st.second) if st.second else None, recompute_layers=st.recompute_layers,
                            heap_cap_bytes=st.heap_cap, heap_slack_bytes=st.heap_slack or 0,
                            heap_limit_bytes=st.heap_limit),
            resident_names=tuple(resident_param_names(mcfg, st, lora_targets, train.lora_train_router)), data_file=data_file, train=train,
            runtime=runtime, start_step=start_step, resume_dir=resume_dir, ckpt_root=ckpt_root, coord_addr=coord_addr,
            inbox=inbox, ipc_dir=ipc_dir, slot_bytes=slot_bytes, slots=slots, dist_init=dist_init,
            boundary_transport=boundary, model_index=index, reference=reference))
    return specs


# ------------------------------------------------------------------------------ settings -> typed pieces
def pipeline_stages(cfg, mcfg, kinds: list) -> tuple[int, int, int]:
    """``(P, dp, zero)`` for the cards of ``kinds`` and model ``mcfg``. Raises ConfigError when ``data.seq_len``
    exceeds the model's (or its ``sliding_window``), the cards do not form ``dp`` equal replicas, or P exceeds the layer count."""
    from npu_train.config import check_dp_cards
    from npu_train.model.limits import check_seq_len

    check_seq_len(int(cfg.data.seq_len), int(mcfg.max_position_embeddings), getattr(mcfg, "sliding_window", None))
    # data parallelism: dp replicas of a P-stage pipeline, global rank = replica * P + stage (runtime/layout.py)
    dp, zero = 1 if cfg.parallel.dp is None else int(cfg.parallel.dp), int(cfg.parallel.zero)  # null: default_dp
    P = check_dp_cards(len(kinds), dp)
    for k in range(1, dp):
        if kinds[k * P:(k + 1) * P] != kinds[:P]:
            raise ConfigError(f"parallel.dp={dp}: replica {k} has cards {kinds[k * P:(k + 1) * P]} but replica 0 "
                              f"has {kinds[:P]}: list the same card kinds, stage by stage, for every replica")
    if P > mcfg.num_layers:
        if dp == 1:
            raise ConfigError(f"{P} cards but the model has only {mcfg.num_layers} layers: "
                              f"use at most {mcfg.num_layers} backend entries")
        raise ConfigError(f"{P} stages per pipeline ({len(kinds)} cards / parallel.dp={dp}) but the model has only "
                          f"{mcfg.num_layers} layers: use at most {mcfg.num_layers} backend entries per replica "
                          "or raise parallel.dp")
    return P, dp, zero


def plan_request(cfg, mcfg, dtype: str, cards: list, *, threads: int, dp: int, zero: int,
                 host_ram_bytes: Optional[int], multinode: bool = False, host_cores: Optional[int] = None,
                 cards_per_host: int = 0):
    """The planner's :class:`~npu_train.planner.PlanRequest` of ``cfg`` (the only place one is built from the
    config): the model ``mcfg`` in compute ``dtype`` on one pipeline's ``cards`` (replica 0's; every replica
    has the same kinds) for ``dp`` replicas, with rates and memory terms of each card's kind for ``threads``
    torch threads per card process, ``cards_per_host`` of them on one host (0: every card). Raises :class:`~npu_train.errors.ConfigError` for a bad
    ``train.resident_layers``."""
    from npu_train.planner import PlanRequest, load_rates
    from npu_train.planner.memterms import load_memory_terms

    tr, fur = cfg.train, cfg.runtime.furiosa
    shape = run_shape(cfg, mcfg, dtype)
    if shape.recompute_counts and len(shape.recompute_counts) != len(cards):
        raise ConfigError(f"train.recompute_layers={list(shape.recompute_counts)} lists {len(shape.recompute_counts)} "
                          f"count(s) for a pipeline of {len(cards)} card(s): give one per card, or fewest")
    from npu_train.planner.fit import shape_key

    key = shape_key(mcfg, shape.tokens_per_micro_batch)  # figures fitted from runs of this model and shape only
    rates = [load_rates(c.kind, cfg.placement.profile, threads=threads, model_shape=key, head=i == len(cards) - 1)
             for i, c in enumerate(cards)]
    if cfg.placement.profile is None and not multinode:  # nodes must plan alike: no figure of one node's own
        from npu_train.runtime.flops import measured_compute_rate

        batch_seq = (shape.micro_batch, shape.seq_len)
        rates = [measured_compute_rate(r, c.kind, dtype, threads, mcfg, batch_seq) for r, c in zip(rates, cards)]
    from npu_train.hostmem import user_malloc_settings

    # the user's own MALLOC_* settings win in the card processes (hostmem): whether they return freed
    # memory is unknown, so the plan keeps the heap's holes
    reuse = bool(cfg.runtime.keep_host_memory) or user_malloc_settings()
    terms = [load_memory_terms(c.kind, cfg.placement.profile,
                               loaded_modules=fur.loaded_modules if c.kind == "furiosa" else None,
                               reuse_freed_memory=reuse)
             for c in cards]
    resident = as_list(tr.resident_layers)
    if isinstance(resident, str) and resident != "auto":
        try:
            resident = int(resident)
        except ValueError:
            raise ConfigError(f"train.resident_layers={resident!r}: use auto, an integer, or a list per card") from None
    return PlanRequest(model=mcfg, shape=shape, cards=list(cards), rates=rates,
                       split=as_list(tr.split) or None, resident_layers=resident, host_ram_bytes=host_ram_bytes,
                       threads=threads, headroom=float(cfg.placement.headroom), memory_terms=terms, dp=dp, zero=zero,
                       host_cores=host_cores, cards_per_host=cards_per_host)


def run_shape(cfg, mcfg, dtype: str):
    """The planner's RunShape of ``cfg`` for ``mcfg`` in ``dtype`` (LoRA: adapter parameters per layer)."""
    from npu_train.planner import RunShape

    tr, lora_pl, lora_active, expert_rank = cfg.train, 0, 0, 0
    if tr.mode == "lora":  # every expert's adapters for memory, the k a token passes through for compute
        from npu_train.planner.moe import lora_expert_rank, lora_params_per_layer

        lora_pl, lora_active = lora_params_per_layer(mcfg, cfg.lora.rank, tuple(cfg.lora.targets),
                                                     bool(getattr(cfg.lora, "train_router", False)))
        expert_rank = lora_expert_rank(mcfg, cfg.lora.rank, cfg.lora.targets, cfg.lora.dropout)
    return RunShape(seq_len=cfg.data.seq_len, micro_batch=tr.micro_batch, micro_batches=tr.accum,
                    schedule=tr.schedule, dtype=dtype, recompute=tr.recompute,
                    recompute_attention=tr.recompute_attention is True, lora_params_per_layer=lora_pl,
                    recompute_fewest=bool(tr.recompute) and getattr(tr, "recompute_layers", "all") != "all",
                    recompute_counts=_recompute_counts(tr),
                    lora_active_params_per_layer=lora_active, lora_expert_rank=expert_rank,
                    grad_accum=tr.grad_accum, offload="serial" if not tr.offload_overlap else
                    "delayed" if tr.offload_update == "delayed" else "overlap", packed=packed_rows(cfg.data),
                    checkpoint_dtype=model_file_dtype(cfg.model.path), moe_aux_loss=_aux_needs_1f1b(cfg, mcfg),
                    vocab_parallel=getattr(cfg.parallel, "vocab", False) is True,
                    overlap_copies=getattr(cfg.runtime, "overlap_copies", None),
                    vocab_exchange=getattr(cfg.runtime, "vocab_exchange", "gloo"),
                    transport=getattr(cfg.runtime, "transport", "shm"))


def _recompute_counts(tr) -> tuple:
    """``train.recompute_layers=[k0, ...]`` as a tuple (() for all / fewest)."""
    rl = getattr(tr, "recompute_layers", "all")
    return () if isinstance(rl, str) else tuple(int(x) for x in rl)


def model_file_dtype(spec: str) -> str:
    """The checkpoint dtype of model path ``spec`` (:func:`npu_train.model.chunks.checkpoint_dtype`), or ``"bf16"``
    (the Hub's) for a shape preset or a path that cannot be read (the loaders report that one)."""
    if _preset_config(spec) is not None:  # no file (and no torch import for a preset's dry run)
        return "bf16"
    from npu_train.model import resolve_model_path
    from npu_train.model.chunks import checkpoint_dtype
    from npu_train.model.files import ModelFormatError

    try:
        return checkpoint_dtype(resolve_model_path(spec))
    except (OSError, ModelFormatError):
        return "bf16"


def packed_rows(d) -> bool:
    """Whether the data gets several samples per row (chat / prompt_completion with ``data.pack``, text with
    ``data.doc_mask``): then every stage builds a block-diagonal attention mask."""
    fmt = str(getattr(d, "format", "text") or "text")
    if fmt == "preference":  # one padded sequence per row, never packed
        return False
    return bool(getattr(d, "doc_mask", False)) if fmt == "text" else bool(getattr(d, "pack", True))


def train_spec(cfg, dtype: str, mcfg=None) -> TrainSpec:
    """The :class:`~npu_train.runtime.spec.TrainSpec` of ``cfg`` with the resolved compute ``dtype`` (and, for the
    model ``mcfg``, the load-balancing loss weight)."""
    from npu_train.pipeline.moeaux import aux_loss_weight

    tr = cfg.train
    return TrainSpec(steps=tr.steps, micro_batch=tr.micro_batch, accum=tr.accum, lr=tr.lr,
                     min_lr_ratio=tr.min_lr_ratio, warmup_steps=tr.warmup_steps, weight_decay=tr.weight_decay,
                     beta1=tr.beta1, beta2=tr.beta2, eps=tr.eps, clip=tr.clip, schedule=tr.schedule,
                     recompute=tr.recompute, recompute_attention=tr.recompute_attention is True,
                     seed=tr.seed, save_every=tr.save_every,
                     save_on_interrupt=tr.save_on_interrupt, stop_after=tr.stop_after, dtype=dtype,
                     eval_every=cfg.data.eval_every, eval_batches=cfg.data.eval_batches, mode=tr.mode,
                     lora_rank=cfg.lora.rank, lora_alpha=float(cfg.lora.alpha), lora_dropout=float(cfg.lora.dropout),
                     lora_targets=tuple(cfg.lora.targets), lora_train_router=bool(cfg.lora.train_router),
                     nonfinite=tr.nonfinite,
                     grad_accum=tr.grad_accum, offload_overlap=bool(tr.offload_overlap),
                     offload_update=tr.offload_update, save_checkpoints=bool(cfg.checkpoint.save),
                     objective=str(getattr(tr, "objective", "sft")), **_dpo_fields(cfg),
                     moe_aux_loss=aux_loss_weight(tr.moe_aux_loss, mcfg) if mcfg is not None else 0.0,
                     vocab=getattr(cfg.parallel, "vocab", False) is True)


def _dpo_fields(cfg) -> dict:
    """``dpo.*`` as TrainSpec fields (defaults when the config has no ``dpo`` group)."""
    from npu_train.config import section

    d = section(cfg, "dpo")
    if d is None:
        return {}
    return {"dpo_beta": float(d.beta), "dpo_loss": str(d.loss), "dpo_label_smoothing": float(d.label_smoothing)}


def furiosa_cache_dir(cfg) -> str:
    """``runtime.furiosa.compiler_cache_dir``, default ``<cache root>/furiosa/compiler``, absolute."""
    d = cfg.runtime.furiosa.compiler_cache_dir
    return os.path.abspath(os.path.expanduser(d)) if d else str(cache_dir("furiosa", "compiler"))


def furiosa_runtime_fields(cfg, plan) -> dict:
    """The RNGD fields of RuntimeSpec: compile options, accounting, warm-up."""
    from npu_train.backends.furiosa_compile import FuriosaCompileOptions

    fur = cfg.runtime.furiosa
    n = max((t.loaded_modules for t, st in zip(plan.memory_terms, plan.stages)
             if st.card.kind == "furiosa"), default=int(fur.loaded_modules))
    return {"furiosa": FuriosaCompileOptions(compiler_cache_dir=furiosa_cache_dir(cfg), loaded_modules=int(n),
                                             cpu_fallback=bool(fur.cpu_fallback), probe_free=bool(fur.probe_free),
                                             compiled_layers=bool(fur.compiled_layers)),
            "furiosa_accounting": str(fur.accounting), "warmup": bool(fur.warmup)}


def model_index(model_path: Optional[str]) -> Optional[dict]:
    """A GGUF file's tensor table, so card processes read at those offsets without re-parsing the metadata
    (seconds per process for a 49k vocabulary); None for safetensors or a preset."""
    from npu_train.model.files import is_gguf_path

    if model_path is None or not is_gguf_path(os.path.expanduser(model_path)):
        return None
    from npu_train.model.gguf import gguf_tensor_index

    return gguf_tensor_index(os.path.expanduser(model_path))


def run_job(cfg, run_dir: str, resume_with=None) -> dict:
    """Run the training job ``cfg`` (an OmegaConf ``Config``) in ``run_dir``; returns the run summary dict.
    ``resume_with``: the words of the shell command that resumes the run from a checkpoint root (launch/run.py's
    ``resume_words``; None: the ``stopped:`` line says "the same command" with the overrides to add).

    Raises UserError (exit 2) for bad input, JobFailed (exit 1) when a card process fails, Interrupted
    (130/143) on SIGINT/SIGTERM. Multi-node when ``NNODES`` > 1 (:mod:`npu_train.runtime.nodes`)."""
    from npu_train.config import check_known_keys

    check_known_keys(cfg)  # +train.stepz=3: Hydra's append form adds a mistyped key instead of refusing it
    os.makedirs(run_dir, exist_ok=True)
    if not cfg.plan:  # a read-only NPT_CACHE: one line now, not a traceback at the data cache's first write
        writable_cache_dir()
    raise_pending_signal()  # a signal while this module imported (launch/run.py): stop before any work
    if cfg.calibrate:
        return _calibrate_only(cfg)
    if cfg.plan:
        with launch_signals():  # Ctrl-C while it plans stops it (no card process is ever started)
            return _dry_run(cfg, run_dir)
    from npu_train.runtime.dirlock import JobLocks

    node, locks = _this_node(cfg), JobLocks()
    try:
        with launch_signals():
            return _train(cfg, run_dir, node, locks, resume_with)
    except UserError as e:  # the other nodes stop waiting and name this node's error
        if node.rdv is not None:
            node.rdv.abort(str(e))
        raise
    finally:  # every exit path, an interrupt or a failed card included (a kill -9 drops the flock)
        locks.release()


#: SIGHUP (a terminal or ssh session closed without tmux) is handled as SIGTERM: stop cleanly, status.json written
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(signum, preparing=True)  # set until the coordinator starts the card processes


def _record_late_signal(signum, frame) -> None:
    """After the card processes: the job's outcome is decided; a late signal must not kill the launcher before
    it writes its records (summary, ``status.json``)."""
    print(f"note: {signal.Signals(signum).name} received while the job was ending: ignored", file=sys.stderr,
          flush=True)


@contextlib.contextmanager
def launch_signals():
    """The launcher's signals while ``run_job`` runs (main thread only): during preparation SIGINT and SIGTERM
    raise :class:`~npu_train.errors.Interrupted` (cleanup paths run, ``status.json`` is written);
    while the coordinator runs, its own handlers count them; after it (:func:`defer_signals`) both are only
    noted; a signal held in :data:`~npu_train.errors.PENDING_SIGNALS` is raised on entry. The previous
    handlers come back at the end."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in _SIGNALS}
    for s in _SIGNALS:
        signal.signal(s, _raise_interrupted)
    try:
        raise_pending_signal()  # one the launcher received while this module imported
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def defer_signals() -> None:
    """From now on until :func:`launch_signals` ends, SIGINT/SIGTERM are only noted (set before the coordinator
    runs; it restores them after its teardown)."""
    if threading.current_thread() is threading.main_thread():
        for s in _SIGNALS:
            signal.signal(s, _record_late_signal)


def _train(cfg, run_dir: str, node: "NodeContext", locks, resume_with=None) -> dict:
    """The phases of a training job (module docstring); ``locks``: the launch's
    :class:`~npu_train.runtime.dirlock.JobLocks`, taken first (a live job's directories are refused);
    ``resume_with``: as for :func:`run_job`."""
    from npu_train.runtime import nodes as N

    locks.run_dir(run_dir, node.node_rank)
    root = checkpoint_root(cfg, run_dir)
    if cfg.checkpoint.save:
        check_checkpoint_dir_writable(root)  # a read-only checkpoint.dir would fail at the first save
        if node.is_owner and os.path.isdir(root):  # a new root: locked once created
            locks.checkpoint_root(root)
    if node.rdv is not None:
        node.rdv.check_same("config", N.config_digest(cfg), "model/data/train settings",
                            "give every node's launcher the same overrides (only backend=, runtime.host, "
                            "runtime.port, runtime.threads and checkpoint.* except checkpoint.save may differ)")
    from npu_train.metrics.live import live_progress

    live = live_progress(str(getattr(cfg.runtime, "progress", "auto")), int(cfg.train.steps),
                         sweep=_sweep_group() is not None)
    try:
        return _train_phases(cfg, run_dir, node, locks, live, resume_with)
    finally:
        if live is not None:
            live.stop()


def _train_phases(cfg, run_dir: str, node: "NodeContext", locks, live, resume_with=None) -> dict:
    """:func:`_train` with the terminal's live display ``live`` (None: plain lines) told each phase."""
    say = live.phase if live is not None else (lambda _text: None)
    say("preparing: cards, model header, placement plan")
    from npu_train.data.rows import check_data_source

    check_data_source(cfg)  # a missing data.source: one line now, before the plan and its timings
    prep = prepare(cfg, run_dir, nodes=node.rdv)
    say("data: reading and tokenizing (cached after the first run)")
    from npu_train.metrics.report import still_saying

    with still_saying("data: reading and tokenizing (cached after the first run)"):
        data = _prepare_data(cfg, prep)
    resume = _resume_point(cfg, prep, data, run_dir, owner=node.is_owner)
    if resume.complete:
        if live is not None:
            live.stop()
        return _already_complete(cfg, resume)
    if live is not None:
        live.at_step(resume.start_step)
    launch = _launch_identity(cfg, prep, data, resume, node)
    locks.set_job(launch.job_id)
    prepare_checkpoint_root(resume.ckpt_root, cfg, prep.model_cfg, len(prep.plan.stages), resume.earlier,
                            owner=node.is_owner, lock=locks.checkpoint_root, start_step=resume.start_step,
                            lora_params_per_layer=prep.shape.lora_params_per_layer)
    say("starting the card processes")
    try:
        with _private_ipc_dir(launch.job_id, node) as ipc_dir:  # removed unless the coordinator took it over
            job = _start_job(cfg, run_dir, prep, data, resume, launch, node, ipc_dir, live=live)
        _supervise(job, cfg, resume)
    finally:
        launch.store = None  # the card processes are gone: the job's store stops listening
    if live is not None:
        live.stop()  # the end-of-run lines below go to the console as plain lines
    return _finish(job, cfg, run_dir, prep, resume, node, resume_with)


def _already_complete(cfg, resume: ResumePoint) -> dict:
    """``train.resume=auto`` on a finished run (a replaced pod, a Slurm requeue): print one line and return the
    summary ``{"complete_at": step, "checkpoint": dir, "checkpoint_dir": root}``; no card process is started and
    nothing in the run dir or checkpoint root is written (exit 0)."""
    tr = cfg.train
    print(f"already complete: checkpoint {resume.resume_dir} is at step {resume.start_step} of train.steps={tr.steps} "
          "(train.resume=auto); nothing to train, no card process started; to train further raise train.steps and "
          "set train.resume_mismatch=allow", flush=True)
    return {"complete_at": resume.start_step, "checkpoint": resume.resume_dir, "checkpoint_dir": resume.ckpt_root}


# ---------------------------------------------------------------------------------------------- phases
@dataclass(frozen=True)
class NodeContext:
    """Where this launcher runs; ``layout``/``rdv`` None on a single node; ``host``: the listen address."""

    layout: object
    rdv: object
    host: str

    @property
    def is_owner(self) -> bool:
        """This node owns the job's shared things (the checkpoint root): single node, or node 0."""
        return self.rdv is None or self.layout.is_master

    @property
    def node_rank(self) -> int:
        return self.layout.node_rank if self.layout else 0

    @property
    def nnodes(self) -> int:
        return self.layout.nnodes if self.layout else 1


@dataclass
class ResumePoint:
    """Where the run starts: checkpoint root, resumed checkpoint (None: fresh) and step, the restored sampler,
    and ``earlier``: another run's checkpoints in the root."""

    ckpt_root: str
    saving: bool  # checkpoint.save
    sampler: object  # StepSampler
    start_step: int = 0
    resume_dir: Optional[str] = None
    earlier: list = field(default_factory=list)
    #: DPO: the reference log-probabilities' files and whether the cards compute them (None for SFT)
    reference: Optional[ReferenceSpec] = None
    #: ``train.resume=auto`` found a checkpoint at ``train.steps`` (or beyond): the run is already complete
    complete: bool = False
    #: the run directory of the launch that wrote the resumed checkpoint (:func:`saved_by_run_dir`; None: fresh)
    earlier_run_dir: Optional[str] = None
    #: the job id the resumed checkpoint's manifest records (the launch that wrote it; None: fresh)
    earlier_job_id: Optional[str] = None


@dataclass
class LaunchIdentity:
    """Job id, token and gloo port (node 0's everywhere), boundary transports and slot sizes; ``shared``: node
    0's answer; ``store``: the job's ``TCPStore`` on ``port`` that this launcher hosts (single node, node 0;
    else None) until the job ends (:mod:`npu_train.runtime.jobstore`)."""

    job_id: str
    token: str
    port: int
    node_of_rank: list
    boundary: tuple
    slot_bytes: int
    slots: int
    shared: dict
    store: object = None


@dataclass
class StartedJob:
    """The coordinator, the metrics reporter, the packed data file (removed at the end) and the job id."""

    coord: object  # Coordinator
    reporter: object  # Reporter
    data_file: str
    job_id: str


def _calibrate_only(cfg) -> dict:
    """``calibrate=true``: measure this machine's cards and save the profile; no training."""
    from npu_train.backends.spec import parse_backend_list, resolve_cards
    from npu_train.calibrate import main_calibrate

    reqs = resolve_cards(parse_backend_list(as_list(cfg.backend)))
    kinds = [r.kind if r.index is None else f"{r.kind}:{r.index}" for r in reqs]
    model_path = cfg.model.path if _preset_config(cfg.model.path) is None else None
    saved = main_calibrate(kinds, modules=CARD_PROCESS_MODULES, model_path=model_path, profile=cfg.placement.profile)
    return {"calibrate": saved}


def dry_run_data_warning(cfg) -> Optional[str]:
    """``plan=true``'s one ``warning:`` (printed before it plans, folded within 100 columns) when ``data.source`` cannot be found on
    this machine: a real run here refuses it (:func:`~npu_train.data.rows.check_data_source`), but a dry
    run may plan for another machine that has the data; None when it is found."""
    from npu_train.data.rows import check_data_source

    try:
        check_data_source(cfg)
    except FileNotFoundError as e:
        return (f"warning: {e}; a real run here refuses it before planning (plan=true plans anyway: the data "
                "may be on the training server)")
    return None


def _dry_run(cfg, run_dir: str) -> dict:
    """``plan=true``: print the plan table for the target server; nothing is measured or started. A
    ``data.source`` missing here is one ``warning:`` line first (:func:`dry_run_data_warning`)."""
    from npu_train.planner import plan_table

    from npu_train.runtime.flops import predicted_mfu_line

    warn = dry_run_data_warning(cfg)
    if warn:  # folded at words within 100 columns, as the refusals are
        from npu_train.errors import refusal_text

        print(refusal_text(warn.removeprefix("warning: "), prefix="warning: "), file=sys.stderr, flush=True)
    prep = prepare(cfg, run_dir, probe=False)
    print(plan_table(prep.plan, width=console_columns()))
    line = predicted_mfu_line(prep)
    if line:
        print(line)
    if str(getattr(cfg.train, "objective", "sft")) == "dpo":
        tr = cfg.train
        # at most: rows repeat after an epoch; plus the held-out micro-batches
        rows = (tr.steps * tr.accum * prep.dp + int(cfg.data.eval_batches or 0)) * tr.micro_batch
        print(f"DPO: before step 1 a reference pass (forward only, no activations kept: inside the memory above) "
              f"over the at most {rows} sequences the {tr.steps} steps and the held-out batches use, about "
              f"{rows / prep.dp / (tr.micro_batch * tr.accum) * prep.plan.step_time_s / 3:.0f} s (a third of a step per "
              f"step's sequences{', spread over the replicas' if prep.dp > 1 else ''}); "
              "fewer when an earlier run on the same data and model stored them")
    host_need = prep.plan.host_bytes_all  # every replica's offloaded state (one node)
    try:
        import psutil

        here = psutil.virtual_memory().total
        if host_need > here:
            print(f"note: the offloaded optimizer state needs {host_need / 2**30:.1f} GiB of host RAM on the "
                  f"training server; this machine has {here / 2**30:.1f} GiB (not checked in a dry run)")
    except ImportError:
        pass
    return {"plan": True}


def _this_node(cfg) -> NodeContext:
    """This launcher's node: single node unless ``NNODES`` > 1 (then the rendezvous with the others)."""
    from npu_train.runtime.nodes import NodeLayout, Rendezvous, route_address

    layout = NodeLayout.from_env()
    if layout is None:
        return NodeContext(None, None, cfg.runtime.host or "127.0.0.1")
    # multi-node: this node's listening address (the interface that routes to MASTER_ADDR by default)
    host = cfg.runtime.host or route_address(layout.master_addr)
    return NodeContext(layout, Rendezvous(layout, cfg.runtime.startup_timeout_s), host)


def _prepare_data(cfg, prep: Prepared):
    """The packed data; ConfigError when the training split has fewer sequences than one micro-batch."""
    from npu_train.data.prepare import prepare_data

    data = prepare_data(cfg, prep.model_path, prep.model_cfg)
    mb = cfg.train.micro_batch
    if data.train.shape[0] < mb:
        raise ConfigError(f"the training split has {data.train.shape[0]} sequences, fewer than "
                          f"train.micro_batch={mb}: lower train.micro_batch or data.seq_len")
    return data


def _resume_point(cfg, prep: Prepared, data, run_dir: str, owner: bool = True) -> ResumePoint:
    """The checkpoint root and where this run starts in it (``train.resume``), every refusal first. A resume
    first removes dead jobs' staging dirs (the ``owner`` node): an interrupted save is named, never resumed."""
    from npu_train.checkpoint.store import check_reused_root, find_checkpoint, remove_stale_staging
    from npu_train.data.sampler import make_sampler

    tr = cfg.train
    # the sampler every card process uses (replica k takes the k-th share of each step's global batch)
    sampler = make_sampler(data.train.shape[0], tr.micro_batch, tr.accum, tr.seed, dp_size=prep.dp,
                           pairs=bool(getattr(data, "pairs", False)))
    point = ResumePoint(ckpt_root=checkpoint_root(cfg, run_dir),
                        saving=bool(cfg.checkpoint.save), sampler=sampler)
    # train.resume=auto: the newest complete checkpoint if there is one, else a fresh start (a restarted pod)
    interrupted = remove_stale_staging(point.ckpt_root) if tr.resume and owner else []
    for p in interrupted:
        print(f"removed {p}: staging directory of a job that is no longer running", flush=True)
    found = find_checkpoint(tr.resume, point.ckpt_root, interrupted=interrupted) if tr.resume else None
    if found is not None:
        _open_resume(cfg, prep, data, point, found)
    if point.complete:  # train.resume=auto found the run complete: nothing is written or started
        return point
    # another run's checkpoints in the root (a reused hydra.run.dir / checkpoint.dir) are never mixed in;
    # checkpoint.save=false: nothing is written into the root, so nothing can be mixed
    if point.saving:
        point.earlier = check_reused_root(point.ckpt_root, point.resume_dir, cfg.checkpoint.existing)
    if getattr(data, "pairs", False):
        point.reference = _reference_spec(cfg, prep, data, point)
    return point


def _reference_spec(cfg, prep: Prepared, data, point: ResumePoint) -> ReferenceSpec:
    """DPO: the rows of the reference pass (those this run draws from ``point.start_step`` on, and the held-out
    micro-batches, minus the ones a stored file holds)."""
    from npu_train.data.sampler import make_sampler
    from npu_train.env import cache_dir
    from npu_train.runtime.reference import needed_rows, reference_key, reference_spec

    tr = cfg.train
    samplers = [make_sampler(data.n_train, tr.micro_batch, tr.accum, tr.seed, dp_rank=k, dp_size=prep.dp, pairs=True)
                for k in range(prep.dp)]
    n_eval = len(eval_micro_batches(data.n_val, tr.micro_batch, int(cfg.data.eval_batches or 0), pairs=True))
    key = reference_key(data.fingerprint, prep.model_path, prep.dtype, [c.kind for c in prep.cards])
    return reference_spec(key, point.ckpt_root, point.saving, str(cache_dir("data")), n_train=data.n_train,
                          n_val=data.n_val, train_rows=needed_rows(samplers, point.start_step, tr.steps),
                          val_rows=list(range(n_eval * tr.micro_batch)), resuming=point.resume_dir is not None,
                          lora=tr.mode == "lora")


def _open_resume(cfg, prep: Prepared, data, point: ResumePoint, found: str) -> None:
    """Check the checkpoint ``found`` against this run and set ``point``'s resume dir, step and sampler."""
    from npu_train.checkpoint.store import open_resume_checkpoint

    tr = cfg.train
    if tr.offload_update == "delayed":
        raise ConfigError(f"train.offload_update=delayed cannot resume from {found} exactly (the card "
                          "weights one update behind the masters are not checkpointed): resume with "
                          "train.offload_update=sync, or start fresh without train.resume")
    reader = open_resume_checkpoint(found, point.ckpt_root, auto=tr.resume == "auto")
    point.resume_dir = reader.path
    point.earlier_run_dir = saved_by_run_dir(reader.manifest, point.ckpt_root)
    point.earlier_job_id = reader.manifest.get("job_id")
    reader.check_model(prep.model_cfg.to_dict())
    reader.check_mode(tr.mode, cfg.lora.rank, list(cfg.lora.targets))
    reader.check_objective(str(getattr(tr, "objective", "sft")))  # before the sampler speaks of n_sequences
    if tr.mode == "lora":  # the adapters were trained on the recorded base: refuse other weights at model.path
        for d in reader.check_base(_model_fingerprint(prep.model_path), prep.model_path,
                                   allow=tr.resume_mismatch == "allow"):
            print(f"note: resuming with a changed setting (train.resume_mismatch=allow): {d}", flush=True)
    allow = tr.resume_mismatch == "allow"
    files = _data_files_change(cfg, reader.manifest)
    try:  # before check_run: a data order no setting can continue is refused as such
        point.sampler.load_state_dict(reader.manifest.get("sampler", {}))
    except ValueError as e:
        if allow and files:  # the data changed on purpose: the new data's order from the resumed step on
            print(f"note: resuming onto changed data (train.resume_mismatch=allow): {files}; the data order "
                  f"continues from step {reader.step} over the data as it is now ({e})", flush=True)
        elif files:
            raise ConfigError(f"train.resume: data.source={cfg.data.source} changed since {point.resume_dir} was "
                              f"written: {files}; so the data/batch layout differs ({str(e).split('(', 1)[-1]}: "
                              "restore the data as it was to resume exactly, or set train.resume_mismatch=allow to "
                              f"continue on the data as it is now (its order from step {reader.step} on)") from None
        else:
            fix = _layout_fix(cfg, reader.manifest)
            if fix:
                raise ConfigError(f"cannot resume: {fix}, or start a fresh run without train.resume") from None
            raise ConfigError(f"{e}. The checkpoint's run settings are in {point.resume_dir}/manifest.json ('train'); "
                              "repeat the original run's overrides (data.source, data.seq_len, data.val_fraction, "
                              "train.seed, train.micro_batch, and train.accum x parallel.dp) together with train.resume") from None
    allowed = reader.check_run({k: getattr(tr, k) for k in reader.RUN_KEYS}, data.fingerprint,
                               allow=allow, data_change=files,
                               lora={"alpha": cfg.lora.alpha, "dropout": cfg.lora.dropout} if tr.mode == "lora" else None)
    for d in allowed:
        print(f"note: resuming with a changed setting (train.resume_mismatch=allow): {d}", flush=True)
    point.start_step = reader.step
    if point.start_step >= tr.steps:
        if tr.resume == "auto":  # a requeued / restarted finished run: success
            point.complete = True
            return
        # asked to train on from it, with nothing left: say how to train further
        raise ConfigError(f"checkpoint {point.resume_dir} is at step {point.start_step} but train.steps={tr.steps}: "
                          "the run is complete; to train further raise train.steps and set train.resume_mismatch=allow")


def vocab_on_shm(cfg, boundary: tuple) -> bool:
    """Whether the job's vocabulary exchange takes /dev/shm (its segments then count in the launcher's /dev/shm
    check): ``parallel.vocab`` on and :func:`~npu_train.pipeline.hosts.vocab_exchange_shm` of
    ``runtime.vocab_exchange`` over the job's ``boundary`` transports, the rule the cards
    (``StageTrainer._vocab_shm``) and the plan (``CostModel.vocab_shm``) apply."""
    from npu_train.pipeline.hosts import vocab_exchange_shm

    return (getattr(cfg.parallel, "vocab", False) is True
            and vocab_exchange_shm(getattr(cfg.runtime, "vocab_exchange", "gloo"), boundary))


def _launch_identity(cfg, prep: Prepared, data, resume: ResumePoint, node: NodeContext) -> LaunchIdentity:
    """Job id, token, the job's store (hosted here on a single node and node 0) and its port, transports, with
    the port and /dev/shm checks (dead jobs' leftovers freed first)."""
    from npu_train.pipeline import hosts as H
    from npu_train.runtime.jobstore import host_store
    from npu_train.runtime.leftovers import sweep_dead_jobs
    from npu_train.transport.shm import ShmTooSmallError

    rt, tr = cfg.runtime, cfg.train
    job_id, token = secrets.token_hex(6), secrets.token_hex(16)
    store, port = None, rt.port  # other nodes: node 0's port comes with its job id (shared["gloo_port"])
    if node.is_owner:  # gloo's rendezvous; held until the job ends: no port picked now and bound later
        if rt.port:
            check_port(node.host, rt.port)
        store = host_store(node.host, rt.port, rt.startup_timeout_s)
        port = store.port
    node_of_rank = H.node_of_rank(prep.node_counts)
    boundary = H.boundary_transports(node_of_rank, rt.transport)
    # shared-memory boundaries of this node (both stages here; the ring pair of boundary b is counted at stage b)
    n_shm = sum(1 for b, m in enumerate(boundary) if m == "shm" and (node.rdv is None or node_of_rank[b] == node.node_rank))
    shared = {}
    if node.rdv is not None:
        shared = _agree_between_nodes(prep, data, resume, node, job_id, token, port)
        job_id, token = shared["job_id"], shared["token"]
    elem = 2 if prep.dtype == "bf16" else 4
    slot_bytes = tr.micro_batch * cfg.data.seq_len * prep.model_cfg.hidden_size * elem
    slots = rt.slots or (min(tr.accum, len(prep.plan.stages)) + 1)
    # leftovers of jobs whose launcher is gone (kill -9 of a whole process group) free /dev/shm first
    swept = sweep_dead_jobs()
    if swept:
        print(f"removed shared memory and IPC directories of {len(swept)} dead job(s): {', '.join(swept)}", flush=True)
    vocab_shm = vocab_on_shm(cfg, boundary)
    if n_shm or vocab_shm:
        from npu_train.pipeline.schedule import chunks_per_card

        # per boundary a ring each way; two chunks per card: two pairs (ZB-V's way down and back up)
        need = 2 * chunks_per_card(tr.schedule) * n_shm * slots * (slot_bytes + 64)
        if vocab_shm:  # the vocabulary exchange's segments (pipeline/vocabshm.py), every replica
            from npu_train.pipeline.vocabshm import exchange_bytes

            need += prep.dp * exchange_bytes(tr.schedule, len(prep.plan.stages), tr.accum, slot_bytes)
        avail = _shm_free_bytes()
        if avail < need:
            raise ShmTooSmallError(f"npt_{job_id}_*", need, avail)
    return LaunchIdentity(job_id=job_id, token=token, port=port, node_of_rank=node_of_rank, boundary=boundary,
                          slot_bytes=slot_bytes, slots=slots, shared=shared, store=store)


def _agree_between_nodes(prep: Prepared, data, resume: ResumePoint, node: NodeContext, job_id: str, token: str,
                         port: int) -> dict:
    """Multi-node: one plan, data, resume point, job id/token/port and a checkpoint root every node sees."""
    from npu_train.runtime import nodes as N

    node.rdv.check_same("plan", N.plan_digest(prep.plan, data.fingerprint, resume.start_step, resume.resume_dir),
                        "placement plans, data or resume points", "give every node the same data and checkpoint "
                        "files and calibration profiles (placement.profile), or fix the split with train.split")
    marker = os.path.join(resume.ckpt_root, f".npt-shared-{job_id}")
    if node.layout.is_master:  # the checkpoint root must be one directory seen by every node
        os.makedirs(resume.ckpt_root, exist_ok=True)
        open(marker, "w").close()
    shared = N.share_job(node.rdv, job_id=job_id, token=token, gloo_port=port)
    if not node.layout.is_master:
        N.check_shared_root(resume.ckpt_root, shared["job_id"])
    return shared


@contextlib.contextmanager
def _private_ipc_dir(job_id: str, node: NodeContext):
    """The job's 0700 directory (in TMPDIR) and owner record, removed on an exception before the coordinator
    owns them."""
    from npu_train.runtime.leftovers import discard_job_ipc, write_job_owner

    ipc_dir = tempfile.mkdtemp(prefix=f"npt-{job_id}-")
    os.chmod(ipc_dir, 0o700)
    write_job_owner(job_id, ipc_dir, node=node.node_rank)
    try:
        yield ipc_dir
    except BaseException:
        discard_job_ipc(job_id, ipc_dir)
        raise


def _start_job(cfg, run_dir: str, prep: Prepared, data, resume: ResumePoint, launch: LaunchIdentity,
               node: NodeContext, ipc_dir: str, live=None) -> StartedJob:
    """Write the run's files (metrics moved aside, packed data, ``plan.json``), build the specs and the
    coordinator."""
    from npu_train.data.packfile import save_packed
    from npu_train.metrics.report import Reporter
    from npu_train.runtime.flops import model_flops_per_rank

    _rotate_run_dir(run_dir, resume)
    node_plan = link = None
    if node.rdv is not None:
        node_plan, link = _join_nodes(cfg, resume, launch, node, ipc_dir)
    # in the private IPC dir, not the run dir: a resume packs the data again (checked against the checkpoint's
    # fingerprint), and that dir goes on every exit path, launcher killed included (runtime/leftovers.py).
    # Data mapped from the cache is hard-linked there (same file system) or named where it is: never copied.
    data_file = os.path.join(ipc_dir, "data.safetensors")
    if data.path is not None:
        try:
            os.link(data.path, data_file)
        except OSError:
            data_file = data.path
    else:
        save_packed(data, data_file,
                    where="set TMPDIR to a directory on a larger disk (the job's private dir is made there)")
    plan, rt, train = prep.plan, cfg.runtime, train_spec(cfg, prep.dtype, prep.model_cfg)
    # no fixed receive / collective timeout: liveness is the coordinator's heartbeat check (issue 12)
    runtime = RuntimeSpec(heartbeat_interval_s=float(rt.heartbeat_interval_s), transport=rt.transport,
                          threads=prep.threads,  # the figure the plan used (planner.threads_per_card)
                          keep_host_memory=bool(rt.keep_host_memory), trace=bool(rt.trace),
                          overlap_copies=rt.overlap_copies, vocab_exchange=getattr(rt, "vocab_exchange", "gloo"),
                          **furiosa_runtime_fields(cfg, plan))
    specs = build_worker_specs(plan, prep, train=train, runtime=runtime, job_id=launch.job_id, token=launch.token,
                               data_file=data_file, start_step=resume.start_step, resume_dir=resume.resume_dir,
                               ckpt_root=resume.ckpt_root, ipc_dir=ipc_dir, host=node.host, port=launch.port,
                               slot_bytes=launch.slot_bytes, slots=launch.slots, nodes=node_plan,
                               reference=resume.reference)
    _announce(cfg, run_dir, prep, data, resume, launch, node, len(specs))
    reporter = Reporter(run_dir, cfg.train.steps, predicted_mem=[s.mem["total"] for s in plan.stages] * prep.dp,
                        predicted_step_s=plan.step_time_s, trackers=_open_trackers(cfg, run_dir, plan, resume, node),
                        model_flops=model_flops_per_rank(prep), live=live, plain_phases=True,
                        start_step=resume.start_step, positions_per_step=plan.tokens_per_step)
    coord = _coordinator_class()(specs, run_dir=run_dir, ipc_dir=ipc_dir, job_id=launch.job_id, token=launch.token,
                        heartbeat_timeout_s=rt.heartbeat_timeout_s, startup_timeout_s=rt.startup_timeout_s,
                        steps=cfg.train.steps, start_step=resume.start_step, ckpt_root=resume.ckpt_root,
                        ckpt_keep=cfg.checkpoint.keep,
                        manifest_base={**_manifest_base(cfg, prep, data, resume, launch, train),
                                       "run_dir": os.path.abspath(run_dir)},
                        save_on_interrupt=cfg.train.save_on_interrupt and resume.saving,
                        reporter=reporter, coord_addr=specs[0].coord_addr, node_link=link,
                        node=node.node_rank, nnodes=node.nnodes)
    return StartedJob(coord=coord, reporter=reporter, data_file=data_file, job_id=launch.job_id)


def _open_trackers(cfg, run_dir: str, plan, resume: ResumePoint, node: NodeContext) -> list:
    """``metrics.logger``'s trackers (:mod:`npu_train.metrics.trackers`) on node 0 (the one that reports);
    a resumed run continues the tracker runs recorded in its checkpoint dir."""
    from omegaconf import OmegaConf

    from npu_train.metrics.report import dir_label
    from npu_train.metrics.trackers import TrackerSetup, open_trackers

    met = cfg.get("metrics") if hasattr(cfg, "get") else None
    names = as_list(met.logger) if met is not None else ["tensorboard"]
    names = [names] if isinstance(names, str) else names
    if not names or not node.is_owner:
        return []
    conf = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else {}
    name = met.run_name or dir_label(run_dir)
    setup = TrackerSetup(run_dir=run_dir, config=conf, plan=plan.to_dict(), project=str(met.project), run_name=name,
                         group=_sweep_group(), ckpt_root=resume.ckpt_root if resume.saving else None,
                         resuming=resume.resume_dir is not None, mlflow_uri=met.mlflow_uri)
    from npu_train.metrics.report import still_saying

    with still_saying(f"opening the tracker(s) {', '.join(map(str, names))} (their imports take seconds)"):
        return open_trackers(names, setup)


def _sweep_group():
    """The sweep (Hydra multirun) directory's name this job belongs to, e.g. ``2026-12-03/10-00-00.123456``;
    None for a single run."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from npu_train.metrics.report import dir_label

        hc = HydraConfig.get()
        if hc.mode == RunMode.MULTIRUN:
            return dir_label(str(hc.sweep.dir))
    except Exception:  # noqa: BLE001 - not under Hydra (tests, library use)
        pass
    return None


def fold_words(line: str, width: int) -> str:
    """``line`` folded at words to ``width`` columns (continuation lines indented by two spaces; a terminal
    otherwise breaks a long line mid-word), each of its own lines (``\\n``) apart, those indented keeping their
    indent (:func:`~npu_train.metrics.report.fold_long_line`: a ``label: <path>`` line stays whole); unchanged
    when ``width`` is 0."""
    from npu_train.errors import wrap_words  # never between a number and its unit
    from npu_train.metrics.report import fold_long_line

    if width <= 0:
        return line
    return "\n".join(("\n".join(wrap_words(ln, width)) or ln) if k == 0 or not ln.startswith(" ")
                     else fold_long_line(ln, width) for k, ln in enumerate(line.split("\n")))


def _rotate_run_dir(run_dir: str, resume: ResumePoint) -> None:
    """Move an earlier launch's outputs aside (a resumed run's metrics continue from them)."""
    from npu_train.metrics.report import (CONTINUED, ContinuedLaunch, carry_over, launch_accepted, newest_records,
                                          rotate_previous_run)

    launch_accepted()  # past every run-dir refusal: this launch's held-back run.log lines go to the file now
    if resume.resume_dir and resume.earlier_run_dir:  # the launch it continues: marked however this one ends
        CONTINUED[:] = [ContinuedLaunch(resume.earlier_run_dir, resume.resume_dir, resume.start_step)]
    with contextlib.suppress(OSError):  # packed data a killed launch of an older version left in the run dir
        os.remove(os.path.join(run_dir, "data.safetensors"))
    moved = rotate_previous_run(run_dir)
    if moved:
        print(f"note: {run_dir} held the records of an earlier launch; moved them to {moved}", flush=True)
    records = newest_records(run_dir) if resume.resume_dir else None  # a plan=true launch may sit in between
    if records is None and resume.resume_dir:  # resumed into another run dir: the saving launch's records
        records = _saving_launch_records(run_dir, resume)
    if records and carry_over(records, run_dir, resume.start_step):
        print(f"note: metrics.jsonl and eval.jsonl continue with the steps up to {resume.start_step} of {records}",
              flush=True)


def _saving_launch_records(run_dir: str, resume: ResumePoint) -> Optional[str]:
    """A launch resumed into a run dir other than the one that saved its checkpoint (the default
    ``outputs/<date>/<time>`` of a new launch): that earlier run dir, whose ``metrics.jsonl`` / ``eval.jsonl``
    :func:`~npu_train.metrics.report.carry_over` copies up to the resumed step, so that this launch's files
    and ``loss.png`` cover the whole run, as a resume into the same run dir does; the earlier dir is only read.
    None unless that dir still holds the saving launch's records (its ``job.json`` names the checkpoint's
    job id: a later launch into it wrote other records) and is not ``run_dir``."""
    earlier = resume.earlier_run_dir
    if not earlier or not resume.earlier_job_id or os.path.abspath(earlier) == os.path.abspath(run_dir):
        return None
    try:
        with open(os.path.join(earlier, "job.json")) as f:
            same = json.load(f).get("job_id") == resume.earlier_job_id
    except (OSError, ValueError, AttributeError):
        return None
    return earlier if same and os.path.isfile(os.path.join(earlier, "metrics.jsonl")) else None


def _join_nodes(cfg, resume: ResumePoint, launch: LaunchIdentity, node: NodeContext, ipc_dir: str):
    """Multi-node: ``(NodePlan, NodeLink)``; node 0 then removes the shared-root marker."""
    from npu_train.runtime.nodes import join_nodes

    node_plan, link = join_nodes(node.rdv, node.layout, launch.node_of_rank, launch.boundary, ipc_dir, node.host,
                                 launch.shared, cfg.runtime)
    if node.layout.is_master:
        with contextlib.suppress(OSError):
            os.remove(os.path.join(resume.ckpt_root, f".npt-shared-{launch.job_id}"))
    return node_plan, link


def write_whole(path: str, text: str) -> None:
    """Write ``text`` to ``path``; a write that fails (a full disk) leaves no partial file and raises its OSError
    with the file's name."""
    try:
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.remove(path)
        raise OSError(e.errno, e.strerror, path) from None


def _announce(cfg, run_dir: str, prep: Prepared, data, resume: ResumePoint, launch: LaunchIdentity,
              node: NodeContext, local_cards: int) -> None:
    """Print the plan table and the job line, write ``plan.json``."""
    from npu_train.optim.lr import warmup_note
    from npu_train.planner import plan_table
    from npu_train.planner.table import plan_summary

    plan, tr, P, dp = prep.plan, cfg.train, len(prep.plan.stages), prep.dp
    write_whole(os.path.join(run_dir, "plan.txt"), plan_table(plan) + "\n")
    if _sweep_group() is None:
        print(plan_table(plan, width=console_columns()), flush=True)
    else:  # a sweep job: jobs print concurrently into one console; the table is in the job's plan.txt
        print(f"plan: {plan_summary(plan)} (table: {os.path.join(run_dir, 'plan.txt')})", flush=True)
    from npu_train.runtime.flops import predicted_mfu_line

    line = predicted_mfu_line(prep)
    if line:
        print(line, flush=True)
    write_whole(os.path.join(run_dir, "plan.json"), json.dumps(plan.to_dict(), indent=1))  # read by planner.fit
    where = f"node {node.node_rank}/{node.nnodes} ({local_cards} local card(s), host {node.host}), " if node.layout else ""
    lora = f"LoRA r={cfg.lora.rank} alpha={cfg.lora.alpha:g} on {','.join(cfg.lora.targets)}, " if tr.mode == "lora" else ""
    print(f"job {launch.job_id}: {where}{P * dp} card process(es) ({dp} replica(s) x {P} stage(s)), "
          f"{prep.model_cfg.name}, {data.train.shape[0]:,} train / {data.val.shape[0]:,} "
          f"val sequences of {cfg.data.seq_len} tokens, dtype {prep.dtype}, schedule {tr.schedule}, "
          f"{lora}micro-batch {tr.micro_batch} x accumulation {tr.accum}; run dir {run_dir}", flush=True)
    if resume.resume_dir:
        print(f"resuming from {resume.resume_dir} at step {resume.start_step}", flush=True)
    held_out = eval_note(data.val.shape[0], tr.micro_batch, int(cfg.data.eval_batches or 0), tr.objective == "dpo")
    if held_out:
        print(held_out, flush=True)
    if resume.reference is not None:
        print(reference_plan_line(resume.reference, data, tr, plan.step_time_s, cfg.dpo, dp), flush=True)
    note = warmup_note(lr=float(tr.lr), warmup_steps=int(tr.warmup_steps), total_steps=int(tr.steps))
    if note:
        print(note, flush=True)


def reference_plan_line(ref: ReferenceSpec, data, tr, step_s: float, dpo, dp: int = 1) -> str:
    """The DPO line under the plan: objective settings and the reference pass's cost (computed or read).

    Time: a forward pass over the rows to compute, spread over the ``dp`` replicas (whole micro-batches,
    :func:`~npu_train.runtime.reference.pass_shares`): the largest share, estimated as a third of the plan's
    step time (one replica's) per ``micro_batch x accum`` rows (a forward is about a third of a forward +
    backward; the pipeline fill and the values' exchange are not counted). Memory: the pass keeps no
    activations (no_grad), so it stays inside each card's planned training peak; the last stage holds one
    float64 per row in host memory."""
    from npu_train.runtime.reference import pass_shares

    rows = ref.n_compute
    what = (f"DPO (loss {dpo.loss}, beta {dpo.beta:g}"
            + (f", label smoothing {dpo.label_smoothing:g}" if dpo.label_smoothing else "") + f"): "
            f"{data.n_train // 2} train / {data.n_val // 2} val pairs, {tr.micro_batch // 2} pair(s) per micro-batch; ")
    if not ref.compute:
        return what + f"reference log-probabilities of the rows it uses read from {ref.existing()}"
    most = max(len(t) + len(v) for t, v in zip(*pass_shares(ref, tr.micro_batch, dp)))  # the busiest replica's
    est = most / max(1, tr.micro_batch * tr.accum) * step_s / 3.0
    base = "the base model (LoRA adapters disabled)" if tr.mode == "lora" else "the initial weights"
    return (what + f"reference pass over the {rows} sequences it uses" + (" (the rest stored)" if ref.existing() else "")
            + f" with {base} before step 1" + (f", spread over the {dp} replicas" if dp > 1 else "")
            + f", about {est:.0f} s by the plan, "
            f"inside the planned training memory (no activations kept; {8 * rows / 2**20:.2f} MiB of host "
            "memory on the last stage), stored beside the data cache"
            + (" and in the checkpoint root" if ref.run_file else " (checkpoint.save=false: not in a checkpoint root)"))


def _manifest_base(cfg, prep: Prepared, data, resume: ResumePoint, launch: LaunchIdentity, train: TrainSpec) -> dict:
    """The fields every checkpoint manifest of this job carries (the coordinator adds the step's)."""
    plan, P = prep.plan, len(prep.plan.stages)
    return {"model": prep.model_cfg.to_dict(), "world_size": P, "job_id": launch.job_id,
            "split": [[s.first_layer, s.last_layer] + (list(s.second) if s.second else []) for s in plan.stages],
            # layers each card recomputes whole (None: every layer, or no recompute): a resumed
            # train.schedule=auto launch keeps them (_resumed_recompute_layers)
            "recompute_layers": [s.recompute_layers for s in plan.stages],
            "parallel": {"dp": prep.dp, "pp": P, "zero": prep.zero},
            "sampler": resume.sampler.state_dict(),
            "data_fingerprint": data.fingerprint, "train": train.to_dict(),
            "data_source": str(cfg.data.source), "data_files": _data_files(cfg),
            "model_path": prep.model_path, "model_fingerprint": _model_fingerprint(prep.model_path),
            "tokenizer_path": _tokenizer_path(cfg, prep.model_path)}


def saved_by_run_dir(manifest: dict, ckpt_root: str) -> Optional[str]:
    """The run directory of the launch that wrote a checkpoint: its manifest's ``run_dir``; for a checkpoint
    written before that was recorded, the root's parent when the root is ``<run dir>/checkpoints`` (the default
    ``checkpoint.dir``) and that directory holds a ``status.json``; else None."""
    recorded = manifest.get("run_dir")
    if isinstance(recorded, str) and recorded:
        return recorded
    root = os.path.abspath(ckpt_root)
    parent = os.path.dirname(root)
    if os.path.basename(root) == "checkpoints" and os.path.isfile(os.path.join(parent, "status.json")):
        return parent
    return None


def _data_files(cfg) -> Optional[dict]:
    """:func:`~npu_train.data.sources.source_files` of ``data.source`` (None when it cannot be listed)."""
    from npu_train.data.sources import resolve_source, source_files

    d = cfg.data
    try:
        return source_files(resolve_source(d.source, str(getattr(d, "format", "text") or "text"),
                                           str(getattr(d, "split", None) or "train"), getattr(d, "val_split", None)))
    except (UserError, OSError, ValueError):
        return None


def _layout_fix(cfg, manifest: dict) -> Optional[str]:
    """For a resume whose data order differs from the checkpoint's: the batch settings that differ from the
    checkpoint's manifest (``train.micro_batch``, ``train.accum``, ``parallel.dp``, ``train.seed``), as
    ``train.accum: checkpoint 2, now 4 (the data order of each step depends on it): resume with train.accum=2``;
    None when none of them differs (the data itself, data.seq_len or data.val_fraction changed)."""
    t, par = manifest.get("train") or {}, manifest.get("parallel") or {}
    saved = {"train.micro_batch": t.get("micro_batch"), "train.accum": t.get("accum"), "parallel.dp": par.get("dp"),
             "train.seed": t.get("seed")}
    now = {"train.micro_batch": cfg.train.micro_batch, "train.accum": cfg.train.accum, "parallel.dp": cfg.parallel.dp,
           "train.seed": cfg.train.seed}
    diff = [k for k, v in saved.items() if v is not None and str(v) != str(now[k])]
    if not diff:
        return None
    which = "; ".join(f"{k}: checkpoint {saved[k]}, now {now[k]}" for k in diff)
    return (f"{which} (the data order of each step depends on {'it' if len(diff) == 1 else 'them'}): resume with "
            + " ".join(f"{k}={saved[k]}" for k in diff))


def _data_files_change(cfg, manifest: dict) -> str:
    """The files of ``data.source`` added, removed or changed since the checkpoint ``manifest`` was written
    (:func:`~npu_train.data.sources.files_change`); ``""`` when none, when ``data.source`` names another source
    than the checkpoint's run did, or when the manifest has no record."""
    from npu_train.data.sources import files_change

    before = manifest.get("data_files")
    if not isinstance(before, dict) or manifest.get("data_source") != str(cfg.data.source):
        return ""  # another data.source (or an older checkpoint): the fingerprint's message says it
    now = _data_files(cfg)
    if now is None:
        return ""
    return files_change(before, now)


def _tokenizer_path(cfg, model_path: Optional[str]) -> Optional[str]:
    """The tokenizer's absolute path as the checkpoints record it: ``model.tokenizer``, else the model's."""
    if not cfg.model.tokenizer:
        return model_path
    from npu_train.model import resolve_model_path

    return os.path.abspath(resolve_model_path(cfg.model.tokenizer))


def _model_fingerprint(model_path: Optional[str]) -> Optional[str]:
    """:func:`~npu_train.model.weights.model_fingerprint` of the model (a LoRA resume and export check the base
    with it), None when it cannot be read."""
    from npu_train.model.weights import model_fingerprint

    try:
        return model_fingerprint(model_path) if model_path else None
    except OSError:
        return None


def _supervise(job: StartedJob, cfg, resume: ResumePoint) -> None:
    """Run the card processes to their end; removes the packed data on every path. The reporter stays open
    when the coordinator returns, so :func:`_finish` hands the summary to the trackers before closing them;
    on a failure it is closed here. Signals after the coordinator's teardown are only noted
    (:func:`defer_signals`)."""
    defer_signals()
    try:
        _run_coordinator(job, cfg, resume)
    except BaseException:
        job.reporter.close()
        raise
    finally:
        with contextlib.suppress(OSError):
            os.remove(job.data_file)


def _run_coordinator(job: StartedJob, cfg, resume: ResumePoint) -> None:
    """``job.coord.run()`` with a failure's message naming what the run can go on from."""
    try:
        job.coord.run()
    except Interrupted as e:  # checkpoint.save=false stops at once: say that there is nothing to resume
        if resume.saving:
            raise
        raise Interrupted(e.signum, interrupt_note(None, resume.ckpt_root, cfg.train.offload_update,
                                                   save=False)) from None
    except JobFailed as e:  # name the checkpoint the run can go on from (status.json: checkpoint, resume)
        ck, note = last_checkpoint_note(resume.ckpt_root, cfg.train.offload_update, job.coord.run_dir)
        raise JobFailed(f"{e}; {note}", checkpoint=ck, checkpoint_dir=resume.ckpt_root if ck else None,
                        failure=str(e)) from None


def _finish(job: StartedJob, cfg, run_dir: str, prep: Prepared, resume: ResumePoint, node: NodeContext,
            resume_with=None) -> dict:
    """The run summary and the last line; :class:`Interrupted` when the run was stopped by a signal before
    its last step. A signal after it (during the final evaluation or save) stops nothing: the run is complete
    with its final checkpoint, so it ends as done (exit 0, ``status.json`` ``ok``; a Kubernetes Job or Slurm
    job that did all its work succeeds), with a note, and no resume command that would be refused.
    ``resume_with``: as for :func:`run_job` (the ``stopped:`` line's command)."""
    from npu_train.planner.fit import refit_from_run

    from npu_train.metrics.report import phase_peaks

    coord, tr, plan = job.coord, cfg.train, prep.plan
    # each card's peak per phase over the whole run (the last save and evaluation too), from its "done" message
    final = phase_peaks([r.mem_phases for r in coord.ranks])
    summ = job.reporter.finish({"checkpoint": coord.last_ckpt, "job_id": job.job_id,
                                "cards": [c.name for c in prep.cards], "node": node.node_rank, "nnodes": node.nnodes,
                                "predicted_step_s": plan.step_time_s,
                                "predicted_mem_bytes": [s.mem["total"] for s in plan.stages] * prep.dp,
                                # where a resumed launch continued from (launch/run.py marks that launch's dir)
                                **({"resumed_from": resume.resume_dir, "resumed_at_step": resume.start_step,
                                    "earlier_run_dir": resume.earlier_run_dir} if resume.resume_dir else {}),
                                **({"run_peak_mem_bytes": final["mem_run_peak_bytes"],
                                    "phase_peak_mem_bytes": final["mem_phase_peak_bytes"]} if final else {})})
    if coord.rejected:
        print(f"note: ignored {coord.rejected} unauthenticated message(s) on the coordinator socket "
              "(wrong or missing job token)", file=sys.stderr, flush=True)
    at = resume.start_step + int(summ["steps_run"])
    if coord.interrupted and not (at >= tr.steps and coord.last_ckpt):
        raise Interrupted(coord.signum, interrupt_note(coord.last_ckpt, resume.ckpt_root, tr.offload_update,
                                                       resume.saving),
                          checkpoint=coord.last_ckpt, checkpoint_dir=resume.ckpt_root)
    if coord.interrupted:  # after the last step (during the final eval or save): the run's work is done, exit 0
        print(f"note: {signal.Signals(coord.signum).name} came after the last step: the run is complete (its final "
              f"checkpoint {coord.last_ckpt} is saved), nothing to resume", flush=True)
    # figures fitted from this run (planner.fit), never raises; a run returning freed memory, or under the
    # user's own malloc settings, is not the default's speed: only its memory figure is kept
    from npu_train.hostmem import user_malloc_settings

    fit_note = ""  # the run's speed not fitted: its host was busy with other work
    if job.reporter.records_failed is None:  # records cut short by a full run dir: nothing to fit from
        fit_note = refit_from_run(run_dir, plan.rates,
                                  timing=bool(cfg.runtime.keep_host_memory) and not user_malloc_settings())
    width = console_columns()
    words = resume_with(resume.ckpt_root) if resume_with is not None and at < tr.steps and coord.last_ckpt else None
    print(fold_words(end_of_run_line(summ, at, tr, coord.last_ckpt, resume.ckpt_root, resume.saving, run_dir,
                                     resume_words=words, width=width, fit_note=fit_note), width), flush=True)
    if at < tr.steps:  # train.stop_after ended this launch early; status.json: where the run stands
        summ.update(stopped_at=at, checkpoint_dir=resume.ckpt_root if coord.last_ckpt else None)
    elif node.is_owner and _sweep_group() is None:  # the default job: what to try next (runtime/hints.py)
        from npu_train.runtime.hints import next_steps

        for line in next_steps(cfg, resume.ckpt_root if coord.last_ckpt else None):
            print(line, flush=True)
    return summ
