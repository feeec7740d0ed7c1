"""What a run's checkpoint settings mean at launch and at its end (``checkpoint.save``, ``checkpoint.dir``).

Used by :mod:`npu_train.runtime.job`:

- :func:`prepare_checkpoint_root`: with ``checkpoint.save=true`` create the checkpoint root, warn when one
  checkpoint will not fit there, remove dead jobs' staging directories and set an earlier run's checkpoints
  aside; with ``checkpoint.save=false`` print one line that no checkpoint will be written and touch nothing.
- :func:`interrupt_note` and :func:`done_checkpoint`: the interrupt message's checkpoint part (with the
  resume command only when a checkpoint was saved) and the ``done:`` line's.

Whether a card process writes a checkpoint is decided in
:meth:`npu_train.runtime.trainer.StageTrainer.save_due` (``TrainSpec.save_checkpoints``).
"""
from __future__ import annotations

import os
from typing import Optional

from npu_train.env import resume_env_prefix

#: printed at launch by a ``checkpoint.save=false`` run
NO_SAVE_NOTE = ("note: checkpoint.save=false: no checkpoint will be written (not at train.save_every, the end or an "
                "interrupt), so this run cannot be resumed")


def prepare_checkpoint_root(ckpt_root: str, cfg, model_cfg, stages: int, earlier: list, owner: bool) -> None:
    """Get the checkpoint root ready before the card processes start, printing what the user must know.

    ``checkpoint.save=false``: prints :data:`NO_SAVE_NOTE`; creates, checks and removes nothing.
    Else: creates ``ckpt_root``, prints :func:`~npu_train.checkpoint.store.launch_space_warning` (less free
    space than one checkpoint of ``model_cfg`` on ``stages`` stages), and where this node ``owner``\\ s the root
    (single node, or node 0 of a multi-node job) removes the staging directories of jobs that are gone and
    moves ``earlier`` (an earlier run's checkpoints, ``checkpoint.existing=set_aside``) to ``previous-<k>/``.
    Raises ``OSError`` when the root cannot be created.
    """
    from npu_train.checkpoint.store import launch_space_warning, remove_stale_staging, set_aside

    if not cfg.checkpoint.save:
        print(NO_SAVE_NOTE, flush=True)
        return
    os.makedirs(ckpt_root, exist_ok=True)
    if warn := launch_space_warning(ckpt_root, model_cfg, stages, cfg.train.mode):  # the first save would fail
        print(warn, flush=True)
    if owner:  # multi-node: the root is shared; node 0 owns the staging dirs
        for p in remove_stale_staging(ckpt_root):  # only staging dirs of jobs that are gone
            print(f"removed {p}: staging directory of a job that is no longer running", flush=True)
        if earlier:  # checkpoint.existing=set_aside
            print(f"note: moved {len(earlier)} checkpoint(s) of an earlier run to {set_aside(ckpt_root)}", flush=True)


def continue_note(ckpt_root: str, offload_update: str) -> str:
    """How to continue from the newest checkpoint in ``ckpt_root``: the same command with
    ``train.resume=latest checkpoint.dir=<ckpt_root>`` (and ``train.offload_update=sync`` after a
    delayed-update run), started with this run's ``NPT_`` variables that change a run
    (:func:`npu_train.env.resume_env_prefix`)."""
    args = f"train.resume=latest checkpoint.dir={ckpt_root}" + (
        " train.offload_update=sync (a delayed-update run resumes with the synchronous update)"
        if offload_update == "delayed" else "")
    env = resume_env_prefix()
    if env:
        return f"resume with: {env}<the same command> {args}"
    return f"resume by rerunning the same command with {args}"


def interrupt_note(last_ckpt: Optional[str], ckpt_root: str, offload_update: str, save: bool = True) -> str:
    """The interrupt message's second half: the checkpoint saved and how to resume from it (the same
    command with ``train.resume=latest checkpoint.dir=<ckpt_root>``, started with this run's ``NPT_``
    variables that change a run, :func:`npu_train.env.resume_env_prefix`), or ``no checkpoint saved``
    (with ``save`` false, ``checkpoint.save=false``: why, and that the run cannot be resumed)."""
    if not save:
        return "no checkpoint saved (checkpoint.save=false: this run cannot be resumed)"
    if not last_ckpt:
        return "no checkpoint saved"
    return f"checkpoint {last_ckpt} saved; {continue_note(ckpt_root, offload_update)}"


def done_checkpoint(last_ckpt: Optional[str], save: bool = True) -> str:
    """The ``done:`` line's checkpoint part: ``checkpoint <dir>``, or ``no checkpoint (checkpoint.save=false)``."""
    return f"checkpoint {last_ckpt}" if save else "no checkpoint (checkpoint.save=false)"


def end_of_run_line(summ: dict, at: int, train, last_ckpt: Optional[str], ckpt_root: str, save: bool,
                    run_dir: str) -> str:
    """The launcher's last line: ``done: 20 steps, loss 4.0859 -> 3.5585; checkpoint ...; metrics ...``, or,
    when ``train.stop_after`` ended the launch at step ``at`` < ``train.steps``, ``stopped: ...`` with how to
    continue. ``summ``: the reporter's summary (``steps_run``, ``first_loss``/``last_loss`` in nats/token,
    ``skipped_steps``); ``train``: the ``train`` config group."""
    from npu_train.metrics.report import fmt_loss

    n = int(summ["steps_run"])
    early = at < train.steps
    skipped = f" ({summ['skipped_steps']} skipped: non-finite)" if summ.get("skipped_steps") else ""
    return (f"{'stopped' if early else 'done'}: {n} step{'' if n == 1 else 's'}{skipped}"
            + (f" of this launch (train.stop_after={train.stop_after}), at step {at} of train.steps={train.steps}"
               if early else "")
            + f", loss {fmt_loss(summ['first_loss'])} -> {fmt_loss(summ['last_loss'])}; "
            f"{done_checkpoint(last_ckpt, save)}; metrics {os.path.join(run_dir, 'metrics.jsonl')}"
            + (f"; {continue_note(ckpt_root, train.offload_update)} (the whole command: 'resume' in "
               f"{os.path.join(run_dir, 'status.json')})" if early and last_ckpt else ""))
