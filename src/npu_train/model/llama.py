"""Pure-PyTorch Llama-family decoder (Llama, Qwen2/2.5, Qwen3, Mistral) split into pipeline stages
(:class:`StageModule`) with HF parameter names. Numerics follow transformers' ``modeling_llama.py`` (fp32 RMSNorm,
RoPE, GQA SDPA, SwiGLU) plus Qwen2's q/k/v biases and Qwen3's q/k norms; no ``transformers`` import.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import FAMILIES, LlamaConfig
from .headops import IGNORE_INDEX, HeadLinear, cross_entropy_sum

__all__ = [
    "RMSNorm",
    "rope_inv_freq",
    "rope_cos_sin",
    "apply_rope",
    "Attention",
    "MLP",
    "DecoderLayer",
    "StageModule",
    "stage_param_names",
    "checkpoint_source_name",
    "causal_lm_loss_sum",
    "full_model",
]


# ----------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """RMS layer norm (HF ``LlamaRMSNorm``): ``weight * (x / sqrt(mean(x**2, -1) + eps)).to(x.dtype)``, statistics
    in fp32. ``weight`` [hidden] (ones); output dtype ``promote(weight.dtype, x.dtype)`` as in HF."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.to(torch.float32)
        var = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(var + self.eps)
        return self.weight * xf.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------
def _rope_type(scaling: Optional[dict]) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """Inverse RoPE frequencies, fp32 CPU ``[head_dim // 2]``: ``rope_theta ** (-2i / head_dim)`` (RoFormer),
    rescaled for ``llama3`` as HF ``_compute_llama3_parameters``, divided by ``factor`` for ``linear``."""
    dim = int(cfg.head_dim)
    base = float(cfg.rope_theta)
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))
    kind = _rope_type(cfg.rope_scaling)
    if kind == "default":
        return inv_freq
    sc = cfg.rope_scaling
    if kind == "linear":
        return inv_freq / float(sc["factor"])
    if kind != "llama3":
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; npu-train supports None/'default', 'linear' "
            f"and 'llama3'"
        )
    factor = float(sc["factor"])
    low = float(sc["low_freq_factor"])
    high = float(sc["high_freq_factor"])
    old_ctx = sc.get("original_max_position_embeddings", cfg.max_position_embeddings)
    old_ctx = float(old_ctx)
    low_wavelen = old_ctx / low
    high_wavelen = old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    inv_l = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, inv_l)


