"""The memory model's terms, each its own function, sum to the totals the model gave before it was split
(figures recorded from ``MemoryModel.stage`` at commit 8e36068, one expression per stage). The cpu
workspace fraction went from 12 % to 4 % since (experiments/2026-12-03-lora-memory.md): for cpu rows the
recorded workspace and total are replaced by 4 % of the recorded body; the heap's holes a cpu card adds
since it reuses freed host memory (experiments/2026-12-04-cpu-heap.md) are tested on their own below, the
recorded rows with cards that return freed memory (``runtime.keep_host_memory=false``). The furiosa rows' eager
activation figure went from 136314880 B to :data:`EAGER_8B_S512` a layer (the math kernel's saved tensors,
``tests/unit/test_eager_activations.py``): their activations are written with it, workspace 0.5 GiB + 2 % of the
body + the 512 MiB module cache, the second row's peak (total) unchanged. The first furiosa row's transient went from 0
to ``2*P + 4*q*s*b`` (the math kernel's backward), then (2026-12-07) to :data:`MATH_BACKWARD_8B_S512`, the layer's
MLP phase, larger at S = 512 than its attention's less what the MLP freed (``tests/unit/test_attention_transient.py``);
the second row's accumulation temporary is larger."""
from __future__ import annotations

import pytest

from npu_train.hardware import GIB, make_cards
from npu_train.model.presets import get_preset
from npu_train.planner import RunShape
from npu_train.planner.memory import MemoryModel
from npu_train.planner.memterms import DEFAULT_MEMORY_TERMS, load_memory_terms

TERMS = ("baseline", "weights", "grads", "optimizer", "activations", "transient", "workspace")
KEYS = TERMS + ("total", "modules")
#: Llama-3.1-8B, bf16, S = 512, b = 1, eager (math kernel): 512 x (2(4 + 2e)h + 8 + (12 + e)q + 4ei) + 4*a*s*s
EAGER_8B_S512 = 512 * (2 * 8 * 4096 + 8 + 14 * 4096 + 8 * 14336) + 4 * 32 * 512 * 512
#: what one layer's backward allocates on top of the held graph on an eager card at S = 512: the MLP's phase,
#: down_proj's input gradient and the SwiGLU product's two gradients less the product freed, 2*e*i per token
MATH_BACKWARD_8B_S512 = 2 * 2 * 14336 * 512
#: (preset, kind, RunShape fields, cards, nonlayer_resident, (stage, layers, resident), bytes of KEYS)
RECORDED = [
    ('llama-3.1-8b', 'furiosa', dict(seq_len=512, micro_batch=1, micro_batches=4, dtype='bf16', grad_accum='compute'),
     2, None, (0, 16, 0), (0, 8030257152, 8030257152, 0, 2 * 16 * EAGER_8B_S512, MATH_BACKWARD_8B_S512,
                           2**30 + int(0.02 * (2 * 8030257152 + 2 * 16 * EAGER_8B_S512 + MATH_BACKWARD_8B_S512)),
                           2 * 8030257152 + 2 * 16 * EAGER_8B_S512 + MATH_BACKWARD_8B_S512 + 2**30
                           + int(0.02 * (2 * 8030257152 + 2 * 16 * EAGER_8B_S512 + MATH_BACKWARD_8B_S512)),
                           536870912)),
    ('llama-3.1-8b', 'furiosa', dict(seq_len=512, micro_batch=1, micro_batches=4, dtype='bf16', grad_accum='compute'),
     # activations: 16 layers + the fp32 log-probabilities; the peak is the same: transient = peak - activations
     2, None, (1, 16, 6), (0, 8030265344, 8030265344, 15704064000, 16 * EAGER_8B_S512 + 512 * 128256 * 4,
                           2443706368 + 2790981632 - 16 * EAGER_8B_S512 - 512 * 128256 * 4, 1813727477, 38813010165,
                           536870912)),
    ('smollm2-135m', 'cpu', dict(seq_len=128, micro_batch=2, micro_batches=4, dtype='fp32', offload='delayed'),
     3, None, (0, 10, 10), (375809638, 254850048, 254850048, 509700096, 366028800, 113246208, 179841024, 2054325862, 0)),
    ('smollm2-135m', 'cpu', dict(seq_len=128, micro_batch=2, micro_batches=4, dtype='fp32', offload='delayed'),
     3, None, (1, 10, 4), (375809638, 141603840, 141603840, 368169984, 244019200, 84962304, 117643100, 1473811906, 0)),
    ('smollm2-135m', 'cpu', dict(seq_len=128, micro_batch=2, micro_batches=4, dtype='fp32', offload='delayed'),
     3, None, (2, 10, 0), (375809638, 254852352, 254852352, 764557056, 172341248, 258391296, 204599316, 2285403258, 0)),
    ('smollm2-135m', 'cpu', dict(seq_len=128, micro_batch=2, micro_batches=8, dtype='bf16', schedule='zb-h1', lora_params_per_layer=34560),
     2, None, (0, 15, 15), (375809638, 163862784, 2073600, 6220800, 200878080, 0, 44764231, 793609133, 0)),
    ('smollm2-135m', 'cpu', dict(seq_len=128, micro_batch=2, micro_batches=8, dtype='bf16', schedule='zb-h1', lora_params_per_layer=34560),
     # activations: recorded 431499264 less the head's logits gradient kept from B to W, 2 x 128*2*2*49152 B, which
     # LoRA does not keep (frozen head: MemoryModel.pending_head)
     2, None, (1, 15, 5), (375809638, 163863936, 2073600, 6220800, 431499264 - 2 * 128 * 2 * 2 * 49152, 100663296,
                           84518507, 1164649041, 0)),
    ('llama-3.1-8b', 'cuda', dict(seq_len=1024, micro_batch=1, micro_batches=8, dtype='fp32', schedule='gpipe', recompute=True),
     1, None, (0, 32, 8), (0, 32121044992, 32121044992, 13959168000, 8900452352, 2101346304, 5533894656, 94736951296, 0)),
    ('smollm2-135m', 'cpu', dict(seq_len=128, micro_batch=2, micro_batches=4, dtype='bf16', grad_accum='compute', offload='serial'),
     2, False, (0, 15, 3), (375809638, 162825984, 162825984, 976955904, 200878080, 464512512, 236159815, 2579967917, 0)),
    ('smollm2-135m', 'cpu', dict(seq_len=128, micro_batch=2, micro_batches=4, dtype='bf16', grad_accum='compute', offload='serial'),
     2, False, (1, 15, 15), (375809638, 162827136, 162827136, 976962816, 150770688, 514622208, 236161198, 2579980820, 0)),
]


