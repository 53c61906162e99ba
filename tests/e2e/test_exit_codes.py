"""The pod's exit-code contract end to end: a config error that only a worker can see (a
rollout server without vLLM's weight-transfer API) makes the trainer pod's own command
exit 2, although torchrun turns every worker failure into 1, and the termination message
names `rollout.image`; a failed weight sync exits 75 the same way (restart)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_contract.api import validate_job
from rlhf_contract.exit_codes import PERMANENT, ExitCode
from rlhf_contract.pod import trainer_process
from rlhf_contract.trainer_config import TrainerConfig
from rlhf_launcher.local import free_port

pytestmark = pytest.mark.slow


class OldServer(BaseHTTPRequestHandler):
    """Healthy, but an OpenAI server without /version or the weight-transfer routes."""

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def run_trainer_pod(handler: type[BaseHTTPRequestHandler], tmp_path, tiny_model_dir, name: str,
                    **spec) -> tuple[subprocess.CompletedProcess, str]:
    """The trainer pod's own command (the contract's `trainer_process`) against a rollout
    server answering with `handler`: (its result, its termination message)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        job = validate_job({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": name},
                            "spec": {"model": {"path": str(tiny_model_dir)},
                                     "data": {"path": "builtin://last-digit", "maxPromptLength": 16},
                                     "rollout": {"engine": "cpu", "maxTokens": 2}, **spec}})
        config = tmp_path / "trainer.json"
        config.write_text(TrainerConfig.from_job(job).to_json())
        proc = trainer_process(job, config_path=str(config), rollout_endpoints=[url],
                               weight_sync_addr=f"127.0.0.1:{free_port()}", output_dir=str(tmp_path / "out"),
                               master_addr="127.0.0.1", master_port=free_port(), python=sys.executable)
        termination = tmp_path / "termination-log"
        termination.write_text("")
        res = subprocess.run(proc.command, env={**os.environ, **proc.env, "RLHF_TERMINATION_LOG": str(termination)},
                             capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    return res, termination.read_text()


def test_a_server_without_weight_transfer_exits_2_naming_rollout_image(tmp_path, tiny_model_dir):
    res, message = run_trainer_pod(OldServer, tmp_path, tiny_model_dir, "old")
    assert res.returncode == 2, res.stderr[-3000:]
    assert "rollout.image" in message


class RefusingServer(BaseHTTPRequestHandler):
    """Passes the start-up check as vLLM 0.33 would, then refuses to join the weight-sync
    group (as vLLM answers when its transfer engine is not configured)."""

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.split("?")[0]
        replies = {"/health": {}, "/version": {"version": "0.33.0"}, "/get_world_size": {"world_size": 1},
                   "/server_info": {"vllm_config": {"weight_transfer_config": {"backend": "gloo"},
                                                    "model_config": {"dtype": "torch.float32"}}}}
        self._reply(200, replies[path]) if path in replies else self._reply(404, {})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path.startswith("/init_weight_transfer_engine"):
            return self._reply(500, {"error": {"message": "Weight transfer not configured"}})
        self._reply(200, {})

    def log_message(self, *args):
        pass


def test_a_failed_weight_sync_exits_75_through_torchrun_so_the_job_restarts(tmp_path, tiny_model_dir):
    """torchrun (two processes: a world of one runs without it) turns the worker's exit into 1;
    the launcher passes the weight sync's own code on (75: not permanent, so the operator
    restarts the job, its servers included)."""
    res, message = run_trainer_pod(RefusingServer, tmp_path, tiny_model_dir, "sync", trainer={"nprocPerNode": 2})
    assert res.returncode == ExitCode.WEIGHT_SYNC == 75, res.stderr[-3000:]
    assert ExitCode.WEIGHT_SYNC not in PERMANENT
    assert "WeightSyncError" in message and "/init_weight_transfer_engine" in message and "HTTP 500" in message
    assert "exiting with code 75 so the job restarts" in res.stderr
