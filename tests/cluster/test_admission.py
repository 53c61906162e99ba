"""Admission: the generated CRD (crds/rlhfjobs.yaml) makes the real API server reject bad
RLHFJobs at `kubectl apply`, naming the field: OpenAPI constraints (the numbers' bounds of
api/common.py among them) and the CEL rules of api/rules.py. Server-side dry runs, so
nothing is stored."""

from __future__ import annotations

import copy
import json
import uuid
from pathlib import Path

import pytest
import yaml

from rlhf_contract.api import JobError, validate_job
from rlhf_contract.api.common import INT_MAX

from .harness import Cluster, wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "rlhfjobs.yaml"


def install_crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "--field-manager=rlhf-tests", "-f", str(CRD))
    cluster.wait_established("rlhfjobs.rlhf.dev")


@pytest.fixture(scope="module")
def ns(cluster: Cluster):
    install_crd(cluster)
    name = f"adm-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


VALID = {
    "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
    "metadata": {"name": "ok"},
    "spec": {"model": {"path": "/models/qwen"}, "data": {"path": "/data/train.jsonl"}},
}


def with_(path: str, value, base=VALID) -> dict:
    doc = copy.deepcopy(base)
    node = doc
    *parents, last = path.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    if value is _DELETE:
        node.pop(last)
    else:
        node[last] = value
    return doc


_DELETE = object()


def dry_run(cluster: Cluster, ns: str, doc: dict):
    return cluster.kubectl("create", "--dry-run=server", "-n", ns, "-f", "-", input=yaml.safe_dump(doc), check=False)


def test_valid_specs_are_accepted(cluster: Cluster, ns: str):
    # VALID has no `algorithm`: a CEL rule reading self.algorithm.x without has() fails on it
    # ("no such key: algorithm"), as the numMiniBatches rule once did.
    for doc in (VALID,
                with_("spec.algorithm", {}),
                with_("spec.algorithm", {"preset": "ppo"}),
                with_("spec.algorithm", {"preset": "dapo"}, with_("spec.rollout", {"maxTokens": 4096})),
                with_("spec.reward", {"type": "python", "file": "/work/reward.py"}),
                with_("spec.reward", {"type": "math", "components": [
                    {"name": "fmt", "type": "python", "file": "/work/fmt.py", "weight": 0.2},
                    {"name": "judge", "type": "http", "url": "http://judge:8000/score"}]}),
                with_("spec.reward", {"type": "python", "function": "my_rewards.trl:accuracy", "components": [
                    {"name": "verl", "type": "python", "function": "verl_rewards:compute_score"},
                    {"name": "judge", "type": "judge", "judge": {"model": "/models/judge"}},
                    {"name": "judge2", "type": "judge", "judge": {"model": "/models/judge", "choices": {"yes": 1}}},
                    {"name": "api", "type": "judge", "judge": {"url": "https://api.example.com/v1", "model": "big",
                                                               "apiKeySecret": {"name": "k", "key": "token"}}}]}),
                with_("spec.tracking", {"wandb": {"project": "rl", "apiKeySecret": {"name": "w", "key": "k"}},
                                        "mlflow": {"trackingUri": "http://mlflow:5000"}, "samplesEvery": 5}),
                with_("spec.model.lora", {"rank": 8, "targetModules": ["q_proj", "v_proj"]}),
                with_("spec.trainer", {"engine": "deepspeed", "nprocPerNode": 2,
                                       "deepspeed": {"zeroStage": 2, "offloadOptimizer": True}}),
                with_("spec.trainer", {"engine": "deepspeed", "deepspeed": {"offloadParams": True}}),
                with_("spec.pod", {"env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
                                   "envFrom": [{"secretRef": {"name": "creds"}}]}),
                with_("spec.algorithm", {"preset": "gspo"}), with_("spec.algorithm", {"preset": "cispo"}),
                with_("spec.algorithm", {"tisCap": 1.5}), with_("spec.algorithm", {"rolloutCorrection": {}}),
                with_("spec.algorithm", {"rolloutCorrection": {"mode": "sequence-mask", "upper": 1.1}}),
                with_("spec.algorithm", {"rolloutCorrection": {"mode": "two-sided-mask", "lower": 0.5, "upper": 5}}),
                yaml.safe_load((REPO / "examples" / "local-grpo.yaml").read_text()),
                yaml.safe_load((REPO / "examples" / "local-distill.yaml").read_text()),
                yaml.safe_load((REPO / "examples" / "local-agent.yaml").read_text()),
                yaml.safe_load((REPO / "examples" / "rlhfjob.yaml").read_text())):
        validate_job(copy.deepcopy(doc))
        proc = dry_run(cluster, ns, doc)
        assert proc.returncode == 0, proc.stderr



