"""The built-in tracking back ends: one small writer per tool, each following
:class:`~llmrl.engine.client.tracking.protocol.TrackerBackend` (opened with the run's folders, names and config;
``write(scalars, step, wall_time)``; ``close()``). Their names, packages and installs are rows of
:data:`~llmrl.engine.client.tracking.registry.BUILTIN`; every tool's package is imported only when its back end
opens, and a missing one is refused with the back end's name and the install that provides it.

- ``csv``: ``<run dir>/scalars.csv`` in long format, one row per scalar: ``step,key,value,wall_time`` (pandas:
  ``pd.read_csv(path).pivot_table(index="step", columns="key", values="value")``); a file that exists is appended to.
- ``tensorboard``: event files in ``<run dir>`` (``torch.utils.tensorboard.SummaryWriter``), flushed at every write.
- ``trackio``: trackio's local database under ``<dir>/trackio`` (``TRACKIO_DIR``, unless set), project and run name
  from the config; its own CPU/GPU sampling threads stay off.
- ``wandb``: an offline run in ``<run dir>/wandb`` (``wandb sync`` uploads it later; W&B's error reports off) unless
  ``WANDB_MODE`` is set; every scalar is plotted against the llmrl step (the ``step`` metric), so steps may go back
  without being dropped. W&B's service writes the run file on its own, after ``close`` returns.
- ``mlflow``: an MLflow run in the file store ``<dir>/mlruns`` (``mlflow ui --backend-store-uri <dir>/mlruns``),
  or in ``MLFLOW_TRACKING_URI`` when set; names MLflow refuses have their other characters replaced by ``_``.

This module chooses no names, steps or paths (the tracker does), registers nothing (the registry does) and computes
no scalar.
"""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

from llmrl.engine.client.tracking.registry import require as _require


class CSVBackend:
    def __init__(self, run_dir: Path, **_):
        self.path = run_dir / "scalars.csv"
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file = open(self.path, "a", newline="")
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(["step", "key", "value", "wall_time"])
            self._file.flush()

    def write(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        self._writer.writerows([step, key, repr(value), f"{wall_time:.3f}"] for key, value in scalars.items())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardBackend:
    def __init__(self, run_dir: Path, config: dict, **_):
        _require("tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir))
        if config:
            import json

            self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def write(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step, walltime=wall_time)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class TrackioBackend:
    def __init__(self, run_dir: Path, root: Path, project: str, run_name: str, config: dict, **_):
        import inspect
        import sys

        os.environ.setdefault("TRACKIO_DIR", str(root / "trackio"))  # read when trackio is first imported
        fresh = "trackio" not in sys.modules
        trackio = _require("trackio")
        if not fresh:
            from llmrl.engine.log import logger

            logger.info("trackio was imported before llmrl opened it: it writes to %s", os.environ["TRACKIO_DIR"])
        wanted = {"auto_log_cpu": False, "auto_log_gpu": False, "embed": False}
        accepted = inspect.signature(trackio.init).parameters
        self.run = trackio.init(project=project, name=run_name, config=config or None,
                                **{k: v for k, v in wanted.items() if k in accepted})

    def write(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        import trackio

        current = getattr(getattr(trackio, "context_vars", None), "current_run", None)
        if current is not None and current.get() is self.run:
            trackio.finish()  # also forgets it as trackio's current run, which trackio would finish again at exit
        else:
            self.run.finish()


class WandbBackend:
    def __init__(self, run_dir: Path, project: str, run_name: str, config: dict, **_):
        mode = None if os.environ.get("WANDB_MODE") else "offline"  # never the network unless the user asks
        if mode == "offline":
            os.environ.setdefault("WANDB_ERROR_REPORTING", "false")  # nor W&B's crash reports
        wandb = _require("wandb")
        self.run = wandb.init(project=project, name=run_name, dir=str(run_dir), mode=mode, config=config or None,
                              reinit="create_new", settings=wandb.Settings(console="off"))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def write(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        self.run.log({**scalars, "step": step})

    def close(self) -> None:
        self.run.finish()


_MLFLOW_REFUSED = re.compile(r"[^\w\-. /:]")


class MLflowBackend:
    def __init__(self, root: Path, project: str, run_name: str, config: dict, **_):
        _require("mlflow")
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (root / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks file-store users to opt in
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.uri = uri
        if config:
            from mlflow.entities import Param

            params = [Param(_MLFLOW_REFUSED.sub("_", k)[:250], str(v)[:500]) for k, v in config.items()]
            for start in range(0, len(params), 100):  # MLflow's limit per batch
                self.client.log_batch(self.run_id, params=params[start:start + 100])

    def write(self, scalars: dict[str, float], step: int, wall_time: float) -> None:
        from mlflow.entities import Metric

        stamp = int(wall_time * 1000)
        metrics = [Metric(_MLFLOW_REFUSED.sub("_", key), value, stamp, step) for key, value in scalars.items()]
        for start in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
