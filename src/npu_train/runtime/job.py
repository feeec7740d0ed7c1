"""Job preparation: everything between the parsed configuration and the first card process.

:func:`run_job` validates the configuration, resolves ``backend=`` into cards, plans the placement
(:mod:`npu_train.planner`), checks the model files' headers, tokenizes and packs the data, checks
the resume checkpoint, ``/dev/shm`` and ports, builds one :class:`~npu_train.runtime.spec.WorkerSpec`
per card (:func:`build_worker_specs`, the only place they are built), then hands them to the
:class:`~npu_train.runtime.coordinator.Coordinator`. Every check that can reject the job runs before
anything is written, and raises a :class:`~npu_train.errors.UserError` naming the fix.
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import tempfile
from dataclasses import dataclass
from typing import Optional

from npu_train.env import getenv
from npu_train.errors import ConfigError, Interrupted, UserError
from npu_train.runtime.coordinator import Coordinator
from npu_train.runtime.saving import end_of_run_line, interrupt_note, prepare_checkpoint_root
from npu_train.runtime.spec import CardInfo, RuntimeSpec, StageInfo, TrainSpec, WorkerSpec
from npu_train.runtime.specs import furiosa_cache_dir, furiosa_runtime_fields, model_index, pipeline_stages, run_shape, train_spec
from npu_train.transport.channel import Endpoint


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
    """Planner :class:`~npu_train.planner.CardSpec` of one node's resolved card requests.

    Capacity: the backend's (``placement.capacity_gib`` overrides it); CPU cards share the node's
    RAM equally. Names: ``cpu`` (one CPU card) or ``cpu:<i>``, ``<kind>:<index>``, after ``prefix``
    (multi-node: ``node1/``, so every card of the job has a distinct name).
    """
    from npu_train.planner import CardSpec, default_capacity

    n_cpu = sum(1 for r in reqs if r.kind == "cpu")
    cards = []
    for r in reqs:
        cap = default_capacity(r.kind)
        if r.kind == "cpu" and n_cpu:
            cap = cap // n_cpu
        if cfg.placement.capacity_gib:
            cap = int(cfg.placement.capacity_gib * 2 ** 30)
        name = r.kind if r.kind == "cpu" and n_cpu == 1 else (f"cpu:{len([c for c in cards if c.kind == 'cpu'])}" if r.kind == "cpu" else f"{r.kind}:{r.index}")
        cards.append(CardSpec(kind=r.kind, index=r.index, capacity_bytes=cap, name=prefix + name))
    return cards


@dataclass
class Prepared:
    """What the launcher knows before any card process starts (the result of :func:`prepare`)."""

    cards: list  # planner CardSpec of every card of the job (node order, then card order)
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
    """Validate ``cfg`` and build everything needed before a card process starts.

    Returns a :class:`Prepared`. Multi-node (``nodes``: a
    :class:`~npu_train.runtime.nodes.Rendezvous`): the nodes exchange their cards, thread counts and
    host RAM, and every node plans over ALL cards of the job (node order, then card order), with the
    smallest thread count of any node, so the same inputs give every node the same plan.
    Raises a :class:`~npu_train.errors.UserError` on bad input.
    """
    from npu_train.backends.spec import parse_backend_list, resolve_cards
    from npu_train.config import compute_dtype, validate
    from npu_train.model import check_weights, load_config, resolve_model_path
    from npu_train.planner import load_rates, make_plan, threads_per_card
    from npu_train.planner.memterms import load_memory_terms

    validate(cfg)
    reqs = resolve_cards(parse_backend_list(as_list(cfg.backend)), probe=probe)
    # one thread count for the plan's step time and the card processes (WorkerSpec.runtime.threads)
    threads = plan_threads = threads_per_card(cfg.runtime.threads, len(reqs))
    try:
        import psutil

        host_ram = psutil.virtual_memory().total
    except Exception:
        host_ram = None
    cards, node_counts, node_ram = card_specs(reqs, cfg), [len(reqs)], [host_ram]
    if nodes is not None:  # every node's cards, in node order (runtime/nodes.py)
        from npu_train.runtime.nodes import exchange_cards

        cards, node_counts, plan_threads, node_ram = exchange_cards(nodes, cards, threads, host_ram)
    mcfg, model_path = _preset_config(cfg.model.path), None
    if mcfg is None:
        model_path = resolve_model_path(cfg.model.path)
    elif not cfg.plan:
        raise ConfigError(f"model.path={cfg.model.path} is a shape preset without weights: use it with plan=true, "
                          "or point model.path at an HF directory or a GGUF file")
    tr, dtype = cfg.train, compute_dtype(cfg.train.dtype, [c.kind for c in cards])
    if model_path is not None:
        mcfg = load_config(model_path)
        if not cfg.plan:
            check_weights(model_path, mcfg)
    P, dp, zero = pipeline_stages(cfg, mcfg, [c.kind for c in cards])
    shape = run_shape(cfg, mcfg, dtype)
    rates = [load_rates(c.kind, cfg.placement.profile, threads=plan_threads) for c in cards[:P]]
    fur = cfg.runtime.furiosa
    terms = [load_memory_terms(c.kind, cfg.placement.profile,
                               loaded_modules=fur.loaded_modules if c.kind == "furiosa" else None)
             for c in cards[:P]]
    resident = as_list(tr.resident_layers)
    if isinstance(resident, str) and resident != "auto":
        try:
            resident = int(resident)
        except ValueError:
            raise ConfigError(f"train.resident_layers={resident!r}: use auto, an integer, or a list per card") from None
    # A dry run plans for the target server, not this machine: its host RAM is not checked then
    # (the table shows the host GiB the offloaded state needs). Multi-node: checked per node below.
    # one pipeline is planned (replica 0's cards; every replica has the same kinds), for dp replicas
    plan = make_plan(mcfg, shape, cards[:P], rates, split=as_list(tr.split), resident_layers=resident,
                     host_ram_bytes=None if (cfg.plan or nodes is not None) else host_ram, threads=plan_threads,
                     headroom=float(cfg.placement.headroom), memory_terms=terms, dp=dp, zero=zero)
    if any(c.kind == "furiosa" for c in cards):
        plan.compiler_cache_dir = furiosa_cache_dir(cfg)
    if nodes is not None:
        from npu_train.runtime.nodes import check_node_host_ram

        check_node_host_ram(plan, node_counts, node_ram)
    return Prepared(cards=cards, requests=reqs, model_cfg=mcfg, plan=plan, shape=shape, dtype=dtype,
                    model_path=model_path, threads=threads, node_counts=node_counts, dp=dp, zero=zero)


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
    """Free bytes in /dev/shm; ``NPT_SHM_FREE_BYTES`` overrides the figure (test-only: simulates
    a small /dev/shm, e.g. Docker's 64 MB default, for the pre-spawn check)."""
    from npu_train.transport.shm import shm_free_bytes

    override = getenv("SHM_FREE_BYTES")
    return int(override) if override else shm_free_bytes()


def resident_param_names(model_cfg, stage, lora_targets=()) -> list[str]:
    """HF names of a stage's parameters that are resident (master + moments on the card).

    Decoder layers follow the plan; the embedding, final norm and LM head follow the plan's
    ``nonlayer_resident`` flag (the placement model's choice, so memory is predicted for what runs).
    With LoRA (``lora_targets`` non-empty) the resident layers' adapter names are listed as well (the
    frozen base weights have no optimizer state, so listing them is harmless).
    """
    from npu_train.model.lora import lora_param_names

    names = []
    for i in stage.resident:
        names += model_cfg.layer_param_names(i)
        if lora_targets:
            names += lora_param_names(i, lora_targets)
    if stage.nonlayer_resident:
        if stage.has_embed:
            names.append("model.embed_tokens.weight")
        if stage.has_head:
            names += ["model.norm.weight", "lm_head.weight"]
    return names


#: modules a card process imports (calibration measures their resident memory as the process baseline)
CARD_PROCESS_MODULES = ("npu_train.runtime.worker", "npu_train.runtime.trainer", "npu_train.backends",
                        "npu_train.optim.adamw", "npu_train.pipeline.stage", "npu_train.data.dataset",
                        "npu_train.checkpoint.store", "npu_train.transport")


def build_worker_specs(plan, prep: Prepared, *, train: TrainSpec, runtime: RuntimeSpec, job_id: str, token: str,
                       data_file: str, start_step: int, resume_dir: Optional[str], ckpt_root: str, ipc_dir: str,
                       host: str, port: int, slot_bytes: int, slots: int, nodes=None) -> list[WorkerSpec]:
    """One :class:`~npu_train.runtime.spec.WorkerSpec` per card (the only place they are built): global rank
    ``r = replica * P + stage`` runs stage ``r % P`` of ``plan`` on ``prep.cards[r]``, for ``prep.dp``
    replicas (:class:`~npu_train.runtime.layout.ParallelLayout`).

    Addresses: with the ``shm`` transport the boundary mailboxes and the coordinator are ipc sockets in
    ``ipc_dir``; with ``inline`` they are TCP ports on ``host``. gloo rendezvous: ``tcp://host:port``.
    Multi-node (``nodes``: this node's :class:`~npu_train.runtime.nodes.NodePlan`): specs for this
    node's cards only (global ranks), with the job's mailbox addresses, per-boundary transports
    (``inline`` across nodes) and gloo rendezvous from ``nodes``; the coordinator socket is local.
    """
    from npu_train.runtime.layout import ParallelLayout

    P = len(plan.stages)
    dp, zero = prep.dp, prep.zero
    layout = ParallelLayout(dp, P)
    mcfg, index = prep.model_cfg, model_index(prep.model_path)  # GGUF: the tensor table, parsed once
    if runtime.transport == "shm":
        inbox = tuple(f"ipc://{ipc_dir}/r{r}.sock" for r in range(layout.world))
        coord_addr = f"ipc://{ipc_dir}/coord.sock"
    else:
        inbox = tuple(f"tcp://{host}:{Endpoint.free_tcp_port(host)}" for _ in range(layout.world))
        coord_addr = f"tcp://{host}:{Endpoint.free_tcp_port(host)}"
    ranks, boundary, dist_init = range(layout.world), (), f"tcp://{host}:{port}"
    if nodes is not None:
        ranks, inbox, boundary, dist_init = nodes.local_ranks, nodes.inbox, nodes.boundary_transport, nodes.dist_init
    lora_targets = train.lora_targets if train.mode == "lora" else ()
    specs = []
    for r in ranks:
        st, card = plan.stages[layout.stage(r)], prep.cards[r]
        specs.append(WorkerSpec(
            rank=r, world_size=layout.world, dp=dp, zero=zero, job_id=job_id, token=token, parent_pid=os.getpid(),
            card=CardInfo(card.kind, card.index, card.name), model_path=prep.model_path, model_cfg=mcfg.to_dict(),
            stage=StageInfo(st.first_layer, st.last_layer, st.has_embed, st.has_head, st.layers_label),
            resident_names=tuple(resident_param_names(mcfg, st, lora_targets)), data_file=data_file, train=train,
            runtime=runtime, start_step=start_step, resume_dir=resume_dir, ckpt_root=ckpt_root, coord_addr=coord_addr,
            inbox=inbox, ipc_dir=ipc_dir, slot_bytes=slot_bytes, slots=slots, dist_init=dist_init,
            boundary_transport=boundary, model_index=index))
    return specs


def run_job(cfg, run_dir: str) -> dict:
    """Run one training job described by ``cfg`` (an OmegaConf ``Config``) in ``run_dir``.

    Returns the run summary dict. Raises a :class:`~npu_train.errors.UserError` (exit 2) for bad input, :class:`~npu_train.errors.JobFailed`
    (exit 1) when a card process fails, :class:`~npu_train.errors.Interrupted` (130/143) on SIGINT/SIGTERM.

    Multi-node (``NNODES`` > 1 in the environment, :mod:`npu_train.runtime.nodes`): this launcher runs
    this node's cards (``backend=``) as global ranks after the cards of the lower ``NODE_RANK`` nodes;
    the nodes rendezvous through node 0's ``TCPStore`` and must be given the same settings.
    """
    os.makedirs(run_dir, exist_ok=True)
    if cfg.calibrate:
        from npu_train.backends.spec import parse_backend_list, resolve_cards
        from npu_train.calibrate import main_calibrate

        reqs = resolve_cards(parse_backend_list(as_list(cfg.backend)))
        kinds = [r.kind if r.index is None else f"{r.kind}:{r.index}" for r in reqs]
        saved = main_calibrate(kinds, modules=CARD_PROCESS_MODULES, model_path=cfg.model.path if _preset_config(cfg.model.path) is None else None,
                               profile=cfg.placement.profile)
        return {"calibrate": saved}
    if cfg.plan:
        prep = prepare(cfg, run_dir, probe=False)
        print(prep.plan.table())
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
    from npu_train.runtime.nodes import NodeLayout, Rendezvous, route_address

    layout = NodeLayout.from_env()
    if layout is None:
        return _train(cfg, run_dir, None, None, cfg.runtime.host or "127.0.0.1")
    # multi-node: this node's listening address (the interface that routes to MASTER_ADDR by default)
    host = cfg.runtime.host or route_address(layout.master_addr)
    rdv = Rendezvous(layout, cfg.runtime.startup_timeout_s)
    try:
        return _train(cfg, run_dir, layout, rdv, host)
    except UserError as e:  # the other nodes stop waiting and name this node's error
        rdv.abort(str(e))
        raise


def _train(cfg, run_dir: str, layout, rdv, host: str) -> dict:
    """The training part of :func:`run_job`; ``layout``/``rdv`` are None on a single node."""
    from npu_train.checkpoint.store import check_reused_root, find_checkpoint, open_resume_checkpoint
    from npu_train.data.dataset import save_packed
    from npu_train.data.prepare import prepare_data
    from npu_train.data.sampler import StepSampler
    from npu_train.metrics.report import Reporter, carry_over, rotate_previous_run
    from npu_train.optim.lr import warmup_note
    from npu_train.planner.fit import refit_from_run
    from npu_train.runtime import nodes as N
    from npu_train.runtime.leftovers import discard_job_ipc, sweep_dead_jobs, write_job_owner
    from npu_train.transport.shm import ShmTooSmallError

    if rdv is not None:
        rdv.check_same("config", N.config_digest(cfg), "model/data/train settings",
                       "give every node's launcher the same overrides (only backend=, runtime.host, "
                       "runtime.port, runtime.threads and checkpoint.* except checkpoint.save may differ)")
    prep = prepare(cfg, run_dir, nodes=rdv)
    plan, mcfg, tr = prep.plan, prep.model_cfg, cfg.train
    P, dp = len(plan.stages), prep.dp
    data = prepare_data(cfg, prep.model_path, mcfg)
    if data.train.shape[0] < tr.micro_batch:
        raise ConfigError(f"the training split has {data.train.shape[0]} sequences, fewer than "
                          f"train.micro_batch={tr.micro_batch}: lower train.micro_batch or data.seq_len")

    # the sampler every card process uses (replica k takes the k-th share of each step's global batch)
    sampler = StepSampler(data.train.shape[0], tr.micro_batch, tr.accum, tr.seed, dp_size=dp)
    ckpt_root = os.path.abspath(cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints"))
    start_step, resume_dir = 0, None
    # train.resume=auto: the newest complete checkpoint if there is one, else a fresh start (a restarted pod)
    resume_dir = find_checkpoint(tr.resume, ckpt_root) if tr.resume else None
    if resume_dir is not None and tr.offload_update == "delayed":
        raise ConfigError(f"train.offload_update=delayed cannot resume from {resume_dir} exactly (the card "
                          "weights one update behind the masters are not checkpointed): resume with "
                          "train.offload_update=sync, or start fresh without train.resume")
    if resume_dir is not None:
        reader = open_resume_checkpoint(resume_dir, ckpt_root, auto=tr.resume == "auto")
        resume_dir = reader.path
        reader.check_model(mcfg.to_dict())
        reader.check_mode(tr.mode, cfg.lora.rank, list(cfg.lora.targets))
        try:  # before check_run: a data order no setting can continue is refused as such (no allow dead end)
            sampler.load_state_dict(reader.manifest.get("sampler", {}))
        except ValueError as e:
            raise ConfigError(f"{e}. The checkpoint's run settings are in {resume_dir}/manifest.json ('train'); "
                              "repeat the original run's overrides (data.source, data.seq_len, data.val_fraction, "
                              "train.seed, train.micro_batch, and train.accum x parallel.dp) together with train.resume") from None
        allowed = reader.check_run({k: getattr(tr, k) for k in reader.RUN_KEYS}, data.fingerprint,
                                   allow=tr.resume_mismatch == "allow",
                                   lora={"alpha": cfg.lora.alpha, "dropout": cfg.lora.dropout} if tr.mode == "lora" else None)
        for d in allowed:
            print(f"note: resuming with a changed setting (train.resume_mismatch=allow): {d}", flush=True)
        start_step = reader.step
        if start_step >= tr.steps:
            raise ConfigError(f"checkpoint {resume_dir} is at step {start_step} but train.steps={tr.steps}: the run is "
                              "complete; to train further raise train.steps and set train.resume_mismatch=allow")
    # another run's checkpoints in the root (a reused hydra.run.dir / checkpoint.dir) are never mixed in
    saving = bool(cfg.checkpoint.save)  # false: nothing is written into the root, so nothing can be mixed
    earlier = check_reused_root(ckpt_root, resume_dir, cfg.checkpoint.existing) if saving else []

    # Every check that can reject the job runs before anything is written (checkpoint dir,
    # packed data file, IPC dir, metrics): a rejected job leaves only Hydra's own files.
    job_id, token = secrets.token_hex(6), secrets.token_hex(16)
    rt = cfg.runtime
    if rt.port and (rdv is None or layout.is_master):
        check_port(host, rt.port)
    port = rt.port or Endpoint.free_tcp_port(host)
    node_of_rank = [n for n, c in enumerate(prep.node_counts) for _ in range(c)]
    boundary = N.boundary_transports(node_of_rank, rt.transport)
    # shared-memory boundaries of this node (both stages here; the ring pair of boundary b is counted at stage b)
    n_shm = sum(1 for b, m in enumerate(boundary) if m == "shm" and (rdv is None or node_of_rank[b] == layout.node_rank))
    job = {}
    if rdv is not None:
        rdv.check_same("plan", N.plan_digest(plan, data.fingerprint, start_step, resume_dir), "placement plans, data or "
                       "resume points", "give every node the same data and checkpoint files and calibration profiles "
                       "(placement.profile), or fix the split with train.split")
        marker = os.path.join(ckpt_root, f".npt-shared-{job_id}")
        if layout.is_master:  # the checkpoint root must be one directory seen by every node
            os.makedirs(ckpt_root, exist_ok=True)
            open(marker, "w").close()
        job = N.share_job(rdv, job_id=job_id, token=token, gloo_port=port, host=host)
        job_id, token = job["job_id"], job["token"]
        if not layout.is_master:
            N.check_shared_root(ckpt_root, job_id)
    elem = 2 if prep.dtype == "bf16" else 4
    slot_bytes = tr.micro_batch * cfg.data.seq_len * mcfg.hidden_size * elem
    slots = rt.slots or (min(tr.accum, P) + 1)
    # leftovers of jobs whose launcher is gone (kill -9 of a whole process group) free /dev/shm first
    swept = sweep_dead_jobs()
    if swept:
        print(f"removed shared memory and IPC directories of {len(swept)} dead job(s): {', '.join(swept)}", flush=True)
    if n_shm:
        need = 2 * n_shm * slots * (slot_bytes + 64)
        avail = _shm_free_bytes()
        if avail < need:
            raise ShmTooSmallError(f"npt_{job_id}_*", need, avail)

    prepare_checkpoint_root(ckpt_root, cfg, mcfg, P, earlier, owner=rdv is None or layout.is_master)
    ipc_dir = tempfile.mkdtemp(prefix=f"npt-{job_id}-")
    os.chmod(ipc_dir, 0o700)
    write_job_owner(job_id, ipc_dir, node=layout.node_rank if layout else 0)
    try:  # until the coordinator owns them (its teardown removes both), a failure removes the IPC dir and record
        with contextlib.suppress(OSError):  # packed data a killed launch of an older version left in the run dir
            os.remove(os.path.join(run_dir, "data.safetensors"))
        moved = rotate_previous_run(run_dir)
        if moved:
            print(f"note: {run_dir} held the metrics of an earlier launch; moved them to {moved}", flush=True)
            if resume_dir and carry_over(moved, run_dir, start_step):  # the resumed run's records continue
                print(f"note: metrics.jsonl and eval.jsonl continue with that launch's steps up to {start_step}",
                      flush=True)
        node_plan = link = None
        if rdv is not None:
            node_plan, link = N.join_nodes(rdv, layout, node_of_rank, boundary, ipc_dir, host, job, rt)
            if layout.is_master:  # every node passed check_shared_root before it joined
                try:
                    os.remove(os.path.join(ckpt_root, f".npt-shared-{job_id}"))
                except OSError:
                    pass
        # in the private IPC dir, not the run dir: a resume packs the data again (checked against the checkpoint's
        # fingerprint), and that dir goes on every exit path, launcher killed included (runtime/leftovers.py)
        data_file = os.path.join(ipc_dir, "data.safetensors")
        save_packed(data, data_file, where="set TMPDIR to a directory on a larger disk (the job's private dir is made there)")
        threads = prep.threads  # the figure the plan used (planner.threads_per_card)
        train = train_spec(cfg, prep.dtype)
        # no fixed receive / collective timeout: liveness is the coordinator's heartbeat check (issue 12)
        specs = build_worker_specs(plan, prep, train=train, runtime=RuntimeSpec(
            heartbeat_interval_s=float(rt.heartbeat_interval_s), transport=rt.transport, threads=threads,
            keep_host_memory=bool(rt.keep_host_memory), trace=bool(rt.trace), **furiosa_runtime_fields(cfg, plan)),
            job_id=job_id, token=token, data_file=data_file, start_step=start_step, resume_dir=resume_dir,
            ckpt_root=ckpt_root, ipc_dir=ipc_dir, host=host, port=port, slot_bytes=slot_bytes, slots=slots,
            nodes=node_plan)
        print(plan.table(), flush=True)
        with open(os.path.join(run_dir, "plan.json"), "w") as f:  # read by planner.fit at the run's end
            json.dump(plan.to_dict(), f, indent=1)
        where = f"node {layout.node_rank}/{layout.nnodes} ({len(specs)} local card(s), host {host}), " if layout else ""
        print(f"job {job_id}: {where}{P * dp} card process(es) ({dp} replica(s) x {P} stage(s)), {mcfg.name}, {data.train.shape[0]} train / {data.val.shape[0]} "
              f"val sequences of {cfg.data.seq_len} tokens, dtype {prep.dtype}, schedule {tr.schedule}, "
              + (f"LoRA r={cfg.lora.rank} alpha={cfg.lora.alpha:g} on {','.join(cfg.lora.targets)}, " if tr.mode == "lora" else "")
              + f"micro-batch {tr.micro_batch} x accumulation {tr.accum}; run dir {run_dir}", flush=True)
        if resume_dir:
            print(f"resuming from {resume_dir} at step {start_step}", flush=True)
        note = warmup_note(lr=float(tr.lr), warmup_steps=int(tr.warmup_steps), total_steps=int(tr.steps))
        if note:
            print(note, flush=True)
        reporter = Reporter(run_dir, tr.steps, predicted_mem=[s.mem["total"] for s in plan.stages] * dp,
                            predicted_step_s=plan.step_time_s)
        manifest_base = {"model": mcfg.to_dict(), "world_size": P, "job_id": job_id,
                         "split": [[s.first_layer, s.last_layer] for s in plan.stages],
                         "parallel": {"dp": dp, "pp": P, "zero": prep.zero},
                         "sampler": sampler.state_dict(),
                         "data_fingerprint": data.fingerprint, "train": train.to_dict(),
                         "model_path": prep.model_path,
                         "tokenizer_path": cfg.model.tokenizer or prep.model_path}
        coord = Coordinator(specs, run_dir=run_dir, ipc_dir=ipc_dir, job_id=job_id, token=token,
                            heartbeat_timeout_s=rt.heartbeat_timeout_s, startup_timeout_s=rt.startup_timeout_s,
                            steps=tr.steps, start_step=start_step, ckpt_root=ckpt_root, ckpt_keep=cfg.checkpoint.keep,
                            manifest_base=manifest_base, save_on_interrupt=tr.save_on_interrupt and saving,
                            reporter=reporter, coord_addr=specs[0].coord_addr, node_link=link,
                            node=layout.node_rank if layout else 0, nnodes=layout.nnodes if layout else 1)
    except BaseException:
        discard_job_ipc(job_id, ipc_dir)
        raise
    try:
        coord.run()
    except Interrupted as e:  # checkpoint.save=false stops at once: say that there is nothing to resume
        if saving:
            raise
        raise Interrupted(e.signum, interrupt_note(None, ckpt_root, tr.offload_update, save=False)) from None
    finally:
        reporter.close()
        try:
            os.remove(data_file)
        except OSError:
            pass
    summ = reporter.finish({"checkpoint": coord.last_ckpt, "job_id": job_id, "cards": [c.name for c in prep.cards],
                            "node": layout.node_rank if layout else 0, "nnodes": layout.nnodes if layout else 1,
                            "predicted_step_s": plan.step_time_s,
                            "predicted_mem_bytes": [s.mem["total"] for s in plan.stages] * dp})
    if coord.rejected:
        print(f"note: ignored {coord.rejected} unauthenticated message(s) on the coordinator socket "
              "(wrong or missing job token)", file=sys.stderr, flush=True)
    if coord.interrupted:
        raise Interrupted(coord.signum, interrupt_note(coord.last_ckpt, ckpt_root, tr.offload_update, saving),
                          checkpoint=coord.last_ckpt, checkpoint_dir=ckpt_root)
    refit_from_run(run_dir, plan.rates)  # figures fitted from this run (planner.fit), never raises
    at = start_step + int(summ["steps_run"])
    early = at < tr.steps  # train.stop_after ended this launch before train.steps
    print(end_of_run_line(summ, at, tr, coord.last_ckpt, ckpt_root, saving, run_dir), flush=True)
    if early:  # status.json: where the run stands and the command that continues it
        summ.update(stopped_at=at, checkpoint_dir=ckpt_root if coord.last_ckpt else None)
    return summ
