"""Rules of where the rollout servers run (`rollout.placement`), and of what the operator can
build (CLUSTER_RULES: the CRD's CEL and the operator's builders, not what a job means; local
mode runs these jobs)."""

from __future__ import annotations

from typing import Any

from .common import Method
from .rule import Rule

ONLINE_CEL = "(" + " || ".join(f"self.method == '{m}'" for m in Method if not m.offline) + ")"
"""CEL: the job has rollout servers (method rl or distill)."""

COLOCATED_RULES: tuple[Rule, ...] = (
    Rule(
        field_path="rollout.inFlightUpdates",
        cel="!has(self.rollout.inFlightUpdates) || !self.rollout.inFlightUpdates || self.rollout.maxStaleness >= 1",
        message="needs rollout.maxStaleness >= 1: only rollouts generated ahead are in flight when the weights "
        "change (synchronous steps push weights while nothing generates); set maxStaleness, or remove "
        "inFlightUpdates",
        check=lambda s: not s.rollout.in_flight_updates or s.rollout.max_staleness >= 1,
    ),
    Rule(
        field_path="rollout.maxStaleness",
        cel="self.rollout.placement != 'colocated' || self.rollout.maxStaleness == 0",
        message="must be 0 with rollout.placement colocated: colocated servers sleep while the trainer "
        "trains, so nothing is generated ahead; use placement separate to overlap generation and training",
        check=lambda s: s.rollout.placement != "colocated" or s.rollout.max_staleness == 0,
        detail=lambda s: f"got {s.rollout.max_staleness}",
    ),
    Rule(
        field_path="rollout.vllm.kvCacheMemoryBytes",
        cel="self.rollout.placement != 'colocated' || self.rollout.engine != 'vllm' || "
        "(has(self.rollout.vllm) && has(self.rollout.vllm.kvCacheMemoryBytes))",
        message="is required with rollout.placement colocated and engine vllm: the KV cache is set in bytes, "
        "not as what gpuMemoryUtilization leaves, because the trainer's state shares the GPU",
        check=lambda s: (s.rollout.placement != "colocated" or s.rollout.engine != "vllm"
                         or s.rollout.vllm.kv_cache_memory_bytes is not None),
    ),
)

_CLUSTER_RULES: tuple[Rule, ...] = (
    Rule(
        field_path="trainer.numNodes",
        cel="self.rollout.placement != 'colocated' || self.trainer.numNodes == 1",
        message="must be 1 with rollout.placement colocated on a cluster: each trainer pod runs its own rollout "
        "servers on loopback, which only the first pod's trainer rank 0 could reach; use placement separate "
        "for several trainer nodes",
        check=lambda s: s.rollout.placement != "colocated" or s.trainer.num_nodes == 1,
        detail=lambda s: f"got {s.trainer.num_nodes}",
    ),
    Rule(
        field_path="rollout.replicas",
        cel="self.rollout.placement != 'colocated' || "
        "self.rollout.replicas * self.rollout.tensorParallelSize == self.trainer.nprocPerNode",
        message="times rollout.tensorParallelSize must equal trainer.nprocPerNode with rollout.placement colocated "
        "on a cluster: the servers take turns with the trainer on the trainer pod's own GPUs, each server on "
        "tensorParallelSize of them",
        check=lambda s: (s.rollout.placement != "colocated"
                         or s.rollout.replicas * s.rollout.tensor_parallel_size == s.trainer.nproc_per_node),
        detail=lambda s: (f"got {s.rollout.replicas} x {s.rollout.tensor_parallel_size} for "
                          f"{s.trainer.nproc_per_node} GPUs"),
    ),
    Rule(
        field_path="trainer.device",
        cel=f"!has(self.trainer.device) || self.trainer.device != 'cpu' || self.rollout.engine == 'cpu' || !{ONLINE_CEL}",
        message="cpu needs rollout.engine cpu on a cluster: a trainer on CPU cannot send weights to vLLM "
        "servers over NCCL; set rollout.engine: cpu, or trainer.device: gpu",
        check=lambda s: s.trainer.device != "cpu" or s.rollout.engine == "cpu" or s.offline,
    ),
)
"""Rules of what the operator can build (the CRD's CEL and the operator's builders), not of
what a job means: local mode runs these jobs."""