def rope_cos_sin(cfg: LlamaConfig, seq_len: int, device=None, dtype=torch.float32):
    """RoPE tables ``(cos, sin)``, each [seq_len, head_dim] in ``dtype`` on ``device`` (angles in fp32,
    rotate-half layout, as HF ``LlamaRotaryEmbedding``)."""
    inv_freq = rope_inv_freq(cfg).to(device=device)
    pos = torch.arange(seq_len, device=device, dtype=torch.int64).to(torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, heads, S, head_dim] with ``cos``/``sin`` [S, head_dim] (HF rotate_half), or
    [B, 1, S, head_dim] per-row tables (packed rows, positions restarting per sample)."""
    return x * cos + _rotate_half(x) * sin


# ----------------------------------------------------------------------------------------------
# Attention / MLP / decoder layer
# ----------------------------------------------------------------------------------------------
class Attention(nn.Module):
    """Causal grouped-query self-attention (HF ``LlamaAttention`` / ``Qwen2Attention`` / ``Qwen3Attention``):
    ``q_proj`` [heads*D, H], ``k_proj``/``v_proj`` [kv_heads*D, H] (+ biases when ``cfg.qkv_bias``), ``o_proj``
    [H, heads*D]; ``q_norm``/``k_norm`` RMSNorm [D] per head before RoPE when ``cfg.qk_norm``.
    ``forward(h [B,S,H], cos, sin [S,D] or [B,1,S,D], mask) -> [B,S,H]``: ``mask`` None (causal) or
    ``[B,1,S,S]``, additive in the compute dtype or bool (True = attend; :mod:`.masks`); ``S`` above
    ``cfg.sliding_window`` is a ValueError. ``recompute_core``: the attention core (``softmax(QK^T)V``) runs under
    a non-reentrant :func:`~torch.utils.checkpoint.checkpoint`, so what the kernel saves (the eager kernel's
    ``[B, heads, S, S]`` probabilities) is dropped and recomputed from the held q, k, v in the backward
    (selective activation recompute, Korthikanti et al. 2022 §5); the values are the same."""

    def __init__(self, cfg: LlamaConfig, recompute_core: bool = False) -> None:
        super().__init__()
        self.recompute_core = bool(recompute_core)
        H, D = cfg.hidden_size, cfg.head_dim
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = D
        self.sliding_window = cfg.sliding_window
        self.q_proj = nn.Linear(H, cfg.num_heads * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(H, cfg.num_kv_heads * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * D, H, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(D, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, S, _ = h.shape
        D = self.head_dim
        if self.sliding_window is not None and S > self.sliding_window:
            raise ValueError(f"sequence of {S} tokens exceeds the model's sliding_window={self.sliding_window}: "
                             f"sliding-window attention is not implemented; use data.seq_len<={self.sliding_window}")
        q = self.q_proj(h).view(B, S, self.num_heads, D)
        k = self.k_proj(h).view(B, S, self.num_kv_heads, D)
        if self.q_norm is not None:  # Qwen3: RMSNorm over head_dim of each head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(h).view(B, S, self.num_kv_heads, D).transpose(1, 2)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        rep = self.num_heads // self.num_kv_heads
        if rep > 1:  # HF repeat_kv: kv head j serves query heads j*rep .. j*rep+rep-1
            k = k[:, :, None].expand(B, self.num_kv_heads, rep, S, D).reshape(B, self.num_heads, S, D)
            v = v[:, :, None].expand(B, self.num_kv_heads, rep, S, D).reshape(B, self.num_heads, S, D)
        if self.recompute_core and torch.is_grad_enabled():
            o = checkpoint(_attention_core, q, k, v, mask, D ** -0.5, use_reentrant=False)
        else:
            o = _attention_core(q, k, v, mask, D ** -0.5)
        o = o.transpose(1, 2).reshape(B, S, self.num_heads * D)
        return self.o_proj(o)


def _attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                    scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` for ``[B, heads, S, D]`` inputs: causal when ``mask`` is None, else the
    packed rows' block-diagonal causal mask (:mod:`npu_train.model.masks`)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One pre-norm Llama decoder layer (HF ``LlamaDecoderLayer``); state_dict keys are HF's without
    the ``model.layers.{i}.`` prefix. ``forward(h [B,S,H], cos, sin [S,D] (or [B,1,S,D]), mask=None) -> [B,S,H]``.
    A sparse layer (``cfg.is_moe_layer(layer_idx)``) holds a :class:`~npu_train.model.moe.SparseMoe` under the
    family's checkpoint name (:attr:`mlp_name`: ``mlp``, Mixtral ``block_sparse_moe``) whose router statistics
    go to ``recorder``. ``recompute_core``: :class:`Attention`'s selective recompute of its core."""

    def __init__(self, cfg: LlamaConfig, layer_idx: int, recorder=None, recompute_core: bool = False) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, recompute_core)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.is_moe_layer(layer_idx):
            from .moe import SparseMoe

            self.mlp_name = FAMILIES[cfg.family].moe_prefix
            setattr(self, self.mlp_name, SparseMoe(cfg, layer_idx, recorder))
        else:
            self.mlp_name = "mlp"
            self.mlp = MLP(cfg)

    @property
    def ffn(self) -> nn.Module:
        """The MLP block, dense or sparse, whatever its checkpoint name."""
        return getattr(self, self.mlp_name)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask)
        return h + self.ffn(self.post_attention_layernorm(h))


# ----------------------------------------------------------------------------------------------
# Pipeline stage
# ----------------------------------------------------------------------------------------------
def stage_param_names(cfg: LlamaConfig, first: int, last: int, has_embed: bool,
                      has_head: bool) -> list[str]:
    """HF names of a stage's parameters in ``named_parameters()`` order, without building it (tied: a stage
    with embed and head owns the embedding; a head-only stage owns ``lm_head.weight``)."""
    _check_range(cfg, first, last)
    names: list[str] = []
    if has_embed:
        names.append("model.embed_tokens.weight")
    for i in range(first, last):
        names.extend(cfg.layer_param_names(i))
    if has_head:
        names.append("model.norm.weight")
        if not (cfg.tie_word_embeddings and has_embed):
            names.append("lm_head.weight")
    return names


