"""What a job may ask of the node through its pod settings: an allow-list of volume types,
no root group, no security-profile annotations. Each check is here once, as a pydantic
validator (`rlhfctl validate` names the field) and as the CRD's schema and CEL (the API
server refuses the same at `kubectl apply`).

Why: a user who may create RLHFJobs but not pods must not get, through the operator, what
pod rights would give: the node's filesystem (`hostPath: /`, the container runtime's
socket), any Secret of the namespace mounted as files, root's group. Secrets reach a job
through its named fields (`storageSecret`, `reward.judge.apiKeySecret`,
`tracking.wandb.apiKeySecret`, `pod.env[].valueFrom.secretKeyRef`, `pod.envFrom`).

`hostPath` passes the contract (the CRD cannot know how the operator was installed) and is
refused by the operator's builders unless it runs with `security.allowHostPath`
(`rlhf_operator.builders.pods.PodSettings.from_job(..., allow_host_path=...)`).

Not done here: `nfs` volumes are allowed (a platform team's usual shared storage) although the
`restricted` Pod Security level admits only configMap, csi, downwardAPI, emptyDir, ephemeral,
persistentVolumeClaim, projected and secret volumes; such a job needs a namespace at
`baseline` (or the NFS export as a PersistentVolume behind a claim).
"""

from __future__ import annotations

from typing import Any

HOST_PATH = "hostPath"
ALLOWED_VOLUME_TYPES = ("persistentVolumeClaim", "configMap", "emptyDir", "ephemeral", "csi", "nfs", "downwardAPI",
                        "projected", HOST_PATH)
"""Volume sources `pod.volumes` may use (hostPath only where the operator allows it)."""
PROJECTED_SOURCES = ("configMap", "downwardAPI")
"""Sources a `projected` volume may combine (not secret, serviceAccountToken, clusterTrustBundle)."""
KUBERNETES_VOLUME_TYPES = (
    "awsElasticBlockStore", "azureDisk", "azureFile", "cephfs", "cinder", "configMap", "csi", "downwardAPI",
    "emptyDir", "ephemeral", "fc", "flexVolume", "flocker", "gcePersistentDisk", "gitRepo", "glusterfs", "hostPath",
    "image", "iscsi", "nfs", "persistentVolumeClaim", "photonPersistentDisk", "portworxVolume", "projected",
    "quobyte", "rbd", "scaleIO", "secret", "storageos", "vsphereVolume",
)
"""Every volume source of Kubernetes' core/v1 Volume (1.34)."""
KUBERNETES_PROJECTED_SOURCES = ("clusterTrustBundle", "configMap", "downwardAPI", "podCertificate", "secret",
                                "serviceAccountToken")
REFUSED_VOLUME_TYPES = tuple(t for t in KUBERNETES_VOLUME_TYPES if t not in ALLOWED_VOLUME_TYPES and t != "secret")
MAX_PROJECTED_SOURCES = 16
MAX_POD_VOLUMES = 64
"""Bounds the API server needs to price the CEL rules below (an unbounded list is priced at
what fits in a request, and the CRD is refused)."""

SECRET_MESSAGE = ("secret volumes are not allowed (a job could mount any Secret of its namespace): give credentials "
                  "through the job's Secret fields (storageSecret, reward.judge.apiKeySecret, "
                  "tracking.wandb.apiKeySecret) or pod.env[].valueFrom.secretKeyRef / pod.envFrom")
TYPE_MESSAGE = (f"this volume type is not allowed; use one of {', '.join(ALLOWED_VOLUME_TYPES)} (other storage "
                "through a PersistentVolumeClaim)")
PROJECTED_MESSAGE = (f"projected volumes may combine {' and '.join(PROJECTED_SOURCES)} sources only (not secret, "
                     "serviceAccountToken or clusterTrustBundle: a job's tokens and Secrets come from its own fields)")
GROUP_MESSAGE = "0 is root's group; use a non-zero gid (e.g. 1000, the pods' default)"
PROFILE_ANNOTATIONS = ("container.apparmor.security.beta.kubernetes.io/", "seccomp.security.alpha.kubernetes.io/",
                       "container.seccomp.security.alpha.kubernetes.io/")