# (what, document, substrings every one of which the API server's message must contain)
_AGENT = {"command": ["python", "/work/agent.py"]}
_TOOLS = {"functions": [{"file": "/work/tools.py", "function": "calculator"}]}
INVALID = [
    ("agent and tools", with_("spec.rollout", {"agent": _AGENT, "tools": _TOOLS}),
     ["spec.rollout.agent", "cannot be set with rollout.tools"]),
    ("agent and environment", with_("spec.environment", {"file": "/work/env.py"}, with_("spec.rollout", {"agent": _AGENT})),
     ["spec.rollout.agent", "cannot be set with spec.environment"]),
    ("agent without command", with_("spec.rollout", {"agent": {"command": []}}), ["spec.rollout.agent.command"]),
    ("missing model", with_("spec.model", _DELETE), ["spec.model: Required value"]),
    ("empty model path", with_("spec.model.path", ""), ["spec.model.path", "at least 1"]),
    ("unknown dtype", with_("spec.model.dtype", "int3"), ["spec.model.dtype", "Unsupported value", "bfloat16"]),
    ("zero replicas", with_("spec.rollout", {"replicas": 0}), ["spec.rollout.replicas", "greater than or equal to 1"]),
    ("top_p above 1", with_("spec.rollout", {"topP": 1.5}), ["spec.rollout.topP", "less than or equal to 1"]),
    ("nucleus sampling in RL", with_("spec.rollout", {"topP": 0.9}), ["spec.rollout.topP", "importance ratio"]),
    ("learning rate 0", with_("spec.trainer", {"learningRate": 0}), ["spec.trainer.learningRate", "greater than 0"]),
    ("dual clip <= 1", with_("spec.algorithm", {"dualClip": 1.0}), ["spec.algorithm.dualClip", "greater than 1"]),
    ("wrong type", with_("spec.schedule", {"totalSteps": "many"}), ["spec.schedule.totalSteps", "must be of type integer"]),
    ("negative restarts", with_("spec.runPolicy", {"maxRestarts": -1}), ["spec.runPolicy.maxRestarts"]),
    ("name too long", with_("metadata.name", "x" * 41), ["metadata.name", "at most 40"]),
    # CEL rules (api/rules.py)
    ("group estimator with one sample", with_("spec.rollout", {"samplesPerPrompt": 1}),
     ["spec.rollout.samplesPerPrompt", "at least 2 with a group advantage estimator"]),
    ("critic without gae", with_("spec.algorithm", {"critic": True}),
     ["spec.algorithm.critic", "must be true exactly when"]),
    ("gae without critic", with_("spec.algorithm", {"preset": "ppo", "critic": False}),
     ["spec.algorithm.critic", "must be true exactly when"]),
    ("python reward without file", with_("spec.reward", {"type": "python"}),
     ["spec.reward.file", "is required when reward.type is python"]),
    ("http reward without url", with_("spec.reward", {"type": "http"}),
     ["spec.reward.url", "is required when reward.type is http"]),
    ("overlong buffer >= maxTokens", with_("spec.algorithm", {"preset": "dapo", "overlongBuffer": 8},
                                                    with_("spec.rollout", {"maxTokens": 8})),
     ["spec.algorithm.overlongBuffer", "smaller than rollout.maxTokens"]),
    ("parallelism does not divide the world",
     with_("spec.trainer", {"numNodes": 1, "nprocPerNode": 4, "parallelism": {"tensorParallel": 3}}),
     ["spec.trainer.parallelism", "must divide the trainer world size"]),
    ("tisCap beside rolloutCorrection", with_("spec.algorithm", {"tisCap": 2.0, "rolloutCorrection": {}}),
     ["spec.algorithm.tisCap", "keep only rolloutCorrection"]),
    ("a mask without upper", with_("spec.algorithm", {"rolloutCorrection": {"mode": "token-mask"}}),
     ["spec.algorithm.rolloutCorrection.upper", "is required with mode token-mask"]),
    ("two-sided without lower", with_("spec.algorithm", {"rolloutCorrection": {"mode": "two-sided-mask", "upper": 5}}),
     ["spec.algorithm.rolloutCorrection.lower", "is required with mode two-sided-mask"]),
    ("lower above upper", with_("spec.algorithm", {"rolloutCorrection": {"mode": "token-mask", "lower": 3, "upper": 2}}),
     ["spec.algorithm.rolloutCorrection.lower", "must not exceed"]),
    ("negative lower", with_("spec.algorithm", {"rolloutCorrection": {"mode": "token-mask", "lower": -1, "upper": 2}}),
     ["spec.algorithm.rolloutCorrection.lower", "greater than 0"]),
    ("cispo with a dual clip", with_("spec.algorithm", {"preset": "cispo", "dualClip": 3.0}),
     ["spec.algorithm.dualClip", "cannot be used with policyLoss cispo"]),
    ("distill without a teacher", with_("spec.method", "distill"),
     ["spec.distillation", "is set exactly when method is distill"]),
    ("mini batches do not divide", with_("spec.algorithm", {"numMiniBatches": 3}),
     ["spec.algorithm.numMiniBatches", "must divide"]),
    ("model reward without a model", with_("spec.reward", {"type": "model"}),
     ["spec.reward.model", "is required when reward.type is model"]),
    ("python component without file", with_("spec.reward", {"type": "math", "components": [
        {"name": "fmt", "type": "python"}]}), ["spec.reward.components", "each component of type python needs file"]),
    ("judge component without judge", with_("spec.reward", {"type": "math", "components": [
        {"name": "j", "type": "judge"}]}), ["spec.reward.components", "each component of type judge needs judge"]),
    ("two judge models served", with_("spec.reward", {"type": "judge", "judge": {"model": "/m/a"}, "components": [
        {"name": "j", "type": "judge", "judge": {"model": "/m/b"}}]}),
     ["spec.reward", "judges without judge.url must all name the same judge.model"]),
    ("component named like the main reward", with_("spec.reward", {"type": "math", "components": [
        {"name": "math", "type": "exact_match"}]}), ["spec.reward.components", "names must be unique"]),
    ("two components of one name", with_("spec.reward", {"type": "math", "components": [
        {"name": "a", "type": "exact_match"}, {"name": "a", "type": "prefix_match"}]}),
     ["spec.reward.components", "names must be unique"]),
    ("lora rank 0", with_("spec.model.lora", {"rank": 0}), ["spec.model.lora.rank", "greater than or equal to 1"]),
    ("lora with tensor parallel",
     with_("spec.model.lora", {"rank": 8}, with_("spec.trainer", {"nprocPerNode": 2, "parallelism": {"tensorParallel": 2}})),
     ["spec.trainer.parallelism.tensorParallel", "must be 1 with model.lora"]),
    ("deepspeed with tensor parallel",
     with_("spec.trainer", {"engine": "deepspeed", "nprocPerNode": 2, "parallelism": {"tensorParallel": 2}}),
     ["spec.trainer.engine", "deepspeed is data parallel only"]),
    ("deepspeed with lora", with_("spec.model.lora", {"rank": 8}, with_("spec.trainer", {"engine": "deepspeed"})),
     ["spec.trainer.engine", "model.lora trains with engine fsdp2 only"]),
    ("parameter offload at zero stage 2",
     with_("spec.trainer", {"engine": "deepspeed", "deepspeed": {"zeroStage": 2, "offloadParams": True}}),
     ["spec.trainer.deepspeed.offloadParams", "parameter offload needs ZeRO stage 3"]),
    ("colocated and stale", with_("spec.rollout", {"placement": "colocated", "maxStaleness": 1}),
     ["spec.rollout.maxStaleness", "must be 0 with rollout.placement colocated"]),
    ("sft with context parallel",
     with_("spec.method", "sft", with_("spec.trainer", {"nprocPerNode": 2, "parallelism": {"contextParallel": 2}})),
     ["spec.trainer.parallelism.contextParallel", "must be 1 for method sft"]),
]


