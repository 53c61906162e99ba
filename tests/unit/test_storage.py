"""`hf://` and `s3://` in the spec, the download plan, and the pods that run it (pure: no
server; tests/unit/test_storage_servers.py runs the downloads and uploads against real
ones): the grammar's errors name the field, each remote path is replaced by its local copy
in every process's config, the download step is an init container of exactly the pods
that read a remote path, and the Secret reaches it and the trainer but never a rollout
server's container or the sandbox."""

from __future__ import annotations

import copy
import json

import pytest
from kubernetes.client import ApiClient

from rlhf_contract.api import JobError, validate_job
from rlhf_contract.api.uris import parse_remote
from rlhf_contract.sources import localize, plan, plan_from_json, plan_json
from rlhf_operator.backends import build_children

SECRET = "storage-creds"


def job_data(**spec):
    data = {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": "remote", "namespace": "ns", "uid": "0b7e6d2c-1111-4222-8333-944455556666"},
            "spec": {"model": {"path": "hf://Qwen/Qwen2.5-0.5B@v1.0"}, "data": {"path": "s3://datasets/math/train.jsonl"},
                     "output": {"claimName": "runs"}, "rollout": {"replicas": 2}}}
    data["spec"].update(spec)
    return data


@pytest.mark.parametrize("field,value,expected", [
    ("model", {"path": "hf://Qwen"}, "spec.model.path"),
    ("model", {"path": "hf://a/b/c/../d"}, "spec.model.path"),
    ("model", {"path": "hf://datasets/org/x"}, "spec.model.path"),  # a dataset repository as the model
    ("model", {"path": "hf://spaces/org/x"}, "spec.model.path"),
    ("data", {"path": "hf://dataset/org/x"}, "spec.data.path"),  # the type prefix is plural
    ("data", {"path": "hf://models/org/x"}, "spec.data.path"),
    ("data", {"path": "hf://org/x/data/*.jsonl"}, "spec.data.path"),
    ("data", {"path": "hf://datasets/org/x/train.jsonl", "config": "main"}, "spec.data.config"),  # a config of files
    ("data", {"path": "builtin://last-digit", "config": "main"}, "spec.data.config"),
    ("evaluation", {"datasets": [{"name": "e", "path": "s3://bucket/x", "config": "main"}]}, "spec.evaluation.datasets[0].config"),
    ("data", {"path": "s3://Bad_Bucket/x"}, "spec.data.path"),
    ("data", {"path": "s3://bucket/../etc"}, "spec.data.path"),
    ("evaluation", {"datasets": [{"name": "e", "path": "hf://org/x@"}]}, "spec.evaluation.datasets[0].path"),
    ("reward", {"type": "model", "model": {"path": "s3://ab"}}, "spec.reward.model.path"),
    ("output", {"uri": "s3://B"}, "spec.output.uri"),
    ("output", {"uri": "hf://org/name"}, "spec.output.uri"),
])
def test_malformed_address_names_its_field(field, value, expected):
    with pytest.raises(JobError) as err:
        validate_job(job_data(**{field: value}))
    assert any(p.path == expected for p in err.value.problems), err.value.problems


def test_parse_remote():
    hf = parse_remote("hf://Qwen/Qwen2.5-0.5B@refs/pr/1")
    assert (hf.scheme, hf.name, hf.ref) == ("hf", "Qwen/Qwen2.5-0.5B", "refs/pr/1")
    assert parse_remote("hf://Qwen/Qwen2.5-0.5B").ref == "main"
    s3 = parse_remote("s3://my-bucket/runs/a/")
    assert (s3.scheme, s3.name, s3.ref) == ("s3", "my-bucket", "runs/a")
    assert parse_remote("s3://my-bucket").ref == ""
    assert parse_remote("/models/qwen") is None and parse_remote("builtin://tiny-qwen2") is None


@pytest.mark.parametrize("uri", [
    "hf://org/name", "hf://org/name@v1", "hf://datasets/org/name@v1/data/train.jsonl", "hf://models/org/m/sub/dir",
    "hf://org/name@refs/pr/3/sub", "hf://org/name@refs/convert/parquet", "hf://org/name@feature%2Fx/a.json",
    "hf://org/name/file@1.txt", "hf://datasets/org/name/a/b",
])
def test_hub_addresses_split_as_huggingface_hub_splits_them(uri):
    """Our grammar (the contract imports no client) against huggingface_hub's own parser."""
    from huggingface_hub.utils._hf_uris import parse_hf_uri

    ours, theirs = parse_remote(uri), parse_hf_uri(uri)
    assert (ours.name, ours.ref, ours.path) == (theirs.id, theirs.revision or "main", theirs.path_in_repo)
    assert ours.repo_type == (theirs.type if uri.startswith(("hf://models/", "hf://datasets/")) else None)


