"""Sparse mixture-of-experts MLP (:class:`SparseMoe`) of Qwen3-MoE, Qwen2-MoE and Mixtral, with the checkpoint's
parameter names (one module per expert: ``experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``, Mixtral's
``w1`` / ``w3`` / ``w2``; router ``gate``; Qwen2-MoE's ``shared_expert`` + ``shared_expert_gate``), and the
router statistics of the load-balancing loss (:class:`RouterRecorder`).

Routing follows transformers 5.25 (``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter``, ``MixtralTopKRouter``):
``logits = x @ gate^T`` in the compute dtype; ``p = softmax(logits)`` in fp32; ``(w, idx) = topk(p, k)``;
``w /= sum(w)`` when ``norm_topk_prob`` (Mixtral: always); Qwen casts ``w`` back to the compute dtype before
weighting the experts' outputs, Mixtral weights in fp32 and casts the sum. The weighted outputs are summed per
token over the ``k`` slots in one reduction, as transformers' default experts implementation (``grouped_mm``,
``integrations/moe.py::grouped_mm_experts_forward``) does.

Compute: the ``N * k`` (token, expert) pairs are sorted by expert; every expert with tokens runs one SwiGLU on
its contiguous block (three matmuls), never a loop over tokens. The experts' SwiGLUs are one autograd node
(:class:`GroupedSwiGlu`: per-expert matmuls, elementwise steps once over all rows, no per-module autograd), and
bf16 runs its matmuls in fp32 on a CPU without bf16 hardware (:func:`matmul_dtype`); LoRA adapters on the experts
run inside it too (adapter dropout or biases: as modules). The experts' weights are held stacked as transformers
holds them (:meth:`SparseMoe.stack_experts`; each expert's parameter is its rows), so gate and up run as one
matmul. With several threads the experts' blocks run concurrently, one thread each (:func:`_parallel_blocks`;
bf16 widened to fp32: each thread widens into its own buffers), except under LoRA. Speed against transformers' ``grouped_mm``: ``experiments/2026-12-06-moe.md``.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import FAMILIES, LlamaConfig

__all__ = ["Expert", "GroupedSwiGlu", "SparseMoe", "stack_experts", "RouterRecorder", "LayerRouting", "matmul_dtype"]


class Expert(nn.Module):
    """One SwiGLU expert ``down(silu(gate(x)) * up(x))`` whose three ``nn.Linear`` (no bias) carry the family's
    checkpoint names ``names = (gate, up, down)`` (``gate_proj, up_proj, down_proj``; Mixtral ``w1, w3, w2``).
    ``forward(x [n, H]) -> [n, H]``."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")):
        super().__init__()
        self.names = tuple(names)
        g, u, d = self.names
        setattr(self, g, nn.Linear(hidden, inter, bias=False))
        setattr(self, u, nn.Linear(hidden, inter, bias=False))
        setattr(self, d, nn.Linear(inter, hidden, bias=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, d = (getattr(self, n) for n in self.names)
        return d(F.silu(g(x)) * u(x))

    def grouped_operands(self) -> Optional[tuple[list, Optional[float]]]:
        """``(tensors, scaling)`` for :class:`GroupedSwiGlu`: plain ``nn.Linear`` projections (or LoRA ones with
        the adapters disabled) give their weights ``[gate, up, down]`` and scaling None; LoRA projections
        (``model/lora.py::LoraLinear``: no bias, no dropout, one scaling) give ``(weight, lora_A, lora_B)`` of each
        in turn and the scaling. None for anything else (biases, dropout): the expert runs as modules."""
        mods = [getattr(self, n) for n in self.names]
        if any(m.bias is not None for m in mods):
            return None
        lora = [hasattr(m, "lora_A") and m.adapter_enabled for m in mods]
        if not any(lora) and all(type(m) is nn.Linear or hasattr(m, "lora_A") for m in mods):
            return [m.weight for m in mods], None
        if all(lora) and all(isinstance(m.dropout, nn.Identity) for m in mods) and \
                len({m.scaling for m in mods}) == 1:
            return [t for m in mods for t in (m.weight, m.lora_A.weight, m.lora_B.weight)], float(mods[0].scaling)
        return None


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the expert matmuls run in for tensors of ``dtype`` on ``device``: ``dtype`` itself, except bf16 /
    fp16 on a CPU without hardware for them (no AVX512-BF16 / AMX; the x86 CPUs of this project's hosts), whose
    matmuls are emulated and slower than fp32 ones (3-5x at the expert shapes, experiments/2026-12-06-moe.md):
    fp32 there, on the half-precision values, with the products rounded to ``dtype`` once as the half-precision
    kernels do (fp32 accumulation), so only the order of the sums differs."""
    if device.type != "cpu":
        return dtype
    if dtype == torch.bfloat16 and not (_cpu_has("_is_avx512_bf16_supported") or _cpu_has("_is_amx_tile_supported")):
        return torch.float32
    if dtype == torch.float16 and not _cpu_has("_is_amx_fp16_supported"):
        return torch.float32
    return dtype


def _cpu_has(probe: str) -> bool:
    """``torch.cpu.<probe>()`` (torch's private CPU feature probes); False where this torch lacks the probe."""
    return bool(getattr(torch.cpu, probe, lambda: False)())


def _wide(w: torch.Tensor, mm: torch.dtype) -> torch.Tensor:
    """``w`` in the matmul dtype ``mm`` (itself when it is; else a copy made on one thread, :class:`_serial`)."""
    if w.dtype == mm:
        return w
    with _serial():
        return w.to(mm)


def _adjacent(g: torch.Tensor, u: torch.Tensor) -> Optional[torch.Tensor]:
    """``[g; u]`` ``[2I, H]`` as one view of their storage when ``u`` follows ``g`` in it (the stacked layout of
    :meth:`SparseMoe.stack_experts`, transformers' ``gate_up_proj[e]``); None otherwise."""
    if g.shape != u.shape or g.dtype != u.dtype or not (g.is_contiguous() and u.is_contiguous()):
        return None
    if g.untyped_storage().data_ptr() != u.untyped_storage().data_ptr() or \
            u.storage_offset() != g.storage_offset() + g.numel():
        return None
    return g.as_strided((2 * g.shape[0], g.shape[1]), (g.shape[1], 1))


#: FLOP of a widened block's gate/up matmul (``2 * rows * 2I * H``) under which the block runs on one thread
#: (:meth:`_Operands.threads`): 2^29, 85 rows at Qwen3-30B-A3B's experts (H 2048, I 768), 2 at Mixtral-8x7B's.
#: Qwen3-30B-A3B-shaped slice (32 experts, 16 rows each, bf16, 2 threads, load 6-7): 1.41 s per forward +
#: backward against 3.42 s with every matmul on both threads (experiments/2026-12-06-moe.md)
SERIAL_FLOP = 1 << 29


#: Kernels without adapters (fp32 on a CPU, weights used in place; or bf16 widened to fp32, each thread into its own
#: buffers) run their experts' row blocks
#: concurrently, one block per intra-op thread at a time with its matmuls on that thread (:func:`_parallel_blocks`),
#: instead of one block after another with every matmul threaded; where there are at least ``BLOCKS_PER_THREAD``
#: blocks per thread. Mixtral-like layer (8 experts of 3584, 1024 tokens, fp32, 2 threads); Qwen3-30B-A3B layer
#: (bf16 widened, 2 threads: 0.74-1.22x transformers serial, 1.59-2.28x concurrent): experiments/2026-12-06-moe.md
PARALLEL_BLOCKS = True
BLOCKS_PER_THREAD = 4


class _Operands:
    """The per-expert tensors of :class:`GroupedSwiGlu` as its matmuls take them. ``tensors`` per block's expert
    in turn: ``(gate [I, H], up [I, H], down [H, I])`` weights (``lora`` False), else each projection's ``(weight,
    lora_A [r, in], lora_B [out, r])``; ``mm`` the matmul dtype (:func:`matmul_dtype`). Weights of another dtype
    (``wide``) are copied on one thread (:class:`_serial`) into one workspace per thread that runs blocks
    (:meth:`buffer`), ``2*I*H`` elements of ``mm`` made once per kernel call at the largest size used (the calling
    thread's before the per-row tensors, :meth:`reserve`): gate and up
    into its two halves as one ``[2I, H]``, down into its first ``I*H`` as ``[H, I]``; weight gradients go through a
    second such workspace, ``[2I, H]`` / ``[H, I]`` views, rounded to the weights' dtype on one thread. Both live
    until the call ends (:meth:`release`): no phase frees a buffer that a larger one of a later phase does not fit
    (the down phase's ``[H, I]`` block left a hole under the gate/up phase's ``[2I, H]``, issue 37's Mixtral-shaped
    runs; experiments/2026-12-06-moe.md). Same dtype: the weights in place, gate and
    up as one ``[2I, H]`` view where they are adjacent in memory (:func:`_adjacent`), else two matmuls."""

    def __init__(self, tensors: tuple, lora: bool, mm: torch.dtype):
        self.t, self.lora, self.mm = tensors, lora, mm
        self.step = 9 if lora else 3
        self.inter, self.hidden = tensors[0].shape
        self.rank = tensors[1].shape[0] if lora else 0
        self.dtype = tensors[0].dtype
        self.wide = self.dtype != mm
        self._bufs: dict = {}

    def threads(self, rows: int):
        """Context for one block of ``rows`` rows: one intra-op thread (:class:`_serial`) for a widened block whose
        gate/up matmul is under :data:`SERIAL_FLOP` (its copies and matmuls as one serial run: a small matmul gains
        little from a second thread and, on a host busier than its cores, waits a scheduler slice for it at every
        call), else all threads."""
        if self.wide and 4 * rows * self.inter * self.hidden < SERIAL_FLOP:
            return _serial()
        return contextlib.nullcontext()

    def parallel(self, blocks: int) -> bool:
        """Whether :func:`_each_block` runs ``blocks`` blocks concurrently (:func:`_parallel_blocks`; widened
        weights: each thread into its own buffers, :meth:`buffer`), no adapters (the plan counts one block's ``dy B`` at a time),
        :data:`PARALLEL_BLOCKS`, more than one intra-op thread and at least :data:`BLOCKS_PER_THREAD` blocks per
        thread (fewer, e.g. 8 experts on 16 cores: the matmuls threaded); and the thread count can be set per
        thread (:func:`_setters`)."""
        n = torch.get_num_threads()
        return PARALLEL_BLOCKS and not self.lora and n > 1 and blocks >= BLOCKS_PER_THREAD * n \
            and _setters() is not None

    def index(self, j: int, proj: int, part: int = 0) -> int:
        """Position in ``tensors`` of ``part`` (0 weight, 1 ``lora_A``, 2 ``lora_B``) of projection ``proj`` (0 gate,
        1 up, 2 down) of block ``j``."""
        return j * self.step + proj * (self.step // 3) + part

    def weight(self, j: int, proj: int) -> torch.Tensor:
        return self.t[self.index(j, proj)]

    def reserve(self, key: str) -> None:
        """Make the calling thread's workspace ``key`` (:meth:`buffer`) now, if it has none: a kernel call's own
        thread reserves what it will use before its per-row tensors, so those stack above it and their holes are
        reused by the later phases' per-row tensors, not left under a later buffer. (A worker's, made in its
        block, comes from its own glibc arena, or from 64 MiB on is mapped on its own and unmapped when freed: no
        hole. Made here instead, in the main heap, the workers' blocks left holes of their own there:
        experiments/2026-12-06-moe.md, h37mem.)"""
        ident = (key, getattr(_SLOT, "k", 0))
        if ident not in self._bufs:
            self._bufs[ident] = torch.empty(2 * self.inter * self.hidden, dtype=self.mm, device=self.t[0].device)

    def buffer(self, key: str, rows: int, cols: int) -> torch.Tensor:
        """``[rows, cols]`` (``rows * cols <= 2*I*H``) view of the calling thread's workspace ``key`` (per slot of
        :func:`_parallel_blocks`: at most one per intra-op thread, whichever pool thread runs a slot) (``"weights"``:
        the widened weights; ``"grads"``: the weight gradients' products), ``2*I*H`` matmul-dtype elements made on
        its first use there (:meth:`reserve`; concurrent blocks, :func:`_parallel_blocks`, each widen into their
        own thread's) and kept until :meth:`release`: the down ``[H, I]`` and gate/up ``[2I, H]`` phases, forward
        or backward, reuse the one block."""
        self.reserve(key)
        return self._bufs[(key, getattr(_SLOT, "k", 0))][:rows * cols].view(rows, cols)

    def release(self, *keys: str) -> None:
        """Drop the workspaces ``keys`` of every thread."""
        for ident in [i for i in self._bufs if i[0] in keys]:
            del self._bufs[ident]

    def gate_up(self, j: int) -> Optional[torch.Tensor]:
        """``[W_gate; W_up]`` ``[2I, H]`` of block ``j`` in the matmul dtype, or None (same dtype, not adjacent)."""
        g, u = self.weight(j, 0), self.weight(j, 1)
        both = _adjacent(g, u)
        if not self.wide:
            return both
        buf, inter = self.buffer("weights", 2 * self.inter, self.hidden), self.inter
        with _serial():
            if both is not None:
                buf.copy_(both)
            else:
                buf[:inter].copy_(g)
                buf[inter:].copy_(u)
        return buf

    def down(self, j: int) -> torch.Tensor:
        """``W_down`` ``[H, I]`` of block ``j`` in the matmul dtype."""
        d = self.weight(j, 2)
        if not self.wide:
            return d
        with _serial():
            return self.buffer("weights", self.hidden, self.inter).copy_(d)

    def adapter(self, j: int, proj: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lora_A, lora_B)`` of projection ``proj`` of block ``j`` in the matmul dtype."""
        return _wide(self.t[self.index(j, proj, 1)], self.mm), _wide(self.t[self.index(j, proj, 2)], self.mm)

    def weight_grads(self, dy: torch.Tensor, x: torch.Tensor, needs: tuple) -> list:
        """``dy^T x`` split by rows into ``len(needs)`` equal parts in the weights' dtype (None where ``needs`` is
        False): views of one fresh product (same dtype), else rounded copies of the thread's ``"grads"`` workspace
        (:meth:`buffer`)."""
        n = dy.shape[1] // len(needs)
        if not self.wide:
            full = torch.mm(dy.t(), x)
            return [full[i * n:(i + 1) * n] if need else None for i, need in enumerate(needs)]
        buf = torch.mm(dy.t(), x, out=self.buffer("grads", dy.shape[1], x.shape[1]))
        return _narrow(*[buf[i * n:(i + 1) * n] if need else None for i, need in enumerate(needs)], dtype=self.dtype)


class GroupedSwiGlu(torch.autograd.Function):
    """The SwiGLU of every expert hit, on rows sorted by expert, as one autograd node (the per-expert matmuls of
    transformers' ``grouped_mm`` CPU kernel, which loops over the groups the same way; no per-module autograd).

    ``apply(xs [S, H], counts (n_0, ...), scaling, *tensors) -> [S, H]`` in ``xs.dtype``: ``counts`` the
    consecutive row blocks (``sum = S``); ``tensors`` per block's expert in turn: ``(gate [I, H], up [I, H],
    down [H, I])`` weights when ``scaling`` is None, else each projection's ``(weight, lora_A [r, in], lora_B
    [out, r])`` (LoRA: ``x W^T + scaling (x A^T) B^T``, :meth:`Expert.grouped_operands`). Row block ``j``:
    ``down_j(silu(gate_j(x)) * up_j(x))``; the elementwise steps run once over all rows, rounded to ``xs.dtype``
    between the matmuls as the module form is. Saves ``xs``, the gate and up products, ``silu(gate)`` and their
    product (``2H + 4I`` elements per row, as the module form: ``planner/moe.py::routed_saved_bytes_per_token``;
    LoRA: and ``3r`` adapter inputs ``x A^T`` in the matmul dtype).

    Matmuls in :func:`matmul_dtype` (:class:`_Operands`): per expert ``x [W_gate; W_up]^T`` and ``h W_down^T``
    forward, ``dy W_down``, ``dy^T h``, ``[dg | du] [W_gate; W_up]`` and ``[dg | du]^T x`` backward (6, as
    ``grouped_mm``'s two grouped calls and their gradients) where gate and up are one operand: adjacent in
    memory (:meth:`SparseMoe.stack_experts`) or widened into one buffer; else 8 (gate and up forward, ``dx``
    as ``mm`` + ``addmm_``). Products go straight into
    row blocks of preallocated outputs, rounded once over all rows when the matmul dtype is wider. LoRA adds per
    projection ``x A^T`` (saved) and ``+= s (x A^T) B^T`` forward, ``dy B``, ``dx += s (dy B) A`` and the two
    adapter gradients backward. Transients: ``planner/moe.py::expert_kernel_bytes``.

    Split backward (zero-bubble schedules, ``pipeline/backward.py``): autograd runs this node in the ``B`` (input
    gradient) and again in the ``W`` (weights); each run makes only its half (:func:`_needed_now`): ``B`` the
    ``dy W_down``, SwiGLU and ``dx`` steps, keeping ``[dg | du]`` (compute dtype) on the node; ``W`` the weight
    and adapter gradients from it, then drops it. No step runs twice."""

    @staticmethod
    def forward(ctx, xs: torch.Tensor, counts: tuple, scaling: Optional[float], *tensors: torch.Tensor):
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + int(c))
        ops = _Operands(tensors, scaling is not None, matmul_dtype(xs.dtype, xs.device))
        y, saved = _swiglu_forward(xs, bounds, ops, scaling)
        ctx.save_for_backward(*saved, *tensors)
        ctx.bounds, ctx.scaling, ctx.nsaved = bounds, scaling, len(saved)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        saved = ctx.saved_tensors
        ws = saved[ctx.nsaved:]
        ops = _Operands(ws, ctx.scaling is not None, matmul_dtype(dy.dtype, dy.device))
        needs = _needed_now(ctx)
        # the B of a split backward (pipeline/backward.py): the input gradient now, the weights' later from the
        # same [dg | du] (kept in the compute dtype: the output gradients W needs, as a dense layer's recorded
        # ones; planner/moe.py::mlp_pending_bytes_per_token)
        keep = needs[0] and not any(needs[3:]) and any(ctx.needs_input_grad[3:])
        dx, grads, dgu = _swiglu_backward(dy.contiguous(), saved[:ctx.nsaved], ops, ctx.bounds, ctx.scaling,
                                          needs, getattr(ctx, "dgu", None), keep)
        ctx.dgu = dgu
        if any(needs[3:]):
            ctx.dgu = None  # the W: its gradients are made, nothing is kept
        grads = [torch.zeros_like(w) if n and d is None else d  # a block without rows
                 for w, d, n in zip(ws, grads, needs[3:])]
        return (dx, None, None, *grads)


def _needed_now(ctx) -> tuple:
    """Which of :class:`GroupedSwiGlu`'s inputs the running backward wants a gradient of: ``needs_input_grad``,
    narrowed to the inputs whose gradient node autograd's engine will execute in *this* pass. A plain
    ``backward()`` wants all; the zero-bubble split (``pipeline/backward.py``) runs this node twice, its ``B``
    (``autograd.grad`` to the stage input: the input gradient only) and its ``W`` (``backward(inputs=weights)``:
    the weights' only), so each pass makes only its half, as autograd's built-in ``mm`` does. Where the engine
    cannot tell (a leaf input under ``autograd.grad``; a torch without ``_will_engine_execute_node``): wanted."""
    will = getattr(torch._C, "_will_engine_execute_node", None)
    edges = list(ctx.next_functions)  # one per tensor argument: xs, then the tensors (not counts, scaling)
    nodes = [edges[0][0], None, None] + [n for n, _ in edges[1:]]
    if len(nodes) != len(ctx.needs_input_grad):
        return tuple(ctx.needs_input_grad)
    out = []
    for need, node in zip(ctx.needs_input_grad, nodes):
        if need and node is not None and will is not None:
            try:
                need = bool(will(node))
            except RuntimeError:
                need = True
        out.append(bool(need))
    return tuple(out)


def _blocks(bounds: list):
    """``(j, a, b)`` of the non-empty row blocks ``[a, b)``."""
    return [(j, bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1) if bounds[j + 1] > bounds[j]]


def _each_block(bounds: list, ops: _Operands, fn) -> None:
    """``fn(j, a, b)`` for every non-empty row block ``[a, b)`` of ``bounds`` (each writes only its own rows and
    its expert's gradients). Serially, each block under :meth:`_Operands.threads`; or, where
    :meth:`_Operands.parallel`, the blocks spread over torch's intra-op threads, each block's matmuls on one thread
    (:func:`_parallel_blocks`)."""
    blocks = _blocks(bounds)
    if ops.parallel(len(blocks)):
        _parallel_blocks(blocks, fn)
        return
    for j, a, b in blocks:
        with ops.threads(b - a):
            fn(j, a, b)


def _parallel_blocks(blocks: list, fn) -> None:
    """``fn(j, a, b)`` for every block, spread over torch's ``n`` intra-op threads: the calling thread and ``n - 1``
    workers of a process-wide pool (:func:`_pool`) each take the largest block left, one intra-op thread each
    (:class:`_serial`: their matmuls single-threaded, no thread waits for another inside a matmul, which on a host
    busier than its cores costs a scheduler slice per call; only these threads' own counts change, not torch's
    process-wide one), with the caller's grad mode; the caller's count is restored after, and a worker's error
    raised. The blocks write disjoint rows and gradients, so the result does not depend on which thread ran which
    block."""
    n = torch.get_num_threads()
    todo = iter(sorted(blocks, key=lambda blk: blk[1] - blk[2]))
    lock, grad = threading.Lock(), torch.is_grad_enabled()

    def work(slot: int) -> None:
        _SLOT.k = slot  # the workspaces this thread widens into (_Operands.buffer): slot, not thread (the pool
        try:            # may hold more threads than n - 1, and a phase's work may run on any of them)
            with _serial(), torch.set_grad_enabled(grad):
                while True:
                    with lock:
                        nxt = next(todo, None)
                    if nxt is None:
                        return
                    fn(*nxt)
        finally:
            _SLOT.k = 0

    futures = [_pool(n - 1).submit(work, k) for k in range(1, n)]
    try:
        work(0)
    finally:
        concurrent.futures.wait(futures)
    for f in futures:
        f.result()


_SLOT = threading.local()  # .k: the slot of _parallel_blocks the thread runs now (0: the caller, or none)
_POOL: list = []  # [(pid, ThreadPoolExecutor)]: one per process (a forked child makes its own)


#: the OS name of :func:`_pool`'s threads (``/proc/<pid>/task/<tid>/comm``, ``top -H``): a run's concurrent blocks
#: are seen from outside (experiments/bench/plan_bound.py ``--thread-name``)
POOL_THREAD_NAME = "moe-blocks"


def _name_thread() -> None:
    """Give the calling OS thread the name :data:`POOL_THREAD_NAME` (Linux ``prctl(PR_SET_NAME)``; elsewhere
    nothing: Python's thread names are its own)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, POOL_THREAD_NAME.encode(), 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _pool(workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """The process's worker pool for :func:`_parallel_blocks`, with at least ``workers`` threads (OS name
    :data:`POOL_THREAD_NAME`)."""
    if not _POOL or _POOL[0][0] != os.getpid() or _POOL[0][1]._max_workers < workers:
        _POOL[:] = [(os.getpid(), concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix=POOL_THREAD_NAME, initializer=_name_thread))]
    return _POOL[0][1]


def _swiglu_forward(xs: torch.Tensor, bounds: list, ops: _Operands, s: Optional[float]) -> tuple:
    """:meth:`GroupedSwiGlu.forward`: ``(y [S, H] xs.dtype, saved tensors)``."""
    S, H = xs.shape
    inter = ops.inter
    if ops.wide:
        ops.reserve("weights")
    xm = xs.to(ops.mm)
    gu = xm.new_empty(S, 2 * inter)
    ts = [xm.new_empty(S, ops.rank) for _ in range(3)] if ops.lora else []
    _each_block(bounds, ops, lambda j, a, b: _gate_up_forward(xm[a:b], ops, j, s, gu[a:b], [t[a:b] for t in ts]))
    del xm
    if ops.wide:
        g, u = gu[:, :inter].to(xs.dtype), gu[:, inter:].to(xs.dtype)
        del gu
    else:
        g, u = gu[:, :inter], gu[:, inter:]
    act = F.silu(g)
    h = act * u
    hm = h.to(ops.mm)
    ym = hm.new_empty(S, H)

    def down(j: int, a: int, b: int) -> None:
        torch.mm(hm[a:b], ops.down(j).t(), out=ym[a:b])
        if ops.lora:
            _adapter_forward(hm[a:b], ops, j, 2, s, ym[a:b], ts[2][a:b])

    _each_block(bounds, ops, down)
    ops.release("weights")
    del hm
    return ym.to(xs.dtype), (xs, g, u, act, h, *ts)


def _gate_up_forward(x: torch.Tensor, ops: _Operands, j: int, s: Optional[float], out: torch.Tensor,
                     ts: list) -> None:
    """``out [n, 2I] = x [W_gate; W_up]^T`` of block ``j`` (LoRA: ``+ s (x A^T) B^T`` per half, ``x A^T`` into
    ``ts``)."""
    inter = ops.inter
    w = ops.gate_up(j)
    if w is not None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.mm(x, ops.weight(j, 0).t(), out=out[:, :inter])
        torch.mm(x, ops.weight(j, 1).t(), out=out[:, inter:])
    if ops.lora:
        for p in (0, 1):
            _adapter_forward(x, ops, j, p, s, out[:, p * inter:(p + 1) * inter], ts[p])


def _adapter_forward(x: torch.Tensor, ops: _Operands, j: int, p: int, s: float, out: torch.Tensor,
                     t: torch.Tensor) -> None:
    """``t = x A^T``, ``out += s t B^T`` for projection ``p`` of block ``j``, on one thread (as :func:`_adapter_backward`)."""
    with _serial():
        a, b = ops.adapter(j, p)
        torch.mm(x, a.t(), out=t)
        out.addmm_(t, b.t(), alpha=s)


def _swiglu_backward(dy: torch.Tensor, saved: tuple, ops: _Operands, bounds: list, s: Optional[float],
                     needs: tuple, kept: Optional[torch.Tensor] = None, keep: bool = False) -> tuple:
    """:meth:`GroupedSwiGlu.backward`: ``(dx or None, gradients per tensor (None where not needed), [dg | du]
    or None)``. ``kept``: the ``[dg | du]`` a previous input-gradient pass returned (``keep``), so this pass
    (the weights' gradients) does not make it again; ``keep``: return it, in the compute dtype (its values are
    of that dtype: :func:`_swiglu_output_grad`)."""
    xs = saved[0]
    ts = saved[5:]
    need = needs[3:]
    grads: list = [None] * len(ops.t)
    if ops.wide:  # this thread's workspaces first (Operands.reserve): widened weights for dh or dx, and the
        if kept is None or needs[0]:  # weight gradients' products where any weight gradient is made
            ops.reserve("weights")
        if any(need[ops.index(j, p)] for j in range(len(bounds) - 1) for p in range(3)):
            ops.reserve("grads")
    if kept is None:
        dgu = _swiglu_output_grad(dy, saved[1:5], ops, bounds, s, ts[2] if ts else None, need, grads)
    else:
        _down_weight_grads(dy, saved[4], ops, bounds, s, ts[2] if ts else None, need, grads)
        dgu = kept.to(ops.mm)
    out = (dgu.to(xs.dtype) if ops.wide else dgu) if keep else None
    mm = ops.mm
    xm = xs.to(mm)
    dxm = xm.new_empty(xs.shape) if needs[0] else None
    _each_block(bounds, ops, lambda j, a, b: _gate_up_backward(
        dgu[a:b], xm[a:b], ops, j, s, None if dxm is None else dxm[a:b], [t[a:b] for t in ts[:2]], need, grads))
    ops.release("weights", "grads")
    del dgu, xm
    return (None if dxm is None else dxm.to(xs.dtype)), grads, out


def _down_weight_grads(dy: torch.Tensor, h: torch.Tensor, ops: _Operands, bounds: list, s: Optional[float],
                       t: Optional[torch.Tensor], need: tuple, grads: list) -> None:
    """The down projection's gradients into ``grads`` without ``dh`` (a weights-only pass with ``[dg | du]``
    kept)."""
    dym, hm = dy.to(ops.mm), h.to(ops.mm)
    _each_block(bounds, ops, lambda j, a, b: _down_backward(
        dym[a:b], hm[a:b], ops, j, s, None, None if t is None else t[a:b], need, grads))


def _swiglu_output_grad(dy: torch.Tensor, saved: tuple, ops: _Operands, bounds: list, s: Optional[float],
                        t: Optional[torch.Tensor], need: tuple, grads: list) -> torch.Tensor:
    """The down projection's backward (its gradients into ``grads``) and the SwiGLU's: ``[dg | du]`` ``[S, 2I]`` in
    the matmul dtype, ``dg = silu'(g) * dh * u``, ``du = dh * act`` for ``dh = dy W_down``, ``dh`` written into the
    ``du`` half (``[dg | du]`` made first, below ``dy`` and ``h`` widened, which are freed after the down phase).
    Same dtype: both halves made in place (no other ``[S, I]`` temporary, the values of ``silu_backward(dh * u,
    g)`` and ``dh * act``); wider matmuls: ``dh`` rounded to the compute dtype first (as the module form) and the
    halves widened from it through one compute-dtype temporary (so their values are of the compute dtype)."""
    g, u, act, h = saved
    inter, mm = ops.inter, ops.mm
    dgu = h.new_empty(h.shape[0], 2 * inter, dtype=mm)
    dhm = dgu[:, inter:]
    dym, hm = dy.to(mm), h.to(mm)
    _each_block(bounds, ops, lambda j, a, b: _down_backward(
        dym[a:b], hm[a:b], ops, j, s, dhm[a:b], None if t is None else t[a:b], need, grads))
    del dym, hm
    if not ops.wide:
        dg = torch.mul(dhm, u, out=dgu[:, :inter])
        torch.ops.aten.silu_backward.grad_input(dg, g, grad_input=dg)
        dhm.mul_(act)
        return dgu
    dh = dhm.to(h.dtype)
    q = dh * u
    torch.ops.aten.silu_backward.grad_input(q, g, grad_input=q)
    dgu[:, :inter].copy_(q)
    dgu[:, inter:].copy_(torch.mul(dh, act, out=q))
    return dgu


def _down_backward(dy: torch.Tensor, h: torch.Tensor, ops: _Operands, j: int, s: Optional[float],
                   dh: Optional[torch.Tensor], t: Optional[torch.Tensor], need: tuple, grads: list) -> None:
    """``dh = dy W_down`` (LoRA ``+ s (dy B) A``) of block ``j`` (``dh`` None: not made); the down projection's
    gradients into ``grads``."""
    if dh is not None:
        torch.mm(dy, ops.down(j), out=dh)
    k = ops.index(j, 2)
    if need[k]:
        grads[k] = ops.weight_grads(dy, h, (True,))[0]
    if ops.lora:
        _adapter_backward(dy, h, ops, j, 2, s, dh, t, need, grads)


def _gate_up_backward(dgu: torch.Tensor, x: torch.Tensor, ops: _Operands, j: int, s: Optional[float],
                      dx: Optional[torch.Tensor], ts: list, need: tuple, grads: list) -> None:
    """``dx = [dg | du] [W_gate; W_up]`` (LoRA ``+ s (d B) A`` per half) of block ``j``;
    ``[dW_gate; dW_up] = [dg | du]^T x`` and the adapters' gradients into ``grads``."""
    inter = ops.inter
    kg, ku = ops.index(j, 0), ops.index(j, 1)
    if dx is not None:
        w = ops.gate_up(j)
        if w is not None:
            torch.mm(dgu, w, out=dx)
        else:
            torch.mm(dgu[:, :inter], ops.weight(j, 0), out=dx).addmm_(dgu[:, inter:], ops.weight(j, 1))
    if need[kg] or need[ku]:
        grads[kg], grads[ku] = ops.weight_grads(dgu, x, (need[kg], need[ku]))
    if ops.lora:
        for p in (0, 1):
            _adapter_backward(dgu[:, p * inter:(p + 1) * inter], x, ops, j, p, s, dx, ts[p], need, grads)


def _adapter_backward(dy: torch.Tensor, x: torch.Tensor, ops: _Operands, j: int, p: int, s: float,
                      dx: Optional[torch.Tensor], t: torch.Tensor, need: tuple, grads: list) -> None:
    """LoRA part of projection ``p``'s backward: ``dx += s (dy B) A``, ``dA = s (dy B)^T x``, ``dB = s dy^T t``
    (``t = x A^T`` saved), the gradients in the adapters' dtype. On one thread: rank-``r`` products (``r`` of 8-64
    against widths of hundreds to thousands) gain nothing from a second thread and, as parallel regions, wait a
    scheduler slice each on a host busier than its cores (6 per expert and projection)."""
    with _serial():
        a, b = ops.adapter(j, p)
        ka, kb = ops.index(j, p, 1), ops.index(j, p, 2)
        q = torch.mm(dy, b)
        if dx is not None:
            dx.addmm_(q, a, alpha=s)
        if need[ka]:
            grads[ka] = torch.mm(q.t(), x).mul_(s).to(ops.t[ka].dtype)
        if need[kb]:
            grads[kb] = torch.mm(dy.t(), t).mul_(s).to(ops.t[kb].dtype)


class _serial:
    """Context: the calling thread's intra-op threads set to 1 inside, restored after (:func:`_thread_local_threads`:
    this thread only; torch's process-wide default, which a thread's first parallel op starts from, is left
    alone). For the per-expert weight copies and gradient roundings of :class:`_Operands` (a few MB each,
    memory-bound): as parallel regions each waits for every OpenMP thread, which on a host busier than its cores
    costs a scheduler slice per copy (2 threads on this 2-core VM at load 7: 16 ms per 768 x 2048 bf16 -> fp32
    copy against 0.7 ms on one thread, ``experiments/2026-12-06-moe.md``); the matmuls between them keep all
    threads. Where the thread count cannot be set per thread: nothing changes (all threads)."""

    def __enter__(self):
        self.prev = _thread_local_threads(1)

    def __exit__(self, *exc):
        if self.prev is not None:
            _thread_local_threads(*self.prev)


_SETTERS: list = []  # [(omp_set_num_threads, MKL_Set_Num_Threads_Local or None) or None], resolved once


def _setters():
    """``(omp_set_num_threads, MKL_Set_Num_Threads_Local or None)`` of the OpenMP runtime and MKL this torch's
    intra-op work runs on (ctypes functions), or None where they cannot be found (no OpenMP backend; MKL in use
    but its per-thread setter not exported)."""
    if _SETTERS:
        return _SETTERS[0]
    found = None
    try:
        import ctypes

        if "parallel backend: OpenMP" in torch.__config__.parallel_info():
            omp = ctypes.CDLL(None).omp_set_num_threads
            omp.argtypes, omp.restype = [ctypes.c_int], None
            mkl = None
            if torch.backends.mkl.is_available():
                lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
                mkl = lib.MKL_Set_Num_Threads_Local  # the C entry (lowercase is Fortran's: a pointer)
                mkl.argtypes, mkl.restype = [ctypes.c_int], ctypes.c_int
            found = (omp, mkl)
    except (OSError, AttributeError):
        found = None
    _SETTERS.append(found)
    return found


def _thread_local_threads(n: int, mkl_prev: Optional[int] = None) -> Optional[tuple]:
    """Set the *calling thread's* intra-op thread count to ``n`` (the OpenMP ``nthreads-var`` of this thread and
    MKL's thread-local count; ``mkl_prev``: the MKL value to put back, else ``n``) and return what restores it,
    ``(threads, mkl)`` for a second call, or None when nothing changed (already ``n``; no per-thread setters).

    Not ``torch.set_num_threads``: besides this thread's settings it stores ``n`` as the process's default, which
    every thread's first parallel op (``at::internal::lazy_init_num_threads``) copies, so a thread starting its
    torch work meanwhile (the host optimizer's, an exchange thread) would keep one thread for good; and it clears
    oneDNN's primitive cache and resizes the process's pthreadpool (``ATen/ParallelOpenMP.cpp``)."""
    cur = torch.get_num_threads()  # first: this thread's lazy initialisation, which would overwrite ours later
    found = _setters()
    if found is None or (cur == n and mkl_prev is None):
        return None
    omp, mkl = found
    omp(n)
    old = mkl(n if mkl_prev is None else mkl_prev) if mkl is not None else None
    return cur, old


def _narrow(*ts: Optional[torch.Tensor], dtype: torch.dtype) -> list:
    """``ts`` rounded to ``dtype`` (new tensors: the gradients handed to autograd; None stays None), on one
    thread."""
    with _serial():
        return [None if t is None else t.to(dtype) for t in ts]


@dataclass
class LayerRouting:
    """One sparse layer's router statistics of one forward (transformers' ``load_balancing_loss_func`` terms):
    ``counts`` fp32 ``[E]`` top-k assignments per expert (no gradient), ``prob_sum`` fp32 ``[E]`` routing
    probabilities summed over the rows (with gradient when the aux loss is on, else None), ``rows`` tokens."""

    layer: int
    counts: torch.Tensor
    prob_sum: Optional[torch.Tensor]
    rows: int


@dataclass
class RouterRecorder:
    """Collects :class:`LayerRouting` of a stage's sparse layers while :attr:`active` (the training forward;
    a recomputation during backward or an evaluation pass records nothing). ``with_probs``: keep the
    differentiable probability sums (aux loss on)."""

    active: bool = False
    with_probs: bool = False
    records: list = field(default_factory=list)

    def start(self, with_probs: bool) -> None:
        self.active, self.with_probs, self.records = True, bool(with_probs), []

    def take(self) -> list:
        """Stop recording; the records of the forward since :meth:`start`."""
        out, self.records, self.active = self.records, [], False
        return out


class SparseMoe(nn.Module):
    """The sparse MLP block of a decoder layer (module names as the family's checkpoint): router ``gate``
    ``nn.Linear(H, E)``, ``experts`` ``ModuleList`` of :class:`Expert` ``[I_e]``, and for Qwen2-MoE
    ``shared_expert`` (:class:`Expert` ``[I_s]``) scaled by ``sigmoid(shared_expert_gate(x))`` ``[1, H]``.
    ``forward(x [B, S, H]) -> [B, S, H]`` in ``x.dtype``. ``recorder``: where the router statistics go."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int, recorder: Optional[RouterRecorder] = None):
        super().__init__()
        fam = FAMILIES[cfg.family]
        H = cfg.hidden_size
        self.layer_idx = layer_idx
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.mixtral = cfg.family == "mixtral"
        self.norm_topk_prob = True if self.mixtral else bool(cfg.norm_topk_prob)
        self.gate = nn.Linear(H, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            [Expert(H, cfg.moe_intermediate_size, fam.expert_projs) for _ in range(cfg.num_experts)])
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = Expert(H, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(H, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        self.recorder = recorder
        self.stack_experts()

    def stack_experts(self, copy: bool = True) -> None:
        """Lay the experts' weights out as transformers 5 holds them: every expert's gate rows then up rows in one
        ``[E, 2I, H]`` tensor, the down weights in one ``[E, H, I]``; each expert's parameter (an ``nn.Linear``'s or
        a LoRA base's ``weight``) is set to its rows of them, the same ``Parameter`` object (names, checkpoints,
        the optimizer and LoRA see no difference). :class:`GroupedSwiGlu` then multiplies gate and up as one
        operand (6 matmuls per expert and pass, as ``grouped_mm``, against 8). ``copy``: keep the values (False:
        the new storage is left uninitialised, for a module just made by ``to_empty``). A later ``.to()`` or
        ``to_empty`` makes separate tensors again: still exact, with 8 matmuls (call this again after it)."""
        projs = [[getattr(ex, n) for n in ex.names] for ex in self.experts]
        w = projs[0][0].weight
        inter, hidden = w.shape
        gu = torch.empty(len(projs), 2 * inter, hidden, dtype=w.dtype, device=w.device)
        down = torch.empty(len(projs), hidden, inter, dtype=w.dtype, device=w.device)
        with torch.no_grad():
            for e, (g, u, d) in enumerate(projs):
                for lin, rows in ((g, gu[e, :inter]), (u, gu[e, inter:]), (d, down[e])):
                    if copy:
                        rows.copy_(lin.weight)
                    lin.weight.data = rows

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(logits [N, E] x.dtype, fp32 probabilities [N, E], weights [N, k], experts int64 [N, k])`` of
        ``x [N, H]``: the family's router (module docstring); weights in fp32 for Mixtral, else ``x.dtype``."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        if not self.mixtral:
            w = w.to(logits.dtype)
        return logits, probs, w, idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        xf = x.reshape(-1, H)
        logits, probs, w, idx = self.route(xf)
        rec = self.recorder
        if rec is not None and rec.active:
            rec.records.append(self._routing_stats(logits, probs, idx, rec.with_probs))
        out = self.experts_forward(xf, w, idx)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(xf)) * self.shared_expert(xf)
        return out.reshape(B, S, H)

    def experts_forward(self, xf: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """``sum_j w[t, j] * expert_{idx[t, j]}(x[t])`` per token ``t`` of ``xf [N, H]`` -> ``[N, H]`` in
        ``xf.dtype``: the ``N * k`` pairs sorted by expert, one SwiGLU per expert on its block, each product weighted,
        put back in (token, slot) order and summed over the ``k`` slots in one reduction (then cast) — the
        arithmetic of transformers' default ``experts_implementation="grouped_mm"``. Plain experts run in
        :class:`GroupedSwiGlu` (one autograd node for all of them, LoRA adapters included); experts it does not take
        (biases, adapter dropout) run as modules."""
        N, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        xs = xf.index_select(0, order // k)
        hit = [e for e in range(self.num_experts) if counts[e]]
        experts = [self.experts[e] for e in hit]
        ops = [ex.grouped_operands() for ex in experts]
        if all(o is not None for o in ops) and len({o[1] for o in ops}) == 1:
            ys = GroupedSwiGlu.apply(xs, tuple(counts[e] for e in hit), ops[0][1], *[t for o in ops for t in o[0]])
        else:
            parts = [self.experts[e](blk) for e, blk in enumerate(xs.split(counts)) if counts[e]]
            ys = torch.cat(parts) if len(parts) > 1 else parts[0]
        ys = ys * w.reshape(-1).index_select(0, order).unsqueeze(-1)  # Mixtral: fp32 weights promote
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return ys.index_select(0, inv).view(N, k, -1).sum(dim=1).to(xf.dtype)

    def _routing_stats(self, logits: torch.Tensor, probs: torch.Tensor, idx: torch.Tensor,
                       with_probs: bool) -> LayerRouting:
        """transformers' ``load_balancing_loss_func`` per layer: softmax of the logits in *their* dtype (the
        routing's fp32 ``probs`` when the logits are fp32), its own top-k, assignment counts [E] and fp32
        probability sums [E]."""
        if logits.dtype != torch.float32:
            probs = torch.softmax(logits, dim=-1)
            idx = torch.topk(probs, self.top_k, dim=-1).indices
        counts = torch.bincount(idx.reshape(-1).detach(), minlength=self.num_experts).to(torch.float32)
        prob_sum = probs.float().sum(dim=0) if with_probs else None
        return LayerRouting(self.layer_idx, counts, prob_sum, int(logits.shape[0]))


def stack_experts(module: nn.Module, copy: bool = True) -> int:
    """:meth:`SparseMoe.stack_experts` on every sparse block of ``module`` (``copy`` as there); returns how many."""
    blocks = [m for m in module.modules() if isinstance(m, SparseMoe)]
    for m in blocks:
        m.stack_experts(copy=copy)
    return len(blocks)
