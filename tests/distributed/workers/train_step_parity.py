"""torchrun worker: the trainer's own steps on fixed data under a parallel layout vs the
same step in one process (computed on every rank, no process group involved): RL's
`TrainStep` (prepare + updates) for several algorithm settings, with a learned reward
model (`grpo-rm`), and the offline methods' `OfflineStep` (`sft`, `rm`, `dpo`).

Each case: `layout=dp,tp,cp` and a variant. Rank 0 writes
`{case: {metrics, ref_metrics, param_rel_err, worst}}` to --out. The rows are random but
fixed; two mini-batches make the second one's policy differ from the old one (ratio != 1).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from rlhf_contract.api.models import AlgorithmSpec
from rlhf_trainer.models.builtin import build_tiny_qwen2
from rlhf_trainer.data.sequences import Row
from rlhf_trainer.orchestrator.types import RolloutBatch, RolloutStats
from rlhf_trainer.parallel.parallelize import parallelize_models
from rlhf_trainer.models.logprob_head import attach_logprob_head
from rlhf_trainer.rl.models import Models
from rlhf_trainer.engine import Fsdp2Engine
from rlhf_trainer.rl.step import TrainStep

VARIANTS = {
    "grpo": dict(preset="grpo", loss_agg="seq-mean-token-mean", kl_coef=0.04),
    "token-mean-2mb": dict(preset="grpo", loss_agg="token-mean", num_mini_batches=2, kl_coef=0.0),
    "seq-sum-tis": dict(preset="dr_grpo", loss_agg="seq-mean-token-sum", tis_cap=2.0, num_mini_batches=2),
    "sum-norm-entropy": dict(preset="dr_grpo", loss_agg="seq-mean-token-sum-norm", entropy_coef=0.01,
                             num_mini_batches=2),
    "dapo-dual": dict(preset="dapo", dual_clip=3.0, num_mini_batches=2, kl_coef=0.01, kl_mode="reward"),
    "grpo-rm": dict(preset="grpo", loss_agg="seq-mean-token-mean", kl_coef=0.0),  # + a learned reward model
    # + the critic; the parallel side checkpoints the policy's and the critic's layers
    "ppo-ac": dict(preset="ppo", num_mini_batches=2),
    # the sequence ratio (a mean over a sequence split between CP ranks); a wider clip than the
    # paper's 3e-4 / 4e-4, so that the second mini-batch clips some sequences and not others
    "gspo": dict(preset="gspo", num_mini_batches=2, clip_low=0.02, clip_high=0.02),
    "cispo-tis": dict(preset="cispo", num_mini_batches=2, clip_high=0.1, tis_cap=2.0),
}
GROUP = 4
# variants whose old log-probs are moved by seeded noise of this size (as stale rollouts would be),
# the same on every rank: ratios far enough from 1 that the clip binds for some sequences / tokens
OFF_POLICY = {"gspo": 0.05, "cispo-tis": 0.3}

# What "equal to one process" means, shared by the CPU parity tests and `make gpu-check`'s parity part
METRIC_KEYS = ["loss", "clip_fraction", "approx_kl", "entropy", "kl", "grad_norm", "advantage_mean", "skipped_steps"]
METRIC_TOLERANCE = {"rel": 2e-4, "abs": 1e-6}
"""A step metric of a parallel layout against one process's: pytest.approx's `rel` and `abs`."""
PARAM_REL_ERR = 1e-3
"""The updated weights' largest relative error (norm of the difference over the norm). Adam
divides by sqrt(v): for parameters whose true gradient is ~0 (the key bias: softmax ignores a
shift shared by all keys) float noise becomes an lr-sized update, hence 1e-3."""


def mismatches(result: dict, keys: list[str] = METRIC_KEYS) -> list[str]:
    """What of one case's result (this worker's JSON) is not equal to one process: the
    metrics beyond METRIC_TOLERANCE, the weights beyond PARAM_REL_ERR; [] when it matches."""
    got, want, out = result["metrics"], result["ref_metrics"], []
    for key in keys:
        if want.get(key) is None or got.get(key) is None:
            if (want.get(key) is None) != (got.get(key) is None):
                out.append(f"{key}: {got.get(key)} vs {want.get(key)}")
        elif abs(got[key] - want[key]) > max(METRIC_TOLERANCE["rel"] * abs(want[key]), METRIC_TOLERANCE["abs"]):
            out.append(f"{key}: {got[key]} vs {want[key]}")
    if not result["param_rel_err"] < PARAM_REL_ERR:
        out.append(f"weights: relative error {result['param_rel_err']:.2e} at {result['worst']}")
    return out


def resolved(variant: str) -> AlgorithmSpec:
    from rlhf_contract.api.presets import PRESETS

    fields = dict(VARIANTS[variant])
    preset = fields["preset"]
    base = {k: v for k, v in PRESETS[preset].items() if v != "maxTokens/5"}
    base["overlong_buffer"] = 0
    return AlgorithmSpec(**{**base, **fields})


def rows() -> list[Row]:
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(8):
        p = int(torch.randint(2, 7, (1,), generator=gen))
        r = int(torch.randint(1, 6, (1,), generator=gen))
        prompt = torch.randint(3, 16, (p,), generator=gen).tolist()
        response = torch.randint(3, 16, (r,), generator=gen).tolist()
        logprobs = (-torch.rand(r, generator=gen) * 3).tolist()
        reward = float(torch.rand((), generator=gen) > 0.5)
        out.append(Row(prompt, response, logprobs, reward, reward, False))
    return out


OFFLINE = ("sft", "rm", "dpo")


def examples(method: str) -> list:
    """Fixed random examples: one sequence each for sft, (chosen, rejected) pairs otherwise."""
    from rlhf_trainer.data.examples import Example, Sequence

    gen = torch.Generator().manual_seed(5)

    def seq() -> Sequence:
        p, r = (int(torch.randint(2, 6, (1,), generator=gen)) for _ in range(2))
        return Sequence(torch.randint(3, 16, (p,), generator=gen).tolist(),
                        torch.randint(3, 16, (r,), generator=gen).tolist(), [1] * r)

    return [Example((seq(),) if method == "sft" else (seq(), seq())) for _ in range(6)]


def critic_model(tmp: str):
    """The critic of the tiny model (a value head, zero at start, on its decoder)."""
    from rlhf_trainer.models.critic import ValueModel

    path = os.path.join(tmp, "tiny")
    if not os.path.exists(os.path.join(path, "config.json")) and int(os.environ.get("RANK", "0")) == 0:
        build_tiny_qwen2(0).save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return ValueModel(path)


def score_model(tmp: str):
    """A reward model (decoder + `score` head) from the tiny model, with a random head."""
    from rlhf_trainer.models.score import ScoreModel

    path = os.path.join(tmp, "tiny")
    if not os.path.exists(os.path.join(path, "config.json")) and int(os.environ.get("RANK", "0")) == 0:
        build_tiny_qwen2(0).save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    model = ScoreModel(path, 0)
    torch.nn.init.normal_(model.score.weight, generator=torch.Generator().manual_seed(1))
    return model


def run_offline(layout: tuple[int, int, int], method: str, device: torch.device, tmp: str):
    from types import SimpleNamespace

    from rlhf_contract.api.models import PreferenceSpec
    from rlhf_trainer.offline.step import OfflineStep

    model = score_model(tmp) if method == "rm" else build_tiny_qwen2(0)
    model = model.to(device)
    ref = build_tiny_qwen2(0).to(device).eval().requires_grad_(False) if method == "dpo" else None
    lay = parallelize_models(model, ref=ref, critic=None, world_size=layout[0], tp=1, cp=1,
                             activation_checkpointing=False, device_type=device.type)
    if method != "rm":
        for m in (model, ref):
            if m is not None:
                attach_logprob_head(m)
    config = SimpleNamespace(method=method, preference=PreferenceSpec(beta=0.5),
                             optim=SimpleNamespace(max_tokens_per_micro_batch=24, max_grad_norm=0.3),
                             schedule=SimpleNamespace(prompts_per_step=6))
    step = OfflineStep(config, Fsdp2Engine(model, torch.optim.AdamW(model.parameters(), lr=1e-2)), ref, lay, device)
    metrics = step(examples(method), lr_factor=1.0)
    metrics.update({f"eval_{k}": v for k, v in step.evaluate(examples(method)).items()})
    return metrics, model


def run(layout: tuple[int, int, int], variant: str, temperature: float,
        device: torch.device = torch.device("cpu"), tmp: str = "") -> tuple[dict, dict[str, torch.Tensor]]:
    if variant in OFFLINE:
        metrics, policy = run_offline(layout, variant, device, tmp)
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
                  for n, p in policy.named_parameters()}
        return metrics, params
    dp, tp, cp = layout
    world = dp * tp * cp
    a = resolved(variant)
    policy = build_tiny_qwen2(0).to(device)
    ref = build_tiny_qwen2(0).to(device).eval().requires_grad_(False) if a.kl_coef else None
    reward_model = score_model(tmp).to(device).eval().requires_grad_(False) if variant == "grpo-rm" else None
    critic = critic_model(tmp).to(device) if a.critic else None
    checkpointed = variant.endswith("-ac") and world > 1
    lay = parallelize_models(policy, ref=ref, critic=critic, world_size=world, tp=tp, cp=cp,
                             activation_checkpointing=checkpointed, device_type=device.type,
                             reward_model=reward_model)
    if checkpointed:  # the critic's layers were checkpointed like the policy's
        assert critic.model.gradient_checkpointing and policy.model.gradient_checkpointing
    for m in (policy, ref):
        if m is not None:
            attach_logprob_head(m)
    models = Models(Fsdp2Engine(policy, torch.optim.AdamW(policy.parameters(), lr=1e-2)), ref,
                    critic_engine=Fsdp2Engine(critic, torch.optim.AdamW(critic.parameters(), lr=1e-2))
                    if critic is not None else None, reward_model=reward_model)
    step = TrainStep(a, models, lay, max_tokens_per_micro_batch=24, max_grad_norm=0.3, temperature=temperature,
                     device=device, reward_model_weight=0.5)
    batch = RolloutBatch(rows(), GROUP, RolloutStats(*[0] * 12))
    tensors = step.prepare(batch)
    if variant in OFF_POLICY:
        noise = torch.randn(tensors.mask.shape, generator=torch.Generator().manual_seed(5)) * OFF_POLICY[variant]
        tensors.old_logprobs = tensors.old_logprobs + noise * tensors.mask
    metrics = step(batch, tensors)
    metrics.update(tensors.reward_metrics)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
              for n, p in policy.named_parameters()}
    metrics["vocab_parallel_head_calls"] = getattr(policy.get_output_embeddings(), "_rlhf_vocab_parallel_calls", 0)
    return metrics, params


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    parser.add_argument("cases", nargs="+", help="dp,tp,cp:variant[:temperature]")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    results = {}
    try:
        for case in args.cases:
            layout_s, variant, *rest = case.split(":")
            temperature = float(rest[0]) if rest else 1.0
            layout = tuple(int(x) for x in layout_s.split(","))
            tmp = os.path.dirname(os.path.abspath(args.out))
            ref_metrics, ref_params = run((1, 1, 1), variant, temperature, tmp=tmp)  # one process, fp32, CPU
            metrics, params = run(layout, variant, temperature, device, tmp=tmp)
            worst, worst_name = 0.0, ""
            for name, ref in ref_params.items():
                err = ((params[name] - ref).norm() / ref.norm().clamp(min=1e-30)).item()
                if err > worst:
                    worst, worst_name = err, name
            initial = build_tiny_qwen2(0).state_dict()
            moved = max((params[n] - initial[n]).norm().item() for n in params if n in initial)
            results[case] = {"metrics": metrics, "ref_metrics": ref_metrics, "param_rel_err": worst,
                             "worst": worst_name, "moved": moved}
    finally:
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
