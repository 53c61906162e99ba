"""A trainer pod's log kept on the job's volume: the entry program (launch.py) copies what
its child (torchrun, or the one trainer process) prints, stdout and stderr alike, to its own
stdout/stderr (what `kubectl logs` shows) AND to `trainer_log_path(RLHF_OUTPUT_DIR,
RLHF_ATTEMPT, RLHF_POD_NAME)`, appended, so an attempt's log outlives its pods (a restart
deletes them). Only in a pod (the builders set those variables); local mode keeps
`logs/trainer.log` itself.

Does not: rotate or cap the file (a trainer's log is small beside its checkpoints), or fail
the run when the file cannot be written (a warning on stderr, and the pod's log as before)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any, Callable

from rlhf_contract.pod import ENV_ATTEMPT, ENV_OUTPUT_DIR, ENV_POD_NAME, trainer_log_path


def kept_log(env: dict[str, str] | None = None) -> Path | None:
    """The file this pod keeps its log in (None outside a pod, or when a variable is empty)."""
    env = os.environ if env is None else env
    out, attempt, pod = env.get(ENV_OUTPUT_DIR), env.get(ENV_ATTEMPT), env.get(ENV_POD_NAME)
    return Path(trainer_log_path(out, attempt, pod)) if out and attempt and pod else None


def _copy(src: IO[bytes], dst: Any, file: IO[bytes] | None, lock: threading.Lock) -> None:
    for line in iter(src.readline, b""):
        dst.write(line)
        dst.flush()
        if file is not None:
            with lock:
                file.write(line)
                file.flush()


def open_kept_log(path: Path | None) -> IO[bytes] | None:
    if path is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "ab")
    except OSError as err:
        print(f"warning: cannot keep the trainer's log at {path} ({err.strerror}); it is only in the pod's log",
              file=sys.stderr, flush=True)
        return None


def popen_kept(command: list[str], env: dict[str, str]) -> tuple[subprocess.Popen, Callable[[], None]]:
    """Start the child; in a pod, with its output also copied to the kept log. Returns the
    child and what to call once it has exited (the last lines copied, the file closed)."""
    kept = open_kept_log(kept_log(env))
    if kept is None:
        return subprocess.Popen(command, env=env), lambda: None
    child = subprocess.Popen(command, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    lock = threading.Lock()
    threads = [threading.Thread(target=_copy, args=(pipe, dst.buffer, kept, lock), daemon=True)
               for pipe, dst in ((child.stdout, sys.stdout), (child.stderr, sys.stderr))]
    for t in threads:
        t.start()

    def finish() -> None:
        for t in threads:
            t.join()
        kept.close()

    return child, finish
