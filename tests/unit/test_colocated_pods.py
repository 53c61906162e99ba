"""`rollout.placement: colocated` on a cluster: what the operator renders (the servers inside
the trainer pod, no rollout workload or weight-sync Service) and the pod's entry program
(`python -m rlhf_trainer.supervise`) run with real processes: one failing stops all with its
code, SIGTERM reaches the trainer first, the trainer's exit ends the servers."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from rlhf_contract import images
from rlhf_contract import pod as contract
from rlhf_contract.api import validate_job
from rlhf_operator.backends import build_children
from rlhf_operator.builders import PodSettingsError

from test_builders import make_job

COLOCATED = {"placement": "colocated", "replicas": 4, "tensorParallelSize": 2,
             "vllm": {"kvCacheMemoryBytes": 8 * 2**30}}


def colocated_job(backend: str = "PyTorchJob", **trainer):
    return make_job(backend=backend, rollout=dict(COLOCATED), trainer={"numNodes": 1, "nprocPerNode": 8, **trainer})


def render(data) -> dict:
    job = validate_job(copy.deepcopy(data))
    return {(c["kind"], c["metadata"]["name"]): c for c in build_children(job, 0)}


def trainer_pod(children: dict) -> dict:
    if ("JobSet", "demo") in children:
        return children[("JobSet", "demo")]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return children[("PyTorchJob", "demo-trainer")]["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize("backend", ["PyTorchJob", "JobSet"])
def test_the_servers_run_in_the_trainer_pod_on_its_own_gpus(backend):
    separate = render(make_job(backend=backend, rollout={"replicas": 4, "tensorParallelSize": 2},
                               trainer={"numNodes": 1, "nprocPerNode": 8}))
    children = render(colocated_job(backend))
    # no rollout workload, rollout Service or weight-sync Service: what the separate job has beyond it
    gone = set(separate) - set(children)
    assert {k for k, _ in gone} >= {"Service"} and not set(children) - set(separate)
    assert ("StatefulSet", "demo-rollout") not in children and ("Service", "demo-weight-sync") not in children
    if backend == "JobSet":
        assert [r["name"] for r in children[("JobSet", "demo")]["spec"]["replicatedJobs"]] == ["trainer"]
    pod = trainer_pod(children)
    [container] = pod["containers"]
    assert container["image"] == images.COLOCATED_IMAGE
    assert container["command"][-2:] == ["-m", "rlhf_trainer.supervise"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    env = env_of(container)
    plan = json.loads(env[contract.ENV_SUPERVISE])
    gpus = [s["env"]["CUDA_VISIBLE_DEVICES"].split(",") for s in plan["servers"]]
    assert len(gpus) == 4 and all(len(g) == 2 for g in gpus)
    assert sorted(int(g) for gs in gpus for g in gs) == list(range(8))  # each GPU to exactly one server
    urls = []
    for server in plan["servers"]:
        cmd = server["command"]
        assert cmd[:2] == ["vllm", "serve"] and "--enable-sleep-mode" in cmd
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1"  # loopback only
        assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
        urls.append(f"http://127.0.0.1:{cmd[cmd.index('--port') + 1]}")
    assert len(set(urls)) == 4 and env[contract.ENV_ROLLOUT_ENDPOINTS] == ",".join(urls)
    assert plan["trainer"]["command"][1:3] == ["-m", "rlhf_trainer.launch"]
    assert plan["terminationGracePeriodSeconds"] == pod["terminationGracePeriodSeconds"]


def test_an_explicit_trainer_image_is_kept():
    data = colocated_job()
    data["spec"]["trainer"]["image"] = "registry.example/own:1"
    assert trainer_pod(render(data))["containers"][0]["image"] == "registry.example/own:1"


@pytest.mark.parametrize("trainer, field", [({"numNodes": 2}, "spec.trainer.numNodes"),
                                            ({"nprocPerNode": 4}, "spec.rollout.replicas")])
def test_what_a_cluster_cannot_colocate_is_refused_naming_the_field(trainer, field):
    job = validate_job(colocated_job(**trainer))  # valid: local mode runs it on one machine
    with pytest.raises(PodSettingsError, match=field.replace(".", r"\.")):
        build_children(job, 0)


# ---- the pod's entry program, with real processes --------------------------------------

SERVER = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(600)"


def trainer_script(marker: Path, *, exit_after: float | None = None) -> str:
    return textwrap.dedent(f"""
        import pathlib, signal, sys, time
        def stop(*a):
            pathlib.Path({str(marker)!r}).write_text("sigterm")
            sys.exit(143)
        signal.signal(signal.SIGTERM, stop)
        print("trainer up", flush=True)
        time.sleep({exit_after if exit_after is not None else 600})
        sys.exit(0)
    """)


def start_supervisor(servers: list[list[str]], trainer: list[str], tmp_path: Path) -> subprocess.Popen:
    plan = {"servers": [{"name": f"rollout-{i}", "command": c, "env": {"CUDA_VISIBLE_DEVICES": str(i)}}
                        for i, c in enumerate(servers)],
            "trainer": {"command": trainer, "env": {}}, "terminationGracePeriodSeconds": 20}
    env = {**os.environ, contract.ENV_SUPERVISE: json.dumps(plan)}
    return subprocess.Popen([sys.executable, "-m", "rlhf_trainer.supervise"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def wait_for(predicate, timeout=30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.1)


def children_of_pid(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_failing_server_stops_the_trainer_and_the_pod_exits_with_its_code(tmp_path):
    marker = tmp_path / "trainer-stopped"
    failing = [sys.executable, "-c", "import time, sys; time.sleep(1.5); print('out of memory'); sys.exit(7)"]
    proc = start_supervisor([[sys.executable, "-c", SERVER], failing],
                            [sys.executable, "-c", trainer_script(marker)], tmp_path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 7, out
    assert marker.read_text() == "sigterm"  # the trainer was told to save, not killed
    assert "[rollout-1] out of memory" in out and "[trainer] trainer up" in out


def test_sigterm_goes_to_the_trainer_and_its_code_is_the_pods(tmp_path):
    marker = tmp_path / "trainer-stopped"
    proc = start_supervisor([[sys.executable, "-c", SERVER]] * 2, [sys.executable, "-c", trainer_script(marker)],
                            tmp_path)
    wait_for(lambda: len(children_of_pid(proc.pid)) == 3)
    kids = children_of_pid(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 143 and marker.read_text() == "sigterm", out
    assert not any(alive(pid) for pid in kids)  # the servers went too


def test_the_trainer_finishing_ends_the_servers_and_the_pod_succeeds(tmp_path):
    proc = start_supervisor([[sys.executable, "-c", SERVER]] * 2,
                            [sys.executable, "-c", trainer_script(tmp_path / "m", exit_after=1.0)], tmp_path)
    wait_for(lambda: len(children_of_pid(proc.pid)) == 3)
    kids = children_of_pid(proc.pid)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert not any(alive(pid) for pid in kids)
