"""What ``checkpoint.save`` / ``checkpoint.dir`` mean at launch (:func:`prepare_checkpoint_root`) and at the
end (:func:`interrupt_note`, :func:`end_of_run_line`); card processes decide in ``StageTrainer.save_due``.
"""
from __future__ import annotations

import os
from typing import Optional

from npu_train.env import resume_env_prefix

#: printed at launch by a ``checkpoint.save=false`` run
NO_SAVE_NOTE = ("note: checkpoint.save=false: no checkpoint will be written (not at train.save_every, the end or an "
                "interrupt), so this run cannot be resumed")


def prepare_checkpoint_root(ckpt_root: str, cfg, model_cfg, stages: int, earlier: list, owner: bool,
                            lock=None) -> None:
    """Get the checkpoint root ready before the card processes start. ``save=false``: prints
    :data:`NO_SAVE_NOTE` only. Else creates ``ckpt_root``, locks it when this node is the ``owner`` (``lock``:
    ``JobLocks.checkpoint_root``), warns when a checkpoint will not fit and, as the ``owner``, removes dead
    jobs' staging and sets ``earlier`` aside. Raises OSError, or UserError from ``lock``."""
    from npu_train.checkpoint.store import launch_space_warning, remove_stale_staging, set_aside

    if not cfg.checkpoint.save:
        print(NO_SAVE_NOTE, flush=True)
        return
    os.makedirs(ckpt_root, exist_ok=True)
    if owner and lock is not None:
        lock(ckpt_root)
    if warn := launch_space_warning(ckpt_root, model_cfg, stages, cfg.train.mode):  # the first save would fail
        print(warn, flush=True)
    if owner:  # multi-node: the root is shared; node 0 owns the staging dirs
        for p in remove_stale_staging(ckpt_root):  # only staging dirs of jobs that are gone
            print(f"removed {p}: staging directory of a job that is no longer running", flush=True)
        if earlier:  # checkpoint.existing=set_aside
            print(f"note: moved {len(earlier)} checkpoint(s) of an earlier run to {set_aside(ckpt_root)}", flush=True)


def continue_note(ckpt_root: str, offload_update: str) -> str:
    """The command that continues from ``ckpt_root``'s newest checkpoint (with this run's ``NPT_`` variables)."""
    args = f"train.resume=latest checkpoint.dir={ckpt_root}" + (
        " train.offload_update=sync (a delayed-update run resumes with the synchronous update)"
        if offload_update == "delayed" else "")
    env = resume_env_prefix()
    if env:
        return f"resume with: {env}<the same command> {args}"
    return f"resume by rerunning the same command with {args}"


def interrupt_note(last_ckpt: Optional[str], ckpt_root: str, offload_update: str, save: bool = True) -> str:
    """The interrupt message's checkpoint part: the saved checkpoint and how to resume, or why there is none."""
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
    """The launcher's last line (``done: ...`` or, after ``train.stop_after``, ``stopped: ...``); ``summ``: the
    reporter's summary (losses in nats/token)."""
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
