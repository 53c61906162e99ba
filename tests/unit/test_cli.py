"""`rlhfctl` as a user meets it: one exit-code convention across subcommands (0 ok, 1 failed,
2 usage or invalid job), `-` for standard input, `-o json|yaml`, shell completion (bash runs
argcomplete's own code against the installed `rlhfctl`) and `env`. The cluster commands
against a real API server: tests/cluster/test_rlhfctl.py; `plan`: tests/e2e/test_plan_cli.py."""

from __future__ import annotations

import json
import os
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


@pytest.mark.parametrize("argv", [["validate"], ["get", "--nope"], ["logs", "x", "--role", "critic"], ["frobnicate"]])
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
    assert _complete("rlhfctl logs myjob --role ") == ["rollout", "sandbox", "trainer"]
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
