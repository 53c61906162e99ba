"""Hostile job files: `rlhfctl validate` refuses each with exit 2 and says what is wrong
(contract/rlhf_contract/api/job_yaml.py, uris.py, budgets.py; launcher/rlhf_launcher/validate.py):
an alias bomb in a free-form field, a 50 MB spec, duplicate keys, an output directory that
leaves its volume by `..`, token budgets beyond the model's (or the judge's) context, and
credentials in a URL."""

from __future__ import annotations

import copy
import io
import time

import pytest
import yaml

from rlhf_contract.api import JobError, load_job, validate_job
from rlhf_contract.api.budgets import budget_problems, context_length
from rlhf_contract.api.crd import crd
from rlhf_contract.api.job_yaml import MAX_JOB_BYTES
from rlhf_contract.api.uris import URL_CEL, url_credentials
from rlhf_launcher.cli import main as rlhfctl

HEAD = """apiVersion: rlhf.dev/v1alpha1
kind: RLHFJob
metadata: {name: hostile}
spec:
  model: {path: builtin://tiny-qwen2}
  data: {path: builtin://last-digit, maxPromptLength: 16}
  rollout: {engine: cpu, maxTokens: 2}
"""
BASE = yaml.safe_load(HEAD)


def validate(tmp_path, capsys, text: str) -> tuple[int, str]:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    code = rlhfctl(["validate", str(path)])
    return code, capsys.readouterr().err


def dumped(**spec) -> str:
    data = copy.deepcopy(BASE)
    data["spec"].update(spec)
    return yaml.safe_dump(data, sort_keys=False)


def test_a_plain_job_is_valid(tmp_path, capsys):
    assert validate(tmp_path, capsys, HEAD) == (0, "")


