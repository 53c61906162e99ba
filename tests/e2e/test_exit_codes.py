"""The pod's exit-code contract end to end: a config error that only a worker can see (a
rollout server without vLLM's weight-transfer API) makes the trainer pod's own command
exit 2, although torchrun turns every worker failure into 1, and the termination message
names `rollout.image`."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_contract.api import validate_job
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


def test_a_server_without_weight_transfer_exits_2_naming_rollout_image(tmp_path, tiny_model_dir):
    server = ThreadingHTTPServer(("127.0.0.1", 0), OldServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        job = validate_job({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "old"},
                            "spec": {"model": {"path": str(tiny_model_dir)},
                                     "data": {"path": "builtin://last-digit", "maxPromptLength": 16},
                                     "rollout": {"engine": "cpu", "maxTokens": 2}}})
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
    assert res.returncode == 2, res.stderr[-3000:]
    assert "rollout.image" in termination.read_text()