@pytest.mark.parametrize("name,kind,shape,cards,nonlayer_resident,where,expected", RECORDED)
def test_terms_sum_to_the_recorded_totals(name, kind, shape, cards, nonlayer_resident, where, expected):
    i, n, r = where
    terms = [load_memory_terms(kind, "/nonexistent.json", reuse_freed_memory=False)] * cards
    mm = MemoryModel(get_preset(name), RunShape(**shape), make_cards(kind, cards, 1 << 40), nonlayer_resident, terms)
    mem = mm.stage(i, n, r, 0.35 * GIB if kind == "cpu" else 0).mem
    if kind == "cpu":  # workspace = 0.10 GiB + 4 % of the body (weights .. transient), from docs/planner.md
        body, const = sum(expected[1:6]), int(0.10 * GIB)
        ws = const + int(0.04 * body)
        expected = expected[:6] + (ws, expected[0] + body + ws, expected[8])
    assert tuple(mem[k] for k in KEYS) == expected
    assert mem["total"] == sum(mem[k] for k in TERMS)


@pytest.mark.parametrize("ckpt,read", [("bf16", 2 * 2 + 3), ("fp16", 2 * 2 + 3), ("fp32", 2 * 4 + 3), ("gguf", 20)])
def test_lora_load_peak_is_covered(ckpt, read):
    """A LoRA stage's load holds (issue 43; ``Trainer.setup`` makes the optimizer before the load ends): the
    weights in the compute dtype, the tied embedding's copy on the last stage of Llama-3.2-1B included; the
    optimizer's state (fp32 adapters on a cpu card are their own masters: the two AdamW moments, 8 B/param); the
    fp32 initial values ``apply_lora`` returns (4 B/param); one chunk of rows being read (2**22 elements: as
    stored + the finite check's masks and ``|x|``, ``2s + 3`` B, or GGUF's dequantisation, measured 20 B; a cpu card
    casts inside ``copy_``, no upload copy) and the upload copy of one layer's adapters (4 B/param: the optimizer
    copies each initial value into its adapter); no whole fp32 tensor (the load reads chunks)."""
    cfg = get_preset("llama-3.2-1b")
    A = 1000  # adapter params per layer
    shape = RunShape(seq_len=256, micro_batch=1, micro_batches=4, dtype="fp32", lora_params_per_layer=A,
                     checkpoint_dtype=ckpt)
    mm = MemoryModel(cfg, shape, make_cards("cpu", 2, 1 << 40), None)
    st = mm.stage(1, 6, 6, 0)
    mem = st.mem
    H, I, V = 2048, 8192, 128256
    q, kv = 32 * 64, 8 * 64
    layer = 2 * H * q + 2 * H * kv + 3 * H * I + 2 * H  # q, o; k, v; gate, up, down; two norms
    weights = 4 * (6 * (layer + A) + H + V * H)  # 6 layers (+ adapters), final norm, tied head copy
    assert mem["weights"] == weights
    load_peak = weights + 8 * 6 * A + 4 * 6 * A + (1 << 22) * read + 4 * A
    body = sum(mem[k] for k in ("weights", "grads", "optimizer", "activations", "transient"))
    assert body >= load_peak
    assert mm.load_peak(1, 6, mm.parameters(1, 6, 6), weights) == load_peak


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_full_load_peak_holds_the_optimizer_state(dtype):
    """Full fine-tuning on a cpu card, from the formula: the load ends with the weights (e B/param), the optimizer's
    state made at construction (fp32: resident parameters are their own masters, 8 B of moments; offloaded ones
    12 B with their host master; bf16: 12 B each), the fp32 masters read from the file (bf16 only: fp32
    parameters in host memory are their own, 0), one fp32 checkpoint chunk (2**22 x (2 x 4 + 3) B: the slice and
    its finite check; the cpu card casts inside ``copy_``) and, bf16 only, the upload copy of the largest tensor as the optimizer
    places its masters (4 B/element: the 49152 x 576 embedding of SmolLM2-135M on stage 0; fp32 parameters in host
    memory are the masters the load filled: no copy)."""
    cfg = get_preset("smollm2-135m")
    e = 4 if dtype == "fp32" else 2
    mm = MemoryModel(cfg, RunShape(seq_len=128, micro_batch=1, micro_batches=2, dtype=dtype, schedule="1f1b",
                                   checkpoint_dtype="fp32"), make_cards("cpu", 2, 1 << 40), True)
    n, r = 15, 10
    p = mm.parameters(0, n, r)
    # q, o 576 x 576; k, v 192 x 576 (3 kv heads of 64); gate, up, down 576 x 1536; two norms
    layer = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 576 * 1536 + 2 * 576
    total = n * layer + 49152 * 576
    assert p.trainable == total and p.offloaded == (n - r) * layer
    weights = e * total
    if dtype == "fp32":
        expected = weights + 8 * (total - p.offloaded) + 12 * p.offloaded + 0
    else:
        expected = weights + 12 * total + 4 * total
    expected += (1 << 22) * (2 * 4 + 3) + (0 if dtype == "fp32" else 4 * 49152 * 576)
    assert mm.load_peak(0, n, p, weights) == expected


