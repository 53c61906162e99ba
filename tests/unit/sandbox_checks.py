"""Hostile programs against the code sandbox, as plain functions (stdlib + rlhf_trainer only).

test_code_reward.py runs each as a pytest test in this process (root in CI), and runs this file
as a script under an unprivileged uid with no capabilities and no_new_privs (what a
`restricted` trainer pod is): `python3 sandbox_checks.py [names...]` prints one JSON object
{check name: "ok" | "skip: why" | "FAIL: why"}.

The "trainer" in these checks is this process: its files, its processes, its listening socket.
Every check asserts what would be false if a barrier were missing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from rlhf_trainer import sandbox
from rlhf_trainer.rewards.code import score_code, score_code_batch
from rlhf_trainer.sandbox import Limits, run_python

ALLOWED_ROOT = {"usr", "bin", "lib", "lib32", "lib64", "sbin", "proc", "dev", "tmp"}
SUM_CASES = {"inputs": ["1 2\n", "10 -3\n", "0 0\n", "5 5\n"],
             "outputs": ["3\n", "7", "0\n\n", "10"]}


def fenced(code: str) -> str:
    return f"Here is my solution:\n```python\n{code}\n```\nDone."


def score(code: str, cases=SUM_CASES, **kwargs) -> float:
    return score_code(fenced(code), cases, **kwargs)


def leftover_processes() -> list[int]:
    """Host pids of sandbox programs still alive (their argv holds the limits JSON)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if b'"RLIMIT_NPROC"' in cmdline:
                pids.append(int(entry))
    return pids


def wait_no_leftovers(deadline_s: float = 30.0) -> list[int]:
    end = time.monotonic() + deadline_s
    while (left := leftover_processes()) and time.monotonic() < end:
        time.sleep(0.1)
    return left


def sentinel(marker: str) -> subprocess.Popen:
    """A process of the trainer's uid standing in for torchrun and its ranks."""
    return subprocess.Popen([sys.executable, "-c", "import time, sys; time.sleep(600)", marker])


# --- the checks -----------------------------------------------------------------------------

def check_correct_wrong_partial() -> None:
    assert score("a, b = map(int, input().split())\nprint(a + b)") == 1.0
    assert score("print(42)") == 0.0
    partial = "a, b = map(int, input().split())\nprint(a + b if a + b else 'zero')"
    assert score(partial) == 0.75
    assert score(partial, all_or_nothing=True) == 0.0
    assert score("raise SystemExit(1)") == 0.0
    assert score_code("I think the answer is a+b", SUM_CASES) == 0.0


def check_dataset_file_next_to_trainer_is_out_of_reach() -> None:
    """The training data (with test_cases.outputs) is world-readable next to the trainer."""
    with tempfile.TemporaryDirectory(prefix="rlhf-trainer-data-") as d:
        os.chmod(d, 0o755)
        answer = "expected-" + uuid.uuid4().hex
        data = Path(d) / "train.jsonl"
        data.write_text(answer + "\n")
        data.chmod(0o644)
        assert data.read_text().strip() == answer  # readable by anyone on the host
        cheat = (f"import os\nfor p in [{str(data)!r}, '/proc/1/root{data}']:\n"
                 "    try:\n        print(open(p).read().strip()); break\n"
                 "    except OSError:\n        pass\nelse:\n    print('no data')")
        assert score(cheat, {"inputs": [""], "outputs": [answer]}) == 0.0
        result = run_python(cheat)
        assert result.ok and result.stdout.strip() == "no data", result
    seen = run_python("import os\nprint(' '.join(sorted(os.listdir('/'))))")
    root = set(seen.stdout.split())
    assert root and root <= ALLOWED_ROOT, f"the run sees {sorted(root - ALLOWED_ROOT)} in /"
    token = run_python("import os\nprint(os.path.exists('/var/run/secrets'), "
                       "os.path.exists('/etc/passwd'), os.path.exists(os.path.expanduser('~')))")
    assert token.stdout.split()[:2] == ["False", "False"], token


def check_trainer_processes_are_invisible() -> None:
    marker = "trainer-" + uuid.uuid4().hex
    proc = sentinel(marker)
    try:
        spy = ("import os\nseen = []\nfor p in os.listdir('/proc'):\n"
               "    if p.isdigit():\n        try:\n"
               "            seen.append(open(f'/proc/{p}/cmdline', 'rb').read())\n"
               "        except OSError:\n            pass\n"
               f"print('found' if any({marker!r}.encode() in c for c in seen) else 'hidden', "
               "len(seen))")
        assert score(spy, {"inputs": [""], "outputs": ["found"]}) == 0.0
        result = run_python(spy)
        hidden, count = result.stdout.split()
        assert hidden == "hidden" and int(count) <= 3, result  # bwrap's init and the program
        environ = run_python(f"print(open('/proc/{proc.pid}/environ').read())")
        assert not environ.ok and marker not in environ.stdout
    finally:
        proc.kill()
        proc.wait()


def check_kill_all_leaves_trainer_alive() -> None:
    proc = sentinel("victim-" + uuid.uuid4().hex)
    try:
        for code in ("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('killed')",
                     f"import os, signal\nos.kill({proc.pid}, signal.SIGKILL)\nprint('killed')",
                     f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)\nprint('killed')",
                     "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nprint('killed')"):
            run_python(code)
            time.sleep(0.2)
            assert proc.poll() is None, f"{code!r} killed a trainer process"
        assert score("import os, signal\nos.kill(-1, signal.SIGKILL)",
                     {"inputs": [""], "outputs": [""]}) == 0.0
        time.sleep(1.0)
        assert proc.poll() is None, "a trainer process died"
    finally:
        proc.kill()
        proc.wait()