MULTINODE_RULES: tuple[Rule, ...] = (
    Rule(
        field_path="rollout.nodesPerServer",
        cel="self.rollout.tensorParallelSize % self.rollout.nodesPerServer == 0",
        message="must divide rollout.tensorParallelSize: a server's tensor-parallel ranks are spread evenly over "
        "its nodes (GPUs per pod = tensorParallelSize / nodesPerServer)",
        check=lambda s: s.rollout.tensor_parallel_size % s.rollout.nodes_per_server == 0,
        detail=lambda s: f"got {s.rollout.nodes_per_server} for tensorParallelSize {s.rollout.tensor_parallel_size}",
    ),
    Rule(
        field_path="rollout.nodesPerServer",
        cel="self.rollout.nodesPerServer == 1 || (self.rollout.engine == 'vllm' && "
        "self.rollout.placement != 'colocated' && (!has(self.backend) || self.backend != 'JobSet'))",
        message="above 1 needs rollout.engine vllm, rollout.placement separate and spec.backend PyTorchJob or "
        "TrainJob: a multi-node server is a vLLM LeaderWorkerSet group beside the trainer; set nodesPerServer: 1 "
        "otherwise",
        check=lambda s: s.rollout.nodes_per_server == 1 or (
            s.rollout.engine == "vllm" and s.rollout.placement != "colocated" and s.backend != "JobSet"),
        detail=lambda s: f"got engine {s.rollout.engine}, placement {s.rollout.placement}, backend {s.backend}",
    ),
)
"""Rules of `rollout.nodesPerServer` (servers larger than one node: builders/lws.py); cluster
rules, as local mode runs every server as one CPU process."""

AGENT_RULES: tuple[Rule, ...] = (
    Rule(
        field_path="rollout.agent",
        cel="!has(self.rollout.agent) || !has(self.rollout.tools)",
        message="cannot be set with rollout.tools: an episode is either the built-in tool loop (rollout.tools "
        "runs the calls) or an agent program of one's own that calls the endpoint (rollout.agent runs its own "
        "tools); remove one of the two",
        check=lambda s: s.rollout.agent is None or s.rollout.tools is None,
    ),
    Rule(
        field_path="rollout.agent",
        cel="!has(self.rollout.agent) || !has(self.environment)",
        message="cannot be set with spec.environment: an episode is either an agent program's chat completion "
        "calls (rollout.agent, scored by spec.reward) or a step environment's turns; remove one of the two",
        check=lambda s: s.rollout.agent is None or s.environment is None,
    ),
)
"""Rules of `rollout.agent`: one episode driver at a time."""

CLUSTER_RULES: tuple[Rule, ...] = (*_CLUSTER_RULES, *MULTINODE_RULES)


ENV_NCCL_NET = "NCCL_NET"
ENV_NCCL_IB_DISABLE = "NCCL_IB_DISABLE"
NCCL_NET_VALUES = {"socket": "Socket", "ib": "IB"}
"""`rollout.weightSyncNetwork` as NCCL_NET, NCCL's names of its internal networks (its
environment-variable docs; NCCL compares them without case). Pinning the socket interface
does not pin this choice: NCCL uses InfiniBand verbs whenever it finds a device."""


def weight_sync_network_env(network: str) -> dict[str, str]:
    """The NCCL variables `rollout.weightSyncNetwork` sets in the trainer's and the rollout
    servers' pods: none for `auto`; for `socket` also NCCL_IB_DISABLE=1 (NCCL's documented
    switch to IP sockets, for NCCL releases and plugins that read it rather than NCCL_NET)."""
    if network == "auto":
        return {}
    env = {ENV_NCCL_NET: NCCL_NET_VALUES[network]}
    if network == "socket":
        env[ENV_NCCL_IB_DISABLE] = "1"
    return env


def weight_sync_network_conflicts(spec: Any) -> list[tuple[str, str]]:
    """(field path under spec, message) of each `spec.pod.env` entry that contradicts
    `rollout.weightSyncNetwork` (what NCCL would use is then unclear), naming both fields. An
    entry with the same value agrees (the builders then leave theirs out: one name, one
    entry). Checked in Python only (models.py): a CRD rule over pod.env's free-form entries
    would cost the API server too much to estimate."""
    network = spec.rollout.weight_sync_network
    wanted = weight_sync_network_env(network)
    problems = []
    for i, entry in enumerate(spec.pod.env if network != "auto" else ()):
        name, value = entry.get("name"), entry.get("value")
        if name == ENV_NCCL_NET:
            agrees = isinstance(value, str) and value.lower() == wanted[name].lower()
        elif name == ENV_NCCL_IB_DISABLE:  # socket sets it to 1; with ib, 1 would turn InfiniBand off
            agrees = isinstance(value, str) and (value == "1") == (network == "socket")
        else:
            continue
        if not agrees:
            problems.append((f"pod.env[{i}]", f"{name}={value if isinstance(value, str) else '(valueFrom)'} "
                             f"contradicts spec.rollout.weightSyncNetwork: {network}, which sets "
                             f"{', '.join(f'{k}={v}' for k, v in wanted.items())}; remove the pod.env entry, or set "
                             "weightSyncNetwork: auto to choose with pod.env alone"))
    return problems