def test_checkpoint_dtype_is_checked():
    with pytest.raises(ValueError, match="checkpoint_dtype"):
        RunShape(seq_len=8, checkpoint_dtype="int8")


@pytest.mark.parametrize("dtype,e", [("bf16", 2), ("fp32", 4)])
def test_packed_rows_add_one_mask_per_micro_batch_in_flight(dtype, e):
    """data.pack / data.doc_mask: each micro-batch in flight keeps one [b, 1, S, S] additive mask in the
    compute dtype (shared by the stage's layers): ``k * b * S^2 * e`` more activations, k in flight."""
    cfg = get_preset("smollm2-135m")
    kw = dict(seq_len=4096, micro_batch=2, micro_batches=4, dtype=dtype)
    cards = make_cards("cpu", 2, 1 << 44)
    for stage, k in ((0, 2), (1, 1)):  # 1F1B, P = 2: min(M, P - stage) micro-batches in flight
        plain = MemoryModel(cfg, RunShape(**kw), cards, None).stage(stage, 15, 15, 0).mem["activations"]
        packed = MemoryModel(cfg, RunShape(packed=True, **kw), cards, None).stage(stage, 15, 15, 0).mem["activations"]
        assert packed - plain == k * 2 * 4096 ** 2 * e


def test_cpu_card_returning_freed_memory_has_no_heap_term(tmp_path):
    """A cpu card keeping freed memory (the default) adds ``heap_fraction`` (1.0) x the churn
    (``MemoryModel.hole_churn``: with its heap guard, one micro-batch's layer activations + 2.5 layers' + 32 MiB) to its
    workspace; with ``runtime.keep_host_memory=false`` it returns each freed block from 256 KiB to the OS and its
    workspace is the 0.10 GiB constant (the card process's runtime state) + 4 % of the body alone."""
    from npu_train.planner.memory import activation_bytes_per_layer

    kept, returned = (load_memory_terms("cpu", tmp_path / "none.json", reuse_freed_memory=keep) for keep in (True, False))
    assert kept.heap_fraction == DEFAULT_MEMORY_TERMS["cpu"].heap_fraction == 1.0 and returned.heap_fraction == 0.0
    assert "keep_host_memory=false" in returned.sources["heap_fraction"]
    cards = make_cards("cpu", 2, 1 << 40)
    lora = RunShape(seq_len=128, micro_batch=2, micro_batches=4, dtype="fp32", lora_params_per_layer=34560)
    a, b = (MemoryModel(get_preset("smollm2-135m"), lora, cards, None, [t, t]).stage(0, 15, 15, 0).mem
            for t in (kept, returned))
    body, const = sum(b[k] for k in TERMS[1:6]), int(0.10 * GIB)
    per_layer = activation_bytes_per_layer(get_preset("smollm2-135m"), lora, "sdpa")
    assert b["workspace"] == const + int(0.04 * body) and b["heap"] == 0
    assert a["heap"] == 15 * per_layer + per_layer // 2 + 2 * per_layer + 32 * 2**20
    assert a["workspace"] == const + int(0.04 * body + a["heap"])
    assert a["total"] - b["total"] == a["workspace"] - b["workspace"] == a["heap"]
    # activation recompute: the cpu card returns freed memory (hostmem.card_mmap_threshold), no heap term
    rc = MemoryModel(get_preset("smollm2-135m"), RunShape(seq_len=128, micro_batch=2, micro_batches=4, dtype="fp32",
                                                          lora_params_per_layer=34560, recompute=True),
                     cards, None, [kept, kept]).stage(0, 15, 15, 0).mem
    assert rc["heap"] == 0 and rc["workspace"] == const + int(0.04 * sum(rc[k] for k in TERMS[1:6]))


