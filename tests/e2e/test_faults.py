"""Data-plane faults injected into real trainer runs (a trainer process against a CPU
rollout server), and what each loses."""

import json
import re

import pytest

from jobs import small_job

pytestmark = pytest.mark.slow


def _steps(out):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_damaged_newest_checkpoint_is_set_aside_and_the_one_before_resumed(run_trainer, tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    run_trainer(small_job(tiny_model_dir, out, schedule={"totalSteps": 3, "saveEvery": 1}))
    newest = out / "checkpoints" / "step-3"
    shard = max((f for f in newest.rglob("*.distcp")), key=lambda f: f.stat().st_size)
    size = shard.stat().st_size
    with open(shard, "r+b") as f:  # a shard cut short after its checkpoint was complete
        f.truncate(size // 2)
    rows = run_trainer(small_job(tiny_model_dir, out, schedule={"totalSteps": 4, "saveEvery": 1}))
    assert (out / "checkpoints" / "damaged-step-3" / shard.relative_to(newest)).stat().st_size == size // 2  # kept
    assert _steps(out) == [1, 2, 3, 4]  # steps 3 and 4 re-run from step 2, each row once
    assert [r["policy_version"] for r in rows] == [1, 2, 3, 4]
    state = json.loads((out / "checkpoints" / "step-4" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["policy_version"] == 4


def test_a_step_with_a_nan_loss_is_skipped_unsynced_and_the_run_goes_on(run_trainer, tiny_model_dir, tmp_path):
    # rewards near float32's largest (3e38) on step 2 only: their group sums overflow, the step's loss is NaN
    reward_file = tmp_path / "overflow_on_step_2.py"
    per_step = 4 * 4  # promptsPerStep x samplesPerPrompt
    reward_file.write_text(
        "import itertools\n"
        "calls = itertools.count()\n"
        "def reward_fn(response, answer, extra_info):\n"
        f"    n = next(calls)\n"
        f"    return 3e38 * (n % 2) if {per_step} <= n < {2 * per_step} else float(response.strip() == answer)\n")
    out = tmp_path / "out"
    rows = run_trainer(small_job(tiny_model_dir, out, reward={"type": "python", "file": str(reward_file)},
                                 schedule={"totalSteps": 3, "saveEvery": 0}))
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[1]["skipped_steps"] == 1 and rows[0]["skipped_steps"] == rows[2]["skipped_steps"] == 0
    assert [r["policy_version"] for r in rows] == [1, 1, 2]  # no weight sync after the poisoned step
    assert rows[1]["weight_sync_seconds"] == 0.0
    assert all(v == v for v in (rows[2]["loss"], rows[2]["grad_norm"]))  # finite again (NaN != NaN)


def test_a_full_output_volume_fails_the_checkpoint_cleanly_and_the_next_attempt_resumes(engine, tiny_model_dir,
                                                                                       tmp_path):
    """The output directory on a 600 KiB tmpfs (a checkpoint of the tiny model is ~1.1 MiB), in
    a mount namespace of the test's own: attempt 1 fails writing step 1's checkpoint; the
    volume is grown (remount) and attempt 2 resumes."""
    import os
    import subprocess
    import sys

    from rlhf_contract.api import RLHFJob
    from rlhf_contract.trainer_config import TrainerConfig
    from rlhf_launcher.local import free_port

    out, kept = tmp_path / "out", tmp_path / "kept"
    out.mkdir()
    config = tmp_path / "trainer.json"
    config.write_text(TrainerConfig.from_job(RLHFJob.model_validate(
        small_job(tiny_model_dir, out, schedule={"totalSteps": 2, "saveEvery": 1}))).to_json())
    env = {**os.environ, "RLHF_TRAINER_CONFIG": str(config), "RLHF_ROLLOUT_ENDPOINTS": engine,
           "RLHF_OUTPUT_DIR": str(out), "MASTER_ADDR": "127.0.0.1"}
    attempt = (f"RLHF_WEIGHT_SYNC_ADDR=127.0.0.1:{{port}} MASTER_PORT={{master}} {sys.executable} -m rlhf_trainer "
               f"2>{tmp_path}/attempt-{{n}}.log; echo $? > {tmp_path}/rc-{{n}}")
    script = "\n".join([
        "set -u", f"mount -t tmpfs -o size=600k tmpfs {out}",
        attempt.format(port=free_port(), master=free_port(), n=1),
        f"mkdir -p {kept}/after-1 && cp -a {out}/. {kept}/after-1/",
        f"mount -o remount,size=16m {out}",
        attempt.format(port=free_port(), master=free_port(), n=2),
        f"cp -a {out}/. {kept}/after-2/"])
    proc = subprocess.run(["unshare", "--map-root-user", "--mount", "bash", "-c", script], env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr
    first = (tmp_path / "attempt-1.log").read_text()
    assert (tmp_path / "rc-1").read_text().strip() != "0"
    assert f"checkpoint {out}/checkpoints/step-1: no space left on the output volume" in first
    assert re.search(r"volume \([0-9.]+ (bytes|KiB) free of 600\.0 KiB\)", first), first[-2000:]
    assert not list((kept / "after-1" / "checkpoints").glob("*/COMPLETE"))  # the partial one never counts
    assert (tmp_path / "rc-2").read_text().strip() == "0", (tmp_path / "attempt-2.log").read_text()[-3000:]
    assert _steps(kept / "after-2") == [1, 2]  # step 1 re-run (its checkpoint never completed), once each
    assert (kept / "after-2" / "checkpoints" / "step-2" / "COMPLETE").exists()


class _RewardService:
    """An HTTP reward service on a thread: `down` requests answered 503 first, then each
    request answered after `delay_s` (exact match as the reward)."""

    def __init__(self, down: int = 0, delay_s: float = 0.0):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        service = self
        self.down, self.delay_s, self.requests, self.lock = down, delay_s, 0, threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                import time

                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    service.requests += 1
                    failing = service.requests <= service.down
                time.sleep(0 if failing else service.delay_s)
                reply = b"down" if failing else json.dumps(
                    {"reward": float(body["response"].strip() == body["answer"])}).encode()
                self.send_response(503 if failing else 200)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_reward_service_down_then_back_is_retried_and_a_slow_one_fails_the_run_naming_it(
        run_trainer, tiny_model_dir, tmp_path):
    """Our choice: bounded retries (connection errors, timeouts, 429 and 5xx: 3 more attempts,
    0.5 s then doubling), then the step fails naming the service, never a silent reward of 0,
    which would train the policy on a signal that is not there (a restart retries the step)."""
    flaky = _RewardService(down=3)  # each of the step's first 3 requests fails once
    try:
        rows = run_trainer(small_job(tiny_model_dir, tmp_path / "a", reward={"type": "http", "url": flaky.url},
                                     schedule={"totalSteps": 2, "saveEvery": 0}))
        assert [r["step"] for r in rows] == [1, 2] and flaky.requests == 3 + 2 * 16
    finally:
        flaky.close()
    slow = _RewardService(delay_s=3.0)
    try:
        res = run_trainer(small_job(tiny_model_dir, tmp_path / "b", schedule={"totalSteps": 2, "saveEvery": 0},
                                    reward={"type": "http", "url": slow.url, "timeoutSeconds": 0.5}),
                          expect_failure=True, timeout=120)
        assert f"reward service {slow.url} failed 4 times; last: ReadTimeout" in res.stderr
        assert not (tmp_path / "b" / "metrics.jsonl").exists() or not (tmp_path / "b" / "metrics.jsonl").read_text()
    finally:
        slow.close()
