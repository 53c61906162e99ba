"""Which pods read which copy (operator/rlhf_operator/builders/storage.py): with a
ReadWriteMany output claim the rollout pods mount it (read-only in the server, writable in
the download step) and read the trainer's copy; otherwise the emptyDir fallback; with
`spec.sourceCache` every pod that downloads mounts the cache, read-only but in the download
step. The operator reads the claim's accessModes once (reconcile.Reconciler._output_access)."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
from kubernetes.client import ApiClient
from kubernetes.client.rest import ApiException

from rlhf_contract.api import JobError, validate_job
from rlhf_contract.sources import SOURCE_CACHE_DIR
from rlhf_operator.backends import build_children, job_settings
from rlhf_operator.builders.pods import PodSettingsError
from rlhf_operator.reconcile import JobCache, Reconciler
from test_storage import job_data


def _specs(data, *, shared: bool = False) -> dict[str, dict]:
    """{role: pod spec} of the job's trainer and rollout pods (PyTorchJob or JobSet backend)."""
    job = validate_job(copy.deepcopy(data))
    settings = replace(job_settings(job), output_shared=shared)
    specs = {}
    for child in build_children(job, 1, settings):
        if child["kind"] == "StatefulSet" and child["metadata"]["name"].endswith("-rollout"):
            specs["rollout"] = child["spec"]["template"]["spec"]
        elif child["kind"] == "PyTorchJob":
            specs["trainer"] = child["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
        elif child["kind"] == "JobSet":
            specs.update({r["name"]: r["template"]["spec"]["template"]["spec"] for r in child["spec"]["replicatedJobs"]})
    api = ApiClient()
    for spec in specs.values():  # the Kubernetes model knows every field written
        assert api.sanitize_for_serialization(api._ApiClient__deserialize(copy.deepcopy(spec), "V1PodSpec")) == spec
    return specs


def _mounts(container: dict) -> dict[str, tuple[str, bool]]:
    return {m["name"]: (m["mountPath"], bool(m.get("readOnly"))) for m in container["volumeMounts"]}


@pytest.mark.parametrize("backend", ["PyTorchJob", "JobSet"])
def test_a_readwritemany_output_claim_gives_the_rollout_pods_the_trainers_copy(backend):
    specs = _specs(job_data(backend=backend), shared=True)
    rollout, trainer = specs["rollout"], specs["trainer"]
    assert {"name": "output", "persistentVolumeClaim": {"claimName": "runs"}} in rollout["volumes"]
    assert all("emptyDir" not in v or v["name"] != "sources" for v in rollout["volumes"])
    assert _mounts(rollout["containers"][0])["output"] == ("/output", True)  # the server cannot touch checkpoints
    assert _mounts(rollout["initContainers"][0])["output"] == ("/output", False)  # the download step writes
    assert _mounts(trainer["containers"][0])["output"] == ("/output", False)
    assert "source-cache" not in _mounts(trainer["containers"][0])


def test_without_a_shared_volume_the_rollout_pods_fall_back_to_an_emptydir():
    rollout = _specs(job_data(), shared=False)["rollout"]
    assert {"name": "sources", "emptyDir": {}} in rollout["volumes"]
    assert "output" not in _mounts(rollout["containers"][0])
    assert _mounts(rollout["initContainers"][0])["sources"] == ("/output/sources", False)
    # a user's volume at the output directory is used as it is (no claim of ours, no emptyDir)
    user = _specs(job_data(output={"dir": "/work/out"}, pod={
        "volumes": [{"name": "work", "persistentVolumeClaim": {"claimName": "team"}}],
        "volumeMounts": [{"name": "work", "mountPath": "/work"}]}), shared=True)["rollout"]
    assert [v["name"] for v in user["volumes"] if v["name"] in ("sources", "output", "work")] == ["work"]


@pytest.mark.parametrize("shared", [False, True])
def test_the_source_cache_is_mounted_read_only_but_in_the_download_step(shared):
    specs = _specs(job_data(sourceCache={"claimName": "model-cache"}), shared=shared)
    for role, spec in specs.items():
        assert {"name": "source-cache", "persistentVolumeClaim": {"claimName": "model-cache"}} in spec["volumes"]
        main, init = spec["containers"][0], spec["initContainers"][0]
        assert _mounts(main)["source-cache"] == (SOURCE_CACHE_DIR, True), role
        assert _mounts(init)["source-cache"] == (SOURCE_CACHE_DIR, False), role
        assert init["command"][5:7] == ["--cache", SOURCE_CACHE_DIR]
    # the rollout server reads links into the cache: from its emptyDir, or from the shared claim
    assert ("sources" in _mounts(specs["rollout"]["containers"][0])) is not shared


def test_pods_that_download_nothing_do_not_mount_the_cache():
    specs = _specs(job_data(model={"path": "builtin://tiny-qwen2"}, sourceCache={"claimName": "model-cache"}))
    assert "source-cache" in _mounts(specs["trainer"]["containers"][0])  # its data is in S3
    assert "source-cache" not in _mounts(specs["rollout"]["containers"][0])
    assert "initContainers" not in specs["rollout"]


@pytest.mark.parametrize("spec,error,says", [
    ({"sourceCache": {"claimName": "Model_Cache"}}, JobError, "spec.sourceCache.claimName"),
    ({"sourceCache": {"claimName": "runs"}}, PodSettingsError, "spec.sourceCache.claimName: 'runs' is also "
                                                                "spec.output.claimName"),
    ({"sourceCache": {"claimName": "model-cache"},
      "pod": {"volumes": [{"name": "source-cache", "emptyDir": {}}]}}, PodSettingsError,
     "the name 'source-cache' is taken by spec.sourceCache.claimName"),
])
def test_a_bad_cache_is_refused_naming_the_field(spec, error, says):
    with pytest.raises(error, match=says.replace(".", r"\.")):
        job_settings(validate_job(job_data(**spec)))


class _Claims:
    """The one API read `_output_access` makes: a claim's accessModes (or an API error)."""

    def __init__(self, answer):
        self.answer, self.asked = answer, 0

    def claim_access_modes(self, namespace, name):
        self.asked += 1
        assert (namespace, name) == ("ns", "runs")
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer,shared,cached", [
    (["ReadWriteMany"], True, True), (["ReadWriteOnce"], False, True), (None, False, False),
    (ApiException(status=403, reason="Forbidden"), False, True)])
def test_the_operator_reads_the_output_claims_access_modes_once(answer, shared, cached):
    job = validate_job(job_data())
    kube = _Claims(answer)
    reconciler, cache = Reconciler(kube), JobCache()
    for _ in range(2):
        assert reconciler._output_access(cache, job, job_settings(job), "ns").output_shared is shared
    assert kube.asked == (1 if cached else 2)  # a claim not there yet is asked again
    sft = job_data(method="sft")
    del sft["spec"]["rollout"]
    offline = validate_job(sft)
    assert reconciler._output_access(JobCache(), offline, job_settings(offline), "ns").output_shared is False
    assert kube.asked == (1 if cached else 2)  # no rollout pods: nothing to ask