def _heap(cfg, i, n, terms=None, **kw):
    """``(mem["heap"], StageMemory.heap_cap, one layer's activations (sdpa), mem)`` of cpu card ``i`` of 2 with ``n``
    layers, S = 256, b = 2."""
    from npu_train.planner.memory import activation_bytes_per_layer

    shape = RunShape(seq_len=256, micro_batch=2, **kw)
    terms = terms or [DEFAULT_MEMORY_TERMS["cpu"]] * 2
    sm = MemoryModel(cfg, shape, make_cards("cpu", 2, 1 << 40), None, terms).stage(i, n, n, 0)
    return sm.mem["heap"], sm.heap_cap, activation_bytes_per_layer(cfg, shape, "sdpa"), sm.mem


@pytest.mark.parametrize("schedule,M", [("1f1b", 1), ("1f1b", 8), ("zb-h2", 8), ("gpipe", 8), ("zbv", 8)])
def test_guarded_heap_holes_are_one_micro_batch_and_a_few_layers(schedule, M):
    """With the heap guard (the default on Linux) a cpu card's holes are at most its cap, one micro-batch's saved
    activations of its ``n`` layers (``n a``, ``a`` = :func:`activation_bytes_per_layer` with sdpa), + the guard's
    slack ``a / 2`` (RSS growth between two reads of the live bytes) + what one layer frees between two checks,
    ``2 a`` + 32 MiB + with full fine-tuning one fresh gradient of the largest layer tensor (SmolLM2: the MLP's
    ``576 x 1536``, in the larger of the compute and gradient dtypes); the same whatever the schedule keeps in
    flight, LoRA or full, fp32 or bf16; the head's ``[tokens, vocab]`` blocks are not holes; no guard and no heap
    under recompute."""
    cfg, n, MiB = get_preset("smollm2-135m"), 15, 2**20
    for kw, fresh in ((dict(dtype="fp32", lora_params_per_layer=34560), 0),
                      (dict(dtype="bf16", lora_params_per_layer=34560), 0),
                      (dict(dtype="fp32"), 4 * 576 * 1536),
                      (dict(dtype="bf16", grad_accum="compute"), 2 * 576 * 1536),
                      (dict(dtype="bf16"), 4 * 576 * 1536)):
        for i in (0, 1):
            h, cap, a, mem = _heap(cfg, i, n, schedule=schedule, micro_batches=M, **kw)
            assert h == n * a + a // 2 + 2 * a + fresh + 32 * MiB, (kw, i, h, a)
            assert cap == n * a, (kw, i, cap, a)
            assert mem["workspace"] >= h
    h, cap, _, _ = _heap(cfg, 0, n, schedule="1f1b", micro_batches=M, dtype="fp32", recompute=True)
    assert h == 0 and cap is None


