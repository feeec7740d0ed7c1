"""Experiment trackers beside ``metrics.jsonl``: TensorBoard (default), Weights & Biases, MLflow.

``metrics.logger=[tensorboard,wandb,mlflow]`` picks them; :func:`open_trackers` builds them and
:class:`~npu_train.metrics.report.Reporter` feeds them (per-step scalars, evals, the final summary).
W&B and MLflow come from their own client libraries (``pip install npu-train[wandb]`` / ``[mlflow]``) and are
never required: a missing package, a server that does not answer or any error inside a tracker is one
``warning:`` line and that tracker is dropped; training goes on. A resumed run continues the same tracker
run: the run ids are kept in ``<checkpoint dir>/trackers.json`` (:class:`TrackerIds`).
"""
from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from npu_train.config import LOGGERS  # the names metrics.logger accepts

__all__ = ["LOGGERS", "Tracker", "TrackerIds", "TrackerSetup", "open_trackers", "wandb_mode"]

_IDS_FILE = "trackers.json"


@dataclass
class TrackerIds:
    """The tracker runs a checkpoint dir's run logs to (``trackers.json``), so a resume continues them."""

    wandb: Optional[str] = None
    mlflow: Optional[str] = None

    @classmethod
    def load(cls, ckpt_root: Optional[str]) -> "TrackerIds":
        try:
            with open(os.path.join(ckpt_root, _IDS_FILE)) as f:
                d = json.load(f)
            return cls(**{k: d.get(k) for k in ("wandb", "mlflow")})
        except (OSError, TypeError, ValueError, AttributeError):
            return cls()

    def save(self, ckpt_root: Optional[str]) -> None:
        """Write ``trackers.json`` (atomically; silently nothing when there is no checkpoint dir)."""
        if not ckpt_root or not os.path.isdir(ckpt_root):
            return
        tmp = os.path.join(ckpt_root, f".{_IDS_FILE}.tmp")
        try:
            with open(tmp, "w") as f:
                json.dump(asdict(self), f)
            os.replace(tmp, os.path.join(ckpt_root, _IDS_FILE))
        except OSError:
            pass


@dataclass
class TrackerSetup:
    """What every tracker gets at the start of a launch.

    ``config``: the resolved job config (plain dict); ``plan``: the placement plan's dict (``plan.json``);
    ``project``: W&B project / MLflow experiment; ``run_name``: the run's display name; ``group``: the sweep a
    multirun job belongs to (W&B group, MLflow tag ``sweep``) or None; ``ckpt_root``: where
    :class:`TrackerIds` live (None: no resume, fresh ids); ``resuming``: this launch resumes a checkpoint;
    ``mlflow_uri``: tracking URI (None: ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the
    launch directory, MLflow's own default)."""

    run_dir: str
    config: dict
    plan: dict
    project: str = "npu-train"
    run_name: Optional[str] = None
    group: Optional[str] = None
    ckpt_root: Optional[str] = None
    resuming: bool = False
    mlflow_uri: Optional[str] = None
    ids: TrackerIds = field(default_factory=TrackerIds)


