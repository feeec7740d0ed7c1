"""Seeded, resumable sampler (:class:`StepSampler`) whose output is a pure function of the step number.

Epoch ``e`` visits rows in ``randperm(n, generator seeded seed + e)`` when ``n <= RANDPERM_MAX_ROWS`` (the
permutation is held: 8 bytes a row); above that, in the order of :func:`feistel_order` keyed by ``(seed, e)``,
computed for each micro-batch's positions only, so a card's memory does not grow with the corpus (a 1 GB text
at ``data.seq_len=128`` is 4.2 M rows: a held permutation would be 33 MB per card and per cached epoch,
``experiments/2026-12-03-data.md``). Step ``k`` takes the next global batch
(``micro_batch * micro_batches * dp_size`` indices), data-parallel rank ``r`` its ``r``-th block. A step never
straddles epochs (leftover indices dropped) unless the global batch exceeds the data set; a micro-batch never
does. Resuming needs only the step number. Preference data (rows ``2i``, ``2i+1`` are pair ``i``) is drawn by pairs
(:class:`PairSampler`), so both rows of a pair share a micro-batch."""

from __future__ import annotations

from collections import OrderedDict

import torch

from .text import DataError

__all__ = ["StepSampler", "PairSampler", "make_sampler", "feistel_order", "RANDPERM_MAX_ROWS"]

_STATE_KEYS = ("seed", "n_sequences", "micro_batch", "micro_batches", "dp_size")

#: largest row count whose epoch order is a held ``torch.randperm`` (2**20 rows: 8 MiB of int64); above it the
#: order is :func:`feistel_order`'s. A function of ``n_sequences``, which the checkpoint records, so a resume
#: always takes the order it started with.
RANDPERM_MAX_ROWS = 1 << 20

_M32 = 0xFFFFFFFF
_ROUNDS = 4


