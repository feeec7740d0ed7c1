"""What ``checkpoint.save`` / ``checkpoint.dir`` mean at launch (:func:`prepare_checkpoint_root`) and at the
end (:func:`interrupt_note`, :func:`end_of_run_line`); card processes decide in ``StageTrainer.save_due``.
"""
from __future__ import annotations

import errno
import os
import shutil
from typing import Optional

from npu_train.env import resume_env_prefix
from npu_train.errors import UserError, console_columns, nearest_existing

#: printed at launch by a ``checkpoint.save=false`` run
NO_SAVE_NOTE = ("note: checkpoint.save=false: no checkpoint will be written (not at train.save_every, the end or an "
                "interrupt), so this run cannot be resumed")


class CheckpointDirError(UserError):
    """``checkpoint.dir`` cannot be written, or has too little room for this run's checkpoints (exit 2)."""


def check_checkpoint_dir_writable(ckpt_root: str) -> None:
    """Create and remove a probe file in ``ckpt_root`` (a new root: in its nearest existing ancestor, creating
    nothing). Raises :class:`CheckpointDirError` naming the OS error: a read-only mount, no permission, a path
    through a file."""
    where = nearest_existing(ckpt_root)
    probe = os.path.join(where, f".npt-probe-{os.getpid()}")
    try:
        if not os.path.isdir(where):
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), where)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.remove(probe)
    except OSError as e:
        raise CheckpointDirError(
            f"checkpoint.dir={ckpt_root} cannot be written ({where}: [Errno {e.errno}] {e.strerror}): point "
            "checkpoint.dir at a directory this user can write (default <run dir>/checkpoints), or set "
            "checkpoint.save=false to train without checkpoints") from None


