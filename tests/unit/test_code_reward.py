"""The code reward and its sandbox: right, wrong and partial programs, then hostile ones.

Each hostile program must score 0 and leave the trainer (this test process) unharmed and
unstalled. The barrier tests skip where the host lacks the barrier (not root, no netns).
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import uuid

import pytest

from rlhf_trainer.rewards import sandbox
from rlhf_trainer.rewards.code import extract_code, normalize_output, score_code
from rlhf_trainer.rewards.sandbox import SandboxError, isolation, run_many, run_python

ISO = isolation()
STRICT = ISO.netns and ISO.uid
needs_netns = pytest.mark.skipif(not ISO.netns, reason="no network namespace on this host")
needs_uid = pytest.mark.skipif(not ISO.uid, reason="not root: no uid switch")
needs_mountns = pytest.mark.skipif(not ISO.mountns, reason="no mount namespace on this host")

SUM_CASES = {"inputs": ["1 2\n", "10 -3\n", "0 0\n", "5 5\n"],
             "outputs": ["3\n", "7", "0\n\n", "10"]}


def fenced(code: str, lang: str = "python") -> str:
    return f"Here is my solution:\n```{lang}\n{code}\n```\nDone."


def score(code: str, cases=SUM_CASES, **kwargs) -> float:
    return score_code(fenced(code), cases, require_isolation=STRICT, **kwargs)


def sandbox_uid_processes() -> list[int]:
    """pids of processes running as any sandbox uid."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                uid = os.stat(f"/proc/{entry}").st_uid
            except FileNotFoundError:
                continue
            if sandbox.UID_BASE <= uid < sandbox.UID_BASE + sandbox.MAX_SLOTS:
                pids.append(int(entry))
    return pids


def test_extract_code_and_normalize():
    assert extract_code("```python\na=1\n```\ntext\n```\nb=2\n```") == "b=2\n"
    assert extract_code("```py\nc=3\n```") == "c=3\n"
    assert extract_code("no code") is None
    assert normalize_output("1  \n2\t\n\n\n") == "1\n2"


def test_correct_wrong_and_partial_programs():
    assert score("a, b = map(int, input().split())\nprint(a + b)") == 1.0
    assert score("print(42)") == 0.0
    # right except when the sum is 0: 3 of 4 cases
    partial = "a, b = map(int, input().split())\nprint(a + b if a + b else 'zero')"
    assert score(partial) == 0.75
    assert score(partial, all_or_nothing=True) == 0.0
    assert score("raise SystemExit(1)") == 0.0
    assert score_code("I think the answer is a+b", SUM_CASES) == 0.0  # no code block
    unlabelled = "```\nimport sys\nprint(sum(map(int, sys.stdin.read().split())))\n```"
    assert score_code(unlabelled, SUM_CASES, require_isolation=STRICT) == 1.0


def test_bad_test_cases_are_an_error():
    with pytest.raises(ValueError, match="same length"):
        score_code(fenced("print(1)"), {"inputs": ["1"], "outputs": []})


def test_infinite_loop_stops_at_the_timeout():
    start = time.monotonic()
    assert score("while True:\n    pass", {"inputs": ["", ""], "outputs": ["x", "x"]},
                 timeout_s=1.0) == 0.0
    assert time.monotonic() - start < 1.0 + 3.0  # cases run in parallel; small margin
    assert sandbox_uid_processes() == []


def test_fork_bomb_is_bounded_and_cleaned_up():
    bomb = ("import os\nwhile True:\n    try:\n"
            "        if os.fork() == 0:\n            os.setsid()\n"
            "    except OSError:\n        pass")
    start = time.monotonic()
    result = run_python(bomb, timeout_s=2.0, max_processes=16, require_isolation=STRICT)
    assert result.timed_out and time.monotonic() - start < 2.0 + 3.0
    if ISO.uid:
        assert sandbox_uid_processes() == []  # even children that left the process group
    assert subprocess.run(["true"]).returncode == 0  # the host can still spawn processes


def test_huge_allocation_fails_inside_the_sandbox():
    result = run_python("x = bytearray(8 << 30)\nprint('allocated')", memory_mb=256,
                        timeout_s=5.0, require_isolation=STRICT)
    assert "MemoryError" in result.stderr and result.stdout == ""
    assert score("x = bytearray(8 << 30)\nprint(3)", {"inputs": [""], "outputs": ["3"]},
                 memory_mb=256) == 0.0


def test_output_flood_is_capped():
    result = run_python("while True:\n    print('y' * 1000)", timeout_s=5.0, max_file_mb=2,
                        max_output_bytes=1000, require_isolation=STRICT)
    assert result.output_truncated and len(result.stdout) == 1000 and not result.ok


