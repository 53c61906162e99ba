"""rlhf_trainer/podlog.py: a trainer pod keeps what its child prints (stdout and stderr) in
`<output>/logs/attempt-<N>/<pod>.log` while still printing it as before (the pod's log);
outside a pod (no attempt or pod name) nothing is kept; a file that cannot be written is a
warning, never a failed run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlhf_contract.pod import ENV_ATTEMPT, ENV_OUTPUT_DIR, ENV_POD_NAME, trainer_log_path
from rlhf_trainer.podlog import kept_log

# what launch.py does with its child, here a child that writes to both streams
ENTRY = """
import os, sys
from rlhf_trainer.podlog import popen_kept
child, finish = popen_kept([sys.executable, "-c", "import sys\\nfor i in range(3):\\n    print('step', i)\\n"
                            "    print('warn', i, file=sys.stderr)\\nsys.exit(3)"], dict(os.environ))
code = child.wait()
finish()
sys.exit(code)
"""


def _entry(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", ENTRY], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_the_pod_keeps_its_log_under_its_attempt_and_prints_it_too(tmp_path: Path):
    env = {ENV_OUTPUT_DIR: str(tmp_path), ENV_ATTEMPT: "2", ENV_POD_NAME: "demo-trainer-master-0"}
    res = _entry(env)
    assert res.returncode == 3  # the child's code, untouched
    assert res.stdout.splitlines() == ["step 0", "step 1", "step 2"]
    assert res.stderr.splitlines() == ["warn 0", "warn 1", "warn 2"]
    path = tmp_path / "logs" / "attempt-2" / "demo-trainer-master-0.log"
    assert str(path) == trainer_log_path(str(tmp_path), 2, "demo-trainer-master-0") == str(kept_log(env))
    assert sorted(path.read_text().splitlines()) == sorted(res.stdout.splitlines() + res.stderr.splitlines())
    _entry(env)  # the same pod started again (a container restart): appended
    assert len(path.read_text().splitlines()) == 12


def test_nothing_is_kept_outside_a_pod_and_an_unwritable_place_is_a_warning(tmp_path: Path):
    assert kept_log({ENV_OUTPUT_DIR: str(tmp_path)}) is None  # local mode: logs/trainer.log is rlhfctl run's
    assert kept_log({ENV_OUTPUT_DIR: str(tmp_path), ENV_ATTEMPT: "", ENV_POD_NAME: "p"}) is None
    (tmp_path / "logs").write_text("a file where the directory should be")
    res = _entry({ENV_OUTPUT_DIR: str(tmp_path), ENV_ATTEMPT: "0", ENV_POD_NAME: "p"})
    assert res.returncode == 3 and res.stdout.splitlines() == ["step 0", "step 1", "step 2"]
    assert res.stderr.startswith(f"warning: cannot keep the trainer's log at {tmp_path}/logs/attempt-0/p.log")
