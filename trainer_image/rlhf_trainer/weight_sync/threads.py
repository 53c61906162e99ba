"""The sender's threads: a watchdog that ends a process stuck in a collective, the daemon
threads its blocking calls run on, and waits that fail at once when any of them fails."""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import sys
import threading
import time
from collections.abc import Callable

from rlhf_contract.exit_codes import ExitCode

from ..exits import ConfigErrorExit, mark_exit_code


class WeightSyncError(RuntimeError):
    """A server refused or failed a weight-sync call, the group could not form, or a
    round passed its time limit."""


class GroupStuck(WeightSyncError):
    """A failed round left a thread inside an NCCL call, so the communicator could not be
    aborted (nccl.py `Communicator.abort`): no group can form again in this process (no
    server replacement); the process exits 75 and the job restarts with its servers."""


class WeightSyncConfigError(ConfigErrorExit):
    """A weight-sync failure that only the spec can fix (an NCCL_SOCKET_IFNAME naming no
    interface of the pod): exit code 2, the job fails at once; `str()` says what to set."""


class Watchdog:
    """Calls `on_expire(message)` from a daemon thread unless disarmed within `seconds`."""

    def __init__(self, seconds: float, on_expire: Callable[[str], None], message: str):
        self._disarmed = threading.Event()

        def watch() -> None:
            if not self._disarmed.wait(seconds):
                on_expire(message)

        threading.Thread(target=watch, daemon=True, name="weight-sync-watchdog").start()

    def disarm(self) -> None:
        self._disarmed.set()


def exit_process(message: str) -> None:
    mark_exit_code(ExitCode.WEIGHT_SYNC)  # torchrun would turn it into 1: the launcher passes it on
    print(f"FATAL: {message}; exiting with code {ExitCode.WEIGHT_SYNC} so the job restarts "
          "(the weight-sync group cannot be recovered in this process)", file=sys.stderr, flush=True)
    os._exit(ExitCode.WEIGHT_SYNC)  # not permanent: the job restarts with its servers


def raise_failed(watch: list[cf.Future]) -> None:
    """Raise the error of the first watched future that failed, if any."""
    for future in watch:
        if future.done() and future.exception() is not None:
            raise future.exception()


def put_watching(q: queue.Queue, item, watch: list[cf.Future], deadline: float) -> None:
    """q.put(item), but raise at once if a watched future fails or the deadline passes."""
    while True:
        raise_failed(watch)
        if time.monotonic() > deadline:
            raise WeightSyncError("weight sync timed out while broadcasting")
        try:
            q.put(item, timeout=0.05)
            return
        except queue.Full:
            continue


def run_in_thread(fn: Callable[[], None]) -> cf.Future:
    """Run fn on a daemon thread (it may block in a collective that never completes)."""
    future: cf.Future = cf.Future()

    def target():
        try:
            fn()
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)

    threading.Thread(target=target, daemon=True, name="weight-sync-group").start()
    return future


def wait_all(futures: list[cf.Future], deadline: float) -> list:
    """Wait for every future until `deadline` (monotonic); raise the first error at once."""
    done, pending = cf.wait(futures, timeout=max(0.0, deadline - time.monotonic()),
                            return_when=cf.FIRST_EXCEPTION)
    for future in done:
        if future.exception() is not None:
            raise future.exception()
    if pending:
        raise WeightSyncError("weight sync timed out (the round's time limit passed)")
    return [f.result() for f in futures]
