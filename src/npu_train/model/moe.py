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
run inside it too (adapter dropout or biases: as modules). Speed against transformers' ``grouped_mm``: ``experiments/2026-12-06-moe.md``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import FAMILIES, LlamaConfig

__all__ = ["Expert", "GroupedSwiGlu", "SparseMoe", "RouterRecorder", "LayerRouting", "matmul_dtype"]


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


def _proj(x: torch.Tensor, ws: tuple, s: Optional[float], out: torch.Tensor, t: torch.Tensor) -> None:
    """``out = x W^T + s (x A^T) B^T`` with ``ws = (W, A, B)``, ``x A^T`` written to ``t``; ``x`` in the matmul
    dtype, ``out`` a row block rounded once to its dtype."""
    mm = x.dtype
    torch.mm(x, _wide(ws[1], mm).t(), out=t)
    r = torch.mm(x, _wide(ws[0], mm).t()).addmm_(t, _wide(ws[2], mm).t(), alpha=s)
    out.copy_(r)


def _proj_back(dy: torch.Tensor, x: torch.Tensor, ws: tuple, s: Optional[float], t: torch.Tensor,
               need: tuple, dx: Optional[torch.Tensor]) -> list:
    """Gradients of :func:`_proj` for the upstream ``dy`` (matmul dtype): adds ``dy W + s (dy B) A`` to ``dx``
    (matmul dtype, or None) and returns ``[dW, dA, dB]`` in the weights' dtypes (None where ``need`` is False)."""
    mm = dy.dtype
    grads = [torch.mm(dy.t(), x).to(ws[0].dtype) if need[0] else None]
    if dx is not None:
        dx.addmm_(dy, _wide(ws[0], mm))
    q = torch.mm(dy, _wide(ws[2], mm))
    if dx is not None:
        dx.addmm_(q, _wide(ws[1], mm), alpha=s)
    grads.append(torch.mm(q.t(), x).mul_(s).to(ws[1].dtype) if need[1] else None)
    grads.append(torch.mm(dy.t(), t).mul_(s).to(ws[2].dtype) if need[2] else None)
    return grads


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
    LoRA: and ``3r`` adapter inputs ``x A^T`` in the matmul dtype). Matmuls in :func:`matmul_dtype`; plain
    experts in a wider matmul dtype (bf16 on a CPU without bf16 hardware) go through :class:`_WideSwiGlu`
    (weights widened into two reused buffers, gate and up as one matmul, the products written in place and
    rounded once over all rows), plain experts in their own dtype through :class:`_SameSwiGlu` (each product
    written into its row block, no copies)."""

    @staticmethod
    def forward(ctx, xs: torch.Tensor, counts: tuple, scaling: Optional[float], *tensors: torch.Tensor):
        mm = matmul_dtype(xs.dtype, xs.device)
        bounds = [0]
        for c in counts:
            bounds.append(bounds[-1] + int(c))
        if scaling is None:
            kernel = _WideSwiGlu if mm != xs.dtype else _SameSwiGlu
            y, saved = kernel.forward(xs, bounds, tensors, mm)
            ctx.save_for_backward(*saved, *tensors)
            ctx.bounds, ctx.mm, ctx.scaling, ctx.step, ctx.rank, ctx.kernel = bounds, mm, None, 3, 0, kernel
            return y
        S, H = xs.shape
        step = 9
        inter = tensors[0].shape[0]
        g, u, y = xs.new_empty(S, inter), xs.new_empty(S, inter), xs.new_empty(S, H)
        rank = tensors[1].shape[0]
        ts = [xs.new_empty(S, rank, dtype=mm) for _ in range(3)]
        xm = xs.to(mm)
        for j in range(len(counts)):
            a, b = bounds[j], bounds[j + 1]
            gw, uw = GroupedSwiGlu._ws(tensors, step, j, 0), GroupedSwiGlu._ws(tensors, step, j, 1)
            _proj(xm[a:b], gw, scaling, g[a:b], ts[0][a:b])
            _proj(xm[a:b], uw, scaling, u[a:b], ts[1][a:b])
        del xm
        act = F.silu(g)
        h = act * u
        hm = h.to(mm)
        for j in range(len(counts)):
            a, b = bounds[j], bounds[j + 1]
            _proj(hm[a:b], GroupedSwiGlu._ws(tensors, step, j, 2), scaling, y[a:b], ts[2][a:b])
        ctx.save_for_backward(xs, g, u, act, h, *ts, *tensors)
        ctx.bounds, ctx.mm, ctx.scaling, ctx.step, ctx.rank, ctx.kernel = bounds, mm, scaling, step, rank, None
        return y

    @staticmethod
    def _ws(tensors: tuple, step: int, j: int, proj: int) -> tuple:
        """The tensors of projection ``proj`` (0 gate, 1 up, 2 down) of block ``j``."""
        k = step // 3
        return tuple(tensors[j * step + proj * k: j * step + (proj + 1) * k])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        if ctx.kernel is not None:
            saved = ctx.saved_tensors
            ws = saved[5:]
            dx, grads = ctx.kernel.backward(dy.contiguous(), saved[:5], ws, ctx.bounds, ctx.mm, ctx.needs_input_grad)
            grads = [torch.zeros_like(w) if n and d is None else d  # a block without rows
                     for w, d, n in zip(ws, grads, ctx.needs_input_grad[3:])]
            return (dx, None, None, *grads)
        saved = ctx.saved_tensors
        xs, g, u, act, h = saved[:5]
        ts = saved[5:8]
        tensors = saved[8:]
        bounds, mm, s, step = ctx.bounds, ctx.mm, ctx.scaling, ctx.step
        need = ctx.needs_input_grad[3:]
        k = step // 3
        grads: list = [None] * len(tensors)
        dym, hm = dy.contiguous().to(mm), h.to(mm)
        dh = torch.empty_like(h)
        for j in range(len(bounds) - 1):
            a, b = bounds[j], bounds[j + 1]
            acc = dym.new_zeros(b - a, h.shape[1])
            o = j * step + 2 * k
            grads[o:o + k] = _proj_back(dym[a:b], hm[a:b], GroupedSwiGlu._ws(tensors, step, j, 2), s,
                                        ts[2][a:b], need[o:o + k], acc)
            dh[a:b].copy_(acc)
        del dym, hm
        dum = (dh * act).to(mm)
        dgm = torch.ops.aten.silu_backward(dh * u, g).to(mm)
        xm = xs.to(mm)
        dx = torch.empty_like(xs) if ctx.needs_input_grad[0] else None
        for j in range(len(bounds) - 1):
            a, b = bounds[j], bounds[j + 1]
            acc = dgm.new_zeros(b - a, xs.shape[1]) if dx is not None else None  # one rounding, as gate_up's
            for p, d in ((0, dgm), (1, dum)):
                o = j * step + p * k
                grads[o:o + k] = _proj_back(d[a:b], xm[a:b], GroupedSwiGlu._ws(tensors, step, j, p), s,
                                            ts[p][a:b], need[o:o + k], acc)
            if dx is not None:
                dx[a:b].copy_(acc)
        return (dx, None, None, *grads)


def _blocks(bounds: list):
    """``(j, a, b)`` of the non-empty row blocks ``[a, b)``."""
    return [(j, bounds[j], bounds[j + 1]) for j in range(len(bounds) - 1) if bounds[j + 1] > bounds[j]]


class _serial:
    """Context: torch's intra-op threads set to 1 inside, restored after. For the per-expert weight copies and
    gradient roundings of :class:`_WideSwiGlu` (a few MB each, memory-bound): as parallel regions each waits for
    every OpenMP thread, which on a host busier than its cores costs a scheduler slice per copy (2 threads on
    this 2-core VM at load 7: 16 ms per 768 x 2048 bf16 -> fp32 copy against 0.7 ms on one thread,
    ``experiments/2026-12-06-moe.md``); the matmuls between them keep all threads."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        if self.threads > 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.threads > 1:
            torch.set_num_threads(self.threads)