def test_an_alias_bomb_in_a_free_form_field_is_refused_before_it_expands(tmp_path, capsys):
    levels = ["      l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    levels += [f"      l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10**9 items
    text = HEAD + "  pod:\n    affinity:\n" + "\n".join(levels) + "\n"
    assert len(text) < 2000
    started = time.monotonic()
    code, err = validate(tmp_path, capsys, text)
    assert code == 2 and "line 10: YAML anchors and aliases" in err
    assert time.monotonic() - started < 5  # nothing expanded
    one_anchor = HEAD + "  pod:\n    affinity: &a {}\n"  # an anchor alone is refused too
    assert validate(tmp_path, capsys, one_anchor)[0] == 2


def test_a_50_mb_spec_is_refused_before_it_is_read(tmp_path, capsys):
    text = HEAD + "  reward: {type: python, file: /r.py, function: '" + "x" * (50 * 2**20) + "'}\n"
    code, err = validate(tmp_path, capsys, text)
    assert code == 2 and "the job file is 50.0 MiB; a job file may hold at most 1 MiB" in err and "etcd" in err
    near = HEAD + "#" + "x" * (MAX_JOB_BYTES - len(HEAD) - 3) + "\n"  # just under the cap: read
    assert validate(tmp_path, capsys, near)[0] == 0


def test_standard_input_is_capped_too(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(HEAD + "#" + "x" * (2 * MAX_JOB_BYTES)))
    assert rlhfctl(["validate", "-"]) == 2
    assert "over 1.0 MiB" in capsys.readouterr().err


def test_duplicate_keys_are_refused_naming_the_field(tmp_path, capsys):
    text = HEAD.replace("rollout: {engine: cpu, maxTokens: 2}", "rollout:\n    engine: cpu\n    maxTokens: 2\n"
                        "    maxTokens: 64")
    code, err = validate(tmp_path, capsys, text)
    assert code == 2 and "spec.rollout.maxTokens: duplicate key (lines 9 and 10)" in err
    (tmp_path / "job.yaml").write_text(HEAD)
    with pytest.raises(JobError, match=r"--set.*anchors"):  # an override is read the same way
        load_job(tmp_path / "job.yaml", ["pod.affinity=&a {}"])


@pytest.mark.parametrize("where", ["/work/runs/../../etc", "../outside", "runs/a/../../../x"])
def test_an_output_dir_leaving_its_volume_is_refused(where, tmp_path, capsys):
    code, err = validate(tmp_path, capsys, dumped(output={"dir": where}))
    assert code == 2 and f"spec.output.dir: {where!r} has a '..' segment" in err


def test_a_path_with_dots_is_on_no_mount():
    from rlhf_operator.builders.pods import mount_of

    mounts = [{"name": "w", "mountPath": "/work"}]
    assert mount_of("/work/data/x.jsonl", mounts) is not None
    assert mount_of("/work/../etc/passwd", mounts) is None


def test_max_tokens_beyond_the_models_context_is_refused(tmp_path, capsys):
    code, err = validate(tmp_path, capsys, dumped(rollout={"engine": "cpu", "maxTokens": 200},
                                                  trainer={"maxTokensPerMicroBatch": 512}))
    assert code == 2 and "spec.rollout.maxTokens: 200 is beyond the context of spec.model.path " \
                          "'builtin://tiny-qwen2' (128 tokens)" in err
    # prompt + response beyond it: vLLM refuses such a --max-model-len; the CPU engine runs it
    vllm = dumped(data={"path": "builtin://last-digit", "maxPromptLength": 64}, rollout={"maxTokens": 100},
                  trainer={"maxTokensPerMicroBatch": 512})
    code, err = validate(tmp_path, capsys, vllm)
    assert code == 2 and "(64 + 100 = 164) is beyond the context" in err and "vLLM refuses" in err
    cpu = vllm.replace("maxTokens: 100", "maxTokens: 100\n    engine: cpu")
    code, err = validate(tmp_path, capsys, cpu)
    assert code == 0 and "warning: data.maxPromptLength + rollout.maxTokens (64 + 100 = 164)" in err


def test_a_local_model_directory_gives_its_context(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"text_config": {"max_position_embeddings": 4096}}')
    job = validate_job({**BASE, "spec": {**BASE["spec"], "model": {"path": str(model)},
                                         "rollout": {"maxTokens": 8192}}})
    from rlhf_launcher.validate import model_config_here

    problems, _ = budget_problems(job.spec, lambda p: context_length(model_config_here(p)))
    assert problems == [("spec.rollout.maxTokens", f"8192 is beyond the context of spec.model.path {str(model)!r} "
                         "(4096 tokens): no response could reach it; lower rollout.maxTokens")]
    assert budget_problems(job.spec, lambda p: None) == ([], [])  # not readable here: not checked


def test_the_judges_context_must_hold_the_prompt_the_response_and_its_answer(tmp_path, capsys):
    judge = {"type": "judge", "judge": {"model": "builtin://tiny-qwen2", "maxTokens": 120,
                                        "template": "{prompt} {response} {answer} {min_score} {max_score}"}}
    code, err = validate(tmp_path, capsys, dumped(reward=judge))
    assert code == 2 and "spec.reward.judge.maxTokens: the judge reads" in err
    assert "(16 + 2 + 120" in err and "(128 tokens)" in err
    job = validate_job(yaml.safe_load(dumped(reward=judge)))
    counted = []
    problems, _ = budget_problems(job.spec, lambda p: 150, lambda p, text: counted.append(text) or 20)
    assert "16 + 2 + 120 + 20 of the judge's own text = 158" in problems[0][1]
    # what is counted is what the judge reads: its instructions, the rubric and the tags
    assert "You are a grader" in counted[0] and "<response>" in counted[0] and "</reference>" in counted[0]
    external = {"type": "judge", "judge": {**judge["judge"], "url": "https://judge.example/v1"}}
    assert budget_problems(validate_job(yaml.safe_load(dumped(reward=external))).spec, lambda p: 128) == ([], [])


CREDENTIALS = {
    "judge user info": ({"reward": {"type": "judge", "judge": {"model": "m", "url": "https://u:p@judge.example/v1"}}},
                        "spec.reward.judge.url", "reward.judge.apiKeySecret"),
    "http reward key": ({"reward": {"type": "http", "url": "https://svc/score?api_key=abc"}},
                        "spec.reward.url", "valueFrom.secretKeyRef"),
    "component judge signature": ({"reward": {"type": "math", "components": [
        {"name": "j", "type": "judge", "judge": {"model": "m", "url": "https://x/v1?X-Amz-Signature=abc"}}]}},
        "spec.reward.components[0].judge.url", "reward.judge.apiKeySecret"),
    "sandbox": ({"reward": {"type": "code", "sandbox": {"url": "http://a:b@sandbox:8080"}}},
                "spec.reward.sandbox.url", "secretKeyRef"),
    "mlflow": ({"tracking": {"mlflow": {"trackingUri": "https://u:p@mlflow.example"}}},
               "spec.tracking.mlflow.trackingUri", "MLFLOW_TRACKING_TOKEN"),
    "wandb": ({"tracking": {"wandb": {"project": "p", "baseUrl": "https://wandb.example?token=x"}}},
              "spec.tracking.wandb.baseUrl", "tracking.wandb.apiKeySecret"),
    "hub endpoint in env": ({"pod": {"env": [{"name": "HF_ENDPOINT", "value": "https://u:tok@hub.example"}]}},
                            "spec.pod.env", "storageSecret"),
}


@pytest.mark.parametrize("case", sorted(CREDENTIALS))
def test_credentials_in_a_url_are_refused_with_a_pointer_to_secrets(case, tmp_path, capsys):
    spec, path, pointer = CREDENTIALS[case]
    code, err = validate(tmp_path, capsys, dumped(**copy.deepcopy(spec)))
    assert code == 2 and f"{path}: " in err and "credential" in err and pointer in err


def test_urls_without_credentials_pass():
    for url in ("https://judge.example/v1", "http://svc:8000/score?design=1&page=2", "file:///output/mlruns",
                "sqlite:///output/mlflow.db"):
        assert url_credentials(url) is None, url
    assert url_credentials("https://x/?sig=1") and url_credentials("https://x/?access_token=1")


def test_the_crd_refuses_url_credentials_at_admission():
    spec = crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    judge_url = spec["reward"]["properties"]["judge"]["properties"]["url"]
    assert judge_url["maxLength"] == 2048 and judge_url["pattern"] == "^https?://"
    assert judge_url["x-kubernetes-validations"][0]["rule"] == URL_CEL
    assert "reward.judge.apiKeySecret" in judge_url["x-kubernetes-validations"][0]["message"]
    mlflow = spec["tracking"]["properties"]["mlflow"]["properties"]["trackingUri"]
    assert mlflow["x-kubernetes-validations"][0]["rule"] == URL_CEL and mlflow["minLength"] == 1
