"""Local mode (`rlhfctl run job.yaml`): the job's processes on this machine.

Starts `rollout.replicas` rollout servers (always the CPU engine: vLLM needs GPUs) and one
torchrun trainer node with `trainer.nprocPerNode` processes, using the same commands and
environment as the pods (`rlhf_contract/pod.py`), on 127.0.0.1 ports. Shows progress from
`metrics.jsonl`; Ctrl-C stops everything and keeps the last complete checkpoint. Restarts
as the operator's: any process failing stops all of them, and up to
`runPolicy.maxRestarts` more attempts each resume from the newest complete checkpoint;
a permanent exit code (`rlhf_contract.exit_codes`: 2, 126, 127) ends the run at once, showing the log
tail. A rollout server that exits is started again alone, up to `rollout.maxServerReplacements`
times an attempt (the trainer re-joins it with the current weights). Attempts and restarts are
kept in `logs/attempts.log`; a finished run's curves are drawn to `<output>/plot.png`.

Simplification: local mode runs one trainer node; `trainer.numNodes` > 1 is refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from statistics import mean

from rlhf_contract.api.models import RLHFJob
from rlhf_contract.exit_codes import ExitCode, is_permanent, meaning
from rlhf_contract.outputs import complete_checkpoints
from rlhf_contract.trainer_config import TrainerConfig
from rlhf_contract.pod import (ENV_JUDGE_ENDPOINTS, JOB_FILE, Process, fetch_process, judge_process, rollout_process,
                               run_config, served_judge, trainer_process)
from rlhf_contract.sources import localize, plan

from .plot import plot_runs
from .ports import free_port  # noqa: F401  (also the tests' one definition)

_ERROR_LINE = re.compile(r"^(\[rank\d+\]: )?[A-Za-z_.]*(Error|Exception|Exit): ")


class LocalRunError(RuntimeError):
    """The local run could not start or a process failed."""


class LocalConfigError(LocalRunError):
    """The job cannot work as configured (found before anything starts): exit code 2."""


class Terminated(Exception):
    """`rlhfctl run` got SIGTERM: its processes are stopped as a pod's are (the trainer saves
    a checkpoint within `runPolicy.terminationGracePeriodSeconds`)."""


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the clean-up below must not be cut short
    raise Terminated()


class _Child:
    def __init__(self, name: str, proc: Process, log_path: Path, attempt: int = 1):
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "ab")
        if attempt > 1:
            self._log.write(f"==== attempt {attempt} ====\n".encode())
            self._log.flush()
        self.proc = proc
        self.restart()

    def restart(self) -> None:
        env = {**os.environ, **self.proc.env, "PYTHONUNBUFFERED": "1"}
        self.popen = subprocess.Popen(self.proc.command, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)

    def poll(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the log, and first the error a process raised (torchrun's own
        report after it can push the worker's exception out of the tail)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        errors = [line for line in text if _ERROR_LINE.match(line) and "ChildFailedError" not in line]
        tail = "\n".join(text[-lines:])
        return f"{errors[-1]}\n...\n{tail}" if errors and errors[-1] not in tail else tail

    def stop(self, grace_s: float = 10.0) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                os.killpg(self.popen.pid, signal.SIGCONT)  # a stopped process acts on SIGTERM only once continued
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.popen.wait()
        self._log.close()


def _prepare_output(job: RLHFJob, output: Path, resume: bool, overwrite: bool) -> None:
    done = complete_checkpoints(output)
    if done and not (resume or overwrite):
        raise LocalRunError(
            f"{output} already holds checkpoints (newest: {done[-1].name}); pass --resume to "
            "continue from it, --overwrite to start afresh, or choose another --output"
        )
    if overwrite:
        for name in ("checkpoints", "final", "logs", "metrics.jsonl", "plot.png"):
            target = output / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    output.mkdir(parents=True, exist_ok=True)
    (output / "logs").mkdir(exist_ok=True)


def _resolve_model(job: RLHFJob, output: Path, path: str | None = None, field: str = "spec.model.path",
                   folder: str = "builtin-model") -> str:
    path = path or job.spec.model.path
    from rlhf_trainer.models.builtin import is_builtin, materialize

    if is_builtin(path):
        return str(materialize(path, output / folder, seed=job.spec.schedule.seed))
    if not Path(path).exists():
        from rlhf_contract.api.uris import hub_id_hint

        raise LocalRunError(f"{field}: " + (hub_id_hint(path) or f"{path!r} does not exist on this machine; give a "
                                            "local Hugging Face model directory or builtin://tiny-qwen2"))
    return path


def fetch_sources(job: RLHFJob, out: Path, resume: bool, console) -> RLHFJob:
    """The pods' download step, run here before anything starts: the job's `hf://` / `s3://`
    models and data into `<out>/sources` (and with --resume and `output.uri`, the bucket's
    newest checkpoint when `out` holds none). Returns the job reading the local copies (the
    job itself when it names nothing remote)."""
    proc = fetch_process(plan(job, str(out)), restore_uri=job.spec.output.uri if resume else None,
                         output_dir=str(out), python=sys.executable)
    if proc is None:
        return job
    console.print("downloading the job's models and data (logs/fetch.log)", markup=False)
    with open(out / "logs" / "fetch.log", "ab") as log:
        code = subprocess.run(proc.command, env={**os.environ, **proc.env}, stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL).returncode
    if code:
        lines = (out / "logs" / "fetch.log").read_text(errors="replace").splitlines()
        message = next((line for line in reversed(lines) if line.startswith(("config error", "download failed"))),
                       "\n".join(lines[-20:]))
        raise (LocalConfigError if code == ExitCode.CONFIG_ERROR else LocalRunError)(message)
    return localize(job, str(out))


def _read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return rows


HELD_OUT = "eval/held_out/"
"""Offline methods' held-out metrics in a row (`evaluation.heldOutFraction`)."""