def _widen(buf: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
    """``buf`` (wide, ``[sum of rows, cols]``) holding the weights ``ws`` stacked by rows, copied on one thread."""
    with _serial():
        r = 0
        for w in ws:
            buf[r:r + w.shape[0]].copy_(w)
            r += w.shape[0]
    return buf


def _narrow(*ts: Optional[torch.Tensor], dtype: torch.dtype) -> list:
    """``ts`` rounded to ``dtype`` (new tensors: the gradients handed to autograd; None stays None), on one
    thread."""
    with _serial():
        return [None if t is None else t.to(dtype) for t in ts]


class _SameSwiGlu:
    """:class:`GroupedSwiGlu` for plain experts whose matmuls run in the tensors' dtype: every product goes
    straight into its row block of a preallocated output (``torch.mm(out=)``), the weights used in place.
    ``forward`` / ``backward`` as the node's, without the LoRA case."""

    @staticmethod
    def forward(xs: torch.Tensor, bounds: list, ws: tuple, mm: torch.dtype) -> tuple:
        S, H = xs.shape
        inter = ws[0].shape[0]
        g, u, y = xs.new_empty(S, inter), xs.new_empty(S, inter), xs.new_empty(S, H)
        for j, a, b in _blocks(bounds):
            torch.mm(xs[a:b], ws[3 * j].t(), out=g[a:b])
            torch.mm(xs[a:b], ws[3 * j + 1].t(), out=u[a:b])
        act = F.silu(g)
        h = act * u
        for j, a, b in _blocks(bounds):
            torch.mm(h[a:b], ws[3 * j + 2].t(), out=y[a:b])
        return y, (xs, g, u, act, h)

    @staticmethod
    def backward(dy: torch.Tensor, saved: tuple, ws: tuple, bounds: list, mm: torch.dtype, needs: tuple):
        xs, g, u, act, h = saved
        need = needs[3:]
        grads: list = [None] * len(ws)
        dh = torch.empty_like(h)
        for j, a, b in _blocks(bounds):
            torch.mm(dy[a:b], ws[3 * j + 2], out=dh[a:b])
            if need[3 * j + 2]:
                grads[3 * j + 2] = torch.mm(dy[a:b].t(), h[a:b])
        dg = torch.ops.aten.silu_backward(dh * u, g)  # before du: at most 3 [S, I] at once
        du = dh * act
        del dh
        dx = torch.empty_like(xs) if needs[0] else None
        for j, a, b in _blocks(bounds):
            if dx is not None:
                torch.mm(dg[a:b], ws[3 * j], out=dx[a:b]).addmm_(du[a:b], ws[3 * j + 1])
            if need[3 * j]:
                grads[3 * j] = torch.mm(dg[a:b].t(), xs[a:b])
            if need[3 * j + 1]:
                grads[3 * j + 1] = torch.mm(du[a:b].t(), xs[a:b])
        return dx, grads


class _WideSwiGlu:
    """:class:`GroupedSwiGlu` for plain half-precision experts whose matmuls run in a wider ``mm`` dtype (bf16 on
    a CPU without bf16 hardware, :func:`matmul_dtype`). Each expert's gate and up weights are widened into the
    two halves of one reused ``[2I, H]`` buffer and run as one matmul (``x [W_gate; W_up]^T``), the down weight
    into a reused ``[H, I]`` one; products go into wide row blocks, rounded to the dtype once over all rows (as
    the half-precision kernels round their fp32 accumulators). The per-expert copies (widening, gradient
    rounding) run on one thread (:class:`_serial`), the matmuls on all. Transients besides the saved tensors: the two
    weight buffers and the weight-gradient buffers (``3 I H`` wide elements each pass), and wide copies of the
    rows (``[S, 2I]`` + ``[S, H]`` in the forward; ``[S, H]`` x 3 + ``[S, I]`` x 4 at most in the backward)."""

    @staticmethod
    def forward(xs: torch.Tensor, bounds: list, ws: tuple, mm: torch.dtype) -> tuple:
        S, H = xs.shape
        inter = ws[0].shape[0]
        xm = xs.to(mm)
        gu = xm.new_empty(S, 2 * inter)
        wgu, wd = xm.new_empty(2 * inter, H), xm.new_empty(H, inter)
        for j, a, b in _blocks(bounds):
            _widen(wgu, ws[3 * j], ws[3 * j + 1])
            torch.mm(xm[a:b], wgu.t(), out=gu[a:b])
        del xm, wgu
        g, u = gu[:, :inter].to(xs.dtype), gu[:, inter:].to(xs.dtype)
        del gu
        act = F.silu(g)
        h = act * u
        hm, ym = h.to(mm), xs.new_empty(S, H, dtype=mm)
        for j, a, b in _blocks(bounds):
            torch.mm(hm[a:b], _widen(wd, ws[3 * j + 2]).t(), out=ym[a:b])
        return ym.to(xs.dtype), (xs, g, u, act, h)

    @staticmethod
    def backward(dy: torch.Tensor, saved: tuple, ws: tuple, bounds: list, mm: torch.dtype, needs: tuple):
        xs, g, u, act, h = saved
        need = needs[3:]
        grads: list = [None] * len(ws)
        inter, H = h.shape[1], xs.shape[1]
        dym, hm = dy.to(mm), h.to(mm)
        dhm = hm.new_empty(h.shape)
        wd, gd = dym.new_empty(H, inter), dym.new_empty(H, inter)
        for j, a, b in _blocks(bounds):
            torch.mm(dym[a:b], _widen(wd, ws[3 * j + 2]), out=dhm[a:b])
            if need[3 * j + 2]:
                grads[3 * j + 2] = _narrow(torch.mm(dym[a:b].t(), hm[a:b], out=gd), dtype=h.dtype)[0]
        del dym, hm, wd, gd
        dh = dhm.to(h.dtype)
        del dhm
        dgu = xs.new_empty(xs.shape[0], 2 * inter, dtype=mm)
        dgu[:, :inter].copy_(torch.ops.aten.silu_backward(dh * u, g))
        dgu[:, inter:].copy_(dh * act)
        del dh
        return _WideSwiGlu._gate_up_back(dgu, xs, ws, bounds, needs, grads)

    @staticmethod
    def _gate_up_back(dgu: torch.Tensor, xs: torch.Tensor, ws: tuple, bounds: list, needs: tuple, grads: list):
        """Gate and up part of :meth:`backward`: ``dx = [dg | du] [W_gate; W_up]`` (one matmul, one rounding)
        and ``[dW_gate; dW_up] = [dg | du]^T x`` per block."""
        need = needs[3:]
        inter, H = dgu.shape[1] // 2, xs.shape[1]
        xm = xs.to(dgu.dtype)
        dxm = xm.new_empty(xs.shape) if needs[0] else None
        wgu, ggu = xm.new_empty(2 * inter, H), xm.new_empty(2 * inter, H)
        for j, a, b in _blocks(bounds):
            if dxm is not None:
                torch.mm(dgu[a:b], _widen(wgu, ws[3 * j], ws[3 * j + 1]), out=dxm[a:b])
            if need[3 * j] or need[3 * j + 1]:
                torch.mm(dgu[a:b].t(), xm[a:b], out=ggu)
                parts = [ggu[p * inter:(p + 1) * inter] if need[3 * j + p] else None for p in (0, 1)]
                grads[3 * j], grads[3 * j + 1] = _narrow(*parts, dtype=xs.dtype)
        return (dxm.to(xs.dtype) if dxm is not None else None), grads


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