def _splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele, Lea, Flood 2014), on Python ints: round keys from ``(seed, epoch)``."""
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def _round_fn(r: torch.Tensor, key: int, mask: int) -> torch.Tensor:
    """Feistel round function: a 32-bit integer hash (the ``0x45d9f3b`` multiply-xorshift) of ``r ^ key``,
    ``mask``ed to the half width. int64 arithmetic on values < 2**32 times a constant < 2**27: no overflow."""
    x = (r ^ (key & _M32)) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M32
    return (x ^ (x >> 16)) & mask


def feistel_order(positions: torch.Tensor, n: int, seed: int, epoch: int) -> torch.Tensor:
    """The rows at ``positions`` (int64, each in ``[0, n)``) of a pseudorandom permutation of ``range(n)`` keyed by
    ``(seed, epoch)``: a balanced 4-round Feistel network over ``2**(2h)`` values (``2h`` the even bit width
    covering ``n``, so fewer than ``4n``), with cycle-walking back into ``[0, n)`` (Black & Rogaway, "Ciphers with
    arbitrary finite domains", 2002): a bijection on ``range(n)`` for any key, computed element-wise in O(len)
    memory. Returns int64 of ``positions``' shape."""
    n = int(n)
    bits = max(2, (n - 1).bit_length())
    half = (bits + 1) // 2
    mask = (1 << half) - 1
    keys = [_splitmix64(_splitmix64((int(seed) << 20) ^ int(epoch)) + r) for r in range(_ROUNDS)]

    def encrypt(x: torch.Tensor) -> torch.Tensor:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, left ^ _round_fn(right, k, mask)
        return (left << half) | right

    y = encrypt(positions.to(torch.int64))
    out = y >= n
    while bool(out.any()):  # each walk stays on the cycle of a value in [0, n), so it ends there
        y[out] = encrypt(y[out])
        out = y >= n
    return y


class StepSampler:
    def __init__(
        self,
        n_sequences: int,
        micro_batch: int,
        micro_batches: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        self.n_sequences = int(n_sequences)
        self.micro_batch = int(micro_batch)
        self.micro_batches = int(micro_batches)
        self.seed = int(seed)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        if self.micro_batch < 1 or self.micro_batches < 1:
            raise ValueError(
                f"micro_batch={self.micro_batch} and micro_batches={self.micro_batches} must both be >= 1"
            )
        if self.dp_size < 1 or not (0 <= self.dp_rank < self.dp_size):
            raise ValueError(f"need dp_size >= 1 and 0 <= dp_rank < dp_size, got dp_rank={dp_rank}, dp_size={dp_size}")
        if self.n_sequences < self.micro_batch:
            raise DataError(
                f"only {self.n_sequences} training sequences, fewer than one micro-batch of "
                f"{self.micro_batch}; lower the micro-batch size or data.seq_len, or add text"
            )
        self._units_per_step = self.micro_batches * self.dp_size
        full_steps = self.n_sequences // self.global_batch
        if full_steps >= 1:
            self._units_per_epoch = full_steps * self._units_per_step
        else:
            self._units_per_epoch = self.n_sequences // self.micro_batch
        self._perms: OrderedDict[int, torch.Tensor] = OrderedDict()

    # ------------------------------------------------------------------ shape
    @property
    def global_batch(self) -> int:
        """Rows consumed per optimizer step over all data-parallel ranks."""
        return self.micro_batch * self.micro_batches * self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        """Whole steps per epoch: ``n_sequences // global_batch``, at least 1 (when the
        global batch exceeds the data set, one step spans more than one epoch)."""
        return max(1, self.n_sequences // self.global_batch)

    def epoch_of_step(self, step: int) -> int:
        """The epoch the first micro-batch of ``step`` is drawn from."""
        return (int(step) * self._units_per_step) // self._units_per_epoch

    # ------------------------------------------------------------------ sampling
    def _perm(self, epoch: int) -> torch.Tensor:
        p = self._perms.get(epoch)
        if p is None:
            g = torch.Generator().manual_seed(self.seed + epoch)
            p = torch.randperm(self.n_sequences, generator=g)
            self._perms[epoch] = p
            while len(self._perms) > 4:
                self._perms.popitem(last=False)
        else:
            self._perms.move_to_end(epoch)
        return p

    def _unit(self, u: int) -> torch.Tensor:
        epoch, j = divmod(u, self._units_per_epoch)
        if self.n_sequences > RANDPERM_MAX_ROWS:
            pos = torch.arange(j * self.micro_batch, (j + 1) * self.micro_batch, dtype=torch.int64)
            return feistel_order(pos, self.n_sequences, self.seed, epoch)
        return self._perm(epoch)[j * self.micro_batch : (j + 1) * self.micro_batch].clone()

    def micro_batches_for_step(self, step: int) -> list[torch.Tensor]:
        """``micro_batches`` int64 index tensors of ``micro_batch`` rows each: this rank's
        share of optimizer step ``step`` (0-based)."""
        step = int(step)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        first = step * self._units_per_step + self.dp_rank * self.micro_batches
        return [self._unit(first + m) for m in range(self.micro_batches)]

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        return {k: getattr(self, k) for k in _STATE_KEYS}

    def load_state_dict(self, state: dict) -> None:
        """Check a checkpointed sampler state; ``ValueError`` when the data order would differ.
        The order depends on ``micro_batches * dp_size`` only, so dp may change if that product stays."""
        missing = [k for k in _STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"sampler state is missing {missing}; the checkpoint is incomplete or not from npu-train")
        diffs = [f"{k}: checkpoint {state[k]!r} != now {getattr(self, k)!r}"
                 for k in ("seed", "n_sequences", "micro_batch") if int(state[k]) != getattr(self, k)]
        units = int(state["micro_batches"]) * int(state["dp_size"])
        if units != self._units_per_step:
            diffs.append(f"micro-batches per global step (micro_batches x dp_size): checkpoint "
                         f"{state['micro_batches']} x {state['dp_size']} = {units} != now "
                         f"{self.micro_batches} x {self.dp_size} = {self._units_per_step}")
        if diffs:
            raise ValueError(
                "cannot resume: the data/batch layout differs from the checkpoint ("
                + "; ".join(diffs)
                + "); resume with the same data.source, data.seq_len, data.val_fraction, train.seed, "
                "train.micro_batch and train.accum x parallel.dp, or start a fresh run without resuming"
            )

    def __repr__(self) -> str:
        return (f"StepSampler(n_sequences={self.n_sequences}, micro_batch={self.micro_batch}, "
                f"micro_batches={self.micro_batches}, seed={self.seed}, dp_rank={self.dp_rank}, "
                f"dp_size={self.dp_size})")


class PairSampler:
    """:class:`StepSampler` over the pairs of preference data (rows ``2i`` chosen, ``2i+1`` rejected):
    ``micro_batch`` rows (even) = ``micro_batch / 2`` pairs per micro-batch; each index tensor lists the rows
    of its pairs, chosen before rejected. Same step/epoch arithmetic and resume check as the row sampler."""

    def __init__(self, n_rows: int, micro_batch: int, micro_batches: int, seed: int, dp_rank: int = 0,
                 dp_size: int = 1) -> None:
        if micro_batch % 2 or n_rows % 2:
            raise ValueError(f"preference data needs an even micro-batch (rows: 2 per pair) and an even number of "
                             f"rows, got micro_batch={micro_batch}, rows={n_rows}")
        self.pairs = StepSampler(n_rows // 2, micro_batch // 2, micro_batches, seed, dp_rank, dp_size)
        self.micro_batch = int(micro_batch)

    @staticmethod
    def rows_of(pairs: torch.Tensor) -> torch.Tensor:
        """Row indices ``[2k]`` int64 of pair indices ``[k]``: ``2i, 2i+1`` for each pair."""
        return torch.stack([2 * pairs, 2 * pairs + 1], dim=1).reshape(-1)

    @property
    def global_batch(self) -> int:
        """Rows consumed per optimizer step over all data-parallel ranks."""
        return 2 * self.pairs.global_batch

    @property
    def steps_per_epoch(self) -> int:
        return self.pairs.steps_per_epoch

    def epoch_of_step(self, step: int) -> int:
        return self.pairs.epoch_of_step(step)

    def micro_batches_for_step(self, step: int) -> list[torch.Tensor]:
        """This rank's micro-batches of ``step``: row indices, ``micro_batch`` each (pairs adjacent)."""
        return [self.rows_of(p) for p in self.pairs.micro_batches_for_step(step)]

    def state_dict(self) -> dict:
        return {**self.pairs.state_dict(), "pairs": True}

    def load_state_dict(self, state: dict) -> None:
        if not state.get("pairs"):
            raise ValueError("cannot resume: the checkpoint was trained on rows, this run on preference pairs "
                             "(train.objective=dpo); resume with the checkpoint's objective and data")
        self.pairs.load_state_dict({k: v for k, v in state.items() if k != "pairs"})


def make_sampler(n_rows: int, micro_batch: int, micro_batches: int, seed: int, dp_rank: int = 0, dp_size: int = 1,
                 pairs: bool = False) -> "StepSampler | PairSampler":
    """The sampler of ``n_rows`` training rows: by pairs (``pairs``: preference data) or by rows."""
    cls = PairSampler if pairs else StepSampler
    return cls(n_rows, micro_batch, micro_batches, seed, dp_rank=dp_rank, dp_size=dp_size)