# What reaches the host or carries a secret (api/pod_security.py, api/uris.py; issue 49): CEL on
# a volume's declared sources, the schema's minimum for groups, CEL on URL fields. hostPath is
# admitted: the operator refuses it unless installed with security.allowHostPath.
HOST_REACHING = [
    ("secret volume", with_("spec.pod", {"volumes": [{"name": "s", "secret": {"secretName": "admin-token"}}]}),
     ["spec.pod.volumes[0]", "secret volumes are not allowed"]),
    ("projected service-account token", with_("spec.pod", {"volumes": [{"name": "t", "projected": {"sources": [
        {"configMap": {"name": "c"}}, {"serviceAccountToken": {"path": "token"}}]}}]}),
     ["spec.pod.volumes[0]", "projected volumes may combine configMap and downwardAPI sources only"]),
    ("gitRepo volume", with_("spec.pod", {"volumes": [{"name": "g", "gitRepo": {"repository": "https://x"}}]}),
     ["spec.pod.volumes[0]", "this volume type is not allowed"]),
    ("runAsGroup 0", with_("spec.pod", {"securityContext": {"runAsGroup": 0}}),
     ["spec.pod.securityContext.runAsGroup", "greater than or equal to 1"]),
    ("supplementalGroups [0]", with_("spec.pod", {"securityContext": {"supplementalGroups": [0]}}),
     ["spec.pod.securityContext.supplementalGroups[0]", "greater than or equal to 1"]),
    ("fsGroup 0 in a role's pod", with_("spec.trainer", {"pod": {"securityContext": {"fsGroup": 0}}}),
     ["spec.trainer.pod.securityContext.fsGroup", "greater than or equal to 1"]),
    ("an AppArmor profile annotation", with_("spec.pod", {"annotations": {
        "container.apparmor.security.beta.kubernetes.io/trainer": "unconfined"}}),
     ["spec.pod.annotations", "set security profiles"]),
    ("judge url with user info", with_("spec.reward", {"type": "judge", "judge": {
        "model": "big", "url": "https://user:pass@judge.example/v1"}}),
     ["spec.reward.judge.url", "carries a credential", "reward.judge.apiKeySecret"]),
    ("http reward url with a key", with_("spec.reward", {"type": "http", "url": "https://svc/score?api_key=abc"}),
     ["spec.reward.url", "carries a credential"]),
    ("mlflow uri with user info", with_("spec.tracking", {"mlflow": {"trackingUri": "https://u:p@mlflow:5000"}}),
     ["spec.tracking.mlflow.trackingUri", "carries a credential"]),
]