class Tracker:
    """One tracker: ``log`` scalars per step, ``summary`` at the end, ``close``. Subclasses raise freely;
    :class:`Guarded` turns an error into one warning and drops the tracker."""

    name = "tracker"

    def log(self, scalars: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def summary(self, summ: dict) -> None:
        pass

    def close(self) -> None:
        pass

    def where(self) -> Optional[str]:
        """One line saying where this tracker's run is and how to look at it (None: nothing to say)."""
        return None


class TensorBoardTracker(Tracker):
    """Scalars into ``<run dir>/tb`` (``torch.utils.tensorboard``)."""

    name = "tensorboard"

    def __init__(self, setup: TrackerSetup):
        from torch.utils.tensorboard import SummaryWriter

        self.tb = SummaryWriter(os.path.join(setup.run_dir, "tb"))

    def log(self, scalars, step):
        for k, v in scalars.items():
            self.tb.add_scalar(k, v, step)

    def close(self):
        self.tb.close()


def wandb_mode(env=os.environ) -> str:
    """``$WANDB_MODE`` when set; else ``online`` with credentials (``$WANDB_API_KEY`` or a ``~/.netrc`` entry
    for api.wandb.ai) and ``offline`` without (runs are written under ``<run dir>/wandb``; ``wandb sync``
    uploads them later)."""
    if env.get("WANDB_MODE"):
        return env["WANDB_MODE"]
    if env.get("WANDB_API_KEY"):
        return "online"
    try:
        with open(os.path.expanduser("~/.netrc")) as f:
            if "api.wandb.ai" in f.read():
                return "online"
    except OSError:
        pass
    return "offline"


class WandbTracker(Tracker):
    """A W&B run (``wandb.init``; id kept for resume, ``resume="allow"``), config and plan as its config."""

    name = "wandb"

    def __init__(self, setup: TrackerSetup):
        import wandb

        run_id = setup.ids.wandb if setup.resuming and setup.ids.wandb else uuid.uuid4().hex[:12]
        self.mode = wandb_mode()
        self.run = wandb.init(project=setup.project, name=setup.run_name, group=setup.group, id=run_id,
                              resume="allow", dir=setup.run_dir, mode=self.mode,
                              config={"config": setup.config, "plan": setup.plan},
                              settings=wandb.Settings(init_timeout=60, silent=True, console="off"))
        setup.ids.wandb = run_id

    def log(self, scalars, step):
        self.run.log(dict(scalars), step=step)

    def summary(self, summ):
        for k, v in summ.items():
            if isinstance(v, (int, float, str)) and not isinstance(v, bool):
                self.run.summary[k] = v

    def close(self):
        self.run.finish()

    def where(self):
        if self.mode == "online":
            return f"wandb: run {self.run.url}"
        path = os.path.dirname(self.run.dir)  # <run dir>/wandb/offline-run-<time>-<id>/files
        if self.mode == "offline":
            return f"wandb: offline run; upload it with: wandb sync {path}"
        return f"wandb: run files in {path} (WANDB_MODE={self.mode})"


def _mlflow_key(k: str) -> str:
    """MLflow keys allow ``[A-Za-z0-9_\\-. /]``; anything else becomes ``_``."""
    return "".join(c if c.isalnum() or c in "_-. /" else "_" for c in k)


def _flat(d: dict, prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": "1"}`` (MLflow params are strings of at most 6000 characters)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat(v, key + "."))
        else:
            out[_mlflow_key(key)] = str(v)[:6000]
    return out


def _artifact_root(uri: str) -> Optional[str]:
    """A sqlite store's artifacts go beside its database file (``<db dir>/mlruns``), not into the current
    directory (MLflow's default); None (MLflow's choice) for any other store."""
    if not uri.startswith("sqlite:///"):
        return None
    db = os.path.abspath(uri[len("sqlite:///"):])
    return "file://" + os.path.join(os.path.dirname(db), "mlruns")


class MlflowTracker(Tracker):
    """An MLflow run in experiment ``project`` (continued by id on resume): the config as params, the plan as
    an artifact, scalars as metrics, the summary as ``summary.*`` metrics."""

    name = "mlflow"

    def __init__(self, setup: TrackerSetup):
        # an unreachable server must not stall the launch for minutes (MLflow retries 7 times by default)
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
        _quiet_mlflow()
        from mlflow.tracking import MlflowClient

        uri = setup.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        run_id = setup.ids.mlflow if setup.resuming else None
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(setup.project)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
                setup.project, artifact_location=_artifact_root(uri))
            tags = {"sweep": setup.group} if setup.group else {}
            run_id = self.client.create_run(exp_id, run_name=setup.run_name, tags=tags).info.run_id
            params = _flat(setup.config)
            from mlflow.entities import Param

            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), 100):  # the batch API takes at most 100 params
                self.client.log_batch(run_id, params=items[i:i + 100])
            self.client.log_dict(run_id, setup.plan, "plan.json")
        self.run_id = run_id
        self.exp_id = self.client.get_run(run_id).info.experiment_id
        setup.ids.mlflow = run_id

    def log(self, scalars, step):
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_mlflow_key(k), float(v), ts, step)
                                                    for k, v in scalars.items()])

    def summary(self, summ):
        for k, v in summ.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self.client.log_metric(self.run_id, f"summary.{_mlflow_key(k)}", float(v))

    def close(self):
        self.client.set_terminated(self.run_id)

    def where(self):
        if self.uri.startswith(("http://", "https://")):
            return f"mlflow: run {self.uri.rstrip('/')}/#/experiments/{self.exp_id}/runs/{self.run_id}"
        return f"mlflow: run {self.run_id}; look at it with: mlflow ui --backend-store-uri {self.uri}"


