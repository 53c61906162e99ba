"""`rlhfctl` as a user meets it: one exit-code convention across subcommands (0 ok, 1 failed,
2 usage or invalid job), `-` for standard input, `-o json|yaml`, shell completion (bash runs
argcomplete's own code against the installed `rlhfctl`) and `env`. The cluster commands
against a real API server: tests/cluster/test_rlhfctl.py; `plan`: tests/e2e/test_plan_cli.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlhf_contract.exit_codes import ExitCode
from rlhf_launcher.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "local-grpo.yaml"
CLUSTER_EXAMPLE = ROOT / "examples" / "rlhfjob.yaml"
RLHFCTL = Path(sys.executable).parent / "rlhfctl"


@pytest.fixture
def bad_job(tmp_path: Path) -> str:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["rollout"]["replica"] = 2
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    return str(tmp_path / "bad.yaml")


@pytest.fixture
def no_cluster(tmp_path: Path) -> list[str]:
    """A kubeconfig whose API server refuses connections."""
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
           "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:9"}}],
           "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}], "users": [{"name": "u", "user": {}}]}
    (tmp_path / "kubeconfig").write_text(yaml.safe_dump(cfg))
    return ["--kubeconfig", str(tmp_path / "kubeconfig")]


@pytest.mark.parametrize("argv, code", [
    (["validate", "{bad}"], ExitCode.CONFIG_ERROR),
    (["validate", "{missing}"], ExitCode.CONFIG_ERROR),
    (["render", "{bad}"], ExitCode.CONFIG_ERROR),
    (["render", str(EXAMPLE)], ExitCode.CONFIG_ERROR),  # builtin data, but the output is on no volume
    (["run", "{bad}", "--output", "{tmp}/run"], ExitCode.CONFIG_ERROR),  # nothing starts
    (["submit", "{bad}", "--dry-run"], ExitCode.CONFIG_ERROR),
    (["submit", str(CLUSTER_EXAMPLE), "--working-dir", "{missing}", "--dry-run"], ExitCode.CONFIG_ERROR),
    (["submit", str(CLUSTER_EXAMPLE), "{kube}"], ExitCode.FAILED),
    (["get", "{kube}"], ExitCode.FAILED),
    (["get", "x", "{kube}"], ExitCode.FAILED),
    (["logs", "x", "{kube}"], ExitCode.FAILED),
    (["delete", "x", "{kube}"], ExitCode.FAILED),
    (["delete", "x", "y", "--ignore-not-found", "{kube}"], ExitCode.FAILED),
    (["get", "-w", "{kube}"], ExitCode.FAILED),
    (["get", "x", "-l", "team=a", "{kube}"], ExitCode.CONFIG_ERROR),  # a name and a selector: kubectl's rule
    (["logs", "x", "-f", "--attempt", "1", "--since", "10m", "-p", "{kube}"], ExitCode.FAILED),
    (["plot", "{missing}"], ExitCode.CONFIG_ERROR),
    (["validate", str(CLUSTER_EXAMPLE)], ExitCode.OK),
    (["render", str(CLUSTER_EXAMPLE)], ExitCode.OK),
    (["submit", str(CLUSTER_EXAMPLE), "--dry-run"], ExitCode.OK),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_exit_codes(argv, code, bad_job, no_cluster, tmp_path, capsys):
    subs = {"{bad}": [bad_job], "{missing}": [str(tmp_path / "missing")], "{kube}": no_cluster}
    args = [a for arg in argv for a in subs.get(arg, [arg.replace("{tmp}", str(tmp_path))])]
    assert main(args) == code
    out, err = capsys.readouterr()
    if code == ExitCode.FAILED:
        assert err.startswith("error: cannot reach the API server") and "127.0.0.1" in err
    elif code == ExitCode.CONFIG_ERROR:
        assert err and not out


@pytest.mark.parametrize("argv", [["validate"], ["get", "--nope"], ["logs", "x", "--role", "critic"], ["frobnicate"],
                                  ["logs", "x", "--since", "10"], ["logs", "x", "--since", "1d"], ["delete"]])
def test_usage_errors_are_two(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == ExitCode.CONFIG_ERROR
    assert "usage: rlhfctl" in capsys.readouterr().err


def test_help_states_the_convention(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "exit codes (every subcommand): 0 ok; 1 failed" in text and "2 usage error or invalid job" in text
    assert "75 weight sync failed" in text and "127 command not found" in text


def test_stdin_and_json_through_a_pipe():
    """`cat job.yaml | rlhfctl validate - -o json` in a real process (a cluster job: its data
    is not on this machine, so nothing loads a tokenizer)."""
    res = subprocess.run([str(RLHFCTL), "validate", "-", "-o", "json"], input=CLUSTER_EXAMPLE.read_text(),
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert {k: out[k] for k in ("valid", "source", "name", "problems")} == {
        "valid": True, "source": "<stdin>", "name": "qwen-math-grpo", "problems": []}
    assert any("spec.data.path" in note for note in out["notes"])


def test_an_invalid_job_from_stdin_as_yaml(bad_job, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", open(bad_job))
    assert main(["validate", "-", "-o", "yaml"]) == ExitCode.CONFIG_ERROR
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["valid"] is False and out["source"] == "<stdin>"
    assert {"path": "spec.rollout.replica", "message": out["problems"][0]["message"]} in out["problems"]
    assert "did you mean 'replicas'" in out["problems"][0]["message"]


def test_render_from_stdin_as_a_json_list(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", open(CLUSTER_EXAMPLE))
    assert main(["render", "-", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["apiVersion"] == "v1" and out["kind"] == "List"
    assert main(["render", str(CLUSTER_EXAMPLE)]) == 0
    assert out["items"] == list(yaml.safe_load_all(capsys.readouterr().out))  # the same objects as the YAML


def test_render_the_cluster_example_as_a_trainjob_of_the_charts_runtime(capsys):
    assert main(["render", str(CLUSTER_EXAMPLE), "--backend", "TrainJob"]) == 0
    docs = {d["kind"]: d for d in yaml.safe_load_all(capsys.readouterr().out)}
    assert "PyTorchJob" not in docs and docs["StatefulSet"]["metadata"]["name"] == "qwen-math-grpo-rollout"
    tj = docs["TrainJob"]
    assert tj["spec"]["runtimeRef"] == {"name": "rlhf-torch", "apiGroup": "trainer.kubeflow.org",
                                        "kind": "ClusterTrainingRuntime"}
    assert tj["spec"]["trainer"]["numNodes"] == 2 and tj["spec"]["trainer"]["numProcPerNode"] == 8
    # what a v2.3 TrainJob cannot carry: exit 2 naming the field, as the operator refuses it
    assert main(["render", str(CLUSTER_EXAMPLE), "--backend", "TrainJob", "--set", "pod.priorityClassName=high"]) == 2
    assert "spec.pod.priorityClassName" in capsys.readouterr().err


def _complete(line: str) -> list[str]:
    """What bash offers after `line` with `rlhfctl completion bash` loaded (argcomplete runs
    the installed `rlhfctl` with the completion request)."""
    script = (f'source <("{RLHFCTL}" completion bash)\n'
              f'COMP_LINE="{line}"; COMP_POINT=${{#COMP_LINE}}; COMP_TYPE=9\n'
              'read -ra COMP_WORDS <<< "$COMP_LINE"; [[ "$COMP_LINE" == *" " ]] && COMP_WORDS+=("")\n'
              'COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 ))\n'
              '_python_argcomplete rlhfctl "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD-1]}"\n'
              'printf "%s\\n" "${COMPREPLY[@]}"\n')
    env = {**os.environ, "PATH": f"{RLHFCTL.parent}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return sorted(w.strip() for w in res.stdout.splitlines() if w.strip())


def test_bash_completion():
    assert _complete("rlhfctl su") == ["submit"]
    assert _complete("rlhfctl logs myjob --role ") == ["fetch", "rollout", "sandbox", "trainer"]
    assert "--working-dir" in _complete("rlhfctl submit job.yaml --")


def test_zsh_completion_is_argcomplete_for_rlhfctl(capsys):
    assert main(["completion", "zsh"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#compdef rlhfctl") and "_ARGCOMPLETE_SHELL=\"zsh\"" in out


def test_env_reports_versions_and_an_unreachable_cluster(no_cluster, capsys):
    from importlib.metadata import version

    from rlhf_contract.images import VLLM_VERSION

    assert main(["env", *no_cluster, "-o", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["packages"]["torch"] == version("torch") and report["packages"]["transformers"] == version("transformers")
    assert report["vllm_pin"] == VLLM_VERSION and report["python"].startswith(f"CPython {sys.version.split()[0]}")
    assert report["cuda"]["available"] is False and report["cuda"]["built_with"]  # this machine: no GPU
    assert "127.0.0.1" in report["cluster"]["error"]


@pytest.mark.parametrize("text, seconds", [("30s", 30), ("10m", 600), ("1h30m", 5400), ("1.5h", 5400), ("500ms", 1),
                                           ("2m0.5s", 121)])
def test_since_reads_kubectls_durations(text, seconds):
    from rlhf_launcher.logs import since_seconds

    assert since_seconds(text) == seconds  # whole seconds, at least 1 (the API's sinceSeconds)


def test_watch_rows_keep_their_columns():
    from rlhf_launcher.get import watch_line

    widths = [24, 9, 9]
    assert watch_line(["NAME", "PHASE", "STEP"], widths) == "NAME" + " " * 23 + "PHASE" + " " * 7 + "STEP"
    assert watch_line(["grpo-x7k2p", "Running", "3/10"], widths).index("Running") == 27
    long = "n" * 30  # pushes the rest right, never cut
    assert watch_line([long, "Failed", ""], widths) == f"{long}   Failed"


def test_a_generate_name_job_validates_and_submits_without_a_name(tmp_path: Path, capsys):
    """`metadata.generateName` and no name: valid (under a name made as the API server makes
    one); `submit --dry-run` leaves the name to the server; a prefix too long for the job's
    name limit is refused naming the field."""
    doc = yaml.safe_load(CLUSTER_EXAMPLE.read_text())
    doc["metadata"] = {"generateName": "grpo-"}
    (tmp_path / "gen.yaml").write_text(yaml.safe_dump(doc))
    assert main(["validate", str(tmp_path / "gen.yaml")]) == ExitCode.OK
    assert "generateName 'grpo-': the server names it" in capsys.readouterr().out
    assert main(["submit", str(tmp_path / "gen.yaml"), "--dry-run", "-o", "json"]) == ExitCode.OK
    (sent,) = json.loads(capsys.readouterr().out)["items"]
    assert sent["metadata"] == {"generateName": "grpo-", "namespace": "default"}
    assert main(["submit", str(tmp_path / "gen.yaml"), "--dry-run", "--working-dir", str(tmp_path), "-o", "json"]) == 0
    made = json.loads(capsys.readouterr().out)["items"]
    job = made[-1]  # its ConfigMaps are named after it before it exists: the name is made here
    assert "generateName" not in job["metadata"] and re.fullmatch(r"grpo-[bcdfghjklmnpqrstvwxz2456789]{5}",
                                                                    job["metadata"]["name"])
    assert made[0]["metadata"]["name"] == f"{job['metadata']['name']}-workdir"

    doc["metadata"] = {"generateName": "g" * 36}
    (tmp_path / "long.yaml").write_text(yaml.safe_dump(doc))
    assert main(["validate", str(tmp_path / "long.yaml")]) == ExitCode.CONFIG_ERROR
    err = capsys.readouterr().err
    assert "metadata.generateName" in err and "at most 35 characters" in err


def test_a_job_that_ran_and_has_no_pods_left_says_where_its_trainer_logs_are():
    from argparse import Namespace

    from rlhf_launcher.logs import _no_pods

    job = {"metadata": {"name": "grpo", "namespace": "team"}, "spec": {"output": {"dir": "/ckpt/"}},
           "status": {"phase": "Succeeded", "startTime": "2026-11-28T10:00:00Z"}}
    args = Namespace(name="grpo", role="trainer", attempt=None)
    message = _no_pods(job, "team", args, [])
    assert message.startswith("rlhfjob grpo has no trainer pods in namespace team now")
    assert "every attempt's trainer pods keep their logs on the job's volume at /ckpt/logs/attempt-<N>/<pod>.log" \
        in message and "read them from any pod that mounts the volume" in message
    never_ran = {**job, "status": {"phase": "Pending"}}
    assert "volume" not in _no_pods(never_ran, "team", args, [])
    assert "volume" not in _no_pods(job, "team", Namespace(name="grpo", role="rollout", attempt=None), [])


def test_the_exit_code_of_an_exec_comes_from_its_status_channel():
    from rlhf_launcher.logs import exit_status

    assert exit_status('{"metadata":{},"status":"Success"}') == (0, "")
    failed = ('{"metadata":{},"status":"Failure","message":"command terminated with non-zero exit code",'
              '"reason":"NonZeroExitCode","details":{"causes":[{"reason":"ExitCode","message":"2"}]}}')
    assert exit_status(failed) == (2, "command terminated with non-zero exit code")
    assert exit_status('{"status":"Failure","message":"no exec found"}') == (1, "no exec found")  # no cause given
