"""The kopf wiring: what the operator asks the API server to send it."""

from __future__ import annotations

import kopf
from kopf._cogs.structs.references import Resource

from rlhf_operator.builders import LABEL_JOB
from rlhf_operator.handlers import _configure


def test_pod_and_pytorchjob_watches_are_filtered_by_the_api_server():
    settings = kopf.OperatorSettings()
    _configure(settings=settings)
    pods = Resource("", "v1", "pods", kind="Pod", namespaced=True)
    ptjs = Resource("kubeflow.org", "v1", "pytorchjobs", kind="PyTorchJob", namespaced=True)
    jobs = Resource("rlhf.dev", "v1alpha1", "rlhfjobs", kind="RLHFJob", namespaced=True)
    # kopf joins these into the watch's labelSelector (an existence selector: "rlhf.dev/job").
    assert list(settings.watching.label_selectors.collect(pods)) == [LABEL_JOB]
    assert list(settings.watching.label_selectors.collect(ptjs)) == [LABEL_JOB]
    assert list(settings.watching.label_selectors.collect(jobs)) == []
