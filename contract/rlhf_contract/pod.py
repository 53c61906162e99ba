"""The pod contract: the ONE place that computes each process's command and environment.

The Kubernetes builders put these into pod templates; `rlhfctl run` starts the very same
commands as local processes, with addresses replaced by 127.0.0.1 ports. What runs
locally is therefore what runs in pods.

Environment a trainer process can rely on (besides torchrun's RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, LOCAL_RANK): RLHF_TRAINER_CONFIG (the trainer config,
trainer_config.py), RLHF_ROLLOUT_ENDPOINTS,
RLHF_WEIGHT_SYNC_ADDR, RLHF_OUTPUT_DIR, RLHF_RESUME ("1": continue from the newest
complete checkpoint in the output directory), and RLHF_METRICS_PORT (rank 0 serves
Prometheus metrics on it; unset: no endpoint; every other node's pod answers there with no
step series). Rank 0 also writes the job's `status.progress` with the pod's service-account
token (rlhf_trainer.progress). Beside the trainer config lies `job.json` (JOB_FILE,
`run_config`): the job's name and resolved spec, which rank 0 logs as the trackers' run
config.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .api.models import RLHFJob, RLHFJobSpec
from .api.rules_rollout import (  # noqa: F401  (re-exported: the builders, the trainer's preflight)
    ENV_NCCL_IB_DISABLE, ENV_NCCL_NET, NCCL_NET_VALUES, weight_sync_network_env)
from .api.serving import QUANTIZATION_FLAG
from .redact import redact_spec
from .sources import Fetch, plan_json

ENV_TRAINER_CONFIG = "RLHF_TRAINER_CONFIG"
ENV_ROLLOUT_ENDPOINTS = "RLHF_ROLLOUT_ENDPOINTS"
ENV_WEIGHT_SYNC_ADDR = "RLHF_WEIGHT_SYNC_ADDR"
ENV_OUTPUT_DIR = "RLHF_OUTPUT_DIR"
ENV_RESUME = "RLHF_RESUME"
ENV_METRICS_PORT = "RLHF_METRICS_PORT"
ENV_JUDGE_ENDPOINTS = "RLHF_JUDGE_ENDPOINTS"
"""The job's own judge servers (`reward.judge` without `url`), comma-separated base URLs."""
ENV_JUDGE_API_KEY = "RLHF_JUDGE_API_KEY"
"""The key of a judge at `reward.judge.url` (from `judge.apiKeySecret` in the trainer pods)."""
JUDGE_SERVED_MODEL = "judge"
"""The model name the job's own judge servers answer to (`--served-model-name`)."""
ENV_SUPERVISE = "RLHF_SUPERVISE"
"""A colocated trainer pod's plan (`colocated_trainer_process`): its servers and its trainer,
JSON, read by `python -m rlhf_trainer.supervise`."""
ENV_NCCL_SOCKET_IFNAME = "NCCL_SOCKET_IFNAME"
NCCL_SOCKET_IFNAME = "eth0"
"""The interface NCCL bootstraps on in the operator's pods (trainer and rollout servers
alike): the pod network's, which every CNI names eth0. Unset, each side picks its own
first interface, and on RDMA nodes with secondary networks the two may pick interfaces
that cannot reach each other, so ncclCommInitRank hangs until the sync's deadline. A
`spec.pod.env` entry of that name replaces it (e.g. `net1` for a Multus network)."""

ENV_ATTEMPT = "RLHF_ATTEMPT"
"""A trainer pod's restart attempt (the builders set it from the pod's attempt label by the
downward API). With it and ENV_POD_NAME, the pod's entry program (rlhf_trainer.launch) keeps a
copy of what the trainer prints at `trainer_log_path`, so the log of an attempt outlives its
pods; unset (local mode, which keeps `logs/trainer.log` itself), no copy is made."""
ENV_POD_NAME = "RLHF_POD_NAME"
"""The trainer pod's own name (downward API `metadata.name`)."""


def trainer_log_path(output_dir: str, attempt: int | str, pod: str) -> str:
    """Where a trainer pod of attempt `attempt` keeps its log on the job's volume (what
    `rlhfctl logs --attempt N` points to once the pods are gone)."""
    return f"{output_dir.rstrip('/')}/logs/attempt-{attempt}/{pod}.log"


JOB_FILE = "job.json"
"""Beside the trainer config: `run_config(job)` (what the trackers log as the run's config)."""

