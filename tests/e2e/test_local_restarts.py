"""Local mode restarts as the operator does (`runPolicy.maxRestarts`): processes of a real
`rlhfctl run` killed mid-run, the run resumed from its newest complete checkpoint."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_contract.exit_codes import ExitCode, meaning
from rlhf_contract.outputs import checkpoint_step, complete_checkpoints

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "local-grpo.yaml"
SMALL = ["schedule.promptsPerStep=4", "rollout.samplesPerPrompt=4", "trainer.maxTokensPerMicroBatch=40",
         "rollout.replicas=1"]

SERVER = "-m rlhf_inference"
"""In the CPU engine's command line (rlhf_contract.pod.rollout_process)."""

pytestmark = pytest.mark.slow


def _start(out: Path, *overrides: str) -> subprocess.Popen:
    args = [a for item in (*SMALL, *overrides) for a in ("--set", item)]
    # SIGINT at its default, so _stop's Ctrl-C reaches it: a shell's background job (as CI may run
    # us) starts with SIGINT ignored, which every child inherits (test_local_mode.py does the same)
    return subprocess.Popen([sys.executable, "-m", "rlhf_launcher.cli", "run", str(EXAMPLE), "--output", str(out),
                             *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _stop(run: subprocess.Popen) -> None:
    """Ctrl-C the run (it stops its processes, each in its own session), then kill it, and
    then whatever it left running (a killed launcher cannot stop its children)."""
    if run.poll() is None:
        run.send_signal(signal.SIGINT)
        try:
            run.wait(60)
        except subprocess.TimeoutExpired:
            run.kill()
            run.wait()
    for pid in _pids("", Path(run.args[run.args.index("--output") + 1])):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _steps(out: Path) -> list[int]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def _pids(pattern: str, out: Path) -> list[int]:
    """Processes of this run (their command line names its output directory) matching `pattern`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            if pattern.encode() in cmdline and str(out).encode() in cmdline + environ:
                found.append(int(pid))
        except OSError:
            pass
    return found


def _wait(predicate, run: subprocess.Popen, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        assert run.poll() is None, run.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError("timed out")


def test_killed_server_and_killed_trainer_each_cost_one_restart_and_lose_no_rows(tmp_path):
    out = tmp_path / "run"
    # 12 steps: the trainer is killed after attempt 2's first checkpoint, and a fast machine ran
    # two more steps and the next checkpoint in the moment it took to find and kill it
    run = _start(out, "schedule.totalSteps=12", "schedule.saveEvery=2", "runPolicy.maxRestarts=2",
                 "rollout.maxServerReplacements=0")  # a lost server restarts the job
    try:
        _wait(lambda: len(_steps(out)) >= 3, run)
        servers_1 = set(_pids(SERVER, out))
        assert servers_1
        for pid in servers_1:  # 1. the rollout server SIGKILLed mid-run
            os.kill(pid, signal.SIGKILL)
        first = _wait(lambda: re.search(r"attempt 2 resumes from step-(\d+)", (out / "logs" / "attempts.log").read_text())
                      if (out / "logs" / "attempts.log").exists() else None, run)
        # attempt 2 resumed and saved a checkpoint of its own
        _wait(lambda: [p for p in complete_checkpoints(out) if checkpoint_step(p) > int(first.group(1))], run)
        servers_2 = set(_pids(SERVER, out))
        assert servers_2 and not servers_2 & servers_1
        workers = [p for p in _pids("-m rlhf_trainer", out) if b"launch" not in Path(f"/proc/{p}/cmdline").read_bytes()
                   and b"torch.distributed.run" not in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert workers
        for pid in workers:  # 3. the training process SIGKILLed (as by the OOM killer)
            os.kill(pid, signal.SIGKILL)
        stdout, stderr = run.communicate(timeout=400)
    finally:
        _stop(run)
    assert run.returncode == 0, stderr[-3000:]
    assert _steps(out) == list(range(1, 13))  # re-run steps replaced their rows: none missing, none twice
    log = (out / "logs" / "attempts.log").read_text()
    # each attempt resumes from a checkpoint the one before saved (how far each got depends on the machine's speed)
    resumed = [int(n) for n in re.findall(r"restart \d of 2: attempt \d resumes from step-(\d+)", log)]
    assert len(resumed) == 2 and 2 <= resumed[0] < resumed[1] < 12, log
    assert "restart 1 of 2: attempt 2" in log and "restart 2 of 2: attempt 3" in log
    assert "attempt 1 failed: rollout-0 exited with code 137" in log and "attempt 2 failed: trainer exited" in log
    assert "restart 2 of 2" in stderr
    assert not set(_pids(SERVER, out)) & (servers_1 | servers_2)  # attempt 3 had servers of its own


def test_a_killed_rollout_server_is_replaced_alone_and_the_run_goes_on_without_a_restart(tmp_path):
    """rollout.maxServerReplacements: one of two servers SIGKILLed just after a step's row (its
    next rollout starting): the step goes on with the other, the launcher starts the killed one
    again, the trainer re-joins it with the current weights; no attempt is restarted."""
    out = tmp_path / "run"
    # the restarted server takes seconds to start, which may be 5 steps on a quiet machine or 40
    # on a loaded one: the run is long enough for either, and stopped once the server re-joined
    run = _start(out, "schedule.totalSteps=2000", "schedule.saveEvery=20", "runPolicy.maxRestarts=1",
                 "rollout.replicas=2", "rollout.maxServerReplacements=1")
    rejoined = "holds the current weights: routed to again"
    try:
        _wait(lambda: len(_steps(out)) >= 2, run)
        servers = sorted(_pids(SERVER, out))
        assert len(servers) == 2
        os.kill(servers[0], signal.SIGKILL)
        _wait(lambda: rejoined in (out / "logs" / "trainer.log").read_text(), run)  # the restarted one re-joined
        after = len(_steps(out))
        _wait(lambda: len(_steps(out)) >= after + 3, run)  # and steps go on with both
    finally:
        _stop(run)
    assert run.returncode == ExitCode.INTERRUPTED, run.communicate()[1][-3000:]
    steps = _steps(out)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 5
    log = (out / "logs" / "attempts.log").read_text()
    assert re.search(r"rollout-\d exited with code 137: started again alone", log), log
    assert "restart" not in log and "attempt 1 failed" not in log, log
    assert "==== attempt 2 ====" not in (out / "logs" / "trainer.log").read_text()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["rollout_server_replacements"] == 1 and rows[0]["rollout_server_replacements"] == 0
    assert not set(_pids(SERVER, out)) & set(servers)


def test_a_permanent_exit_code_ends_the_run_without_a_restart(tmp_path):
    """Malformed rows past the preflight's sample (the first rows), found by the trainer's full
    read: a data error, exit code 2, which no restart can fix."""
    data = tmp_path / "prompts.jsonl"
    rows = [{"prompt": f"{i}:", "answer": str(i % 10)} for i in range(300)] + [{"answer": "1"}] * 100
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    run = _start(out, "schedule.totalSteps=4", "runPolicy.maxRestarts=3", f"data.path={data}")
    try:
        _, stderr = run.communicate(timeout=400)
    finally:
        _stop(run)
    assert run.returncode == 2, stderr[-3000:]
    assert meaning(2) in stderr and "100 of the 400 rows" in stderr
    log = (out / "logs" / "attempts.log").read_text()
    assert "attempt 1 failed: trainer exited with code 2" in log and "is permanent" in log
    assert "attempt 2" not in log and "restart 1" not in log and "0 restart(s)" in stderr


def test_a_stopped_server_times_out_the_attempt_instead_of_hanging_it(tmp_path):
    """2. SIGSTOP (a hung server: its socket open, no answer), mid-rollout or mid weight
    update: the client's request timeout (rollout.requestTimeoutSeconds) or the weight sync's
    (rollout.weightSyncTimeoutSeconds, then its watchdog) fails the step, the attempt ends,
    the next one resumes."""
    out = tmp_path / "run"
    # 8 steps: after the stop at least five still need the server, however fast this machine is
    run = _start(out, "schedule.totalSteps=8", "schedule.saveEvery=2", "runPolicy.maxRestarts=1",
                 "rollout.requestTimeoutSeconds=5", "rollout.weightSyncTimeoutSeconds=5",
                 "rollout.maxServerReplacements=0")
    try:
        _wait(lambda: (out / "checkpoints" / "step-2" / "COMPLETE").exists(), run)
        stopped = set(_pids(SERVER, out))
        assert stopped
        for pid in stopped:
            os.kill(pid, signal.SIGSTOP)
        assert len(_steps(out)) < 6, _steps(out)
        since = time.monotonic()
        _wait(lambda: "attempt 2" in (out / "logs" / "attempts.log").read_text()
              if (out / "logs" / "attempts.log").exists() else False, run, timeout=200)
        waited = time.monotonic() - since
        _, stderr = run.communicate(timeout=400)
    finally:
        _stop(run)
    assert run.returncode == 0, stderr[-3000:]
    assert waited < 150  # 5 s timeouts (+ the watchdog's minute at worst), never the 600 s defaults
    assert _steps(out) == list(range(1, 9))
    assert not any(Path(f"/proc/{pid}").exists() for pid in stopped)  # the stopped servers were ended
    trainer_log = (out / "logs" / "trainer.log").read_text()
    assert "==== attempt 2 ====" in trainer_log
    # stopped mid-rollout: the request's timeout; mid weight update: the sync's, exit 75, named as such
    assert "did not answer a generation request within 5 s (rollout.requestTimeoutSeconds)" in trainer_log \
        or "trainer exited with code 75 (weight sync failed or hung" in (out / "logs" / "attempts.log").read_text()


def test_the_restart_budget_spent_ends_the_run_as_the_operator_fails_the_job(tmp_path):
    """Every attempt fails (the reward service never answers): attempt 1 and maxRestarts more,
    then the run fails with the operator's words for it (status.py: "restart i of N", then
    "no restarts left (runPolicy.maxRestarts=N)")."""
    from rlhf_launcher.local import free_port

    out = tmp_path / "run"
    run = _start(out, "schedule.totalSteps=2", "runPolicy.maxRestarts=1", "reward.type=http",
                 f"reward.url=http://127.0.0.1:{free_port()}/score")
    try:
        _, stderr = run.communicate(timeout=400)
    finally:
        _stop(run)
    assert run.returncode == 1, stderr[-3000:]
    log = (out / "logs" / "attempts.log").read_text().splitlines()
    assert [line.split(" ", 1)[1].split(":")[0] for line in log] == [
        "attempt 1 failed", "restart 1 of 1", "attempt 2 failed"]
    assert log[-1].endswith("no restarts left (runPolicy.maxRestarts=1)")
    assert "reward service" in stderr and "1 restart(s)" in stderr
    assert (out / "logs" / "trainer.log").read_text().count("==== attempt 2 ====") == 1


def test_sigterm_saves_the_step_reached_and_the_run_resumes_from_it(tmp_path):
    """Preemption without loss: `rlhfctl run` SIGTERMed mid-run stops its trainer as a pod's
    is stopped; the trainer ends the step in flight and writes a complete checkpoint of the
    step it reached (not a multiple of saveEvery), the run exits 143, and `--resume`
    continues from that step."""
    out = tmp_path / "run"
    run = _start(out, "schedule.totalSteps=100", "schedule.saveEvery=50", "rollout.replicas=1",
                 "runPolicy.terminationGracePeriodSeconds=60")
    try:
        _wait(lambda: len(_steps(out)) >= 2, run)
        processes = set(_pids("-m rlhf_", out))
        run.send_signal(signal.SIGTERM)
        _, stderr = run.communicate(timeout=120)
    finally:
        _stop(run)
    assert run.returncode == 143, stderr[-3000:]
    reached = _steps(out)
    assert reached == list(range(1, len(reached) + 1)) and len(reached) < 50
    assert [checkpoint_step(p) for p in complete_checkpoints(out)] == [reached[-1]]
    assert "stopped by SIGTERM at step" in (out / "logs" / "trainer.log").read_text()
    assert not any(Path(f"/proc/{pid}").exists() for pid in processes)  # nothing left behind
    k = reached[-1]
    resumed = subprocess.run([sys.executable, "-m", "rlhf_launcher.cli", "run", str(EXAMPLE), "--output", str(out),
                              "--resume", *[a for item in (*SMALL, f"schedule.totalSteps={k + 2}", "schedule.saveEvery=50",
                                                            "rollout.replicas=1") for a in ("--set", item)]],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {k})" in (out / "logs" / "trainer.log").read_text().split("resumed from")[-1].splitlines()[0]
    assert _steps(out) == list(range(1, k + 3))
    assert (out / "final" / "config.json").exists()
