"""rlhf_trainer.progress: rank 0's status.progress patches. Here against a local HTTP
server that records requests (rate limit, payload, never raising, local mode); the real
API server with a job's own service-account token is tests/cluster/test_progress.py."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_contract.api import validate_job
from rlhf_contract.trainer_config import TrainerConfig
from rlhf_trainer.progress import ApiServer, ProgressReporter


@pytest.fixture
def recorder(tmp_path):
    seen: list[tuple[str, str, dict, dict]] = []
    status = {"code": 200}

    class Handler(BaseHTTPRequestHandler):
        def do_PATCH(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers["Content-Type"], dict(self.headers), body))
            self.send_response(status["code"])
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("tok-1\n")
    api = ApiServer(url=f"http://127.0.0.1:{server.server_address[1]}", token_file=token, ca_file=None)
    yield api, seen, status, token
    server.shutdown()


def test_patches_the_status_subresource_with_the_token(recorder):
    api, seen, _, _ = recorder
    rep = ProgressReporter("demo", "team-a", 100, api=api, min_interval=0.0)
    rep.report(3, reward_mean=0.25, policy_version=3, last_checkpoint="/out/checkpoints/step-2")
    rep.close()
    (path, ctype, headers, body), = seen
    assert path == "/apis/rlhf.dev/v1alpha1/namespaces/team-a/rlhfjobs/demo/status"
    assert ctype == "application/merge-patch+json" and headers["Authorization"] == "Bearer tok-1"
    p = body["status"]["progress"]
    assert (p["step"], p["totalSteps"], p["rewardMean"], p["policyVersion"], p["lastCheckpoint"]) == (
        3, 100, 0.25, 3, "/out/checkpoints/step-2")
    assert p["updatedTime"].endswith("Z")


def test_rate_limited_newest_values_win_and_close_sends_the_last(recorder):
    api, seen, _, token = recorder
    rep = ProgressReporter("demo", "ns", 50, api=api, min_interval=0.5)
    t0 = time.monotonic()
    for step in range(1, 41):
        rep.report(step, reward_mean=step / 40, last_checkpoint="/c/step-10" if step == 10 else None)
        time.sleep(0.02)  # 40 steps over ~0.8 s
    token.write_text("tok-2")  # a rotated token is read again
    rep.report(41, reward_mean=1.0)
    rep.close()
    assert time.monotonic() - t0 < 5  # report() never blocked on the network
    steps = [b["status"]["progress"]["step"] for _, _, _, b in seen]
    assert 2 <= len(steps) <= 4, steps  # at most every 0.5 s, not 41 patches
    assert steps == sorted(steps) and steps[0] == 1 and steps[-1] == 41
    assert seen[-1][2]["Authorization"] == "Bearer tok-2"
    assert all(b["status"]["progress"].get("lastCheckpoint") == "/c/step-10"  # a skipped step's checkpoint is kept
               for _, _, _, b in seen if b["status"]["progress"]["step"] >= 10)


def test_errors_never_reach_training_and_are_retried(recorder):
    api, seen, status, _ = recorder
    status["code"] = 403
    rep = ProgressReporter("demo", "ns", 10, api=api, min_interval=0.05)
    rep.report(1, reward_mean=float("nan"))  # NaN is not JSON: sent as null
    time.sleep(0.3)
    assert rep.sent == 0 and "HTTP 403" in rep.last_error and len(seen) >= 2  # retried
    status["code"] = 200
    time.sleep(0.3)
    rep.close()
    assert rep.sent >= 1 and rep.last_error is None
    assert seen[-1][3]["status"]["progress"]["rewardMean"] is None

    down = ProgressReporter("demo", "ns", 10, api=ApiServer("https://127.0.0.1:9", api.token_file, None),
                            min_interval=0.0)
    down.report(1, reward_mean=0.5)
    down.close()
    assert down.sent == 0 and "ConnectError" in down.last_error


def test_local_mode_is_a_no_op(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = TrainerConfig.from_job(validate_job({
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "demo"},
        "spec": {"model": {"path": "builtin://tiny-qwen2"}, "data": {"path": "builtin://last-digit"}}}))
    rep = ProgressReporter.from_config(config)
    assert not rep.enabled
    rep.report(1, reward_mean=0.5)
    rep.close()
    assert rep._thread is None
    # In a pod without a namespace in the config it is off as well.
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("t")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert ApiServer.in_cluster(sa) == ApiServer("https://10.0.0.1:443", sa / "token", None)
    assert not ProgressReporter("demo", None, 5, api=ApiServer.in_cluster(sa)).enabled


def test_progress_and_metrics_need_no_kubernetes_client():
    import subprocess
    import sys

    code = ("import sys, rlhf_trainer.progress, rlhf_trainer.metrics; "
            "print(sorted(m for m in ('kubernetes', 'kopf', 'rlhf_operator') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