def summarize(rows: list[dict]) -> str:
    """Mean reward of the first and last 10 steps (what the demo promises)."""
    if rows and "reward_mean" not in rows[0]:  # sft, rm, dpo
        losses = [r["loss"] for r in rows]
        text = f"loss: first 10 steps {mean(losses[:10]):.4f}, last 10 steps {mean(losses[-10:]):.4f}"
        evals = [r for r in rows if r.get(HELD_OUT + "accuracy") is not None or r.get(HELD_OUT + "loss") is not None]
        if evals:
            key = HELD_OUT + (name := "accuracy" if evals[-1].get(HELD_OUT + "accuracy") is not None else "loss")
            text += f"; held-out {name}: start {evals[0][key]:.3f}, end {evals[-1][key]:.3f}"
        return text
    rewards = [r["reward_mean"] for r in rows]
    if not rewards:
        return "no steps completed"
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    ratio = f" ({last / first:.1f}x)" if first > 0 else ""
    return f"reward_mean: first 10 steps {first:.3f}, last 10 steps {last:.3f}{ratio}"


def save_plot(out: Path, console) -> Path | None:
    """Draw the run's curves to `out/plot.png` and print where; a failure only warns (None)."""
    try:
        path = plot_runs([out], out / "plot.png")
    except Exception as err:  # noqa: BLE001 - a picture must never fail a finished run
        console.print(f"warning: could not draw {out / 'plot.png'}: {err}", markup=False)
        return None
    console.print(f"plot: {path}", markup=False)
    return path