@needs_uid
def test_writing_outside_the_scratch_directory_fails(tmp_path):
    tmp_path.chmod(0o777)
    target = tmp_path / "pwned"
    shared_tmp = f"/tmp/rlhf-pwned-{uuid.uuid4().hex}"  # world-writable on the host
    code = (f"for p in [{str(target)!r}, {shared_tmp!r}, 'here.txt']:\n"
            "    try:\n        open(p, 'w').write('x'); print('wrote', p)\n"
            "    except OSError as e:\n        print('denied', p)")
    try:
        result = run_python(code, require_isolation=STRICT)
        assert f"denied {target}" in result.stdout or not ISO.mountns
        assert "wrote here.txt" in result.stdout  # its own directory is writable
        assert not target.exists()
        if ISO.mountns:
            assert not os.path.exists(shared_tmp)
    finally:
        if os.path.exists(shared_tmp):
            os.unlink(shared_tmp)


@needs_mountns
def test_scratch_space_is_bounded():
    code = ("import os\nfor i in range(100):\n    try:\n"
            "        open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n"
            "    except OSError as e:\n        print('full after', i, os.strerror(e.errno)); break")
    result = run_python(code, max_file_mb=8, require_isolation=STRICT)
    assert result.stdout.startswith("full after") and int(result.stdout.split()[2]) <= 8


@needs_netns
def test_no_connection_reaches_a_local_server():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted = []

    def accept_loop(stop: threading.Event):
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    stop = threading.Event()
    thread = threading.Thread(target=accept_loop, args=(stop,), daemon=True)
    thread.start()
    connect = (f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2); "
               "print('connected')")
    # directly (the socket guard), and from a fresh interpreter that has no guard (netns)
    via_child = f"import subprocess; subprocess.run(['python3', '-c', {connect!r}])"
    try:
        for code in (connect, via_child, "import _socket\ns = _socket.socket()\n"
                     f"s.connect(('127.0.0.1', {port})); print('connected')"):
            assert score(code, {"inputs": [""], "outputs": ["connected"]}) == 0.0
        time.sleep(0.3)
    finally:
        stop.set()
        thread.join()
        server.close()
    assert accepted == []


@needs_uid
def test_trainer_environment_is_not_readable(monkeypatch):
    secret = "s3cr3t-" + uuid.uuid4().hex
    monkeypatch.setenv("RLHF_TEST_SECRET", secret)
    code = ("import os\nprint(dict(os.environ))\n"
            f"for pid in (os.getppid(), {os.getpid()}):\n"
            "    try:\n        print(open(f'/proc/{pid}/environ').read())\n"
            "    except OSError:\n        print('denied', pid)")
    result = run_python(code, require_isolation=STRICT)
    assert secret not in result.stdout and "HOME=" not in result.stdout
    assert result.stdout.count("denied") == 2
    assert "RLHF_TEST_SECRET" not in result.stdout


def test_parallel_runs():
    code = "import time\nt = time.time()\ntime.sleep(0.5)\nprint(int(input()) * {}, t, time.time())"
    jobs = [(code.format(i), "3\n") for i in range(8)]
    results = run_many(jobs, max_workers=8, require_isolation=STRICT)
    lines = [r.stdout.split() for r in results]
    assert [line[0] for line in lines] == [str(3 * i) for i in range(8)]
    starts, ends = [float(line[1]) for line in lines], [float(line[2]) for line in lines]
    assert max(starts) < min(ends)  # all eight were running at the same moment
    assert len({r.barriers for r in results}) == 1


def test_broken_sandbox_raises_instead_of_scoring_zero(monkeypatch):
    if ISO.uid:
        monkeypatch.setattr(sandbox, "UID_BASE", 2**32 - 1)  # setuid fails in the child
        with pytest.raises(SandboxError, match=r"could not start: .*\(OSError: .*Invalid arg"):
            run_python("print(1)", require_isolation=STRICT)
        monkeypatch.undo()
    broken = sandbox.Isolation(python="/nonexistent/python3", netns=ISO.netns,
                               mountns=ISO.mountns, pidns=ISO.pidns, uid=ISO.uid)
    monkeypatch.setattr(sandbox, "isolation", lambda: broken)
    with pytest.raises(SandboxError, match="could not start"):
        score("print(1)")
    weak = sandbox.Isolation(python=ISO.python, netns=False, mountns=False, pidns=False,
                             uid=False)
    monkeypatch.setattr(sandbox, "isolation", lambda: weak)
    with pytest.raises(SandboxError, match="needs a network namespace and a uid switch"):
        run_python("print(1)")
