"""The entry program of a colocated trainer pod (`rollout.placement: colocated` on a
cluster): the pod's rollout servers and its trainer, as one unit.

    python -m rlhf_trainer.supervise        # reads RLHF_SUPERVISE (rlhf_contract.pod)

RLHF_SUPERVISE is the JSON that `rlhf_contract.pod.colocated_trainer_process` wrote: the
servers (command, environment: each its own GPUs by CUDA_VISIBLE_DEVICES, on loopback) and
the trainer's command (`python -m rlhf_trainer.launch ...`, which sees every GPU of the pod).
Everything starts at once, as in local mode: the trainer builds its models while the servers
load, then waits for them itself (rollout/servers.py `handshake`).

One failing stops all, with its exit code, as local mode does: a server that exits ends
the trainer (SIGTERM: it saves the step it reached within the grace period) and the pod
exits with the server's code (a signal as 128 + n), so the operator restarts the whole job
from its newest checkpoint; the trainer's exit (0 when done, 2 for a config error, 143 after
SIGTERM) stops the servers and becomes the pod's. SIGTERM to the pod (preemption, drain,
suspend) goes to the trainer first, then to the servers once it has exited. Each child's
output reaches the pod's log with its name in front.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from rlhf_contract.exit_codes import ExitCode
from rlhf_contract.pod import ENV_SUPERVISE

SERVER_STOP_GRACE_S = 10.0


@dataclass
class Child:
    name: str
    popen: subprocess.Popen

    def code(self) -> int | None:
        code = self.popen.poll()
        return None if code is None else (128 - code if code < 0 else code)

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float) -> int:
        """SIGTERM its process group, SIGKILL after `grace_s`; its exit code."""
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait()
        return self.code()


def _pump(name: str, stream, out) -> None:
    for line in iter(stream.readline, b""):
        out.write(f"[{name}] ".encode() + line)
        out.flush()


def start(name: str, command: list[str], env: dict[str, str]) -> Child:
    popen = subprocess.Popen(command, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    threading.Thread(target=_pump, args=(name, popen.stdout, sys.stdout.buffer), daemon=True).start()
    return Child(name, popen)


def supervise(plan: dict, poll_s: float = 0.2) -> int:
    """Run the plan's servers and trainer until the trainer exits or any child fails; the
    pod's exit code (module docstring)."""
    grace = float(plan["terminationGracePeriodSeconds"])
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    signal.signal(signal.SIGINT, lambda *_: stopping.set())
    servers: list[Child] = []
    trainer: Child | None = None
    try:
        for server in plan["servers"]:
            servers.append(start(server["name"], server["command"], server["env"]))
        trainer = start("trainer", plan["trainer"]["command"], plan["trainer"]["env"])
        while True:
            if stopping.is_set():
                print("supervise: SIGTERM: stopping the trainer (it saves the step it reached)", flush=True)
                return trainer.stop(grace)
            code = trainer.code()
            if code is not None:
                print(f"supervise: the trainer exited with code {code}", flush=True)
                return code
            failed = next((s for s in servers if s.code() is not None), None)
            if failed is not None:
                code = failed.code() or int(ExitCode.FAILED)  # a server never ends on its own: 0 is a failure too
                print(f"supervise: {failed.name} exited with code {failed.code()}: stopping the trainer; "
                      f"the pod exits with {code} (the job restarts)", flush=True)
                trainer.stop(grace)
                return code
            time.sleep(poll_s)
    finally:
        for child in ([trainer] if trainer is not None else []) + servers:
            child.stop(grace if child is trainer else SERVER_STOP_GRACE_S)


def main() -> int:
    try:
        plan = json.loads(os.environ[ENV_SUPERVISE])
    except (KeyError, ValueError) as exc:
        print(f"supervise: {ENV_SUPERVISE} is missing or not JSON ({exc}): the pod's command is built by the "
              "operator (rlhf_contract.pod.colocated_trainer_process)", file=sys.stderr)
        return int(ExitCode.CONFIG_ERROR)
    return supervise(plan)


if __name__ == "__main__":
    sys.exit(main())
