"""The code reward and its sandbox: right, wrong and partial programs, then hostile ones.

The hostile programs live in sandbox_checks.py; here each runs once in this process (root in
CI) and all of them once more as an unprivileged uid without capabilities, as in a pod at the
`restricted` level. Then the sandbox service: the trainer's client against a real server, and
the server as PID 1 of its own PID namespace with resource limits only (what a sandbox pod under
the RuntimeDefault seccomp profile has), surviving programs that try to kill it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

import sandbox_checks as checks
from rlhf_contract.sandbox import sandbox_command
from rlhf_trainer import sandbox
from rlhf_trainer.rewards import build_reward
from rlhf_trainer.rewards.code import extract_code, normalize_output, score_code
from rlhf_trainer.sandbox import Limits, SandboxClient, SandboxError, cgroup, run_python
from rlhf_trainer.sandbox import run as sandbox_run

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ISO = sandbox.isolation()
needs_bwrap = pytest.mark.skipif(ISO.backend != "bwrap", reason=f"no bubblewrap: {ISO.reason}")
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv to become an unprivileged uid")
UNPRIVILEGED = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "--inh-caps=-all",
                "--bounding-set=-all", "--no-new-privs"]


@pytest.fixture
def world_readable_tmp():
    """A directory uid 1000 can enter (pytest's tmp_path is under a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix="rlhf-sandbox-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_extract_code_and_normalize():
    assert extract_code("```python\na=1\n```\ntext\n```\nb=2\n```") == "b=2\n"
    assert extract_code("```py\nc=3\n```") == "c=3\n"
    assert extract_code("no code") is None
    assert normalize_output("1  \n2\t\n\n\n") == "1\n2"


def test_bad_test_cases_and_limits_are_errors_naming_the_field():
    with pytest.raises(ValueError, match="same length"):
        score_code(checks.fenced("print(1)"), {"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="memory_mb must be a positive"):
        Limits(memory_mb=0)
    with pytest.raises(TypeError, match="unknown sandbox limits"):
        score_code(checks.fenced("print(1)"), {"inputs": ["1"], "outputs": ["1"]}, memroy_mb=1)


@needs_bwrap
@pytest.mark.parametrize("name", [n for n in checks.CHECKS if n != "many_responses_at_once"])
def test_hostile_and_honest_programs(name):
    checks.CHECKS[name]()


@needs_bwrap
def test_48_responses_x_24_cases_at_once():
    checks.check_many_responses_at_once(48, 24)


@needs_bwrap
@needs_root
def test_same_checks_as_an_unprivileged_uid_without_capabilities(world_readable_tmp):
    """What a `restricted` trainer pod is: uid 1000, no capabilities, no_new_privs, and only
    world-readable code (the system Python and this repository)."""
    tmp_path = world_readable_tmp
    bwrap = tmp_path / "bwrap"
    shutil.copy(ISO.bwrap, bwrap)
    bwrap.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "trainer_image"),
           "RLHF_BWRAP": str(bwrap), "HOME": str(tmp_path)}
    proc = subprocess.run([*UNPRIVILEGED, "/usr/bin/python3", str(HERE / "sandbox_checks.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report.pop("uid") == 1000 and report.pop("backend") == "bwrap", report
    assert report == {name: "ok" for name in checks.CHECKS}, report


def test_no_isolation_is_refused_not_scored(monkeypatch):
    weak = sandbox.Isolation("rlimits", ISO.python, None, "no bwrap binary (test)")
    monkeypatch.setattr(sandbox_run, "isolation", lambda: weak)
    with pytest.raises(SandboxError, match="needs bubblewrap.*requireSandboxIsolation is true"):
        score_code(checks.fenced("print(1)"), {"inputs": [""], "outputs": ["1"]})
    # resource limits alone never run model code in the trainer, whatever the spec says
    with pytest.raises(SandboxError, match="not a sandbox service started with --allow-rlimits"):
        score_code(checks.fenced("print(1)"), {"inputs": [""], "outputs": ["1"]},
                   require_isolation=False)
    broken = sandbox.Isolation("bwrap", "/nonexistent/python3", ISO.bwrap or "/bin/false", "",
                               ISO.mounts or ("/usr",))
    monkeypatch.setattr(sandbox_run, "isolation", lambda: broken)
    with pytest.raises(SandboxError, match="did not start the program"):
        score_code(checks.fenced("print(1)"), {"inputs": [""], "outputs": ["1"]})


@needs_bwrap
def test_a_program_cannot_fake_a_sandbox_failure():
    """Writing bwrap's error format and exiting 1 is a failed case, not a SandboxError."""
    result = run_python("import sys\nsys.stderr.write('bwrap: Can\\'t mount proc\\n')\n"
                        "sys.exit(1)")
    assert result.exit_code == 1 and not result.ok


def test_capacity_comes_from_the_cgroup_and_affinity(monkeypatch):
    monkeypatch.delenv(sandbox.CONCURRENCY_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(cgroup, "cgroup_cpu_quota", lambda: 3.5)
    monkeypatch.setattr(cgroup, "cgroup_memory_limit_mb", lambda: None)
    assert sandbox.capacity(Limits()) == 3  # never the 64 host cores
    monkeypatch.setattr(cgroup, "cgroup_memory_limit_mb", lambda: 2 * Limits().memory_bound_mb)
    monkeypatch.setattr(cgroup, "cgroup_cpu_quota", lambda: None)
    assert sandbox.capacity(Limits()) == 2  # what fits the memory limit
    monkeypatch.setenv(sandbox.CONCURRENCY_ENV, "5")
    assert sandbox.capacity(Limits()) == 5


# --- the sandbox service ----------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_service(command_prefix: list[str], env: dict, *, require_isolation: bool = True,
                   python: str = sys.executable):
    """The service, started with the command line its pods run (the pod contract's)."""
    port = _free_port()
    command = sandbox_command(host="127.0.0.1", port=port, python=python,
                              require_isolation=require_isolation)
    proc = subprocess.Popen([*command_prefix, *command], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"service exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            return proc, url, httpx.get(f"{url}/healthz", timeout=2).json()
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("service did not answer /healthz")


@needs_bwrap
def test_service_scores_through_the_client_and_the_reward_function():
    proc, url, health = _start_service([], dict(os.environ))
    try:
        assert health["backend"] == "bwrap" and health["capacity"] >= 1
        client = SandboxClient(url)
        right = "a, b = map(int, input().split())\nprint(a + b)"
        assert score_code(checks.fenced(right), checks.SUM_CASES, runner=client) == 1.0
        assert score_code(checks.fenced("import os, signal\nos.kill(-1, 9)"), checks.SUM_CASES,
                          runner=client) == 0.0
        from rlhf_contract.api.models import RewardSpec

        scorer = build_reward(RewardSpec(type="code"), sandbox_url=url)
        items = [(checks.fenced(right), "", {"test_cases": checks.SUM_CASES}),
                 (checks.fenced("print(3)"), "", {"test_cases": checks.SUM_CASES})]
        assert scorer.score_batch(items) == [(1.0, 1.0), (0.25, 0.25)]
        with pytest.raises(ValueError, match="data row 0 of the batch has no test_cases"):
            scorer.score_batch([(checks.fenced(right), "", {})])
        bad = httpx.post(f"{url}/run_many", json={"jobs": "nope"})
        assert bad.status_code == 400
    finally:
        proc.kill()
        proc.wait()


@needs_root
def test_service_as_pid_1_with_rlimits_only_survives_its_programs(world_readable_tmp):
    """A sandbox pod without user namespaces: the pod is the barrier, the service its PID 1."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare")
    tmp_path = world_readable_tmp
    # the service needs only the standard library and rlhf_trainer: the system Python, which
    # uid 1000 may run (this venv may live under /root)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "trainer_image"),
           "RLHF_BWRAP": "/nonexistent", "HOME": str(tmp_path)}
    # as PID 1 of a new PID namespace with its own /proc (the pod), as uid 1000 without
    # capabilities
    prefix = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *UNPRIVILEGED]
    proc, url, health = _start_service(prefix, env, require_isolation=False,
                                       python="/usr/bin/python3")
    try:
        assert health["backend"] == "rlimits"
        client = SandboxClient(url, retries=0)
        right = "a, b = map(int, input().split())\nprint(a + b)"
        assert score_code(checks.fenced(right), checks.SUM_CASES, runner=client,
                          require_isolation=False) == 1.0
        for attack in ("import os, signal\nos.kill(-1, signal.SIGKILL)",
                       "import os, signal\nos.kill(1, signal.SIGKILL)",
                       "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
                       "import os\nwhile True:\n    try:\n        if os.fork() == 0:\n"
                       "            os.setsid()\n    except OSError:\n        pass"):
            assert score_code(checks.fenced(attack), {"inputs": [""], "outputs": ["x"]},
                              runner=client, timeout_s=2.0, require_isolation=False) == 0.0
            assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
        assert checks.wait_no_leftovers() == []  # PID 1 killed the bomb's orphans
        # a run that leaves a process behind (to spy on the next run's output)...
        spy = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n"
               "    os.execv('/usr/bin/sleep', ['sleep', '300'])\nprint('left')")
        left = client.run_many([(spy, "")], Limits(timeout_s=5.0, max_processes=64),
                               require_isolation=False)
        assert left[0].stdout.strip() == "left", left
        # ...finds it gone before the next run: that run sees only PID 1 (the service) and itself
        look = ("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit() "
                "and int(p) not in (1, os.getpid())))")
        seen = client.run_many([(look, "")], Limits(), require_isolation=False)
        assert seen[0].stdout.strip() == "[]", seen
        # the service refuses a request that requires namespaces it does not have
        with pytest.raises(SandboxError, match="needs bubblewrap"):
            score_code(checks.fenced(right), checks.SUM_CASES, runner=client)
    finally:
        # the service is unshare's child (setpriv's uid change clears unshare's parent-death
        # signal): kill it, the namespace's init, and with it the namespace, then unshare
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            children = []
        for child in children:
            os.kill(int(child), signal.SIGKILL)
        proc.kill()
        proc.wait()


def _stop_in_namespace(proc: subprocess.Popen) -> None:
    """Kill the service (unshare's child, the namespace's init), then unshare."""
    try:
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    except OSError:
        children = []
    for child in children:
        os.kill(int(child), signal.SIGKILL)
    proc.kill()
    proc.wait()


FORKS = ("import subprocess, sys\n"
         "print(subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True).stdout.strip())")
HOG = ("import threading, time\n"
       "for _ in range(200):\n    threading.Thread(target=time.sleep, args=(300,), daemon=True).start()\n"
       "print('ready', flush=True)\ntime.sleep(300)")


@needs_root
def test_rlimits_only_runs_fork_beside_another_workload_of_uid_1000(world_readable_tmp):
    """RLIMIT_NPROC is counted per uid across the node. Another workload of uid 1000 (a
    trainer's 200 threads) leaves a service of the same uid unable to let a correct program
    fork; the uid the operator gives each job's sandbox pods is its own, and the run's limit
    counts the service's own tasks, so the program forks, and a fork bomb is still bounded."""
    if not shutil.which("unshare"):
        pytest.skip("no unshare")
    from rlhf_contract.api import validate_job
    from rlhf_operator.builders.sandbox import sandbox_uid

    job = validate_job({"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
                        "metadata": {"name": "coder", "namespace": "team-a", "uid": "5f0c3c1e-aaaa"},
                        "spec": {"model": {"path": "m"}, "data": {"path": "d"}, "reward": {"type": "code"}}})
    own = sandbox_uid(job)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "trainer_image"),
           "RLHF_BWRAP": "/nonexistent", "HOME": str(world_readable_tmp)}
    hog = subprocess.Popen([*UNPRIVILEGED, "/usr/bin/python3", "-c", HOG], stdout=subprocess.PIPE, text=True)
    printed = {}
    try:
        assert hog.stdout.readline().strip() == "ready"
        for uid in (1000, own):
            become = ["setpriv", f"--reuid={uid}", f"--regid={uid}", *UNPRIVILEGED[3:]]
            proc, url, health = _start_service(["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *become],
                                               env, require_isolation=False, python="/usr/bin/python3")
            try:
                assert health["backend"] == "rlimits"
                client = SandboxClient(url, retries=0)
                [result] = client.run_many([(FORKS, "")], Limits(timeout_s=20), require_isolation=False)
                printed[uid] = result.stdout.strip() or result.stderr.strip().splitlines()[-1:]
                if uid == own:
                    bomb = "import os\nwhile True:\n    os.fork()"
                    [bombed] = client.run_many([(bomb, "")], Limits(timeout_s=5), require_isolation=False)
                    assert "BlockingIOError" in bombed.stderr  # fork refused past the run's own processes
                    assert httpx.get(f"{url}/healthz", timeout=10).status_code == 200
            finally:
                _stop_in_namespace(proc)
    finally:
        hog.kill()
        hog.wait()
    assert printed[own] == "42", printed
    assert printed[1000] != "42", printed  # why the sandbox pods do not run as the trainers' uid


def test_where_model_code_runs(monkeypatch):
    """The caller says which job and namespace the trainer serves (its config); the rewards
    package reads no config file."""
    from rlhf_contract.api.models import RewardSpec
    from rlhf_trainer.rewards import sandbox_url_for

    for name in ("RLHF_SANDBOX_URL", "RLHF_TRAINER_CONFIG", "KUBERNETES_SERVICE_HOST"):
        monkeypatch.delenv(name, raising=False)
    spec = RewardSpec(type="code")
    assert sandbox_url_for(spec) is None  # local: this process, with bubblewrap
    job = {"job_name": "coder", "namespace": "team-a"}
    assert sandbox_url_for(spec, **job) is None  # not in a pod
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    assert sandbox_url_for(spec, **job) == "http://coder-sandbox.team-a.svc:8080"  # the operator's
    assert sandbox_url_for(spec, job_name="coder", namespace=None) is None  # local mode
    with pytest.raises(ValueError, match="needs the job's name"):
        sandbox_url_for(spec, namespace="team-a")
    # build_reward passes the job on: its programs go to that service
    sent_to = []

    class Client:
        def __init__(self, url):
            self.url = url

        def run_many(self, jobs, limits, require_isolation=True):
            sent_to.append(self.url)
            return [sandbox.SandboxResult("3\n", "", 0, False, 0.1, False, "bwrap") for _ in jobs]

    monkeypatch.setattr(sandbox, "SandboxClient", Client)
    item = (checks.fenced("print(3)"), "", {"test_cases": {"inputs": [""], "outputs": ["3"]}})
    assert build_reward(spec, **job).score_batch([item]) == [(1.0, 1.0)]
    assert sent_to == ["http://coder-sandbox.team-a.svc:8080"]
    monkeypatch.setenv("RLHF_SANDBOX_URL", "http://env:1")
    assert sandbox_url_for(spec, **job) == "http://env:1"
    spec = RewardSpec(type="code", sandbox={"url": "http://shared:8080"})
    assert sandbox_url_for(spec, **job) == "http://shared:8080"
    assert sandbox_url_for(spec, "http://arg:2", **job) == "http://arg:2"