def test_bare_hub_id_hint():
    from rlhf_contract.api.uris import hub_id_hint

    assert "write hf://Qwen/Qwen3-0.6B" in hub_id_hint("Qwen/Qwen3-0.6B")
    assert all(hub_id_hint(p) is None for p in ("/models/qwen", "./Qwen/Qwen3-0.6B", "hf://Qwen/Qwen3-0.6B",
                                                  "data/train.jsonl", "a/b/c", "qwen"))


def test_plan_and_localize_cover_every_field_once():
    job = validate_job(job_data(
        reward={"type": "model", "model": {"path": "hf://Qwen/Qwen2.5-0.5B@v1.0"}},  # the same address as the policy
        evaluation={"datasets": [{"name": "held", "path": "hf://org/evalset"}, {"name": "local", "path": "/data/x.jsonl"},
                                 {"name": "test", "path": "hf://org/evalset", "config": "main", "split": "test"},
                                 {"name": "file", "path": "hf://datasets/org/evalset@v2/extra/hard.jsonl"}]}))
    fetches = plan(job, "/output")
    hub = "/output/sources/hf/datasets/org/evalset/"
    assert [(f.field, f.kind, f.local, f.config, f.split) for f in fetches] == [
        ("spec.model.path", "model", "/output/sources/hf/models/Qwen/Qwen2.5-0.5B/v1.0", None, None),
        ("spec.data.path", "dataset", "/output/sources/s3/datasets/math/train.jsonl", None, None),
        ("spec.evaluation.datasets[0].path", "dataset", hub + "main+default.train", None, "train"),
        ("spec.evaluation.datasets[2].path", "dataset", hub + "main+main.test", "main", "test"),
        ("spec.evaluation.datasets[3].path", "dataset", hub + "v2+extra--hard.jsonl", None, None),
    ]
    assert plan_from_json(plan_json(fetches)) == fetches
    assert len({f.marker() for f in fetches}) == 5 and all(m.startswith("/output/sources/.complete/")
                                                            for m in (f.marker() for f in fetches))
    assert fetches[2].pin_file() == fetches[3].pin_file()  # one address, one revision, two copies
    local = localize(job, "/output").spec
    assert local.model.path == local.reward.model.path == fetches[0].local
    assert local.data.path == fetches[1].local
    assert [d.path for d in local.evaluation.datasets] == [fetches[2].local, "/data/x.jsonl", fetches[3].local,
                                                           hub + "v2+extra--hard.jsonl/extra/hard.jsonl"]
    assert job.spec.model.path == "hf://Qwen/Qwen2.5-0.5B@v1.0"  # the job itself is left as written
    assert plan(job, "/output", model_only=True) == fetches[:1]