ROLLOUT_PORT = 8000
ROLLOUT_STARTUP_PROBE_PERIOD_S = 10
TRAINER_MASTER_PORT = 29500
WEIGHT_SYNC_PORT = 29600
TRAINER_METRICS_PORT = 9400
ROLLOUT_MASTER_PORT = 29501
"""A multi-node rollout server's rendezvous (`vllm serve --master-port`, vLLM's default set
explicitly): its leader listens there, its headless workers connect."""

# The variables the LeaderWorkerSet controller sets in every container of a group (its
# api/leaderworkerset/v1 LwsLeaderAddress, LwsGroupSize, LwsWorkerIndex); Kubernetes expands
# `$(NAME)` in a container's command from them.
LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX = "LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"


def run_config(job: RLHFJob) -> dict:
    """The job's name, namespace and resolved spec (presets applied; camelCase), as others may
    read it (ConfigMap, trackers, model card): env values and URL credentials redacted."""
    return {"name": job.metadata.name, "namespace": job.metadata.namespace,
            "spec": redact_spec(job.to_config()["spec"])}


@dataclass(frozen=True)
class Process:
    """A command and the environment it runs with."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)


LOGPROBS_MODE = "processed_logprobs"
"""The rollout log-probs are those of the distribution the sampler drew from (after the
temperature), as the trainer's log-probs are: the rollout correction (importance weights) and the
`logprob_mismatch` metric then compare like with like at any temperature."""


def serve_command(spec: RLHFJobSpec, *, model_path: str, host: str, port: int, name: str, python: str = "python") -> list[str]:
    """The rollout server's command line: `vllm serve` (the pinned release, images.py) with
    the NCCL weight-transfer engine on GPUs (CUDA IPC when colocated), or the built-in CPU engine
    (`python -m rlhf_inference.cpu_engine`), which speaks the same HTTP protocol.

    Both get `--generation-config vllm`: by default (`auto`) vLLM fills the sampling fields
    a request omits from the model's generation_config.json (e.g. a repetition penalty),
    which would make rollouts differ from what the trainer's log-probs assume.
    tests/protocol/ checks every flag against the pinned release's argument parser."""
    r = spec.rollout
    if r.engine == "cpu":
        return [
            python, "-m", "rlhf_inference.cpu_engine", "--model", model_path, "--host", host,
            "--port", str(port), "--seed", str(spec.schedule.seed), "--served-model-name", name,
            "--generation-config", "vllm", "--logprobs-mode", LOGPROBS_MODE,
            # `auto`: float32, the trainer's master weights (vLLM's `auto` serves a float32
            # checkpoint in bfloat16: tests/vllm checks the explicit choice against it)
            *(["--dtype", spec.model.dtype] if spec.model.dtype != "auto" else []),
            *(["--enable-sleep-mode"] if r.placement == "colocated" else []),
        ]
    return [
        "vllm", "serve", model_path, "--host", host, "--port", str(port),
        "--served-model-name", name,
        "--tensor-parallel-size", str(r.tensor_parallel_size),
        "--dtype", spec.model.dtype,
        "--seed", str(spec.schedule.seed),
        "--max-model-len", str(spec.data.max_prompt_length + r.max_tokens),
        "--generation-config", "vllm",
        # colocated: the servers share the trainer's GPUs, where NCCL refuses a second process
        # on a GPU: they map the trainer's buffers by CUDA IPC (rlhf_trainer/weight_sync/ipc.py)
        "--weight-transfer-config", json.dumps({"backend": "ipc" if r.placement == "colocated" else "nccl"}),
        "--logprobs-mode", LOGPROBS_MODE,
        *(["--enable-sleep-mode"] if r.placement == "colocated" else []),
        *vllm_flags(r.vllm),
    ]


def multinode_flags(spec: RLHFJobSpec, *, leader: bool) -> list[str]:
    """`rollout.nodesPerServer` > 1: the flags that join one pod of a LeaderWorkerSet group into
    one vLLM server (vLLM's multi-node multiprocessing launch, as its LWS recipe): node rank
    `$(LWS_WORKER_INDEX)` of `$(LWS_GROUP_SIZE)`, the rendezvous on the leader; the leader
    (rank 0) serves HTTP, the workers run `--headless` (engine workers, no API server). None
    for a one-node server."""
    if spec.rollout.nodes_per_server == 1:
        return []
    flags = ["--nnodes", f"$({LWS_GROUP_SIZE})", "--node-rank", "0" if leader else f"$({LWS_WORKER_INDEX})",
             "--master-addr", f"$({LWS_LEADER_ADDRESS})", "--master-port", str(ROLLOUT_MASTER_PORT)]
    return flags if leader else [*flags, "--headless"]


