"""A card's peak memory per phase family (issue 43): the trainer folds its backend's peak into ``mem_phases``
when the phase family changes, so the load's peak survives the per-step resets."""
from __future__ import annotations

from npu_train.runtime.trainer import StageTrainer, phase_family


def test_phase_families():
    assert [phase_family(p) for p in ("device setup", "model load", "rendezvous", "peak FLOP/s (a matmul)")] == ["load"] * 4
    assert phase_family("step 3 forward/backward") == phase_family("step 3 optimizer") == "steps"
    assert phase_family("evaluation after step 0") == "eval"
    assert phase_family("DPO reference pass over 8 sequences") == "reference"
    assert phase_family("checkpoint save of step 2") == "save"
    assert phase_family("resume") == "resume"


class _Backend:
    """max_memory_allocated: the largest value set since the last reset."""

    def __init__(self):
        self.now = self.peak = 0

    def set(self, v):
        self.now = v
        self.peak = max(self.peak, v)

    def max_memory_allocated(self):
        return self.peak

    def reset_peak_memory(self):
        self.peak = self.now


class _Ctrl:
    def send(self, *a, **k):
        pass


def test_load_peak_survives_the_steps_and_each_family_keeps_its_own():
    t = StageTrainer.__new__(StageTrainer)
    t.phase, t.mem_phases, t.ctrl, t.backend = "start", {}, _Ctrl(), _Backend()
    t.enter("model load")
    t.backend.set(9)  # the load's spike
    t.backend.set(5)
    t.enter("rendezvous")  # same family: nothing folded yet
    t.enter("evaluation after step 0")  # closes the load
    t.backend.set(6)
    t.fold_peak(reset=True)  # as train_step does first
    t.enter("step 1 forward/backward")
    t.backend.set(7)
    assert t.fold_peak(reset=False) == 7  # the step's own peak
    t.enter("checkpoint save of step 1")
    t.backend.set(8)
    t.backend.set(5)
    t.fold_peak(reset=True)
    t.enter("step 2 forward/backward")
    t.backend.set(6)
    assert t.fold_peak(reset=False) == 6  # the save's 8 is not this step's
    assert t.mem_phases == {"load": 9, "eval": 6, "steps": 7, "save": 8}


class _SampledBackend(_Backend):
    """A cpu card's measure: the process holds ``held`` bytes, but the peak moves only when sampled (at backend
    calls such as memory_allocated)."""

    def __init__(self):
        super().__init__()
        self.held = 0

    def memory_allocated(self):
        self.set(self.held)
        return self.held


def test_the_load_reports_its_peak_before_the_initial_values_go(monkeypatch):
    """The load's peak (planner's MemoryModel.load_peak) is the weights + the optimizer's state + the initial values
    it was made from, at once between the optimizer's construction and ``del masters``: the card samples it there,
    so the load family's report holds it (here 3 + 2 + 1), not only what stays after (3 + 2)."""
    import npu_train.hostmem as hostmem

    t = StageTrainer.__new__(StageTrainer)
    t.phase, t.mem_phases, t.ctrl, t.backend = "start", {}, _Ctrl(), _SampledBackend()
    t.enter("model load")

    def load_model():
        t.backend.held = 3 + 1  # the weights (sampled as they load) and the initial values
        t.backend.memory_allocated()
        return {"w": object()}

    def make_optimizer(masters):
        t.backend.held += 2  # the optimizer's moments: no backend call on a cpu card

    monkeypatch.setattr(t, "_load_model", load_model)
    monkeypatch.setattr(t, "_make_optimizer", make_optimizer)
    monkeypatch.setattr(hostmem, "release_freed_memory", lambda: setattr(t.backend, "held", t.backend.held - 1))
    t._load()
    t.backend.memory_allocated()
    t.enter("evaluation after step 0")
    assert t.mem_phases["load"] == 6