def checkpoint_source_name(cfg: LlamaConfig, name: str) -> str:
    """Name under which parameter ``name`` is stored in a model file: ``lm_head.weight`` ->
    ``model.embed_tokens.weight`` when tied, else ``name``."""
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return "model.embed_tokens.weight"
    return name


def _check_range(cfg: LlamaConfig, first: int, last: int) -> None:
    if not (0 <= first <= last <= cfg.num_layers):
        raise ValueError(
            f"invalid layer range [{first}, {last}) for a model with {cfg.num_layers} layers"
        )


class StageModule(nn.Module):
    """One pipeline stage: optional embedding, global layers ``[first_layer, last_layer)``, optional final
    norm + LM head; a tied embed + head on one stage share one Parameter. ``recompute=True`` checkpoints
    every layer; ``recompute_attention=True`` only every layer's attention core (:class:`Attention`). Random init (std 0.02); load with :meth:`load_named_tensors`.

    ``second=(a, b)``: a card of a two-chunk schedule (:data:`~npu_train.pipeline.schedule.CHUNKED_SCHEDULES`)
    also holds layers ``[a, b)``; ``forward(chunk=0)`` runs the embedding (if any) and the first range,
    ``chunk=1`` the second range and the head (if any). Raises ValueError for a range outside the model or
    overlapping the first.

    ``recompute_layers``: with ``recompute``, only the card's first that many layers in execution order (chunk 0's
    first) are recomputed whole, the others keep their activations (``train.recompute_layers=fewest``: the
    plan's per-card count); None: every layer. Raises ValueError for a negative count.

    ``vocab=(a, b)``: vocabulary parallelism (:mod:`npu_train.pipeline.vocab`): ``lm_head`` holds only rows
    ``[a, b)`` (``[b - a, H]``, any card), and a ``has_head`` stage's forward ends at the final norm (its output
    goes to the joint ``V(m)``); :meth:`vocab_weight` is the slice. Untied heads only (ValueError)."""

    def __init__(self, cfg: LlamaConfig, first_layer: int, last_layer: int, has_embed: bool,
                 has_head: bool, recompute: bool = False, second: Optional[tuple] = None,
                 recompute_attention: bool = False, recompute_layers: Optional[int] = None,
                 vocab: Optional[tuple] = None) -> None:
        super().__init__()
        _check_range(cfg, first_layer, last_layer)
        self.cfg = cfg
        self.first_layer = first_layer
        self.last_layer = last_layer
        self.has_embed = has_embed
        self.has_head = has_head
        self.recompute = recompute
        self.recompute_attention = bool(recompute_attention)
        self.vocab = _vocab_rows(cfg, vocab)
        self.second = None if second is None else (int(second[0]), int(second[1]))
        ranges = [range(first_layer, last_layer)]
        if self.second is not None:
            _check_range(cfg, *self.second)
            if self.second[0] < last_layer and first_layer < self.second[1]:
                raise ValueError(f"layer ranges [{first_layer}, {last_layer}) and {list(self.second)} overlap")
            ranges.append(range(*self.second))
        self.chunk_layers = [[str(i) for i in r] for r in ranges]
        order = [n for c in self.chunk_layers for n in c]
        if recompute_layers is not None and int(recompute_layers) < 0:
            raise ValueError(f"recompute_layers={recompute_layers}: use a count >= 0 (or None: every layer)")
        #: the layers recomputed whole in the backward (under ``recompute``)
        k = len(order) if recompute_layers is None else int(recompute_layers)
        self.recomputed_layers = frozenset(order[:k]) if recompute else frozenset()

        self.model = nn.Module()
        #: router statistics of the sparse layers (mixtures of experts; :mod:`npu_train.model.moe`)
        self.router_recorder = None
        if cfg.is_moe:
            from .moe import RouterRecorder

            self.router_recorder = RouterRecorder()
        if has_embed:
            self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleDict(
            {str(i): DecoderLayer(cfg, i, self.router_recorder, self.recompute_attention) for r in ranges for i in r}
        )
        self._make_head()
        self.reset_parameters()
        if has_head and has_embed and cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        #: called with no argument before each decoder layer's forward and (through a hook on the layer's input)
        #: after its backward: a cpu card's :class:`~npu_train.hostmem.HeapGuard` check; None: nothing
        self.layer_check = None

    def _make_head(self) -> None:
        """The final norm (a head stage) and ``lm_head`` (a head stage, or this card's rows under ``vocab``)."""
        cfg = self.cfg
        if self.has_head:
            self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.has_head or self.vocab is not None:
            rows = cfg.vocab_size if self.vocab is None else self.vocab[1] - self.vocab[0]
            self.lm_head = HeadLinear(cfg.hidden_size, rows, bias=False)

    @property
    def sparse_embed_grad(self) -> bool:
        """Whether the embedding's backward yields a sparse COO gradient of the looked-up rows
        (``nn.Embedding(sparse=True)``); the caller must give the weight a dense zero ``.grad`` first."""
        return bool(self.has_embed and self.model.embed_tokens.sparse)

    @sparse_embed_grad.setter
    def sparse_embed_grad(self, on: bool) -> None:
        if self.has_embed:
            self.model.embed_tokens.sparse = bool(on)

    @property
    def fused_head(self) -> bool:
        """Whether the head and loss use :mod:`npu_train.model.headops` (same values to rounding)."""
        return bool(self.has_head and self.vocab is None and self.lm_head.fused_grad)

    @fused_head.setter
    def fused_head(self, on: bool) -> None:
        if self.has_head and self.vocab is None:
            self.lm_head.fused_grad = bool(on)

    def vocab_weight(self) -> torch.nn.Parameter:
        """This card's rows of the output layer (``vocab``), ``[b - a, H]``."""
        return self.lm_head.weight

    # -- init / bookkeeping ------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        """HF-style init: linear/embedding weights ~ N(0, std), biases 0, RMSNorm weights = 1."""
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                mod.weight.normal_(0.0, std)
                if getattr(mod, "bias", None) is not None:
                    mod.bias.zero_()
            elif isinstance(mod, RMSNorm):
                mod.weight.fill_(1.0)

    def param_names(self) -> list[str]:
        return [n for n, _ in self.named_parameters()]

    @torch.no_grad()
    def load_named_tensors(self, tensors: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy ``tensors`` (HF names -> tensors) into the parameters, cast to their dtype/device.
        ``strict``: every parameter present, no extra names; shapes must match exactly."""
        params = dict(self.named_parameters())
        if strict:
            missing = [n for n in params if n not in tensors]
            extra = [n for n in tensors if n not in params]
            if missing or extra:
                raise KeyError(f"load_named_tensors: missing={missing[:5]} unexpected={extra[:5]}")
        for n, t in tensors.items():
            if n not in params:
                continue
            p = params[n]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{n}: expected shape {tuple(p.shape)}, got {tuple(t.shape)}")
            p.copy_(t.to(device=p.device, dtype=p.dtype))

    def _apply(self, fn, *args, **kwargs):  # device/dtype moves invalidate the RoPE cache
        self._rope_cache = {}
        return super()._apply(fn, *args, **kwargs)

    def rope(self, seq_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached :func:`rope_cos_sin` for this stage's config."""
        key = (int(seq_len), torch.device(device), dtype)
        hit = self._rope_cache.get(key)
        if hit is None:
            hit = rope_cos_sin(self.cfg, seq_len, device, dtype)
            self._rope_cache[key] = hit
        return hit

    def attention_inputs(self, S: int, h: torch.Tensor, positions: Optional[torch.Tensor]):
        """``(cos, sin, mask)`` for a ``[b, S, H]`` input: the cached ``[S, D]`` tables and None (causal) when
        ``positions`` is None or ``0..S-1`` in every row; else per-token tables ``[b, 1, S, D]`` gathered at
        ``positions`` ``[b, S]`` int64 and the block-diagonal causal mask of :mod:`npu_train.model.masks`
        (``[b, 1, S, S]``, additive: 0 / -inf in ``h.dtype``)."""
        from .masks import additive_mask, packed_causal_mask

        mask = None if positions is None else packed_causal_mask(positions.to(h.device))
        if mask is None:
            cos, sin = self.rope(S, h.device, h.dtype)
            return cos, sin, None
        pos = positions.to(h.device)
        cos, sin = self.rope(max(S, int(pos.max()) + 1), h.device, h.dtype)
        # additive (0 / -inf) in the compute dtype: saved once for all layers (masks.additive_mask)
        return cos[pos].unsqueeze(1), sin[pos].unsqueeze(1), additive_mask(mask, h.dtype)

    # -- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, cuts: Optional[list] = None,
                positions: Optional[torch.Tensor] = None, chunk: Optional[int] = None) -> torch.Tensor:
        """``x``: int64 ids ``[b, S]`` or hidden states ``[b, S, H]`` -> hidden states, or fp32 logits ``[b, S, V]``.
        ``cuts``: receives a ``(y, leaf)`` pair per graph cut (before each layer and the head) for
        :func:`npu_train.pipeline.backward.backward_input`. ``positions``: int64 ``[b, S]`` position of each
        token in its sample (packed rows, restarting at 0 per sample; None: ``0..S-1``): RoPE at those
        positions and attention only within each sample (:meth:`attention_inputs`). ``chunk``: 0 or 1 on a
        two-chunk card (class docstring); None: every layer."""
        embed = self.has_embed and chunk != 1
        head = self.has_head and (chunk is None or chunk == len(self.chunk_layers) - 1)
        h = self.model.embed_tokens(x) if embed else x  # the module, not F.embedding: its hooks must run
        S = h.shape[1]
        cos, sin, mask = self.attention_inputs(S, h, positions)
        extra = () if mask is None else (mask,)  # unpacked: the layers' (h, cos, sin) call as before
        use_ckpt = self.recompute and torch.is_grad_enabled()
        whole = self.recomputed_layers
        names = [n for c in self.chunk_layers for n in c] if chunk is None else self.chunk_layers[chunk]
        check = self.layer_check
        for i, name in enumerate(names):
            layer = self.model.layers[name]
            if cuts is not None and (i > 0 or embed):
                h = _cut(h, cuts)
            if check is not None:
                check()
                if h.requires_grad:  # fires once the layer's backward has made h's gradient
                    h.register_hook(check)
            if use_ckpt and name in whole:
                h = checkpoint(layer, h, cos, sin, *extra, use_reentrant=False)
            else:
                h = layer(h, cos, sin, *extra)
        if not head:
            return h
        if cuts is not None and (names or embed):
            h = _cut(h, cuts)
        if self.vocab is not None:  # the logits are the joint V(m)'s (npu_train.pipeline.vocab)
            return self.model.norm(h)
        return self.lm_head(self.model.norm(h)).float()

    def extra_repr(self) -> str:
        return (f"layers=[{self.first_layer}, {self.last_layer})"
                + (f" + [{self.second[0]}, {self.second[1]})" if self.second else "") + f", embed={self.has_embed}, "
                f"head={self.has_head}, recompute={self.recompute}"
                + (f" ({len(self.recomputed_layers)} layers)" if self.recompute and
                   len(self.recomputed_layers) != sum(map(len, self.chunk_layers)) else "")
                + (", recompute_attention=True" if self.recompute_attention else "")
                + (f", vocab rows [{self.vocab[0]}, {self.vocab[1]})" if self.vocab is not None else ""))