def vllm_flags(v) -> list[str]:
    """`rollout.vllm` as `vllm serve` flags (the fields set, then extraArgs as given)."""
    flags = []
    if v.gpu_memory_utilization is not None:
        flags += ["--gpu-memory-utilization", str(v.gpu_memory_utilization)]
    if v.kv_cache_memory_bytes is not None:
        flags += ["--kv-cache-memory-bytes", str(v.kv_cache_memory_bytes)]
    if v.max_num_seqs is not None:
        flags += ["--max-num-seqs", str(v.max_num_seqs)]
    if v.max_num_batched_tokens is not None:
        flags += ["--max-num-batched-tokens", str(v.max_num_batched_tokens)]
    if v.enable_prefix_caching is not None:
        flags.append("--enable-prefix-caching" if v.enable_prefix_caching else "--no-enable-prefix-caching")
    if v.enforce_eager:
        flags.append("--enforce-eager")
    if v.quantization is not None:
        flags += ["--quantization", QUANTIZATION_FLAG[v.quantization]]
    return flags + list(v.extra_args)


def startup_probe_failures(spec: RLHFJobSpec) -> int:
    """failureThreshold of the rollout server's startup probe (period
    ROLLOUT_STARTUP_PROBE_PERIOD_S): it allows `rollout.startupTimeoutSeconds`, the same
    time the trainer waits for the servers."""
    return -(-spec.rollout.startup_timeout_seconds // ROLLOUT_STARTUP_PROBE_PERIOD_S)


def rollout_process(
    job: RLHFJob, *, model_path: str, host: str, port: int, python: str = "python"
) -> Process:
    """One rollout server: vLLM (`vllm serve`) or the CPU engine, per `rollout.engine`."""
    command = serve_command(job.spec, model_path=model_path, host=host, port=port, name=job.metadata.name, python=python)
    env: dict[str, str] = {}
    if job.spec.rollout.engine == "vllm":
        env["VLLM_SERVER_DEV_MODE"] = "1"  # enables the weight-transfer HTTP routes
        if job.spec.rollout.placement == "colocated":
            # vLLM's ipc engine unpickles the trainer's CUDA IPC handles only with this set; the
            # colocated servers listen on 127.0.0.1, where only the pod's own processes reach them
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    return Process(command, env)


def served_judge(spec: RLHFJobSpec):
    """The `reward.judge` the job serves itself (a judge function without `judge.url`), or None.
    A rule (api/rules.py) keeps every such judge to one model."""
    if spec.offline:
        return None
    return next((f.judge for f in spec.reward.functions() if f.type == "judge" and f.judge and not f.judge.url), None)


def judge_process(job: RLHFJob, *, host: str, port: int, python: str = "python") -> Process:
    """One judge server for `served_judge(job.spec)`: `vllm serve` on the rollout servers'
    GPUs per replica, or the CPU engine (`rollout.engine: cpu`), answering to
    JUDGE_SERVED_MODEL. No weight transfer: the judge is frozen."""
    spec, judge = job.spec, served_judge(job.spec)
    if judge is None:
        raise ValueError("the job serves no judge (no reward.judge without judge.url)")
    if spec.rollout.engine == "cpu":
        return Process([python, "-m", "rlhf_inference.cpu_engine", "--model", judge.model, "--host", host,
                        "--port", str(port), "--seed", str(spec.schedule.seed), "--served-model-name",
                        JUDGE_SERVED_MODEL, "--generation-config", "vllm"])
    return Process(["vllm", "serve", judge.model, "--host", host, "--port", str(port),
                    "--served-model-name", JUDGE_SERVED_MODEL,
                    "--tensor-parallel-size", str(spec.rollout.tensor_parallel_size),
                    "--seed", str(spec.schedule.seed), "--generation-config", "vllm"])


def trainer_process(
    job: RLHFJob,
    *,
    config_path: str,
    rollout_endpoints: list[str],
    weight_sync_addr: str,
    output_dir: str,
    master_addr: str | None = None,
    master_port: int | None = None,
    resume: bool = True,
    metrics_port: int | None = None,
    python: str = "python",
) -> Process:
    """One trainer node: `python -m rlhf_trainer.launch` checks the config (exit code 2
    naming the field when it cannot work, before any model loads), then execs torchrun
    with these options, starting `nprocPerNode` processes of `python -m rlhf_trainer`.

    With `master_addr` None (Kubernetes), torchrun takes the rendezvous address and node
    rank from the PET_* variables that the Kubeflow training-operator sets on each pod.
    """
    t = job.spec.trainer
    command = [python, "-m", "rlhf_trainer.launch", f"--nnodes={t.num_nodes}", f"--nproc-per-node={t.nproc_per_node}"]
    if master_addr is not None:
        command += [f"--master-addr={master_addr}", f"--master-port={master_port}", "--node-rank=0"]
    env = {
        ENV_TRAINER_CONFIG: config_path,
        ENV_ROLLOUT_ENDPOINTS: ",".join(rollout_endpoints),
        ENV_WEIGHT_SYNC_ADDR: weight_sync_addr,
        ENV_OUTPUT_DIR: output_dir,
        ENV_RESUME: "1" if resume else "0",
        # torchrun waits this long for its workers after SIGTERM (then SIGKILL): the grace period
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(job.spec.run_policy.termination_grace_period_seconds),
    }
    if metrics_port:
        env[ENV_METRICS_PORT] = str(metrics_port)
    if t.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # on CPU even where the machine has GPUs
    return Process(command, env)


def fetch_process(fetches: list[Fetch], *, restore_uri: str | None = None, output_dir: str | None = None,
                  cache_dir: str | None = None, python: str = "python") -> Process | None:
    """The download step (`python -m rlhf_trainer.storage`, the trainer image): the job's
    `hf://` / `s3://` models and data into its sources directory (rlhf_contract.sources),
    and with `restore_uri` (`output.uri`) the bucket's newest checkpoint into an output
    directory that holds none. With `cache_dir` (`spec.sourceCache`, mounted there) each
    copy is kept once in that cache, by content, and the sources directory links to it.
    Exit 2 names the field and the Secret; None: nothing to do.
    An init container on a cluster; in local mode it runs before anything else starts."""
    if not fetches and not restore_uri:
        return None
    command = [python, "-m", "rlhf_trainer.storage", "--plan", plan_json(fetches)]
    if cache_dir and fetches:
        command += ["--cache", cache_dir]
    if restore_uri:
        command += ["--restore", restore_uri, "--output", output_dir]
    return Process(command, {})


def colocated_servers(spec: RLHFJobSpec) -> list[list[int]]:
    """The GPUs (indices within the pod) of each rollout server of a colocated trainer pod:
    `rollout.replicas` servers of `rollout.tensorParallelSize` GPUs, in order (a cluster rule
    keeps replicas x tensorParallelSize equal to the pod's GPUs, trainer.nprocPerNode)."""
    tp = spec.rollout.tensor_parallel_size
    return [list(range(i * tp, (i + 1) * tp)) for i in range(spec.rollout.replicas)]


def colocated_trainer_process(job: RLHFJob, *, model_path: str, config_path: str, output_dir: str,
                              metrics_port: int | None = None, python: str = "python") -> Process:
    """A colocated trainer pod's command (`rollout.placement: colocated`): `python -m
    rlhf_trainer.supervise`, which starts the pod's rollout servers on loopback, each on its
    own GPUs of the pod, and the trainer node (`trainer_process`, every GPU of the pod), and
    supervises them as one unit (rlhf_trainer/supervise.py)."""
    spec = job.spec
    servers, urls = [], []
    for i, gpus in enumerate(colocated_servers(spec)):
        port = ROLLOUT_PORT + i
        proc = rollout_process(job, model_path=model_path, host="127.0.0.1", port=port, python=python)
        env = {**proc.env, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        servers.append({"name": f"rollout-{i}", "command": proc.command, "env": env})
        urls.append(f"http://127.0.0.1:{port}")
    trainer = trainer_process(job, config_path=config_path, rollout_endpoints=urls,
                              weight_sync_addr=f"127.0.0.1:{WEIGHT_SYNC_PORT}", output_dir=output_dir,
                              master_addr=None, resume=True, metrics_port=metrics_port, python=python)
    plan = {"servers": servers, "trainer": {"command": trainer.command, "env": {}},
            "terminationGracePeriodSeconds": spec.run_policy.termination_grace_period_seconds}
    return Process([python, "-m", "rlhf_trainer.supervise"], {**trainer.env, ENV_SUPERVISE: json.dumps(plan)})
