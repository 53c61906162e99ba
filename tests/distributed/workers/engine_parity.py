"""torchrun worker: the same training steps under FSDP2 and under DeepSpeed ZeRO-2 / ZeRO-3
(`trainer.engine`; ZeRO-3 also with optimizer and parameter offload), on the same processes and data: RL's `TrainStep` (GRPO with a KL
reference, two mini-batches) and the offline `OfflineStep` (DPO against its reference),
three optimizer steps each. ZeRO-3 runs with `stage3_param_persistence_threshold` 0, so
every parameter really is partitioned (and the frozen reference runs as a ZeRO-3
inference engine).

Rank 0 writes `{method: {engine: {"metrics": [per step], "params": {name: [values]}},
"initial": {name: [values]}}}`
as JSON to --out (the tiny model's weights are small)."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_step_parity import GROUP, examples, resolved, rows  # noqa: E402

from rlhf_contract.api.models import DeepSpeedSpec, PreferenceSpec  # noqa: E402
from rlhf_contract.trainer_config import OptimConfig  # noqa: E402
from rlhf_trainer.models.builtin import build_tiny_qwen2  # noqa: E402
from rlhf_trainer.models.logprob_head import attach_logprob_head  # noqa: E402
from rlhf_trainer.orchestrator.types import RolloutBatch, RolloutStats  # noqa: E402
from rlhf_trainer.engine import engine_type  # noqa: E402
from rlhf_trainer.parallel.parallelize import parallelize_models, zero_layout  # noqa: E402

STEPS = 3
ENGINES = {"fsdp2": None, "zero2": DeepSpeedSpec(zero_stage=2),
           "zero3": DeepSpeedSpec(zero_stage=3, param_persistence_threshold=0),
           "zero3-offload": DeepSpeedSpec(zero_stage=3, param_persistence_threshold=0, offload_optimizer=True,
                                          offload_params=True)}


def optim_config(engine: str) -> OptimConfig:
    spec = ENGINES[engine]
    return OptimConfig(learning_rate=1e-2, max_grad_norm=0.3, max_tokens_per_micro_batch=24,
                       engine="fsdp2" if spec is None else "deepspeed", deepspeed=spec or DeepSpeedSpec())


def models(engine: str, world: int):
    """(the policy's training engine, reference, layout, optim config) laid out for `engine`."""
    optim = optim_config(engine)
    policy, ref = build_tiny_qwen2(0), build_tiny_qwen2(0).eval().requires_grad_(False)
    if engine == "fsdp2":
        layout = parallelize_models(policy, ref=ref, critic=None, world_size=world, tp=1, cp=1,
                                    activation_checkpointing=False, device_type="cpu")
    else:
        layout = zero_layout(policy, ref=ref, critic=None, reward_model=None, world_size=world,
                             activation_checkpointing=False)
    for m in (policy, ref):
        attach_logprob_head(m)
    if engine != "fsdp2":
        from rlhf_trainer.engine.zero import frozen_with_zero

        frozen_with_zero(ref, optim)
    return engine_type(optim).train(policy, optim), ref, layout, optim


def full_params(engine) -> dict[str, list[float]]:
    """The engine's whole parameters by Hugging Face name (what the weight sync sends)."""
    specs, tensors = engine.full_tensors()
    return {name: t.float().reshape(-1).tolist() for (name, _, _), t in zip(specs, tensors)}


def cycle(engine, offload: bool) -> None:
    """Colocation between steps: the engine's state to the host and back."""
    if offload:
        engine.offload()
        engine.reload()


def run_grpo(engine: str, world: int) -> dict:
    from rlhf_trainer.rl.models import Models
    from rlhf_trainer.rl.step import TrainStep

    engine, offload = engine.removesuffix("+offload"), engine.endswith("+offload")
    trained, ref, layout, optim = models(engine, world)
    step = TrainStep(resolved("token-mean-2mb").model_copy(update={"kl_coef": 0.05}),
                     Models(trained, ref), layout, max_tokens_per_micro_batch=24, max_grad_norm=0.3,
                     temperature=1.0, device=torch.device("cpu"))
    batch = RolloutBatch(rows(), GROUP, RolloutStats(*[0] * 12))
    metrics = []
    for _ in range(STEPS):
        metrics.append(step(batch, step.prepare(batch)))
        cycle(trained, offload)
    return {"metrics": metrics, "params": full_params(trained)}


def run_dpo(engine: str, world: int) -> dict:
    from types import SimpleNamespace

    from rlhf_trainer.offline.step import OfflineStep

    engine, offload = engine.removesuffix("+offload"), engine.endswith("+offload")
    trained, ref, layout, optim = models(engine, world)
    config = SimpleNamespace(method="dpo", preference=PreferenceSpec(beta=0.5), optim=optim,
                             schedule=SimpleNamespace(prompts_per_step=6))
    step = OfflineStep(config, trained, ref, layout, torch.device("cpu"))
    metrics = []
    for _ in range(STEPS):
        metrics.append(step(examples("dpo"), lr_factor=1.0))
        cycle(trained, offload)
    return {"metrics": metrics, "params": full_params(trained)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("cases", nargs="+", help="grpo|dpo:fsdp2|zero2|zero3|zero3-offload")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results: dict = {}
    try:
        for case in args.cases:
            method, engine = case.split(":")
            torch.manual_seed(0)
            results.setdefault(method, {"initial": {n: p.detach().reshape(-1).tolist()
                                                    for n, p in build_tiny_qwen2(0).named_parameters()}})
            results[method][engine] = (run_grpo if method == "grpo" else run_dpo)(engine, dist.get_world_size())
    finally:
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(results, f)
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
