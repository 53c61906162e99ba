"""Experiment trackers (`spec.tracking`), on rank 0: TensorBoard event files in
`<output>/tensorboard` (on by default), Weights & Biases, MLflow.

Each gets every numeric key of each step's `metrics.jsonl` row, under the same name at the
row's step (MLflow's names may not hold `@`: `eval/<set>/pass@k` is `eval/<set>/pass_at_k`
there); the job's name and resolved spec (`job.json` beside the trainer config) as the
run's config; and every `tracking.samplesEvery` steps a table of sampled prompts,
completions and rewards, with a column for each one the reward functions logged (TRL's
`log_extra`; values that are not plain scalars as text).

A resumed run logs into the same runs: the W&B and MLflow run ids are kept in
`<output>/tracking.json`. TensorBoard purges the steps after the checkpoint (the re-run
values replace them); W&B and MLflow cannot rewrite history, so steps they already hold are
not logged again (each step once; the values are those of the attempt that first logged
them, where metrics.jsonl holds the re-run's). A tracker that fails while logging is
reported once and dropped: the run goes on with the others.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

from rlhf_contract.api.models import TrackingSpec
from rlhf_contract.pod import ENV_TRAINER_CONFIG, JOB_FILE

log = logging.getLogger(__name__)

STATE_FILE = "tracking.json"
SAMPLE_COLUMNS = ("step", "prompt", "completion", "reward", "score")


def columns(rows: list[dict[str, Any]]) -> list[str]:
    """The samples table's columns: SAMPLE_COLUMNS, then the logged ones in order of appearance."""
    return list(dict.fromkeys([*SAMPLE_COLUMNS, *(c for r in rows for c in r)]))


def _plain(value: Any) -> Any:
    return value if value is None or isinstance(value, (str, int, float, bool)) else json.dumps(value, default=repr)


def numeric(row: dict[str, Any]) -> dict[str, float]:
    """The row's finite numbers (null, NaN and text are not logged)."""
    return {k: float(v) for k, v in row.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def run_config(job_name: str) -> dict[str, Any]:
    """`job.json` beside the trainer config (the resolved spec), or just the name."""
    path = os.environ.get(ENV_TRAINER_CONFIG)
    if path and (Path(path).parent / JOB_FILE).exists():
        return json.loads((Path(path).parent / JOB_FILE).read_text())
    return {"name": job_name}


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, output_dir: Path, config: dict[str, Any], resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(output_dir / "tensorboard"),
                                    purge_step=resume_step + 1 if resume_step else None)
        if not resume_step:
            self.writer.add_text("config", "```json\n" + json.dumps(config, indent=1) + "\n```", 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        def cell(v: Any) -> str:
            return str(v).replace("|", "\\|").replace("\n", "<br>")

        names = columns(rows)
        table = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
        table += ["| " + " | ".join(cell(r.get(c)) for c in names) + " |" for r in rows]
        self.writer.add_text("samples", "\n".join(table), step)

    def close(self, success: bool) -> None:
        self.writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, spec: Any, output_dir: Path, config: dict[str, Any], job_name: str, state: dict[str, Any]):
        import wandb

        state.setdefault("wandb_run_id", uuid.uuid4().hex[:12])
        self.run = wandb.init(project=spec.project, entity=spec.entity, name=spec.name or job_name, tags=spec.tags,
                              mode=spec.mode, dir=str(output_dir), id=state["wandb_run_id"], resume="allow",
                              config=config, settings=wandb.Settings(console="off", quiet=True))
        self.wandb = wandb
        self.url = getattr(self.run, "url", None)  # None offline
    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        names = columns(rows)
        table = self.wandb.Table(columns=names, data=[[r.get(c) for c in names] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self, success: bool) -> None:
        self.run.finish(exit_code=0 if success else 1)


def mlflow_key(key: str) -> str:
    """MLflow's metric names take letters, digits, `_-. /` only."""
    return key.replace("@", "_at_")


class MlflowTracker:
    name = "mlflow"

    def __init__(self, spec: Any, output_dir: Path, config: dict[str, Any], job_name: str, state: dict[str, Any]):
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=spec.tracking_uri)
        remote = spec.tracking_uri.startswith(("http://", "https://"))
        if state.get("mlflow_run_id"):
            self.run_id = state["mlflow_run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            self.url = self._url(spec.tracking_uri, self.client.get_run(self.run_id).info.experiment_id, remote)
            return
        name = spec.experiment or job_name
        experiment = self.client.get_experiment_by_name(name)
        # a local store keeps artifacts beside the run's output, not in the process's working directory
        local = not spec.tracking_uri.startswith(("http://", "https://", "databricks"))
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(
            name, artifact_location=(output_dir / "mlflow-artifacts").resolve().as_uri() if local else None)
        self.run_id = self.client.create_run(experiment_id, run_name=spec.run_name or job_name).info.run_id
        state["mlflow_run_id"] = self.run_id
        self.url = self._url(spec.tracking_uri, experiment_id, remote)
        from mlflow.entities import Param

        params = [Param(k[:250], json.dumps(v)[:6000] if not isinstance(v, str) else v[:6000])
                  for k, v in _flatten(config.get("spec", {})).items()]
        for start in range(0, len(params), 100):  # the store's batch limit
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        self.client.log_dict(self.run_id, config, JOB_FILE)

    def _url(self, tracking_uri: str, experiment_id: str, remote: bool) -> str | None:
        """The run's page on an MLflow server (None for a local store)."""
        return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{self.run_id}" if remote else None

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(k), v, stamp, step) for k, v in values.items()]
        for start in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        data = {c: [r.get(c) for r in rows] for c in columns(rows)}
        self.client.log_table(self.run_id, data=data, artifact_file=f"samples/step-{step}.json")

    def close(self, success: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if success else "FAILED")


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and data:
        return {k: v for key, value in data.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): data}