@pytest.mark.parametrize("what, doc, expected", HOST_REACHING, ids=[w for w, _, _ in HOST_REACHING])
def test_host_reaching_settings_and_url_credentials_are_refused(cluster: Cluster, ns: str, what, doc, expected):
    test_invalid_spec_is_rejected_naming_the_field(cluster, ns, what, doc, expected)


def test_platform_volumes_and_host_path_are_admitted(cluster: Cluster, ns: str):
    vols = [{"name": "pvc", "persistentVolumeClaim": {"claimName": "c"}}, {"name": "nfs", "nfs": {"server": "s",
            "path": "/x"}}, {"name": "host", "hostPath": {"path": "/data"}},
            {"name": "proj", "projected": {"defaultMode": 420, "sources": [{"configMap": {"name": "c"}}]}}]
    doc = with_("spec.pod", {"volumes": vols, "securityContext": {"runAsGroup": 3000, "supplementalGroups": [4000]}})
    validate_job(copy.deepcopy(doc))
    proc = dry_run(cluster, ns, doc)
    assert proc.returncode == 0, proc.stderr
    stored = yaml.safe_load(cluster.kubectl("create", "--dry-run=server", "-o", "yaml", "-n", ns, "-f", "-",
                                            input=yaml.safe_dump(doc)).stdout)
    assert stored["spec"]["pod"]["volumes"] == vols  # nothing pruned, defaultMode kept