def _quiet_mlflow() -> None:
    """MLflow logs its own ``INFO`` lines (creating a sqlite store's tables...) into the job's output: keep
    its warnings only, unless ``$MLFLOW_LOGGING_LEVEL`` says otherwise."""
    import logging

    if os.environ.get("MLFLOW_LOGGING_LEVEL"):
        return
    os.environ["MLFLOW_LOGGING_LEVEL"] = "WARNING"  # read when mlflow is first imported
    for name in ("mlflow", "alembic"):  # and for an mlflow imported before
        logging.getLogger(name).setLevel(logging.WARNING)


_KINDS = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}
_EXTRA = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


class Guarded:
    """A tracker whose first error prints one ``warning:`` line and turns it off (training goes on)."""

    def __init__(self, tracker: Tracker, warn: Callable[[str], None]):
        self.tracker, self.warn, self.on = tracker, warn, True

    @property
    def name(self) -> str:
        return self.tracker.name

    def _call(self, what: str, *args) -> None:
        if not self.on:
            return
        try:
            getattr(self.tracker, what)(*args)
        except Exception as e:  # noqa: BLE001 - a tracker must never stop training
            self.on = False
            self.warn(f"warning: {self.name} logging failed ({type(e).__name__}: {str(e)[:200]}); "
                      f"{self.name} is off for the rest of this run, metrics.jsonl still has everything")

    def log(self, scalars: dict[str, float], step: int) -> None:
        self._call("log", scalars, step)

    def summary(self, summ: dict) -> None:
        self._call("summary", summ)

    def close(self) -> None:
        if self.on:
            self._call("close")
            self.on = False

    def where(self) -> Optional[str]:
        try:
            return self.tracker.where()
        except Exception:  # noqa: BLE001 - a tracker must never stop training
            return None


def _warn(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def open_trackers(names, setup: TrackerSetup, warn: Callable[[str], None] = _warn) -> list[Guarded]:
    """Start the trackers named in ``names`` (:data:`LOGGERS`; checked by config validation). A tracker whose
    package is missing or that fails to start is one warning (naming the extra to install) and is skipped.
    The run ids go to ``setup.ckpt_root``'s ``trackers.json``."""
    setup.ids = TrackerIds.load(setup.ckpt_root) if setup.resuming else TrackerIds()
    out = []
    for name in dict.fromkeys(names):  # once each, in the order given
        try:
            out.append(Guarded(_KINDS[name](setup), warn))
        except ImportError as e:
            warn(f"warning: metrics.logger lists {name} but {e.name or name} is not installed "
                 f"(pip install 'npu-train[{_EXTRA[name]}]'); training goes on without it")
        except Exception as e:  # noqa: BLE001 - unreachable server, bad URI, no permission...
            warn(f"warning: {name} could not start ({type(e).__name__}: {str(e)[:200]}); training goes on "
                 "without it")
    setup.ids.save(setup.ckpt_root)
    return out