def _pods(data):
    job = validate_job(copy.deepcopy(data))
    pods = {}
    for child in build_children(job, 1):
        if child["kind"] == "StatefulSet" and child["metadata"]["name"].endswith("-rollout"):
            pods["rollout"] = child["spec"]["template"]["spec"]
        elif child["kind"] == "PyTorchJob":
            pods["trainer"] = child["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        elif child["kind"] == "ConfigMap":
            pods["config"] = json.loads(child["data"]["trainer.json"])
    return pods


def test_rendered_pods_download_first_with_the_secret():
    pods = _pods(job_data(storageSecret=SECRET, output={"claimName": "runs", "uri": "s3://runs/remote"}))
    api = ApiClient()
    for role in ("trainer", "rollout"):  # the Kubernetes model knows every field
        spec = pods[role]
        assert api.sanitize_for_serialization(api._ApiClient__deserialize(copy.deepcopy(spec), "V1PodSpec")) == spec
    trainer_init, = pods["trainer"]["initContainers"]
    rollout_init, = pods["rollout"]["initContainers"]
    for init in (trainer_init, rollout_init):
        assert init["command"][:3] == ["python", "-m", "rlhf_trainer.storage"]
        assert init["envFrom"] == [{"secretRef": {"name": SECRET}}]
        assert {"name": "RLHF_STORAGE_SECRET", "value": SECRET} in init["env"]
        assert "nvidia.com/gpu" not in json.dumps(init["resources"])
    trainer_plan = plan_from_json(trainer_init["command"][4])
    assert [f.field for f in trainer_plan] == ["spec.model.path", "spec.data.path"]
    assert trainer_init["command"][5:] == ["--restore", "s3://runs/remote", "--output", "/output"]
    assert [f.field for f in plan_from_json(rollout_init["command"][4])] == ["spec.model.path"]
    assert "--restore" not in rollout_init["command"]
    # the processes read the copies: the rollout server's model argument and the trainer's config
    server = pods["rollout"]["containers"][0]
    assert trainer_plan[0].local in server["command"] and pods["config"]["modelPath"] == trainer_plan[0].local
    assert pods["config"]["data"]["path"] == trainer_plan[1].local
    # the rollout pod keeps its copy in an emptyDir at the same path; the trainer on its output volume
    assert {"name": "sources", "emptyDir": {}} in pods["rollout"]["volumes"]
    assert {"name": "sources", "mountPath": "/output/sources"} in server["volumeMounts"]
    assert {"name": "output", "mountPath": "/output"} in trainer_init["volumeMounts"]
    # the Secret: the trainer (uploads to output.uri) yes, the rollout server's own container no
    assert pods["trainer"]["containers"][0]["envFrom"] == [{"secretRef": {"name": SECRET}}]
    assert "envFrom" not in server and SECRET not in json.dumps(server)


def test_pod_env_reaches_the_download_step_after_the_secret():
    env = [{"name": "HTTPS_PROXY", "value": "http://proxy.corp:3128"}, {"name": "HF_XET_HIGH_PERFORMANCE", "value": "1"},
           {"name": "AWS_REGION", "value": "eu-west-3"}, {"name": "AWS_CA_BUNDLE", "value": "/certs/ca.pem"}]
    env_from = [{"configMapRef": {"name": "proxy-settings"}}]
    pods = _pods(job_data(storageSecret=SECRET, pod={"env": env, "envFrom": env_from}))
    for role in ("trainer", "rollout"):
        init, = pods[role]["initContainers"]
        assert init["env"][-len(env):] == env  # last: a spec.pod.env entry wins over the contract's
        assert init["envFrom"] == [{"secretRef": {"name": SECRET}}, *env_from]  # the Secret first, as in the trainer


def test_jobset_backend_has_the_same_download_steps():
    job = validate_job(job_data(storageSecret=SECRET, backend="JobSet"))
    jobset, = [c for c in build_children(job, 1) if c["kind"] == "JobSet"]
    specs = {r["name"]: r["template"]["spec"]["template"]["spec"] for r in jobset["spec"]["replicatedJobs"]}
    fields = {name: [f.field for f in plan_from_json(spec["initContainers"][0]["command"][4])]
              for name, spec in specs.items()}
    assert fields == {"trainer": ["spec.model.path", "spec.data.path"], "rollout": ["spec.model.path"]}
    assert all(spec["initContainers"][0]["envFrom"] == [{"secretRef": {"name": SECRET}}] for spec in specs.values())


def test_local_paths_need_no_download_step():
    pods = _pods(job_data(model={"path": "builtin://tiny-qwen2"}, data={"path": "builtin://last-digit"}))
    assert "initContainers" not in pods["trainer"] and "initContainers" not in pods["rollout"]


def test_sandbox_pods_never_get_the_secret():
    data = job_data(storageSecret=SECRET, reward={"type": "code"})
    job = validate_job(data)
    sandbox = [c for c in build_children(job, 1) if c["metadata"]["name"] == "remote-sandbox" and c["kind"] == "StatefulSet"]
    assert sandbox and SECRET not in json.dumps(sandbox)


def test_model_card_records_base_model_reward_scores_and_spec(tmp_path):
    import yaml

    from rlhf_contract.pod import run_config
    from rlhf_trainer.storage.model_card import write_card

    job = validate_job(job_data(reward={"type": "exact_match"},
                                evaluation={"datasets": [{"name": "held", "path": "hf://org/evalset"}]}))
    (tmp_path / "final").mkdir()
    rows = [{"step": 1, "reward_mean": 0.25, "eval/held/greedy_score": 0.125},
            {"step": 2, "reward_mean": 0.5, "eval/held/greedy_score": None},  # not scored at this step
            {"step": 3, "reward_mean": 0.75, "eval/held/greedy_score": 0.625, "eval/held/pass@1": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_card(tmp_path / "final", run_config(job), tmp_path).read_text()
    front = yaml.safe_load(text.split("---")[1])
    assert front["base_model"] == "Qwen/Qwen2.5-0.5B" and "rlhf-operator" in front["tags"]
    assert "from `hf://Qwen/Qwen2.5-0.5B@v1.0`" in text and '"type": "exact_match"' in text
    assert "| eval/held/greedy_score | 0.625 |" in text and "| eval/held/pass@1 | 0.5 |" in text
    assert "| reward_mean | 0.75 |" in text and "## Last step (3)" in text
    spec = yaml.safe_load(text.split("```yaml")[1].split("```")[0])
    assert spec == job.to_config()["spec"]


def test_model_card_metadata_parses_back_with_huggingface_hub(tmp_path):
    """The card's YAML as huggingface_hub reads it: base model, datasets, license (the base
    model's card's, else `output.license` over it), the method and preset as tags; the text
    holds the reward by step and the tracker runs, and no secret (a token in a link's query
    or user info, an env value)."""
    from huggingface_hub import ModelCard

    from rlhf_contract.pod import run_config
    from rlhf_trainer.storage.model_card import write_card

    token = "hf_n0tInTheCard"
    job = validate_job(job_data(data={"path": "hf://org/prompts@v2"}, algorithm={"preset": "grpo"},
                                evaluation={"datasets": [{"name": "held", "path": "hf://org/evalset"}]},
                                pod={"env": [{"name": "HF_TOKEN", "value": token}]}))
    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: mit\nlibrary_name: transformers\n---\n# base\n")
    (tmp_path / "final").mkdir()
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward_mean": s / 40}) + "\n"
                                                    for s in range(1, 41)))
    links = {"wandb": "https://wandb.ai/team/proj/runs/abc123",
             "mlflow": f"https://user:{token}@mlflow.example/#/experiments/1/runs/r1?token={token}"}
    path = write_card(tmp_path / "final", run_config(job), tmp_path, base_dir=base, links=links)
    card = ModelCard.load(path)
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B"
    assert card.data.datasets == ["org/prompts", "org/evalset"]
    assert card.data.license == "mit" and card.data.library_name == "transformers"
    assert {"rlhf-operator", "rl", "grpo"} <= set(card.data.tags)
    table = [line for line in card.text.splitlines() if line.startswith("| ") and line.count("|") == 3]
    steps = [int(line.split("|")[1]) for line in table if line.split("|")[1].strip().isdigit()]
    assert steps[0] == 1 and steps[-1] == 40 and len(steps) == 10  # evenly spaced, the last step in
    assert "| 40 | 1 |" in card.text and "| 1 | 0.025 |" in card.text
    assert "- wandb: https://wandb.ai/team/proj/runs/abc123" in card.text and "mlflow.example" in card.text
    assert token not in path.read_text()

    own = validate_job(job_data(output={"claimName": "runs", "license": "apache-2.0"}))
    assert ModelCard.load(write_card(tmp_path / "final", run_config(own), tmp_path, base_dir=base)).data.license \
        == "apache-2.0"
    assert ModelCard.load(write_card(tmp_path / "final", run_config(own), tmp_path)).data.datasets is None


def test_a_hub_push_without_a_token_is_refused_before_training(monkeypatch):
    from rlhf_contract.trainer_config import TrainerConfig
    from rlhf_trainer.preflight.checks import output_problems

    config = TrainerConfig.from_job(validate_job(job_data(storageSecret=SECRET, output={"hub": {"repo": "team/out"}})))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("RLHF_STORAGE_SECRET", SECRET)
    problem, = output_problems(config)
    assert problem.startswith("spec.output.hub.repo:") and f"HF_TOKEN (none set) from the Secret '{SECRET}'" in problem
    monkeypatch.setenv("HF_TOKEN", "hf_x")
    assert output_problems(config) == []


def test_a_finished_download_step_is_no_failure_its_exit_2_is():
    from helpers import fake_pod
    from rlhf_operator.failures import pod_failure

    pod = fake_pod("remote-rollout-0", {"rlhf.dev/role": "rollout"})
    done = {"name": "fetch", "restartCount": 0, "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}
    pod["status"]["initContainerStatuses"] = [done]
    assert pod_failure(pod) is None  # a rollout server that exits is a failure; its init step exiting 0 is not
    done["state"]["terminated"].update(exitCode=2, reason="Error", message="config error: spec.model.path: ...")
    failure = pod_failure(pod)
    assert (failure.container, failure.exit_code) == ("fetch", 2)