def check_no_network() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list = []
    stop = threading.Event()

    def accept_loop() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept_loop, daemon=True)
    thread.start()
    connect = (f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); "
               "print('connected')")
    # a fresh interpreter has no socket guard: only the network namespace stops it
    via_child = f"import subprocess\nsubprocess.run(['/usr/bin/python3', '-c', {connect!r}])"
    try:
        for code in (connect, via_child):
            assert score(code, {"inputs": [""], "outputs": ["connected"]}) == 0.0
        child = run_python(via_child)
        assert "connected" not in child.stdout and ("unreachable" in child.stderr.lower()
                                                    or "refused" in child.stderr.lower()), child
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert accepted == []


def check_infinite_loop_is_killed() -> None:
    result = run_python("while True:\n    pass", limits=Limits(timeout_s=1.0))
    assert result.timed_out and not result.ok
    assert score("while True:\n    pass", {"inputs": ["", ""], "outputs": ["x", "x"]},
                 timeout_s=1.0) == 0.0
    assert wait_no_leftovers() == []


def check_fork_bomb_is_contained() -> None:
    bomb = ("import os\nwhile True:\n    try:\n"
            "        if os.fork() == 0:\n            os.setsid()\n"
            "    except OSError:\n        pass")
    result = run_python(bomb, limits=Limits(timeout_s=2.0, max_processes=8))
    assert not result.ok
    assert wait_no_leftovers() == [], "processes of the bomb outlived its run"
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes
    counted = run_python("import os\nn = 0\ntry:\n    while True:\n"
                         "        if os.fork() == 0:\n            import time; time.sleep(5); os._exit(0)\n"
                         "        n += 1\nexcept OSError:\n    print(n)",
                         limits=Limits(timeout_s=10.0, max_processes=8))
    assert counted.stdout.strip() and int(counted.stdout) <= 8, counted
    assert wait_no_leftovers() == []


def check_memory_hog_is_contained() -> None:
    result = run_python("x = bytearray(8 << 30)\nprint('allocated')",
                        limits=Limits(memory_mb=256, timeout_s=10.0))
    assert "MemoryError" in result.stderr and result.stdout == "", result
    assert score("x = bytearray(8 << 30)\nprint(3)", {"inputs": [""], "outputs": ["3"]},
                 memory_mb=256) == 0.0
    # the only writable space is the tmpfs: / and /dev/shm are read-only, /tmp is bounded
    fill = ("import os\nfor p in ['/x', '/dev/shm/x', '/usr/x']:\n    try:\n"
            "        open(p, 'w').write('x'); print('wrote', p)\n"
            "    except OSError:\n        print('denied', p)\n"
            "for i in range(100):\n    try:\n"
            "        open(f'/tmp/f{i}', 'wb').write(b'x' * (1 << 20))\n"
            "    except OSError as e:\n        print('full after', i); break")
    result = run_python(fill, limits=Limits(tmpfs_mb=8))
    assert result.stdout.count("denied") == 3, result
    assert "full after" in result.stdout and int(result.stdout.split()[-1]) <= 8, result


def check_output_flood_is_capped() -> None:
    result = run_python("while True:\n    print('y' * 1000)",
                        limits=Limits(timeout_s=5.0, tmpfs_mb=2, max_output_bytes=1000))
    assert result.output_truncated and len(result.stdout) == 1000 and not result.ok


def check_many_responses_at_once(responses: int = 48, cases: int = 24) -> None:
    """48 responses x 24 test cases in one batch: every run gets its turn, none fails."""
    tests = {"inputs": [f"{j}\n" for j in range(cases)],
             "outputs": [str(j * j) for j in range(cases)]}
    items = [(fenced(f"# response {i}\nn = int(input())\nprint(n * n)"), tests)
             for i in range(responses)]
    assert score_code_batch(items, timeout_s=60.0) == [1.0] * responses
    assert wait_no_leftovers() == []


def check_queue_waits_when_full() -> None:
    """More runs than slots: they queue (never more than `capacity` at once) and all pass."""
    size = sandbox.queue_size(Limits())
    code = "import time\nt = time.time()\ntime.sleep(0.3)\nprint(int(input()) * {}, t, time.time())"
    jobs = [(code.format(i), "3\n") for i in range(size * 3)]
    results = sandbox.run_many(jobs)
    assert all(r.ok for r in results), [r for r in results if not r.ok][:1]
    spans = [tuple(map(float, r.stdout.split()[1:])) for r in results]
    assert [r.stdout.split()[0] for r in results] == [str(3 * i) for i in range(len(jobs))]
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert most <= size, f"{most} runs at once with {size} slots"


CHECKS = {name[len("check_"):]: fn for name, fn in dict(globals()).items()
          if name.startswith("check_") and callable(fn)}


def main(names: list[str]) -> None:
    report = {"uid": os.getuid(), "backend": sandbox.isolation().backend}
    for name in names or list(CHECKS):
        try:
            CHECKS[name]()
            report[name] = "ok"
        except BaseException as err:  # noqa: BLE001 - reported to the parent test
            report[name] = f"FAIL: {type(err).__name__}: {err}"[:2000]
    print(json.dumps(report))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    main(sys.argv[1:])