# Numbers (api/common.py): a sample of each kind, each refused by the API server as by
# `rlhfctl validate`: a float, an int64, a field bounded to what works.
BAD_NUMBERS = [
    ("float true", with_("spec.trainer", {"learningRate": True}), ["spec.trainer.learningRate", "must be of type number"]),
    ("int true", with_("spec.schedule", {"totalSteps": True}), ["spec.schedule.totalSteps", "must be of type integer"]),
    ("int beyond int64", with_("spec.schedule", {"totalSteps": 2**63}), ["spec.schedule.totalSteps"]),
    ("int beyond the bound", with_("spec.schedule", {"totalSteps": INT_MAX + 1}), ["spec.schedule.totalSteps"]),
    ("int 1e30", with_("spec.schedule", {"totalSteps": 1e30}), ["spec.schedule.totalSteps"]),
    ("negative seed", with_("spec.schedule", {"seed": -1}), ["spec.schedule.seed", "greater than or equal to 0"]),
    ("seed beyond 2^32", with_("spec.schedule", {"seed": 2**32}), ["spec.schedule.seed", "less than or equal to"]),
    ("replicas beyond int32", with_("spec.rollout", {"replicas": 2**31}),
     ["spec.rollout.replicas", "less than or equal to"]),
    ("temperature 0", with_("spec.rollout", {"temperature": 0}), ["spec.rollout.temperature", "greater than 0"]),
    ("batch of 0", with_("spec.schedule", {"promptsPerStep": 0}), ["spec.schedule.promptsPerStep", "greater than or equal to 1"]),
    ("timeout beyond int32 seconds", with_("spec.rollout", {"requestTimeoutSeconds": 1e12}),
     ["spec.rollout.requestTimeoutSeconds", "less than or equal to"]),
    ("component weight 1e7", with_("spec.reward", {"type": "math", "components": [
        {"name": "fmt", "type": "exact_match", "weight": 1e7}]}), ["spec.reward.components[0].weight", "less than or equal to"]),
    ("tensor parallel with the critic", with_("spec.algorithm", {"preset": "ppo"}, with_(
        "spec.trainer", {"nprocPerNode": 2, "parallelism": {"tensorParallel": 2}})),
     ["spec.trainer.parallelism.tensorParallel", "must be 1 with algorithm.critic"]),
    ("tensor parallel with a reward model", with_("spec.reward", {"type": "model", "model": {"path": "/rm"}}, with_(
        "spec.trainer", {"nprocPerNode": 2, "parallelism": {"tensorParallel": 2}})),
     ["spec.trainer.parallelism.tensorParallel", "must be 1 with reward.model"]),
]
GOOD_NUMBERS = [
    with_("spec.schedule", {"totalSteps": INT_MAX, "seed": 2**32 - 1, "promptsPerStep": 2**31 - 1}),
    with_("spec.rollout", {"temperature": 1e-3, "requestTimeoutSeconds": 2**31 - 1, "replicas": 2**31 - 1,
                           "samplesPerPrompt": 2}),
    with_("spec.trainer", {"learningRate": 1e-300, "maxGradNorm": 1e300, "nprocPerNode": 2,
                           "parallelism": {"tensorParallel": 2}}),
    with_("spec.reward", {"type": "math", "components": [{"name": "fmt", "type": "exact_match", "weight": -1e6}]}),
]


@pytest.mark.parametrize("what, doc, expected", BAD_NUMBERS, ids=[w for w, _, _ in BAD_NUMBERS])
def test_bad_numbers_are_refused_as_by_rlhfctl(cluster: Cluster, ns: str, what, doc, expected):
    test_invalid_spec_is_rejected_naming_the_field(cluster, ns, what, doc, expected)


@pytest.mark.parametrize("doc", GOOD_NUMBERS)
def test_good_numbers_at_the_bounds_are_accepted(cluster: Cluster, ns: str, doc):
    validate_job(copy.deepcopy(doc))
    proc = dry_run(cluster, ns, doc)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_nan_and_infinity_cannot_reach_the_api_server(cluster: Cluster, ns: str, value):
    """JSON has no NaN or infinity: kubectl cannot send them (the models refuse them too)."""
    text = yaml.safe_dump(VALID).replace("spec:\n", f"spec:\n  trainer: {{learningRate: {value}}}\n", 1)
    with pytest.raises(JobError):
        validate_job(yaml.safe_load(text))
    proc = cluster.kubectl("create", "--dry-run=server", "-n", ns, "-f", "-", input=text, check=False)
    assert proc.returncode != 0, proc.stdout


@pytest.mark.parametrize("what, doc, expected", INVALID, ids=[w for w, _, _ in INVALID])
def test_invalid_spec_is_rejected_naming_the_field(cluster: Cluster, ns: str, what, doc, expected):
    with pytest.raises(JobError):  # the same spec fails `rlhfctl validate`
        validate_job(copy.deepcopy(doc))
    proc = dry_run(cluster, ns, doc)
    assert proc.returncode != 0, f"{what}: accepted by the API server"
    for text in expected:
        assert text in proc.stderr, f"{what}: {text!r} not in {proc.stderr!r}"