def _overlap_threads(spec) -> dict[str, int] | None:
    """With rollout.maxStaleness >= 1 generation and training overlap: the cores split between servers
    and trainer, so neither's thread pools spin against the other's (None: synchronous)."""
    if spec.offline or not spec.rollout.max_staleness:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    half = max(1, cores // 2)
    return {"rollout": max(1, half // spec.rollout.replicas),
            "trainer": max(1, (cores - half) // spec.trainer.nproc_per_node)}


def run_local(job: RLHFJob, *, output: str | None = None, resume: bool = False, overwrite: bool = False) -> int:
    """Run the job here; returns the exit code (0 done, `ExitCode.INTERRUPTED` Ctrl-C). A failed attempt stops every
    process; `runPolicy.maxRestarts` more attempts resume from the newest complete checkpoint (module docstring)."""
    from rich.console import Console

    console = Console(stderr=True)
    spec = job.spec
    if spec.trainer.num_nodes != 1:
        raise LocalRunError(f"spec.trainer.numNodes: local mode runs one trainer node, got {spec.trainer.num_nodes}; use --set trainer.numNodes=1")
    out = Path(output or spec.output.dir or f"runs/{job.metadata.name}").resolve()
    _prepare_output(job, out, resume, overwrite)
    localized = fetch_sources(job, out, resume, console)
    model_path = _resolve_model(localized, out)

    resolved = localized.model_copy(deep=True)
    resolved.spec.model.path = model_path
    resolved.spec.rollout.engine = "cpu"
    resolved.spec.output.dir = str(out)
    judge = served_judge(resolved.spec)
    if judge is not None:  # the job's own judge servers: CPU engines here, a built-in model made once
        judge.model = _resolve_model(job, out, judge.model, "spec.reward.judge.model", "builtin-judge")
    trainer_config = TrainerConfig.from_job(resolved)
    from rlhf_trainer.preflight import check

    problems = check(trainer_config, spec.trainer.nproc_per_node)
    if problems:  # the trainer pod's own check, before any server or model starts
        raise LocalConfigError("config error: " + "; ".join(problems))
    config_path = out / "trainer.json"
    config_path.write_text(trainer_config.to_json())
    recorded = resolved if localized is job else job.model_copy(
        update={"spec": job.spec.model_copy(update={"output": resolved.spec.output, "rollout": resolved.spec.rollout})})
    # what the trackers log and the model card shows: the hf:// / s3:// addresses as written
    (out / JOB_FILE).write_text(json.dumps(run_config(recorded), indent=1))

    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _attempts(resolved, out, config_path, console, resume=resume)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _attempts(resolved: RLHFJob, out: Path, config_path: Path, console, *, resume: bool) -> int:
    """Attempt 1 and up to `runPolicy.maxRestarts` more; the run's exit code."""
    budget = resolved.spec.run_policy.max_restarts
    for restarts in range(budget + 1):
        if restarts:
            newest = complete_checkpoints(out)
            _log_attempt(out, console, f"restart {restarts} of {budget}: attempt {restarts + 1} resumes from "
                                       f"{newest[-1].name if newest else 'the start (no complete checkpoint)'}")
        failure = _attempt(resolved, out, config_path, console, resume=resume or restarts > 0, attempt=restarts + 1)
        if failure is None:
            break
        if failure.code in (ExitCode.INTERRUPTED, ExitCode.TERMINATED) and failure.name == "you":
            return failure.code
        if is_permanent(failure.code) or restarts == budget:
            why = (f"exit code {failure.code} is permanent ({meaning(failure.code)}): no restart"
                   if is_permanent(failure.code) else f"no restarts left (runPolicy.maxRestarts={budget})")
            _log_attempt(out, console, f"attempt {restarts + 1} failed: {failure.summary}; {why}")
            error = LocalConfigError if failure.code == ExitCode.CONFIG_ERROR else LocalRunError
            raise error(f"{failure.message}\n({why}; {restarts} restart(s))")
        _log_attempt(out, console, f"attempt {restarts + 1} failed: {failure.summary}")
    console.print(summarize(_read_metrics(out / "metrics.jsonl")))
    console.print(f"final model: {out / 'final'}")
    save_plot(out, console)
    return 0


@dataclasses.dataclass
class _Failure:
    name: str
    code: int
    message: str

    @property
    def summary(self) -> str:
        text = meaning(self.code)
        return f"{self.name} exited with code {self.code}" + (f" ({text})" if text else "")


def _log_attempt(out: Path, console, line: str) -> None:
    """Say it, and keep it in `logs/attempts.log`."""
    console.print(line, markup=False)
    with open(out / "logs" / "attempts.log", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")


def _attempt(resolved: RLHFJob, out: Path, config_path: Path, console, *, resume: bool, attempt: int) -> _Failure | None:
    """One attempt: every process of the run, watched until the trainer finishes (None) or a
    process fails (that failure, after stopping all of them); Ctrl-C is `ExitCode.INTERRUPTED`."""
    spec = resolved.spec
    ports = [free_port() for _ in range(0 if spec.offline else spec.rollout.replicas)]  # sft, rm, dpo: no servers
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    children: list[_Child] = []
    with ExitStack() as stack:
        # the trainer first, while its servers still answer; it saves within the grace period
        grace = spec.run_policy.termination_grace_period_seconds + 10
        stack.callback(lambda: [c.stop(grace if c.name == "trainer" else 10.0) for c in reversed(children)])
        try:
            threads = _overlap_threads(spec)
            for i, port in enumerate(ports):
                proc = rollout_process(resolved, model_path=spec.model.path, host="127.0.0.1", port=port,
                                       python=sys.executable)
                if threads:
                    proc = dataclasses.replace(proc, command=[*proc.command, "--num-threads", str(threads["rollout"])])
                children.append(_Child(f"rollout-{i}", proc, out / "logs" / f"rollout-{i}.log", attempt))
            judge_urls = _start_judges(resolved, out, children, attempt)
            console.print(f"[bold]{resolved.metadata.name}[/] ({spec.method}): {len(ports)} rollout server(s), "
                          + (f"{len(judge_urls)} judge server(s), " if judge_urls else "") +
                          f"{spec.trainer.nproc_per_node} trainer process(es); output in {out}"
                          + (f"; attempt {attempt}" if attempt > 1 else ""))
            # the trainer starts now, while the servers load: it builds its models and then waits
            # for them (rollout/servers.py `handshake`); a server that dies is caught by the loop below
            trainer = trainer_process(
                resolved, config_path=str(config_path), rollout_endpoints=urls,
                weight_sync_addr=f"127.0.0.1:{free_port()}", output_dir=str(out),
                master_addr="127.0.0.1", master_port=free_port(), resume=resume, python=sys.executable,
            )
            from rlhf_trainer.launch import ENV_CHECKED_CONFIG, config_digest  # run_local checked this very file
            trainer = dataclasses.replace(trainer, env={**trainer.env, ENV_CHECKED_CONFIG: config_digest(config_path)})
            if threads:
                trainer = dataclasses.replace(trainer, env={**trainer.env, "OMP_NUM_THREADS": str(threads["trainer"])})
            if judge_urls:
                trainer = dataclasses.replace(trainer, env={**trainer.env, ENV_JUDGE_ENDPOINTS: ",".join(judge_urls)})
            children.append(_Child("trainer", trainer, out / "logs" / "trainer.log", attempt))
            return _watch(children, out, spec.schedule.total_steps, console, spec.rollout.max_server_replacements)
        except (KeyboardInterrupt, Terminated) as why:
            stack.close()  # the trainer saves the step it reached
            kept = complete_checkpoints(out)
            console.print(f"\nstopped; last complete checkpoint: {kept[-1] if kept else 'none'}")
            code = ExitCode.TERMINATED if isinstance(why, Terminated) else ExitCode.INTERRUPTED
            return _Failure("you", code, "stopped")


def _start_judges(resolved: RLHFJob, out: Path, children: list["_Child"], attempt: int) -> list[str]:
    """The job's own judge servers (`reward.judge` without `url`), CPU engines on free ports;
    their base URLs."""
    judge = served_judge(resolved.spec)
    urls = []
    for i in range(judge.replicas if judge is not None else 0):
        port = free_port()
        proc = judge_process(resolved, host="127.0.0.1", port=port, python=sys.executable)
        children.append(_Child(f"judge-{i}", proc, out / "logs" / f"judge-{i}.log", attempt))
        urls.append(f"http://127.0.0.1:{port}")
    return urls


def _watch(children: list[_Child], out: Path, total: int, console, replacements: int) -> _Failure | None:
    """Progress until the trainer (the last child) exits 0 or a child fails (a rollout server: restarted)."""
    metrics_path = out / "metrics.jsonl"
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    trainer_child = children[-1]
    columns = [
        TextColumn("step {task.completed}/{task.total}"), BarColumn(),
        TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
    ]
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=total, info="starting")
        while True:
            rows = _read_metrics(metrics_path)
            if rows:
                last = rows[-1]
                shown = f"reward {last['reward_mean']:.3f}" if "reward_mean" in last else f"loss {last['loss']:.4f}"
                progress.update(task, completed=last["step"], info=f"{shown}  {last['tokens_per_second']:.0f} tok/s")
            for child in children:
                code = child.poll()
                if code is not None and (child is not trainer_child or code != 0):
                    code = 128 - code if code < 0 else code  # killed by a signal: as a shell reports it
                    if child.name.startswith("rollout-") and replacements > 0 and not is_permanent(code):
                        replacements -= 1
                        _log_attempt(out, console, f"{child.name} exited with code {code}: started again alone "
                                                   "(rollout.maxServerReplacements)")
                        child.restart()
                        continue
                    return _Failure(child.name, code, f"{child.name} exited with code {code}; last lines of "
                                                      f"{child.log_path}:\n{child.log_tail()}")
            if trainer_child.poll() == 0:
                return None
            time.sleep(0.5)