class Trackers:
    """The job's trackers, on rank 0. `resume_step`: the checkpoint's step a resumed run
    continues after (0: a fresh run)."""

    def __init__(self, spec: TrackingSpec, output_dir: str | Path, *, job_name: str, resume_step: int = 0):
        self.spec, self.output_dir = spec, Path(output_dir)
        self.state_path = self.output_dir / STATE_FILE
        self.state: dict[str, Any] = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        config = run_config(job_name)
        self.trackers: list[Any] = []
        starts = [(spec.tensorboard, "tensorboard", lambda: TensorBoardTracker(self.output_dir, config, resume_step)),
                  (spec.wandb is not None, "wandb",
                   lambda: WandbTracker(spec.wandb, self.output_dir, config, job_name, self.state)),
                  (spec.mlflow is not None, "mlflow", lambda: MlflowTracker(spec.mlflow, self.output_dir, config, job_name, self.state))]
        for wanted, name, start in starts:
            if not wanted:
                continue
            try:
                self.trackers.append(start())
            except Exception as err:  # an unreachable tracking server must not end the training run
                log.warning("tracker %s could not start (%s: %s); the run goes on without it",
                            name, type(err).__name__, err)
        self._save_state()

    def _save_state(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.state_path.write_text(json.dumps(self.state, indent=1))

    def samples_due(self, step: int) -> bool:
        every = self.spec.samples_every
        return bool(self.trackers) and bool(every) and (step == 1 or step % every == 0)

    def sample_table(self, step: int, rows: list[Any], decode: Any) -> list[dict[str, Any]]:
        """The first `samplesPerTable` of a step's sampled rows (data/sequences.Row), decoded."""
        return [{"step": step, "prompt": decode(r.prompt_ids), "completion": decode(r.response_ids),
                 "reward": float(r.reward), "score": float(r.score),
                 **{c: _plain(v) for c, v in (getattr(r, "extra", None) or {}).items() if c not in SAMPLE_COLUMNS}}
                for r in rows[:self.spec.samples_per_table]]

    def _each(self, step: int, call: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            if tracker.name != "tensorboard" and step <= self.state.get(f"{tracker.name}_step", 0):
                continue  # already in this run (an earlier attempt logged it)
            try:
                getattr(tracker, call)(step, *args)
            except Exception as err:  # a tracker's outage must not end the training run
                log.warning("tracker %s failed (%s: %s); it is dropped for the rest of the run",
                            tracker.name, type(err).__name__, err)
                self.trackers.remove(tracker)

    def log(self, step: int, row: dict[str, Any]) -> None:
        """The step's row (after its samples, if any)."""
        self._each(step, "log", numeric(row))
        for tracker in self.trackers:
            self.state[f"{tracker.name}_step"] = max(step, self.state.get(f"{tracker.name}_step", 0))
        self._save_state()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._each(step, "log_samples", rows)

    def links(self) -> dict[str, str]:
        """{tracker: run URL} of the trackers that have a page (W&B online, an MLflow server)."""
        return {t.name: t.url for t in self.trackers if getattr(t, "url", None)}

    def close(self, success: bool) -> None:
        for tracker in self.trackers:
            try:
                tracker.close(success)
            except Exception as err:
                log.warning("tracker %s failed to close (%s: %s)", tracker.name, type(err).__name__, err)
        self.trackers = []