def test_heap_cap_follows_a_fitted_heap_fraction():
    """``heap_fraction`` f other than 1: the planned holes are ``f`` x the churn (``n a + a/2 + 2 a + 32 MiB``,
    LoRA) and the guard's cap that much less the slack and what one layer frees between checks (0 when that is
    negative)."""
    from dataclasses import replace

    cfg, n, MiB = get_preset("smollm2-135m"), 15, 2**20
    for f in (0.5, 0.1):
        terms = [replace(DEFAULT_MEMORY_TERMS["cpu"], heap_fraction=f)] * 2
        h, cap, a, _ = _heap(cfg, 0, n, terms, schedule="1f1b", micro_batches=8, dtype="fp32",
                             lora_params_per_layer=34560)
        churn = n * a + a // 2 + 2 * a + 32 * MiB
        assert h == int(f * churn)
        assert cap == max(0, int(f * churn) - a // 2 - 2 * a - 32 * MiB)
    assert cap == 0  # f = 0.1


def test_unguarded_heap_holes_are_the_layers_freed_activations(monkeypatch):
    """Where a card cannot guard its heap (no glibc ``mallinfo2``/``malloc_trim``), ``mem["heap"]`` is one copy of
    the layers' activations in flight: ``k * n * a`` (k micro-batches in flight), LoRA or full, whatever the
    gradients; the head's ``[tokens, vocab]`` blocks and its saved log-probabilities are not holes; 0 under
    recompute. One micro-batch per step (M = 1: no accumulation temporary)."""
    import npu_train.planner.memory as memory

    monkeypatch.setattr(memory, "heap_guard_available", lambda: False)
    cfg, n = get_preset("smollm2-135m"), 15
    for kw in (dict(dtype="fp32", lora_params_per_layer=34560), dict(dtype="bf16", lora_params_per_layer=34560),
               dict(dtype="fp32"), dict(dtype="bf16", grad_accum="compute")):
        for i in (0, 1):  # 1F1B, P = 2, M = 1: one micro-batch in flight on each card
            h, cap, a, mem = _heap(cfg, i, n, schedule="1f1b", micro_batches=1, **kw)
            assert h == n * a and cap is None, (kw, i, h, n * a)
            if i == 1:  # card 1 holds the head: its saved log-probabilities (b*S*V*4 B) are not counted
                assert mem["activations"] == n * a + 2 * 256 * cfg.vocab_size * 4
    assert _heap(cfg, 0, n, schedule="1f1b", micro_batches=1, dtype="fp32", recompute=True)[0] == 0
    # M = 4, full fine-tuning, fp32: two micro-batches in flight on card 0 (1F1B, P = 2), and the embedding's
    # accumulation temporary (one block requested again whole) is not a hole
    h, _, a, _ = _heap(cfg, 0, n, schedule="1f1b", micro_batches=4, dtype="fp32")
    assert h == 2 * n * a


@pytest.mark.parametrize("tied", [True, False])
def test_embedding_gradient_add_counts_what_the_schedule_holds_then(tied):
    """Full fine-tuning, one cpu card (GPipe, M = 4: ``F0 F1 F2 F3 B0 B1 B2 B3``), fp32: the embedding's fresh
    ``[V, H]`` gradient (``4 V H`` bytes) exists at the end of each ``B``, when that micro-batch's saved tensors are
    freed, so on top of what the later micro-batches hold, not of the activations' peak. Tied: the head (first in
    each backward, adding ``dW`` in place) makes ``.grad`` first, so every ``B`` adds a fresh gradient: after ``B0``
    3 micro-batches are held. Untied: ``B0``'s becomes ``.grad``, ``B1`` the first to add: 2 held. ``H`` = one
    micro-batch's activations (the term / 4); S = 16 so the gradient outweighs a micro-batch."""
    from dataclasses import replace

    from npu_train.planner.memory import activation_bytes_per_layer, saved_logits_bytes

    cfg = replace(get_preset("smollm2-135m"), tie_word_embeddings=tied)
    shape = RunShape(seq_len=16, micro_batch=1, micro_batches=4, schedule="gpipe", dtype="fp32")
    mm = MemoryModel(cfg, shape, make_cards("cpu", 1, 1 << 40), None, [load_memory_terms("cpu", "/none.json")])
    n = cfg.num_layers
    mem = mm.stage(0, n, n, 0).mem
    H = n * activation_bytes_per_layer(cfg, shape, "sdpa") + saved_logits_bytes(cfg, shape)
    assert mem["activations"] == 4 * H
    fresh = 4 * cfg.vocab_size * cfg.hidden_size
    held = 3 * H if tied else 2 * H
    assert mm.nonlayer_accumulation_peak(0, n) == held + fresh
    assert held + fresh > 4 * H + 4 * cfg.hidden_size * cfg.intermediate_size  # the largest layer gradient's add
    assert mem["transient"] == held + fresh - 4 * H


@pytest.mark.parametrize("mode,dtype,kept", [("full", "fp32", False), ("full", "bf16", True), ("lora", "fp32", False),
                                             ("lora", "bf16", False)])
def test_head_logits_gradient_kept_to_w(mode, dtype, kept):
    """ZB-H1, 2 cpu cards, M = 4: the head's card holds ``min(M, 2)`` = 2 micro-batches between ``B`` and ``W``. Each
    keeps the logits' gradient ``s*b*e*V`` for the head's weight gradient only where it is a tensor of its own:
    full fine-tuning with bf16 compute (the bf16 cast of the fp32 gradient); not with fp32 compute on a cpu card
    (the loss's in-place backward writes it into the saved log-probabilities, held until ``W`` anyway), nor with
    LoRA (the head is frozen: no ``W`` needs it). The rest of the activations is the same whatever ``kept``."""
    from npu_train.planner.memory import activation_bytes_per_layer, pending_grad_bytes_per_layer, saved_logits_bytes

    cfg = get_preset("smollm2-135m")
    kw = dict(lora_params_per_layer=34560) if mode == "lora" else {}
    shape = RunShape(seq_len=128, micro_batch=2, micro_batches=4, schedule="zb-h1", dtype=dtype, **kw)
    mm = MemoryModel(cfg, shape, make_cards("cpu", 2, 1 << 40), None, [load_memory_terms("cpu", "/none.json")] * 2)
    e = 4 if dtype == "fp32" else 2
    n = 15
    layers = 2 * n * activation_bytes_per_layer(cfg, shape, "sdpa") + 2 * saved_logits_bytes(cfg, shape)
    pending = 2 * n * pending_grad_bytes_per_layer(cfg, shape)
    head = 2 * 128 * 2 * e * cfg.vocab_size
    assert mm.stage(1, n, n, 0).mem["activations"] == layers + pending + (head if kept else 0)


def test_zbv_embedding_gradient_add_after_the_first_chunks_backward():
    """ZB-V, 2 cpu cards, M = 4, full fine-tuning, fp32, card 0 holding the tied embedding, layer 0 (its first chunk)
    and the head (its second chunk): its actions ``F00 F10 F20 F01 B01 W01 F11 B11 W11 F30 B00 ...``. The head's
    ``W01`` adds in place first, so each ``B`` of the first chunk adds a fresh ``4 V H`` gradient; ``B00`` comes
    with all four micro-batches' layer-0 activations ``a`` in flight and frees its own, keeping only its output
    (``S b h 4`` bytes) until the ``W``: ``3 a + S b h 4 + 4 V H``, not the activations' peak (which also holds the
    head's saved log-probabilities and pending logits gradient) plus the gradient (the 0.63 B run's card 0)."""
    from npu_train.planner.memory import activation_bytes_per_layer

    cfg = get_preset("smollm2-135m")
    shape = RunShape(seq_len=256, micro_batch=2, micro_batches=4, schedule="zbv", dtype="fp32")
    mm = MemoryModel(cfg, shape, make_cards("cpu", 2, 1 << 40), None, [load_memory_terms("cpu", "/none.json")] * 2)
    a = activation_bytes_per_layer(cfg, shape, "sdpa")
    fresh = 4 * cfg.vocab_size * cfg.hidden_size
    assert mm.nonlayer_accumulation_peak(0, 1) == 3 * a + 256 * 2 * cfg.hidden_size * 4 + fresh
    assert mm.nonlayer_accumulation_peak(1, 29) == 0  # no embedding, no head on card 1
