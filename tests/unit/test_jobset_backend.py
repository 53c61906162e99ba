"""`spec.backend: JobSet`: the JobSet manifest and the status read from a JobSet.

The manifest is also created on the real API server with JobSet's own CRD, webhooks and
controller (tests/cluster/test_jobset.py); here: what is decided from it, without a cluster.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from helpers import fake_pod, job_of
from rlhf_operator.backends import build_children, build_workloads
from rlhf_operator.builders import PodSettings
from rlhf_contract.exit_codes import TABLE, ExitCode
from rlhf_operator.failures import Failure
from rlhf_operator.status import Observed, plan

UID = "uid-js"
NOW = datetime(2026, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def body(status=None, max_restarts=2, suspend=False, method="rl", queue=None):
    meta = {"name": "demo", "namespace": "ns", "uid": UID, "generation": 1,
            "creationTimestamp": (NOW - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if queue:
        meta["labels"] = {"kueue.x-k8s.io/queue-name": queue, "kueue.x-k8s.io/priority-class": "high"}
    spec = {"backend": "JobSet", "method": method, "model": {"path": "/m/tiny"}, "data": {"path": "/d/x.jsonl"},
            "trainer": {"numNodes": 2, "nprocPerNode": 4}, "suspend": suspend,
            "runPolicy": {"maxRestarts": max_restarts},
            "pod": {"volumes": [{"name": "w", "emptyDir": {}}],
                    "volumeMounts": [{"name": "w", "mountPath": p, "subPath": p.strip("/")}
                                     for p in ("/m", "/d", "/output")]}}
    if method == "rl":
        spec["rollout"] = {"replicas": 3}
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": meta, "spec": spec,
            **({"status": status} if status else {})}


def jobset(restarts=0, conditions=(), suspend=False, max_restarts=2):
    return {"kind": "JobSet",
            "metadata": {"name": "demo", "ownerReferences": [{"uid": UID, "controller": True}]},
            "spec": {"suspend": suspend, "failurePolicy": {"maxRestarts": max_restarts}},
            "status": {"restarts": restarts,
                       "conditions": [{"type": t, "status": "True", "reason": r, "message": m}
                                      for t, r, m in conditions]}}


def pod(name, role, attempt=0, phase="Running", exit_code=None):
    return fake_pod(name, {"rlhf.dev/role": role, "rlhf.dev/job-uid": UID,
                           "jobset.sigs.k8s.io/restart-attempt": str(attempt)}, phase=phase, exit_code=exit_code,
                    node="n1")


def all_pods(attempt=0, **failed):
    names = [("demo-rollout-0-0", "rollout"), ("demo-rollout-1-0", "rollout"), ("demo-rollout-2-0", "rollout"),
             ("demo-trainer-0-0", "trainer"), ("demo-trainer-0-1", "trainer")]
    return [pod(f"{n}-x{attempt}", r, attempt, **(failed if n == "demo-trainer-0-1" else {})) for n, r in names]


def run(b, observed):
    return plan(b, job_of(b), observed, NOW)


def test_one_jobset_holds_trainer_and_servers_with_the_budget_and_the_queue_label():
    j = job_of(body(queue="team-a"))
    (js,) = build_workloads(j, 0, PodSettings.from_job(j))
    kinds = [c["kind"] for c in build_children(j, 0)]
    assert "StatefulSet" not in kinds and "PyTorchJob" not in kinds and kinds.count("JobSet") == 1
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"  # Kueue's WorkloadPriorityClass
    rjobs = {r["name"]: r for r in js["spec"]["replicatedJobs"]}
    assert rjobs["trainer"]["replicas"] == 1 and rjobs["trainer"]["template"]["spec"]["parallelism"] == 2
    assert rjobs["rollout"]["replicas"] == 3 and rjobs["rollout"]["template"]["spec"]["parallelism"] == 1
    for r in rjobs.values():
        spec = r["template"]["spec"]
        assert spec["backoffLimit"] == 0 and spec["template"]["spec"]["restartPolicy"] == "Never"
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 2
    assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["trainer"]}
    gpus = rjobs["trainer"]["template"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpus["nvidia.com/gpu"] == "4"
    # the trainer keeps its log under JobSet's attempt (its pods carry no rlhf.dev/attempt)
    env = rjobs["trainer"]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "RLHF_ATTEMPT", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"}}} in env


def test_offline_method_gets_only_the_trainer_job():
    j = job_of(body(method="sft"))
    (js,) = build_workloads(j, 0, PodSettings.from_job(j))
    assert [r["name"] for r in js["spec"]["replicatedJobs"]] == ["trainer"]


@pytest.mark.parametrize("meaning", [m for m in TABLE if m.code != ExitCode.OK], ids=lambda m: m.code.name)
def test_each_exit_code_of_the_table_is_permanent_in_the_jobset_and_the_operator_alike(meaning):
    """rlhf_contract.exit_codes' table decides both: a permanent code is in every Job's
    podFailurePolicy (the JobSet fails at once) and fails the job in the operator's own plan;
    any other code restarts it."""
    j = job_of(body())
    (js,) = build_workloads(j, 0, PodSettings.from_job(j))
    for r in js["spec"]["replicatedJobs"]:
        rule = r["template"]["spec"]["podFailurePolicy"]["rules"][0]
        assert rule["action"] == "FailJob" and rule["onExitCodes"]["operator"] == "In"
        assert (int(meaning.code) in rule["onExitCodes"]["values"]) == meaning.permanent
    assert Failure("p", "trainer", "trainer", int(meaning.code), "Error").permanent == meaning.permanent
    p = run(body(max_restarts=5), Observed(jobset=jobset(), pods=all_pods(phase="Failed", exit_code=int(meaning.code))))
    assert (p.status["phase"] == "Failed") == meaning.permanent, p.status


def test_no_jobset_yet_creates_it():
    p = run(body(), Observed())
    assert p.status["phase"] == "Pending" and p.create_workloads and p.delete == []


def test_running_from_the_pods_of_the_jobsets_attempt():
    p = run(body({"phase": "Pending"}), Observed(jobset=jobset(), pods=all_pods()))
    assert p.status["phase"] == "Running", p.status
    assert "3/3 rollout, 2/2 trainer" in next(c for c in p.status["conditions"] if c["type"] == "Running")["message"]


def test_a_jobset_restart_is_one_restart_of_the_job_naming_the_failed_pod():
    pods = all_pods(0, phase="Failed", exit_code=137) + all_pods(1)[:2]
    p = run(body({"phase": "Running", "restarts": 0}), Observed(jobset=jobset(restarts=1), pods=pods))
    assert p.status["phase"] == "Restarting" and p.status["restarts"] == 1
    msg = next(c for c in p.status["conditions"] if c["type"] == "Restarting")["message"]
    assert "demo-trainer-0-1-x0" in msg and "code 137" in msg and "restart 1 of 2" in msg
    assert p.delete == []  # JobSet recreates its jobs itself
    # the next reconcile: the new attempt's pods decide the phase
    p2 = run(body({"phase": "Restarting", "restarts": 1, "conditions": p.status["conditions"]}),
             Observed(jobset=jobset(restarts=1), pods=all_pods(1)))
    assert p2.status["phase"] == "Running" and p2.status["restarts"] == 1


def test_budget_spent_and_permanent_codes_end_in_failed():
    pods = all_pods(2, phase="Failed", exit_code=1)
    failed = jobset(restarts=2, conditions=[("Failed", "ReachedMaxRestarts", "jobset failed")])
    p = run(body({"phase": "Running", "restarts": 2}), Observed(jobset=failed, pods=pods))
    assert p.status["phase"] == "Failed"
    c = next(c for c in p.status["conditions"] if c["type"] == "Failed")
    assert c["reason"] == "RestartLimitExceeded" and "runPolicy.maxRestarts=2" in c["message"]
    perm = jobset(conditions=[("Failed", "FailJobSetFailurePolicyAction", "rule permanentExitCode")])
    p = run(body({"phase": "Running"}), Observed(jobset=perm, pods=all_pods(0, phase="Failed", exit_code=2)))
    c = next(c for c in p.status["conditions"] if c["type"] == "Failed")
    assert c["reason"] == "PermanentError" and "code 2" in c["message"]


def test_completed_jobset_is_succeeded_and_never_restarted():
    done = jobset(restarts=1, conditions=[("Completed", "AllJobsCompleted", "")])
    p = run(body({"phase": "Running", "restarts": 1}), Observed(jobset=done, pods=all_pods(1, phase="Failed",
                                                                                            exit_code=1)))
    assert p.status["phase"] == "Succeeded" and p.status["restarts"] == 1
    again = run(body(p.status), Observed(jobset=done))
    assert again.status["phase"] == "Succeeded" and not again.create_workloads


@pytest.mark.parametrize("kueue_suspended", [True, False])
def test_suspend_is_the_jobsets_own(kueue_suspended):
    if kueue_suspended:  # Kueue holds the JobSet until admission: Pending, saying why
        p = run(body(), Observed(jobset=jobset(suspend=True)))
        assert p.status["phase"] == "Pending" and not p.status["conditions"]
        assert "admission" in p.events[0].message
    else:
        b = body({"phase": "Running"}, suspend=True)
        p = run(b, Observed(jobset=jobset(), pods=all_pods()))
        assert p.status["phase"] == "Suspended" and p.delete == [] and p.create_workloads
        (js,) = build_workloads(job_of(b), 0, PodSettings.from_job(job_of(b)))
        assert js["spec"]["suspend"] is True


def test_status_announces_the_jobsets_decision_before_it_acts():
    """A pod of the current attempt failed; the JobSet has not restarted yet (its Job and
    JobSet controllers lag): the status already says Restarting (or Failed), as the failure
    policy we wrote will decide, and keeps saying so until the JobSet catches up."""
    pods = all_pods(0, phase="Failed", exit_code=137)
    p = run(body({"phase": "Running", "restarts": 0}), Observed(jobset=jobset(restarts=0), pods=pods))
    assert p.status["phase"] == "Restarting" and p.status["restarts"] == 1 and p.delete == []
    again = run(body(p.status), Observed(jobset=jobset(restarts=0), pods=pods))
    assert again.status["phase"] == "Restarting" and again.status["restarts"] == 1
    caught_up = run(body(p.status), Observed(jobset=jobset(restarts=1), pods=all_pods(1)))
    assert caught_up.status["phase"] == "Running" and caught_up.status["restarts"] == 1
    # budget spent, or a permanent exit code: Failed at once
    spent = run(body({"phase": "Running", "restarts": 2}), Observed(jobset=jobset(restarts=2), pods=all_pods(
        2, phase="Failed", exit_code=1)))
    assert spent.status["phase"] == "Failed" and "no restarts left" in spent.events[0].message
    perm = run(body({"phase": "Running"}), Observed(jobset=jobset(), pods=all_pods(0, phase="Failed", exit_code=127)))
    assert perm.status["phase"] == "Failed" and perm.events[0].reason == "PermanentError"
    # a server stopping after the trainer succeeded is no failure
    done = all_pods(0)
    for p_ in done:
        if p_["metadata"]["labels"]["rlhf.dev/role"] == "trainer":
            p_["status"]["phase"] = "Succeeded"
    done[0]["status"]["phase"] = "Failed"
    assert run(body({"phase": "Running"}), Observed(jobset=jobset(), pods=done)).status["phase"] != "Restarting"


def test_disruptions_restart_the_jobset_without_spending_max_restarts():
    """A pod's DisruptionTarget condition (any Job) and the trainer's exit 143 fail the Job
    through its podFailurePolicy, with the Job controller's message ("Pod ns/x has condition
    DisruptionTarget matching FailJob rule at index 1", "Container c for pod ns/x failed with
    exit code 143 matching FailJob rule at index 2"); the JobSet's first rule matches those
    messages and restarts without spending maxRestarts; permanent codes still fail it."""
    import re

    j = job_of(body())
    (js,) = build_workloads(j, 0, PodSettings.from_job(j))
    first, second = js["spec"]["failurePolicy"]["rules"]
    assert first["action"] == "RestartJobSetAndIgnoreMaxRestarts" and second["action"] == "FailJobSet"
    messages = {}
    for r in js["spec"]["replicatedJobs"]:
        rules = r["template"]["spec"]["podFailurePolicy"]["rules"]
        i = next(i for i, x in enumerate(rules) if x.get("onPodConditions") == [{"type": "DisruptionTarget",
                                                                                   "status": "True"}])
        messages[f"{r['name']} evicted"] = f"Pod ns/x has condition DisruptionTarget matching FailJob rule at index {i}"
        for i, x in enumerate(rules):
            for code in x.get("onExitCodes", {}).get("values", []):
                messages[f"{r['name']} {code}"] = (f"Container {r['name']} for pod ns/x failed with exit code {code} "
                                                   f"matching FailJob rule at index {i}")
    matched = {k for k, m in messages.items() if any(re.search(p, m) for p in first["onJobFailureMessagePatterns"])}
    assert matched == {"trainer evicted", "rollout evicted", "trainer 143"}, messages
    # the operator's plan reads the same pods the same way
    pods = all_pods(phase="Failed", exit_code=143)
    p = run(body({"phase": "Running"}, max_restarts=0), Observed(jobset=jobset(), pods=pods))
    assert p.status["phase"] == "Restarting" and p.status["disruptions"] == 1
    assert next(c for c in p.status["conditions"] if c["type"] == "Restarting")["reason"] == "Disrupted"


def test_a_jobset_pod_still_being_evicted_is_left_to_its_job():
    """The Job controller counts an evicted pod only once it has failed; announcing a restart
    before would wait for one JobSet may never make."""
    pods = all_pods()
    p = pods[-1]
    p["metadata"]["deletionTimestamp"] = "2026-01-01T11:59:00Z"
    p["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"})
    plan_ = run(body({"phase": "Running"}), Observed(jobset=jobset(), pods=pods))
    assert plan_.status["phase"] != "Restarting" and plan_.status["restarts"] == 0
