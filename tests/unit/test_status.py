"""The pure status computation: phases, conditions, restarts and the actions it asks for."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from helpers import fake_pod, job_of
from rlhf_contract.exit_codes import PERMANENT
from rlhf_operator.status import Observed, plan

UID = "uid-1"
NOW = datetime(2025, 1, 1, 12, 0, 0, tzinfo=timezone.utc)


def body(status=None, suspend=False, max_restarts=2, deadline=None, ttl=None, created=NOW - timedelta(minutes=5),
         replacements=0):
    return {
        "apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob",
        "metadata": {"name": "demo", "namespace": "ns", "uid": UID, "generation": 3,
                     "creationTimestamp": created.strftime("%Y-%m-%dT%H:%M:%SZ")},
        "spec": {"model": {"path": "/m"}, "data": {"path": "/d"}, "rollout": {"replicas": 2, "maxServerReplacements": replacements},
                 "trainer": {"numNodes": 1}, "suspend": suspend,
                 "runPolicy": {"maxRestarts": max_restarts, "activeDeadlineSeconds": deadline,
                               "ttlSecondsAfterFinished": ttl}},
        **({"status": status} if status else {}),
    }


def owner(uid=UID):
    return [{"uid": uid, "controller": True, "kind": "RLHFJob", "name": "demo"}]


def workload(kind, attempt, conditions=(), uid=UID):
    return {"kind": kind, "metadata": {"name": "x", "labels": {"rlhf.dev/attempt": str(attempt)},
                                       "ownerReferences": owner(uid)},
            "status": {"conditions": [{"type": t, "status": "True", "reason": t, "message": m} for t, m in conditions]}}


def pod(name, role, attempt=0, phase="Running", ready=True, terminated=None, uid=UID, restarts=0):
    return fake_pod(name, {"rlhf.dev/role": role, "rlhf.dev/attempt": str(attempt), "rlhf.dev/job-uid": uid},
                    phase=phase, ready=ready, exit_code=terminated, restarts=restarts)


def running_children(attempt=0, **trainer):
    return Observed(statefulset=workload("StatefulSet", attempt), pytorchjob=workload("PyTorchJob", attempt),
                    pods=[pod("demo-rollout-0", "rollout", attempt), pod("demo-rollout-1", "rollout", attempt),
                          pod("demo-trainer-master-0", "trainer", attempt, **trainer)])


def run(b, observed, now=NOW):
    return plan(b, job_of(b), observed, now)


def cond(p, type_):
    return next((c for c in p.status["conditions"] if c["type"] == type_), None)


def test_new_job_is_pending_and_creates_everything():
    p = run(body(), Observed())
    assert p.status["phase"] == "Pending" and p.create_workloads and p.apply_support
    assert p.status["observedGeneration"] == 3 and p.status["restarts"] == 0
    assert p.status["progress"] == {"totalSteps": 100}
    assert [(e.type, e.reason) for e in p.events] == [("Normal", "Pending")]


def test_running_once_every_pod_runs_and_servers_are_ready():
    p = run(body({"phase": "Pending"}), running_children())
    assert p.status["phase"] == "Running"
    assert cond(p, "Running")["status"] == "True" and cond(p, "Running")["reason"] == "AllPodsRunning"
    assert "2/2 rollout, 1/1 trainer" in cond(p, "Running")["message"]
    assert p.events[0].reason == "Running" and p.delete == []
    # Not ready servers: Initializing.
    obs = running_children()
    obs.pods[0]["status"]["conditions"][0]["status"] = "False"
    assert run(body({"phase": "Pending"}), obs).status["phase"] == "Initializing"
    # One rollout pod missing: still Pending and creating.
    obs.pods.pop(0)
    p = run(body({"phase": "Pending"}), obs)
    assert p.status["phase"] == "Pending" and p.create_workloads


def test_no_change_means_no_event_and_stable_transition_times():
    first = run(body({"phase": "Pending"}), running_children())
    later = run(body(first.status), running_children(), now=NOW + timedelta(minutes=3))
    assert later.status == first.status and later.events == []


def test_failed_trainer_pod_restarts_the_whole_job():
    b = body({"phase": "Running", "restarts": 0})
    p = run(b, running_children(phase="Failed", terminated=137))
    assert p.status["phase"] == "Restarting" and p.status["restarts"] == 1
    assert sorted(p.delete) == ["PyTorchJob", "StatefulSet"] and not p.create_workloads
    c = cond(p, "Restarting")
    assert c["reason"] == "PodFailed"
    assert "trainer pod demo-trainer-master-0 container c exited with code 137" in c["message"]
    assert "restart 1 of 2" in c["message"]
    assert p.events[0].type == "Warning" and p.events[0].reason == "PodFailed"


def test_restart_waits_until_every_old_pod_is_gone_then_creates_the_next_attempt():
    status = {"phase": "Restarting", "restarts": 1,
              "conditions": [{"type": "Restarting", "status": "True", "reason": "PodFailed", "message": "m"}]}
    # Old workloads still there: delete them, create nothing.
    p = run(body(status), running_children(attempt=0))
    assert p.status["phase"] == "Restarting" and sorted(p.delete) == ["PyTorchJob", "StatefulSet"]
    assert not p.create_workloads and p.status["restarts"] == 1
    # Workloads gone but a pod of attempt 0 is still terminating: wait.
    leftover = Observed(pods=[pod("demo-rollout-0", "rollout", 0)])
    p = run(body(status), leftover)
    assert p.status["phase"] == "Restarting" and not p.create_workloads and p.delete == []
    # A failure of the old attempt does not count against the new one.
    leftover.pods[0]["status"]["phase"] = "Failed"
    assert run(body(status), leftover).status["restarts"] == 1
    # Nothing left: create attempt 1.
    p = run(body(status), Observed())
    assert p.create_workloads and p.status["phase"] == "Pending"
    assert cond(p, "Restarting")["status"] == "False" and cond(p, "Restarting")["reason"] == "Restarted"
    assert cond(p, "Restarting")["message"] == "new pods created after: m"


def test_failed_rollout_server_restarts_too_any_exit_or_restart_counts():
    b = body({"phase": "Running"})
    obs = running_children()
    obs.pods[1] = pod("demo-rollout-1", "rollout", restarts=1)
    p = run(b, obs)
    assert p.status["phase"] == "Restarting" and "rollout pod demo-rollout-1" in cond(p, "Restarting")["message"]


def test_with_server_replacements_a_restarted_rollout_container_is_left_to_the_kubelet():
    """rollout.maxServerReplacements > 0: the trainer re-joins a restarted server (its own budget);
    a permanent exit code, an eviction or a failed trainer still end the attempt."""
    obs = running_children()
    obs.pods[1] = pod("demo-rollout-1", "rollout", restarts=1)
    p = run(body({"phase": "Running"}, replacements=3), obs)
    assert p.status["phase"] == "Running" and p.delete == [] and p.status.get("restarts", 0) == 0
    obs.pods[1] = pod("demo-rollout-1", "rollout", terminated=137, restarts=2)  # CrashLoopBackOff's last exit
    assert run(body({"phase": "Running"}, replacements=3), obs).status["phase"] == "Running"
    obs.pods[1] = pod("demo-rollout-1", "rollout", terminated=next(iter(PERMANENT)))
    assert run(body({"phase": "Running"}, replacements=3), obs).status["phase"] == "Failed"
    obs.pods[1] = evicted(pod("demo-rollout-1", "rollout", restarts=1))
    assert run(body({"phase": "Running"}, replacements=3), obs).status["phase"] == "Restarting"
    obs.pods[1] = pod("demo-rollout-1", "rollout", restarts=1)
    obs.pods[2] = pod("demo-trainer-master-0", "trainer", phase="Failed", terminated=75)
    p = run(body({"phase": "Running"}, replacements=3), obs)
    assert p.status["phase"] == "Restarting" and "demo-trainer-master-0" in cond(p, "Restarting")["message"]


def test_restart_budget_ends_in_failed_naming_pod_and_exit_code():
    b = body({"phase": "Running", "restarts": 2}, max_restarts=2)
    p = run(b, running_children(attempt=2, phase="Failed", terminated=1))
    assert p.status["phase"] == "Failed" and p.status["restarts"] == 2
    c = cond(p, "Failed")
    assert c["reason"] == "RestartLimitExceeded"
    assert "demo-trainer-master-0" in c["message"] and "code 1" in c["message"] and "maxRestarts=2" in c["message"]
    # The failed trainer's PyTorchJob stays for its logs; the rollout servers go.
    assert p.delete == ["StatefulSet"]
    assert p.events[0].type == "Warning" and p.events[0].reason == "RestartLimitExceeded"


def test_permanent_exit_code_fails_at_once():
    assert 2 in PERMANENT
    p = run(body({"phase": "Running"}, max_restarts=5), running_children(phase="Failed", terminated=2))
    assert p.status["phase"] == "Failed" and p.status["restarts"] == 0
    assert cond(p, "Failed")["reason"] == "PermanentError"
    assert "exited with code 2 (invalid job config" in cond(p, "Failed")["message"]


def test_terminal_job_is_never_brought_back():
    failed = run(body({"phase": "Running", "restarts": 2}), running_children(2, phase="Failed", terminated=1)).status
    for observed in (Observed(), running_children(2)):
        p = run(body(failed), observed, now=NOW + timedelta(seconds=5))
        assert p.status["phase"] == "Failed" and not p.create_workloads and not p.apply_support
        assert p.events == []
    # An unfinished PyTorchJob goes after the grace period; the StatefulSet at once.
    assert run(body(failed), running_children(2), now=NOW + timedelta(seconds=5)).delete == ["StatefulSet"]
    assert sorted(run(body(failed), running_children(2), now=NOW + timedelta(minutes=5)).delete) == [
        "PyTorchJob", "StatefulSet"]


def test_succeeded_when_the_trainer_succeeds_then_ttl_deletes_the_job():
    running = run(body({"phase": "Pending"}, ttl=60), running_children()).status
    obs = running_children()
    obs.pytorchjob = workload("PyTorchJob", 0, [("Succeeded", "done")])
    p = run(body(running, ttl=60), obs)
    assert p.status["phase"] == "Succeeded" and p.delete == ["StatefulSet"]
    assert cond(p, "Succeeded")["status"] == "True" and cond(p, "Running")["status"] == "False"
    assert not run(body(p.status, ttl=60), Observed(), now=NOW + timedelta(seconds=59)).delete_job
    assert run(body(p.status, ttl=60), Observed(), now=NOW + timedelta(seconds=60)).delete_job


def test_suspend_deletes_workloads_and_resume_recreates_them():
    p = run(body({"phase": "Running"}, suspend=True), running_children())
    assert p.status["phase"] == "Suspended" and sorted(p.delete) == ["PyTorchJob", "StatefulSet"]
    assert not p.create_workloads and p.apply_support
    assert cond(p, "Suspended")["status"] == "True"
    later = NOW + timedelta(minutes=1)
    p2 = run(body(p.status), Observed(), now=later)
    assert p2.status["phase"] == "Pending" and p2.create_workloads and p2.status["restarts"] == 0
    assert cond(p2, "Suspended") == {"type": "Suspended", "status": "False", "reason": "Resumed",
                                     "message": cond(p2, "Suspended")["message"],
                                     "lastTransitionTime": "2025-01-01T12:01:00Z", "observedGeneration": 3}
    # the status as the API conventions and `kubectl get -o wide` want it
    assert p2.status["message"]  # why it is in its phase (-o wide shows it)
    assert p2.status["startTime"] == "2025-01-01T12:01:00Z"  # pods first asked for on resume here
    assert "completionTime" not in p2.status


def test_start_and_completion_times_are_set_once_and_kept():
    p = run(body({"phase": "Pending"}), Observed())
    assert p.create_workloads and p.status["startTime"] == "2025-01-01T12:00:00Z"
    later = NOW + timedelta(hours=1)
    running = run(body(p.status), running_children(), now=later).status
    assert running["startTime"] == "2025-01-01T12:00:00Z" and "completionTime" not in running
    obs = running_children()
    obs.pytorchjob = workload("PyTorchJob", 0, [("Succeeded", "done")])
    done = run(body(running), obs, now=later + timedelta(minutes=5)).status
    assert done["phase"] == "Succeeded" and done["completionTime"] == "2025-01-01T13:05:00Z"
    again = run(body(done), Observed(), now=later + timedelta(hours=2)).status
    assert again["completionTime"] == "2025-01-01T13:05:00Z" and again["startTime"] == "2025-01-01T12:00:00Z"
    assert all(c["reason"] and c["lastTransitionTime"] for c in again["conditions"])


def test_active_deadline_counts_from_creation_or_resume():
    b = body({"phase": "Running"}, deadline=600, created=NOW - timedelta(seconds=601))
    p = run(b, running_children())
    assert p.status["phase"] == "Failed" and cond(p, "Failed")["reason"] == "DeadlineExceeded"
    resumed = {"phase": "Running", "conditions": [
        {"type": "Suspended", "status": "False", "reason": "Resumed", "message": "",
         "lastTransitionTime": (NOW - timedelta(seconds=100)).strftime("%Y-%m-%dT%H:%M:%SZ")}]}
    assert run(body(resumed, deadline=600, created=NOW - timedelta(hours=2)), running_children()).status["phase"] == "Running"


def test_pods_of_an_earlier_job_with_the_same_name_are_waited_out():
    obs = Observed(pods=[pod("demo-rollout-0", "rollout", uid="old-uid")])
    p = run(body(), obs)
    assert p.status["phase"] == "Pending" and not p.create_workloads
    obs.statefulset = workload("StatefulSet", 0, uid="old-uid")
    assert run(body(), obs).delete == ["StatefulSet"]


def test_invalid_spec_fails_with_the_reason():
    p = plan(body(), None, Observed(), NOW, invalid="spec.rollout.replicas: must be >= 1")
    assert p.status["phase"] == "Failed" and cond(p, "Failed")["reason"] == "InvalidSpec"
    assert "spec.rollout.replicas" in cond(p, "Failed")["message"]


def test_pytorchjob_failure_waits_briefly_for_the_pods_exit_code():
    """The training-operator deletes a failed trainer pod at once; the PyTorchJob's Failed
    condition alone counts only after a grace period (the exit code may still arrive)."""
    obs = running_children()
    obs.pods = obs.pods[:2]  # the failed trainer pod is already gone
    obs.pytorchjob = workload("PyTorchJob", 0, [("Failed", "backoff limit")])
    obs.pytorchjob["status"]["conditions"][0]["lastTransitionTime"] = "2025-01-01T12:00:00Z"
    b = body({"phase": "Running"})
    assert run(b, obs, now=NOW + timedelta(seconds=5)).status["restarts"] == 0
    p = run(b, obs, now=NOW + timedelta(seconds=11))
    assert p.status["phase"] == "Restarting" and p.status["restarts"] == 1
    assert "backoff limit" in cond(p, "Restarting")["message"]


def test_succeeded_dominates_a_rollout_server_failing_as_the_trainer_exits():
    running = run(body({"phase": "Pending"}), running_children()).status
    # The PyTorchJob Succeeded and a rollout server died at the same moment: Succeeded.
    obs = running_children()
    obs.pytorchjob = workload("PyTorchJob", 0, [("Succeeded", "done")])
    obs.pods[0] = pod("demo-rollout-0", "rollout", phase="Failed", terminated=1)
    p = run(body(running), obs)
    assert p.status["phase"] == "Succeeded" and p.status["restarts"] == 0 and p.delete == ["StatefulSet"]
    # The trainer pod finished but its PyTorchJob is not marked yet: no restart either.
    obs = running_children(phase="Succeeded")
    obs.pods[0] = pod("demo-rollout-0", "rollout", phase="Failed", terminated=1)
    p = run(body(running), obs)
    assert p.status["phase"] != "Restarting" and p.status["restarts"] == 0 and p.delete == []
    # ...while before the trainer finished, the same server failure restarts the job.
    obs.pods[2] = pod("demo-trainer-master-0", "trainer")
    assert run(body(running), obs).status["phase"] == "Restarting"


def test_pods_of_a_lost_node_fail_the_attempt_after_the_grace_period():
    running = run(body({"phase": "Pending"}), running_children()).status
    obs = running_children()
    obs.nodes_not_ready = {"node-1": NOW - timedelta(seconds=30)}
    grace = timedelta(seconds=60)
    # Not Ready for 30 s: still running as far as the job is concerned.
    assert plan(body(running), job_of(body(running)), obs, NOW, node_lost_after=grace).status["restarts"] == 0
    p = plan(body(running), job_of(body(running)), obs, NOW + timedelta(seconds=31), node_lost_after=grace)
    assert p.status["phase"] == "Restarting" and p.status["restarts"] == 1
    assert "NodeLost" in cond(p, "Restarting")["message"] and "node node-1 not Ready" in cond(p, "Restarting")["message"]
    assert p.force_delete == []  # nothing is being deleted yet


def test_terminating_pods_of_a_lost_node_are_force_deleted_so_the_restart_completes():
    status = {"phase": "Restarting", "restarts": 1,
              "conditions": [{"type": "Restarting", "status": "True", "reason": "PodFailed", "message": "m"}]}
    stuck = [pod("demo-rollout-0", "rollout", 0), pod("demo-trainer-master-0", "trainer", 0)]
    for p in stuck:
        p["metadata"]["deletionTimestamp"] = "2025-01-01T11:59:00Z"
    stuck[1]["spec"]["nodeName"] = "node-2"  # on a healthy node: the kubelet will finish it
    obs = Observed(pods=stuck, nodes_not_ready={"node-1": NOW - timedelta(minutes=2)})
    p = run(body(status), obs)
    assert p.force_delete == ["demo-rollout-0"] and not p.create_workloads
    # Once they are gone, the next attempt is created.
    assert run(body(status), Observed()).create_workloads


def offline_body(method="sft", **kw):
    b = body(**kw)
    b["spec"].pop("rollout")
    b["spec"]["method"] = method
    return b


def test_offline_job_runs_with_its_trainer_alone():
    # sft / rm / dpo: the PyTorchJob and its pods are the whole job; no StatefulSet is awaited
    p = run(offline_body(), Observed(pytorchjob=workload("PyTorchJob", 0),
                                     pods=[pod("demo-trainer-master-0", "trainer", 0)]))
    assert p.status["phase"] == "Running", p.status
    assert cond(p, "Running")["message"] == "1/1 trainer running"
    # the same observation for an RL job is still waiting for its rollout servers
    assert run(body(), Observed(pytorchjob=workload("PyTorchJob", 0),
                                pods=[pod("demo-trainer-master-0", "trainer", 0)])).status["phase"] == "Pending"


def test_offline_job_succeeds_with_its_trainer():
    done = Observed(pytorchjob=workload("PyTorchJob", 0, [("Succeeded", "done")]),
                    pods=[pod("demo-trainer-master-0", "trainer", 0, phase="Succeeded")])
    assert run(offline_body("dpo", status={"phase": "Running"}), done).status["phase"] == "Succeeded"


def evicted(p, reason="EvictionByEvictionAPI"):
    p["status"]["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": reason})
    return p


def test_disruptions_restart_the_job_without_spending_max_restarts():
    """A drained node's eviction, a preemption, a lost node and the trainer's own exit 143
    after SIGTERM each restart the job; none spends runPolicy.maxRestarts (JobSet's
    RestartJobSetAndIgnoreMaxRestarts), an ordinary failure after them still does."""
    status = {"phase": "Running", "restarts": 1}  # budget of 1, already spent
    obs = running_children(attempt=1, phase="Failed", terminated=137)
    evicted(obs.pods[2], "PreemptionByScheduler")
    p = run(body(status, max_restarts=1), obs)
    assert p.status["phase"] == "Restarting" and p.status["restarts"] == 2 and p.status["disruptions"] == 1
    c = cond(p, "Restarting")
    assert c["reason"] == "Disrupted" and "DisruptionTarget: PreemptionByScheduler" in c["message"]
    assert "not counted against runPolicy.maxRestarts (1 of 1 spent): restart 2" in c["message"]
    assert p.events[0].reason == "Disrupted" and sorted(p.delete) == ["PyTorchJob", "StatefulSet"]
    # a rollout server evicted by a drain, then the trainer stopped by SIGTERM (exit 143)
    status = {**p.status, "phase": "Running"}
    obs = running_children(attempt=2)
    evicted(obs.pods[0])
    obs.pods[0]["status"]["containerStatuses"][0]["state"] = {"terminated": {"exitCode": 0, "reason": "Completed"}}
    p = run(body(status, max_restarts=1), obs)
    assert (p.status["restarts"], p.status["disruptions"], p.status["phase"]) == (3, 2, "Restarting")
    status = {**p.status, "phase": "Running"}
    p = run(body(status, max_restarts=1), running_children(attempt=3, phase="Failed", terminated=143))
    assert (p.status["restarts"], p.status["disruptions"], cond(p, "Restarting")["reason"]) == (4, 3, "Disrupted")
    # an ordinary failure: the budget (1, spent before the disruptions) is gone
    status = {**p.status, "phase": "Running"}
    p = run(body(status, max_restarts=1), running_children(attempt=4, phase="Failed", terminated=1))
    assert p.status["phase"] == "Failed" and cond(p, "Failed")["reason"] == "RestartLimitExceeded"
    assert p.status["disruptions"] == 3


def test_an_ordinary_failure_counts_restarts_net_of_disruptions():
    status = {"phase": "Running", "restarts": 3, "disruptions": 2}
    p = run(body(status, max_restarts=2), running_children(attempt=3, phase="Failed", terminated=1))
    assert p.status["phase"] == "Restarting" and "restart 2 of 2" in cond(p, "Restarting")["message"]
    assert (p.status["restarts"], p.status["disruptions"]) == (4, 2)


def test_child_refused_turns_true_with_the_message_and_false_once_accepted():
    from rlhf_operator.conditions import refused_condition

    conds = {}
    assert not refused_condition(conds, None, NOW)  # never refused: no condition at all
    assert conds == {}
    assert refused_condition(conds, "StatefulSet x refused by the API server: bad volume", NOW, 3)
    assert conds["ChildRefused"]["status"] == "True" and conds["ChildRefused"]["message"].endswith("bad volume")
    assert not refused_condition(conds, "StatefulSet x refused by the API server: bad volume", NOW + timedelta(1), 3)
    assert refused_condition(conds, None, NOW + timedelta(seconds=5), 3)
    assert (conds["ChildRefused"]["status"], conds["ChildRefused"]["reason"]) == ("False", "Accepted")
    # the plan keeps it in the status from then on
    p = run(body({"phase": "Running", "conditions": list(conds.values())}), running_children())
    assert cond(p, "ChildRefused") == conds["ChildRefused"]


def test_a_pod_being_evicted_ends_the_attempt_before_it_is_gone():
    """The Eviction API (a drain) marks the pod DisruptionTarget and deletes it: the StatefulSet
    would quietly replace a server, so the condition alone restarts the job, unbilled."""
    obs = running_children()
    obs.pods[1]["metadata"]["deletionTimestamp"] = "2025-01-01T11:59:59Z"
    evicted(obs.pods[1])["status"]["conditions"][-1]["message"] = "Eviction API: evicting"
    p = run(body({"phase": "Running"}, max_restarts=0), obs)
    assert p.status["phase"] == "Restarting" and p.status["disruptions"] == 1
    msg = cond(p, "Restarting")["message"]
    assert "rollout pod demo-rollout-1 failed [DisruptionTarget: EvictionByEvictionAPI]: Eviction API" in msg