"""Annotation keys that set a pod's security profiles: the operator sets those (RuntimeDefault)."""
PROFILE_MESSAGE = (f"annotations under {', '.join(PROFILE_ANNOTATIONS)} set security profiles, which the operator "
                   "sets (RuntimeDefault); remove them")


def volume_problem(volume: dict[str, Any]) -> str | None:
    """What is wrong with one `pod.volumes` entry (None: allowed here), naming its key."""
    for key, value in volume.items():
        if key == "name":
            continue
        if key == "secret":
            return f"secret: {SECRET_MESSAGE}"
        if key not in KUBERNETES_VOLUME_TYPES:
            return f"{key}: not a Kubernetes volume source; use one of {', '.join(ALLOWED_VOLUME_TYPES)}"
        if key not in ALLOWED_VOLUME_TYPES:
            return f"{key}: {TYPE_MESSAGE}"
        if key == "projected":
            sources = (value or {}).get("sources") or [] if isinstance(value, dict) else []
            for i, source in enumerate(sources):
                bad = sorted(set(source or {}) - set(PROJECTED_SOURCES)) if isinstance(source, dict) else ["?"]
                if bad:
                    return f"projected.sources[{i}].{bad[0]}: {PROJECTED_MESSAGE}"
    return None


def check_volume(volume: dict[str, Any]) -> dict[str, Any]:
    """A pydantic validator's body: `volume` unchanged, or ValueError naming the refused key."""
    problem = volume_problem(volume)
    if problem:
        raise ValueError(problem)
    return volume


def check_group(value: Any) -> Any:
    """A pydantic before-validator of a gid (or a list of them): group 0 refused."""
    if type(value) is int and value == 0 or isinstance(value, list) and any(type(v) is int and v == 0 for v in value):
        raise ValueError(GROUP_MESSAGE)
    return value


def check_annotations(value: dict[str, str] | None) -> dict[str, str] | None:
    taken = sorted(k for k in value or {} if k.startswith(PROFILE_ANNOTATIONS))
    if taken:
        raise ValueError(f"{', '.join(taken)}: {PROFILE_MESSAGE}")
    return value


_OPEN = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_PROJECTED_CEL = ("!has(self.projected) || !has(self.projected.sources) || self.projected.sources.all(s, "
                  + " && ".join(f"!has(s.{t})" for t in KUBERNETES_PROJECTED_SOURCES if t not in PROJECTED_SOURCES)
                  + ")")
VOLUME_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    # Every source of Kubernetes' Volume is a declared property, so CEL can see (and refuse)
    # it. A key that is none of them is kept, unseen by CEL (preserved fields are), and refused
    # by the models when `rlhfctl validate` or the operator reads the job.
    "x-kubernetes-preserve-unknown-fields": True,
    "properties": {
        "name": {"type": "string", "minLength": 1},
        **{t: _OPEN for t in KUBERNETES_VOLUME_TYPES if t != "projected"},
        "projected": {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "properties": {  # defaultMode
            "sources": {"type": "array", "maxItems": MAX_PROJECTED_SOURCES, "items": {
                "type": "object", "properties": {s: _OPEN for s in KUBERNETES_PROJECTED_SOURCES}}}}},
    },
    "x-kubernetes-validations": [
        {"rule": "!has(self.secret)", "message": SECRET_MESSAGE},
        {"rule": " && ".join(f"!has(self.{t})" for t in REFUSED_VOLUME_TYPES), "message": TYPE_MESSAGE},
        {"rule": _PROJECTED_CEL, "message": PROJECTED_MESSAGE},
    ],
}
"""The CRD schema of one `pod.volumes` entry."""
ANNOTATIONS_CEL = {"x-kubernetes-validations": [{
    "rule": "self.all(k, " + " && ".join(f"!k.startsWith('{p}')" for p in PROFILE_ANNOTATIONS) + ")",
    "message": PROFILE_MESSAGE}]}