def _vocab_rows(cfg: LlamaConfig, vocab: Optional[tuple]) -> Optional[tuple]:
    """``StageModule``'s ``vocab`` rows as ints; ValueError for a tied head or rows outside the vocabulary."""
    if vocab is None:
        return None
    a, b = int(vocab[0]), int(vocab[1])
    if cfg.tie_word_embeddings or not 0 <= a < b <= cfg.vocab_size:
        raise ValueError(f"vocab rows {vocab}: need an untied head and 0 <= a < b <= {cfg.vocab_size}")
    return a, b


def _cut(h: torch.Tensor, cuts: list) -> torch.Tensor:
    """A leaf that shares ``h``'s memory and starts a new autograd graph; ``(h, leaf)`` goes to ``cuts``."""
    leaf = h.detach().requires_grad_(True)
    cuts.append((h, leaf))
    return leaf


def full_model(cfg: LlamaConfig) -> StageModule:
    """The whole model as one stage: ``StageModule(cfg, 0, cfg.num_layers, True, True)``."""
    return StageModule(cfg, 0, cfg.num_layers, True, True)


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor,
                       fused: bool = False) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy of fp32 ``logits`` ``[B, S, V]`` and shifted int64 ``labels`` ``[B, S]``
    (``-100`` ignored); returns ``(loss_sum fp32 scalar, n_tokens int)``."""
    V = logits.shape[-1]
    flat, targets = logits.reshape(-1, V), labels.reshape(-1)
    loss = (cross_entropy_sum(flat, targets) if fused else
            F.cross_entropy(flat.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum"))
    n = int((labels != IGNORE_INDEX).sum().item())
    return loss, n
