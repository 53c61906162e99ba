"""A trainer process reports progress with its job's own service-account token (what the
operator gives trainer pods): `kubectl get rlj` shows STEP and REWARD changing, and the
same token cannot write another job's status (the reporter logs it and goes on)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid

import pytest

from rlhf_contract.api import validate_job
from rlhf_operator.builders.access import build_role, build_role_binding, build_service_account

from .harness import Cluster, wait_for
from .test_admission import install_crd

pytestmark = pytest.mark.cluster

TRAINER = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from rlhf_trainer.progress import ApiServer, ProgressReporter
    server, token, ca, ns, name, other = sys.argv[1:7]
    api = ApiServer(url=server, token_file=Path(token), ca_file=Path(ca))
    mine = ProgressReporter(name, ns, 20, api=api, min_interval=0.5)
    theirs = ProgressReporter(other, ns, 20, api=api, min_interval=0.5)
    for step in range(1, 21):  # a 20-step run, one report per step as the run loop makes it
        mine.report(step, reward_mean=step / 20, policy_version=step,
                    last_checkpoint=f"/output/checkpoints/step-{step // 5 * 5}" if step >= 5 else None)
        theirs.report(step, reward_mean=0.0)
        time.sleep(0.15)
    mine.close()
    theirs.close()
    print(json.dumps({"sent": mine.sent, "other_sent": theirs.sent, "other_error": theirs.last_error}))
""")


def job_manifest(name: str) -> dict:
    return {"apiVersion": "rlhf.dev/v1alpha1", "kind": "RLHFJob", "metadata": {"name": name},
            "spec": {"model": {"path": "builtin://tiny-qwen2"}, "data": {"path": "builtin://last-digit"},
                     "schedule": {"totalSteps": 20}}}


def test_trainer_progress_shows_in_kubectl_get_rlj(cluster: Cluster, tmp_path):
    install_crd(cluster)
    ns = f"progress-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", ns)
    try:
        for name in ("mine", "other"):
            cluster.apply({**job_manifest(name), "metadata": {"name": name, "namespace": ns}})
        body = cluster.get("rlhfjob", "mine", namespace=ns)
        job = validate_job({**job_manifest("mine"), "metadata": {"name": "mine", "namespace": ns,
                                                                  "uid": body["metadata"]["uid"]}})
        # The identity the operator gives the job's trainer pods (the same builders).
        cluster.apply(build_service_account(job), build_role(job), build_role_binding(job))
        token = tmp_path / "token"
        token.write_text(cluster.kubectl("create", "token", "mine-trainer", "-n", ns).stdout.strip())

        proc = subprocess.Popen([sys.executable, "-c", TRAINER, cluster.server, str(token),
                                 str(cluster.pki / "ca.crt"), ns, "mine", "other"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        seen = []

        def columns():
            line = cluster.kubectl("get", "rlj", "mine", "-n", ns).stdout.splitlines()[1].split()
            step, reward = line[2], line[3]  # NAME PHASE STEP REWARD RESTARTS AGE (no PHASE yet: <none>)
            if step != "<none>" and (not seen or seen[-1] != (step, reward)):
                seen.append((step, reward))
            return step == "20"
        wait_for(columns, 60, "STEP 20 in `kubectl get rlj`", interval=0.3)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        result = json.loads(out)
        assert len(seen) >= 2 and int(seen[0][0]) < 20, seen  # the columns changed while it ran
        assert seen[-1] == ("20", "1")
        progress = cluster.get("rlhfjob", "mine", namespace=ns)["status"]["progress"]
        assert progress["totalSteps"] == 20 and progress["policyVersion"] == 20
        assert progress["lastCheckpoint"] == "/output/checkpoints/step-20" and progress["updatedTime"].endswith("Z")
        assert 2 <= result["sent"] <= 15  # rate-limited: not one patch per step
        # The same token cannot touch another job; the reporter says so and never raised.
        assert result["other_sent"] == 0 and "HTTP 403" in result["other_error"]
        assert "status" not in cluster.get("rlhfjob", "other", namespace=ns) or \
            not cluster.get("rlhfjob", "other", namespace=ns)["status"].get("progress", {}).get("step")
    finally:
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