def test_a_colocated_job_is_admitted_when_its_servers_fill_one_trainer_pod(cluster: Cluster, ns: str):
    rollout = {"placement": "colocated", "replicas": 4, "tensorParallelSize": 2, "vllm": {"kvCacheMemoryBytes": 16 * 2**30}}
    doc = with_("spec.trainer", {"numNodes": 1, "nprocPerNode": 8}, with_("spec.rollout", rollout))
    validate_job(copy.deepcopy(doc))
    proc = dry_run(cluster, ns, doc)
    assert proc.returncode == 0, proc.stderr
    for trainer, field in (({"numNodes": 2, "nprocPerNode": 8}, "spec.trainer.numNodes: must be 1"),
                           ({"numNodes": 1, "nprocPerNode": 4}, "spec.rollout.replicas: times rollout.tensorParallelSize")):
        bad = with_("spec.trainer", trainer, with_("spec.rollout", rollout))
        validate_job(copy.deepcopy(bad))  # a valid job: `rlhfctl run` runs it on one machine
        proc = dry_run(cluster, ns, bad)
        assert proc.returncode != 0 and field in proc.stderr, proc.stderr


def test_spec_is_immutable_but_suspend_and_run_policy(cluster: Cluster, ns: str):
    doc = with_("metadata.name", f"imm-{uuid.uuid4().hex[:6]}")
    cluster.kubectl("create", "-n", ns, "-f", "-", input=yaml.safe_dump(doc))
    name = doc["metadata"]["name"]

    def patch(spec: dict):
        return cluster.kubectl("patch", "rlj", name, "-n", ns, "--type=merge", "-p", json.dumps({"spec": spec}),
                               check=False)
    try:
        for field, spec in (("model", {"model": {"path": "/models/other"}}),
                            ("schedule", {"schedule": {"totalSteps": 7}}),
                            ("rollout", {"rollout": {"replicas": 3}}),
                            ("trainer", {"trainer": {"numNodes": 2}})):
            res = patch(spec)
            assert res.returncode != 0, f"spec.{field} changed"
            assert f"spec.{field} cannot change once the job exists" in res.stderr, res.stderr
        # What the operator acts on at once may change.
        ok = patch({"suspend": True, "runPolicy": {"maxRestarts": 9, "activeDeadlineSeconds": 600}})
        assert ok.returncode == 0, ok.stderr
        got = cluster.get("rlj", name, namespace=ns)["spec"]
        assert got["suspend"] is True and got["runPolicy"]["maxRestarts"] == 9
        assert got["model"]["path"] == VALID["spec"]["model"]["path"]
    finally:
        cluster.kubectl("delete", "rlj", name, "-n", ns, "--wait=false", check=False)


def test_a_queue_label_on_a_job_kueue_cannot_admit_whole_is_refused_by_the_charts_policy(cluster: Cluster, ns: str):
    """A CRD's CEL cannot read labels: the chart's ValidatingAdmissionPolicy `<release>-jobs`
    (QUEUE_LABEL_BACKEND's CEL) refuses a queued PyTorchJob job, and a queued TrainJob job with
    rollout servers beside it, at `kubectl apply`; JobSet, unset, sft on TrainJob, no label pass."""
    from rlhf_contract.api.rules import QUEUE_LABEL_BACKEND

    chart = REPO / "charts" / "rlhf-operator"
    out = cluster.helm("template", "adm", str(chart), "--kube-version", "1.34.0", "--show-only",
                       "templates/admission-policy.yaml").stdout
    docs = [d for d in yaml.safe_load_all(out) if d and d["metadata"]["name"].endswith("-jobs")]
    assert [d["kind"] for d in docs] == ["ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"]
    try:
        cluster.apply(*docs)

        def queued(name: str, **spec) -> dict:
            doc = with_("metadata", {"name": name, "labels": {"kueue.x-k8s.io/queue-name": "team"}})
            doc["spec"].update(spec)
            return doc

        refused = [queued("q-ptj", backend="PyTorchJob"), queued("q-tj-rl", backend="TrainJob")]
        passed = [queued("q-js", backend="JobSet"), queued("q-unset"),
                  queued("q-tj-sft", backend="TrainJob", method="sft"),
                  with_("spec.backend", "PyTorchJob", with_("metadata", {"name": "no-queue"}))]

        def outcome(doc):  # the policy's first evaluation waits for its type check: a few seconds
            out = dry_run(cluster, ns, doc)
            return out if out.returncode != 0 or doc not in refused else None

        for doc in refused:
            out = wait_for(lambda: outcome(doc), 30, f"{doc['metadata']['name']} refused by the policy")
            assert QUEUE_LABEL_BACKEND.message in out.stderr, out.stderr
        for doc in passed:
            out = dry_run(cluster, ns, doc)
            assert out.returncode == 0, (doc["metadata"]["name"], out.stderr)
    finally:
        for d in docs:
            cluster.kubectl("delete", d["kind"].lower(), d["metadata"]["name"], "--ignore-not-found", check=False)