def saves_of_launch(train, start_step: int) -> int:
    """Checkpoints this launch writes from ``start_step``: every ``train.save_every`` steps and at its last step
    (``train.steps``, or ``train.stop_after`` steps on)."""
    end = min(train.steps, start_step + train.stop_after) if train.stop_after else train.steps
    every = int(train.save_every)
    n = (end // every - start_step // every) if every else 0
    return n + (0 if every and end % every == 0 else 1)


def check_checkpoint_space(ckpt_root: str, cfg, model_cfg, stages: int, start_step: int = 0,
                           lora_params_per_layer: int = 0) -> None:
    """Refuse a launch whose checkpoints will not fit in ``ckpt_root``'s free space (one checkpoint, or
    ``checkpoint.keep`` of them beside the one being written): :class:`CheckpointDirError`, unless
    ``checkpoint.low_space=warn`` (then a warning is printed)."""
    from npu_train.checkpoint.store import (checkpoint_bytes, checkpoints_needed_at_once, complete_checkpoints,
                                            launch_space_message)

    size = checkpoint_bytes(model_cfg, stages, cfg.train.mode, lora_params_per_layer)
    count = checkpoints_needed_at_once(int(cfg.checkpoint.keep), len(complete_checkpoints(ckpt_root)),
                                       saves_of_launch(cfg.train, start_step))
    free = shutil.disk_usage(nearest_existing(ckpt_root)).free
    msg = launch_space_message(ckpt_root, size, count, free, int(cfg.checkpoint.keep))
    if not msg:
        return
    if cfg.checkpoint.low_space == "warn":
        print(f"warning: {msg}; training anyway (checkpoint.low_space=warn): free disk space there or point "
              "checkpoint.dir at a larger disk", flush=True)
        return
    raise CheckpointDirError(f"{msg}, losing the training before it: free disk space there, point checkpoint.dir "
                             "at a larger disk, set checkpoint.low_space=warn to train anyway, or "
                             "checkpoint.save=false to save nothing")


def prepare_checkpoint_root(ckpt_root: str, cfg, model_cfg, stages: int, earlier: list, owner: bool,
                            lock=None, start_step: int = 0, lora_params_per_layer: int = 0) -> None:
    """Get the checkpoint root ready before the card processes start. ``save=false``: prints
    :data:`NO_SAVE_NOTE` only. Else, when this node is the ``owner``, removes dead jobs' staging; refuses
    (:func:`check_checkpoint_space`) before creating anything when the checkpoints will not fit; creates
    ``ckpt_root``, locks it as the ``owner`` (``lock``: ``JobLocks.checkpoint_root``) and sets ``earlier``
    aside. Raises OSError, or UserError."""
    from npu_train.checkpoint.store import remove_stale_staging, set_aside

    if not cfg.checkpoint.save:
        print(NO_SAVE_NOTE, flush=True)
        return
    if owner:  # multi-node: the root is shared; node 0 owns the staging dirs
        for p in remove_stale_staging(ckpt_root):  # only staging dirs of jobs that are gone
            print(f"removed {p}: staging directory of a job that is no longer running", flush=True)
    check_checkpoint_space(ckpt_root, cfg, model_cfg, stages, start_step, lora_params_per_layer)
    os.makedirs(ckpt_root, exist_ok=True)
    if owner and lock is not None:
        lock(ckpt_root)
    if owner and earlier:  # checkpoint.existing=set_aside
        print(f"note: moved {len(earlier)} checkpoint(s) of an earlier run to {set_aside(ckpt_root)}", flush=True)


def continue_note(ckpt_root: str, offload_update: str) -> str:
    """The command that continues from ``ckpt_root``'s newest checkpoint (with this run's ``NPT_`` variables)."""
    import shlex

    from npu_train.config import hydra_value

    args = "train.resume=latest " + shlex.quote(f"checkpoint.dir={hydra_value(ckpt_root)}") + (
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


#: the end of a failed or interrupted launch's line when the run has no complete checkpoint
NO_CHECKPOINT_YET = "no checkpoint saved yet: rerunning the same command starts the run again"


def last_checkpoint_note(ckpt_root: str, offload_update: str, run_dir: str) -> tuple[Optional[str], str]:
    """After a card process failed, or an interrupt before this launch saved: ``(checkpoint, note)``, the latest
    complete checkpoint under ``ckpt_root`` (the one ``train.resume=latest`` picks; staging and partial dirs never
    count) and the line's part naming it and the resume command, or ``(None, note)`` saying that a rerun starts
    again when it has none."""
    from npu_train.checkpoint.store import find_checkpoint

    ck = find_checkpoint("auto", ckpt_root)  # auto: the newest complete one, None when there is none
    if ck is None:
        return None, NO_CHECKPOINT_YET
    return ck, (f"last complete checkpoint {ck}; {continue_note(ckpt_root, offload_update)} (the whole command: "
                f"'resume' in {os.path.join(run_dir, 'status.json')})")


def done_checkpoint(last_ckpt: Optional[str], save: bool = True) -> str:
    """The ``done:`` summary's checkpoint line: ``checkpoint: <dir>``, or ``no checkpoint (checkpoint.save=false)``."""
    return f"checkpoint: {last_ckpt}" if save else "no checkpoint (checkpoint.save=false)"


def fmt_wall(seconds: float) -> str:
    """``h:mm:ss`` of a wall time in seconds (``75.3`` -> ``0:01:15``, ``90061`` -> ``25:01:01``)."""
    s = int(round(max(0.0, float(seconds))))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _pace(summ: dict) -> str:
    """The ``done:`` line's pace from the summary: ``, 84 tok/s, wall 0:01:15`` (``summary.json``'s
    ``mean_tokens_per_s``, the mean over the steps after the first, of trained tokens: ``trained tok/s`` where
    not every position trains, chat data; left out after one step) and this launch's ``wall_s``."""
    tps, out = summ.get("mean_tokens_per_s"), ""
    if tps is not None:
        out += f", {tps:,.0f} {'trained ' if summ.get('mean_all_tokens_per_s') is not None else ''}tok/s"
    if summ.get("wall_s") is not None:
        out += f", wall {fmt_wall(summ['wall_s'])}"
    return out


def end_of_run_line(summ: dict, at: int, train, last_ckpt: Optional[str], ckpt_root: str, save: bool,
                    run_dir: str, resume_words: Optional[list] = None, width: Optional[int] = None,
                    fit_note: str = "") -> str:
    """The launcher's last lines (``done: ...`` or, after ``train.stop_after``, ``stopped: ...``): the steps and
    losses, the mean trained tokens/s and this launch's wall time (:func:`_pace`), then, each on its own line
    indented two spaces, ``checkpoint: <dir>`` and ``metrics: <file>`` (a label with its path: a fresh-clone review saw one ``;``-joined line fold with ``checkpoint`` cut off from its path,
    issue 40), ``fit_note`` when given (``planner.fit.refit_from_run``'s: the run's speed not fitted, its host was
    busy) and a stopped run's resume command. With ``resume_words`` (its words, each quoted for the shell:
    launch/run.py's ``resume_words``) that is ``resume with:`` and the whole command to paste, broken into
    `` \\``-continued lines of at most ``width`` columns (default: the console's) by
    :func:`~npu_train.metrics.report.resume_lines`; without, "the same command" and what to add to it.
    ``summ``: the reporter's summary (losses in nats/token)."""
    from npu_train.metrics.report import fmt_loss, resume_lines

    n = int(summ["steps_run"])
    early = at < train.steps
    skipped = f" ({summ['skipped_steps']} skipped: non-finite)" if summ.get("skipped_steps") else ""
    resume = ""
    if early and last_ckpt:
        cmd = resume_lines(resume_words, width or console_columns()) if resume_words else None
        resume = ("\n" + "\n".join(cmd) if cmd else
                  f"\n  {continue_note(ckpt_root, train.offload_update)} (the whole command: 'resume' in "
                  f"{os.path.join(run_dir, 'status.json')})")
    return (f"{'stopped' if early else 'done'}: {n} step{'' if n == 1 else 's'}{skipped}"
            + (f" of this launch (train.stop_after={train.stop_after}), at step {at} of train.steps={train.steps}"
               if early else "")
            + f", loss {fmt_loss(summ['first_loss'])} -> {fmt_loss(summ['last_loss'])}{_pace(summ)}\n"
            f"  {done_checkpoint(last_ckpt, save)}\n  metrics: {os.path.join(run_dir, 'metrics.jsonl')}"
            + (f"\n  {fit_note}" if fit_note else "") + resume)
