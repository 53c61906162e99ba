"""A GPU memory plan of a job, before anything loads: per-GPU bytes of each thing the
trainer holds, the peak, whether it fits, and the largest `trainer.maxTokensPerMicroBatch`
that would.

`plan(config, model_config, world_size, gpu_bytes)` is a pure function of the job (the
trainer config, the model's config.json, the number of trainer processes, the memory of
one GPU). The peak is

    fixed + (1 + FRAGMENTATION) x max over phases of (persistent + phase)

where `fixed` is what lives outside torch's caching allocator (the CUDA context and every
NCCL communicator rank 0 joins: memory_runtime.py) and the phases are one micro-batch's
forward and backward, the optimizer step and the weight sync (rank 0). Loading adds no phase: the sharded models stream in shard by shard,
the critic and score models a layer at a time.

What the plan assumes the code does (read from the code, keep it in step):

- Layout (parallel/parallelize.py): FSDP2 `fully_shard` per decoder layer and on the root
  over `dp_shard_cp` (data x context ranks); tensor parallelism (tensor_parallel.py)
  splits every decoder linear and the embedding and head over `tp`, norms are replicated.
  So a parameter's bytes are divided by dp x cp, and by tp when TP splits it.
- Policy (models/loading.py): fp32 master weights, fp32 AdamW state (exp_avg,
  exp_avg_sq: 8 bytes per trained parameter), and gradients ASSUMED reduce-scattered
  every micro-batch: fp32 and sharded. On CUDA the MixedPrecisionPolicy computes in bf16:
  FSDP holds unsharded bf16 copies of the root (embedding, head, final norm: FSDP2 does
  not reshard the root after forward, so they live through forward and backward), of the
  current layer and the prefetched one, and in backward one layer's unsharded bf16
  gradients and their fp32 copy for the fp32 reduce-scatter, plus the head's unsharded
  bf16 gradient (reduced with the root, at the end of backward).
- LoRA (models/lora.py): the base stays in fp32 (frozen, sharded), only adapters have
  gradients and AdamW state; the reference is the base with the adapters off (no copy).
- Reference model (TrainerConfig.reference_model; a distill job's teacher alike): a second
  copy in bf16, sharded like the policy, no gradients; its forward runs under no_grad,
  before the micro-batches, so its working set (two unsharded bf16 layers and the head's
  chunk) never adds to the policy's activations.
- Critic (`algorithm.critic`, rl/models.py): a copy of the decoder that trains like the
  policy (fp32 + fp32 gradients + AdamW, sharded), checkpointed when the policy is
  (parallelize_models), run after the policy's backward in each micro-batch, so the
  activation peak is the larger of the two. Read on the host and moved to the GPU a layer
  at a time by FSDP2 as it shards it (models/loading.py `host_until_sharded`): no load
  peak beyond one layer.
- Reward model (`reward.model`, models/score.py): bf16 on GPUs, read on the host and
  sharded like the critic; scored without gradients.
- Activations: MEASURED per decoder layer for this model's shapes: the real Hugging Face
  model (one and two layers, real hidden / intermediate / head sizes) with the trainer's
  attention (`apply_cp(model, None)`: per-document SDPA from explicit boundaries), run
  under FakeTensorMode (no memory) in the training dtype at `MEASURE_TOKENS` tokens of two
  documents, counting the storages saved for backward (`saved_tensors_hooks`, parameters
  excluded, storages deduplicated); the two-layer minus the one-layer figure is one
  layer's, the rest is the embedding's and rotary's. With activation checkpointing each
  layer keeps its input (the residual stream, [tokens, hidden]) and ONE layer's saved set
  exists during its recompute. Backward adds a working set of its own (the gradients of a
  layer's largest intermediates): `BACKWARD_WORKING_FACTOR` x one layer's saved set,
  calibrated against the allocator's measured peak (tests/unit/test_memory_plan.py).
  Tokens per GPU are maxTokensPerMicroBatch / contextParallel. Context parallelism
  (context_parallel.py) adds per layer, computed not measured: the whole row's gathered K
  and V, which attention saves for backward (no mask: the attention takes the documents'
  segments).
- Log-prob head (models/logprob_head.py): one chunk of HEAD_CHUNK_TOKENS x vocab / tp in
  fp32, `HEAD_LIVE_CHUNKS` such tensors live at its peak (the logits, the scaled
  logits, the softmax and the gradients of the recompute), plus the final hidden states
  and their gradient ([tokens, hidden] each).
- Weight sync (weight_sync/sender.py, buckets.py): on rank 0, between steps, when no
  activation is alive: the pack buffers and the largest tensor gathered whole
  (memory_runtime.py `weight_sync_bytes`).
- Optimizer step (optim.py): fused AdamW on CUDA, no temporary worth planning; the
  foreach AdamW elsewhere makes one of the size of the shard's exp_avg_sq (fp32).
- Fixed: the CUDA context and cuBLAS workspaces, and 1 GiB per NCCL communicator rank 0
  joins (memory_runtime.py, with the sources of both figures); `FRAGMENTATION` (17 %) of
  everything else for the caching allocator (measured on an H200: see FRAGMENTATION).

The engine's state (weights, gradients, optimizer, frozen models, buffers) is asked of the
engine (`Engine.planned_state`): the above is FSDP2's; DeepSpeed's is ZeRO's from its config.

Not planned: pipeline parallelism (none exists), the rollout servers' GPUs (vLLM
plans its own with `rollout.vllm.gpuMemoryUtilization`), host memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from rlhf_contract.api.models import Method

from .memory_shapes import (  # noqa: F401  (activations, activation_bytes, model_shape: the plan's API too)
    GIB, dtype_of, hf_config, layer_per_tp_rank, activation_bytes, activations, model_shape)

from .memory_runtime import (  # noqa: F401  (the plan's API too)
    CUDA_CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES, WEIGHT_SYNC_BUFFERS, nccl_communicators, weight_sync_bytes)

FRAGMENTATION = 0.17
"""Share of the planned bytes added for the caching allocator's cache and fragmentation.
Measured on an H200 (torch 2.11, CUDA 13; `make gpu-check`, 2026-11-26): the plan's bytes
before this margin were within 1 % of `max_memory_allocated` at five shapes (Qwen2 0.5B at
4k, 8k, 16k tokens per micro-batch, 1.5B at 4k and 16k), and `max_memory_reserved` was
9.8 % to 15.4 % above `max_memory_allocated` (more at the smaller micro-batches). 10 % missed
three of the five; 17 % covers all five by 1.5 % to 7 %."""
HEAD_LIVE_CHUNKS = 5
"""fp32 [chunk, vocab / tp] tensors live at the log-prob head's peak (recompute + backward of
one chunk: scaled logits, softmax, their product, and two gradients); measured in the test."""
TOKEN_STEP = 512
"""maxTokensPerMicroBatch suggestions are multiples of this."""


@dataclass(frozen=True)
class Term:
    """Per-GPU bytes of one thing the trainer holds."""

    name: str
    bytes: int
    phase: str
    """`fixed` (outside the caching allocator), `persistent`, or the phase it exists in:
    `micro-batch`, `optimizer step`, `weight sync`."""
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    terms: tuple[Term, ...]
    gpu_bytes: int
    activation_checkpointing: bool
    """The setting planned (the resolved default when the spec leaves it unset)."""
    checkpointing_decided: bool
    """The spec leaves activationCheckpointing unset: the plan chose it."""
    tokens: int
    """trainer.maxTokensPerMicroBatch planned."""
    peak_phase: str
    total: int
    max_tokens: int | None = None
    """Largest multiple of TOKEN_STEP that fits with the planned checkpointing (None: none)."""
    max_tokens_checkpointed: int | None = None
    """The same with activation checkpointing on."""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fixed(self) -> int:
        """Bytes outside the caching allocator (CUDA context, NCCL communicators)."""
        return sum(t.bytes for t in self.terms if t.phase == "fixed")

    @property
    def fits(self) -> bool:
        return self.total <= self.gpu_bytes

    def message(self) -> str:
        """The preflight problem when it does not fit ("" when it does)."""
        if self.fits:
            return ""
        fixes = []
        if not self.activation_checkpointing and self.max_tokens_checkpointed is not None:
            on = self.max_tokens_checkpointed
            fixes.append("set trainer.parallelism.activationCheckpointing: true"
                         + ("" if on >= self.tokens else f" with trainer.maxTokensPerMicroBatch <= {on}"))
        if self.max_tokens is not None:
            fixes.append(f"trainer.maxTokensPerMicroBatch <= {self.max_tokens}")
        if not fixes:
            fixes.append("more GPUs (trainer.numNodes x trainer.nprocPerNode), model.lora, or a smaller model: "
                         "the weights and optimizer state alone do not fit")
        return (f"spec.trainer: the plan needs {self.total / GIB:.1f} GiB per GPU of {self.gpu_bytes / GIB:.1f}: "
                + ", or ".join(fixes) + " (rlhfctl plan job.yaml shows the plan)")


# ---- the plan -------------------------------------------------------------------------

def _terms(config, model_config: dict, world_size: int, *, tokens: int, checkpointing: bool, dtype: str,
           reward_model_config: dict | None, cuda: bool) -> list[Term]:
    p = config.optim.parallelism
    tp, cp = p.tensor_parallel, p.context_parallel
    shard = max(world_size // tp, 1)  # FSDP's dp_shard x cp
    lora = config.lora
    s = model_shape(model_config, lora)
    causal = Method(config.method).facts.lm_head  # else a score model: a one-label score head
    layer_tp = layer_per_tp_rank(s, tp)
    params_local = (s.num_layers * layer_tp + s.root_tp(tp, head=causal) + s.root_trainable) / shard
    trained_local = params_local if lora is None else (s.num_layers * s.layer_trainable + s.root_trainable) / shard
    size = dtype_of(dtype).itemsize
    local_tokens = -(-tokens // cp)
    from ..engine import engine_type

    engine = engine_type(config.optim)
    state = engine.planned_state(config.optim, params=params_local, trained=trained_local, shard=shard, cuda=cuda)
    where = f"{s.total(head=causal) / 1e9:.2f} B parameters / {shard} ranks" + (f" / tp {tp}" if tp > 1 else "")
    terms = [Term(name, b, "persistent", note or where) for name, b, note in state.trained]
    frozen, frozen_kind = state.frozen_bytes, "bf16" if cuda else "fp32"
    per_frozen_rank = shard // state.frozen_shard  # 1 when frozen models shard like the policy
    reference = config.reference_model()
    if reference is not None and reference.copy and not reference.teacher:
        terms.append(Term("reference model", int(frozen * params_local * per_frozen_rank), "persistent",
                          f"{frozen_kind}, laid out like the policy"))
    teacher = read_model_config(reference.path) if reference is not None and reference.teacher else None
    if teacher is not None:  # laid out like the reference, with its own shape
        terms.append(Term(f"distillation teacher ({frozen_kind})", int(frozen * model_shape(teacher).total(head=True) / state.frozen_shard),
                          "persistent"))
    critic = not config.method.offline and bool(config.algorithm.critic)
    if critic:
        critic_local = (s.num_layers * layer_tp + s.root_tp(tp, head=False)) / shard
        critic_state = engine.planned_state(config.optim, params=critic_local, trained=critic_local, shard=shard,
                                            cuda=cuda)
        terms.append(Term("critic weights + gradients + AdamW", sum(b for _, b, _ in critic_state.trained),
                          "persistent", "trains like the policy"))
    if not config.method.offline and config.reward.model is not None and reward_model_config is not None:
        terms.append(Term(f"reward model ({frozen_kind})",
                          int(frozen * model_shape(reward_model_config).total(head=False) / state.frozen_shard),
                          "persistent"))
    terms += [Term(name, b, "micro-batch", note) for name, b, note in state.micro_batch]
    # FSDP's unsharded compute copies (bf16 on CUDA; on one CPU process nothing is copied)
    if state.fsdp_copies:
        root = s.root_tp(tp, head=causal)
        head_grad = (s.head or s.embed) / tp if (causal and lora is None) else s.root_trainable
        layer_grads = s.layer_trainable / (tp if lora is None else 1)
        unsharded = size * (root + 2 * layer_tp) + size * head_grad + (size + 4) * layer_grads
        terms.append(Term("FSDP unsharded params + grads", int(unsharded), "micro-batch",
                          "root (embedding, head) + 2 layers, one layer's gradients in bf16 and fp32, the head's"))
    terms.append(_activation_term(model_config, s, lora, dtype, size, tokens=tokens, local_tokens=local_tokens,
                                  tp=tp, cp=cp, checkpointing=checkpointing, critic=critic))
    if causal:
        from ..models.logprob_head import HEAD_CHUNK_TOKENS

        chunk = min(HEAD_CHUNK_TOKENS, local_tokens)
        head_bytes = HEAD_LIVE_CHUNKS * chunk * (s.vocab / tp) * 4
        terms.append(Term("log-prob head", int(head_bytes), "micro-batch",
                          f"{HEAD_LIVE_CHUNKS} x [{chunk}, {s.vocab // tp}] fp32"))
    terms.append(Term("final hidden states + gradient", int(2 * local_tokens * s.hidden * size), "micro-batch"))
    if not cuda:  # on CUDA optim.py's AdamW is fused: no temporary of the shard's size
        terms.append(Term("AdamW step temporaries", int(4 * trained_local), "optimizer step",
                          "foreach sqrt(exp_avg_sq)"))
    syncs = Method(config.method).syncs_weights  # decided once: the sync buffers and its communicator go together
    if syncs:
        from ..weight_sync.buckets import DEFAULT_BUCKET_BYTES

        terms.append(Term("weight-sync buffers (rank 0)", weight_sync_bytes(DEFAULT_BUCKET_BYTES, s.largest),
                          "weight sync", f"{WEIGHT_SYNC_BUFFERS + 1} x ({DEFAULT_BUCKET_BYTES / GIB:.0f} GiB bucket + the "
                                         "largest tensor): ring and packing; that tensor gathered in fp32"))
    if cuda:
        comms = nccl_communicators(world_size, tp, cp, weight_sync=syncs)
        terms.append(Term("CUDA context + cuBLAS", CUDA_CONTEXT_BYTES, "fixed", "outside the caching allocator"))
        terms.append(Term(f"NCCL communicators ({len(comms)})", len(comms) * NCCL_COMMUNICATOR_BYTES, "fixed",
                          ", ".join(comms) or "none"))
    return terms


def _activation_term(model_config: dict, s, lora, dtype: str, size: int, *, tokens: int, local_tokens: int,
                     tp: int, cp: int, checkpointing: bool, critic: bool) -> Term:
    """The policy's (or the larger critic's) activations of one micro-batch."""
    act = activations(model_config, dtype, lora)
    policy_act = activation_bytes(act, s.num_layers, local_tokens, checkpointing)
    act_note = (f"{s.num_layers} layers x {local_tokens} tokens x "
                + (f"{act.layer_input / 1024:.1f} KiB kept + one layer's {act.per_layer / 1024:.0f} KiB"
                   if checkpointing else f"{act.per_layer / 1024:.0f} KiB")
                + f" per token (measured), checkpointing {'on' if checkpointing else 'off'}")
    if cp > 1:  # per layer: the whole row's K and V (saved for backward; no mask)
        hf = hf_config(model_config, num_layers=1)
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kv = (getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads) * head_dim // tp
        cp_layer = size * 2 * tokens * kv
        cp_bytes = cp_layer * (1 if checkpointing else s.num_layers)
        policy_act += cp_bytes
        act_note += f"; context parallel: + {cp_bytes / GIB:.1f} GiB of gathered K/V (not measured)"
    else:
        cp_layer = 0
    if critic:
        critic_act = (activation_bytes(act, s.num_layers, local_tokens, checkpointing)  # checkpointed alike
                      + cp_layer * (1 if checkpointing else s.num_layers))
        if critic_act > policy_act:
            policy_act, act_note = critic_act, act_note + "; the critic's is larger"
    return Term("activations", int(policy_act), "micro-batch", act_note)


def _total(terms: list[Term], cuda: bool) -> tuple[int, str]:
    persistent = sum(t.bytes for t in terms if t.phase == "persistent")
    fixed = sum(t.bytes for t in terms if t.phase == "fixed")
    phases: dict[str, int] = {}
    for t in terms:
        if t.phase not in ("persistent", "fixed"):
            phases[t.phase] = phases.get(t.phase, 0) + t.bytes
    peaks = {phase: persistent + b for phase, b in phases.items()}
    phase = max(peaks, key=peaks.get) if peaks else "persistent"
    peak = peaks.get(phase, persistent)
    return int(fixed + (1 + FRAGMENTATION) * peak), phase


def plan(config, model_config: dict, world_size: int, gpu_bytes: int, *, dtype: str = "bfloat16",
         reward_model_config: dict | None = None, checkpointing: bool | None = None,
         cuda: bool = True) -> MemoryPlan:
    """The memory plan of `config` (a TrainerConfig) for the model of `model_config` (its
    config.json) over `world_size` trainer processes with `gpu_bytes` per GPU.

    `checkpointing`: plan with this setting instead of the spec's; when the spec leaves
    `trainer.parallelism.activationCheckpointing` unset, the plan decides it (`resolve`).
    `cuda=False` plans a CPU process (fp32, no context, no FSDP copies on one process)."""
    tokens = config.optim.max_tokens_per_micro_batch
    spec = config.optim.parallelism.activation_checkpointing
    decided = spec is None and checkpointing is None
    args = dict(dtype=dtype, reward_model_config=reward_model_config, cuda=cuda)

    def total_at(t: int, ckpt: bool) -> tuple[int, str, list[Term]]:
        terms = _terms(config, model_config, world_size, tokens=t, checkpointing=ckpt, **args)
        return (*_total(terms, cuda), terms)

    if checkpointing is None:
        checkpointing = spec if spec is not None else total_at(tokens, False)[0] > gpu_bytes
    total, phase, terms = total_at(tokens, checkpointing)

    def largest_fitting(ckpt: bool) -> int | None:
        low, high = 0, max(tokens // TOKEN_STEP, 1) * 4  # in TOKEN_STEP units; beyond 4x the budget is moot
        if total_at(TOKEN_STEP, ckpt)[0] > gpu_bytes:
            return None
        low = 1
        while low < high:  # total is monotone in tokens
            mid = (low + high + 1) // 2
            if total_at(mid * TOKEN_STEP, ckpt)[0] <= gpu_bytes:
                low = mid
            else:
                high = mid - 1
        return low * TOKEN_STEP

    notes = []
    if decided:
        notes.append(f"trainer.parallelism.activationCheckpointing is unset: the plan turns it "
                     f"{'on (the plan without it does not fit)' if checkpointing else 'off (the plan fits without it)'}"
                     if cuda else "trainer.parallelism.activationCheckpointing is unset: off on CPU")
    fits = total <= gpu_bytes
    return MemoryPlan(terms=tuple(terms), gpu_bytes=gpu_bytes, activation_checkpointing=checkpointing,
                      checkpointing_decided=decided, tokens=tokens, peak_phase=phase, total=total,
                      max_tokens=None if fits else largest_fitting(checkpointing),
                      max_tokens_checkpointed=None if fits or checkpointing else largest_fitting(True),
                      notes=tuple(notes))


def resolve_checkpointing(config, model_config: dict | None, world_size: int, gpu_bytes: int | None,
                          cuda: bool, reward_model_config: dict | None = None) -> bool:
    """`trainer.parallelism.activationCheckpointing` as the trainer applies it: the spec's
    value when set; unset: off on CPU (local mode stays fast), on CUDA on exactly when the
    plan without it does not fit in `gpu_bytes` (on when no plan can be made)."""
    spec = config.optim.parallelism.activation_checkpointing
    if spec is not None:
        return spec
    if not cuda:
        return False
    if model_config is None or gpu_bytes is None:
        return True
    try:
        unplanned = plan(config, model_config, world_size, gpu_bytes, checkpointing=False,
                         reward_model_config=reward_model_config)
    except Exception:  # a model family the plan cannot build: the safe setting
        return True
    return unplanned.total > gpu_bytes


def gib(n: float) -> int:
    return int(n * GIB)


def read_model_config(path: str) -> dict | None:
    """A model directory's config.json, or None (not a directory, unreadable)."""
    from pathlib import Path

    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def detect_gpu_bytes() -> int | None:
    """The memory of this machine's first GPU (`nvidia-smi`), or None without one."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(float(out.split()[0])) << 20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def trainer_checkpointing(config, world_size: int, device) -> bool:
    """What the trainer applies for `trainer.parallelism.activationCheckpointing` on
    `device` (a torch.device): `resolve_checkpointing` with the GPU's own memory unless
    `trainer.gpuMemoryGiB` is set. Every rank computes the same answer."""
    if config.optim.parallelism.activation_checkpointing is not None or device.type != "cuda":
        return resolve_checkpointing(config, None, world_size, None, cuda=device.type == "cuda")
    import torch

    gpu = (gib(config.optim.gpu_memory_gib) if config.optim.gpu_memory_gib
           else torch.cuda.get_device_properties(device).total_memory)
    rm = read_model_config(config.reward.model.path) if config.reward.model is not None else None
    return resolve_checkpointing(config, read_model_config(config.model_path), world_size, gpu, cuda=True,
                                 reward_model_config=rm)


def with_checkpointing_decided(config, world_size: int, device):
    """`config` with `trainer.parallelism.activationCheckpointing` set to what
    `trainer_checkpointing` decides: main resolves it once, before any model loads, and the
    model loaders only read the boolean."""
    decided = trainer_checkpointing(config, world_size, device)
    parallelism = config.optim.parallelism.model_copy(update={"activation_checkpointing": decided})
    return config.model_copy(update={"optim": config.optim.model_copy(update={"parallelism": parallelism})})
