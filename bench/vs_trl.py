"""Our local mode against Hugging Face TRL's GRPOTrainer (a dev-only dependency), same run,
same model, tokenizer, data, reward and settings: a Qwen2 of hidden size 256 and 4 layers
(random weights, made in code) over the built-in character tokenizer, the built-in
`last-digit` task, exact-match reward, 8 prompts x 8 samples of up to 32 tokens per step,
GRPO advantages (group mean and std), token-mean loss over the step's tokens, clip 0.2,
no KL, one optimizer step per step, AdamW lr 1e-3, CPU, fp32 on both sides.

Prints the mean step time of each (steps after the first few) and the ratio ours / TRL.
What still differs: TRL generates in-process with `model.generate` on one padded batch;
we generate on a separate CPU engine process over HTTP (token ids in and out) and push
the weights to it every step; TRL computes the loss on padded [B, T] batches, we on
packed rows. Both score the same decoded text (special tokens skipped) with the same
exact-match function.

    .venv/bin/python bench/vs_trl.py [--steps 12] [--k 0]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = 3
PROMPTS, SAMPLES, TOKENS, LR = 8, 8, 32, 1e-3


def make_model(path: Path) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlhf_trainer.models.builtin import EOS, PAD, VOCAB, build_tokenizer

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(VOCAB), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=VOCAB.index(EOS),
                         pad_token_id=VOCAB.index(PAD))
    Qwen2ForCausalLM(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)


def ours(model: Path, out: Path, steps: int, k: int) -> list[float]:
    sets = [f"model.path={model}", f"schedule.totalSteps={steps}", f"schedule.promptsPerStep={PROMPTS}",
            f"rollout.samplesPerPrompt={SAMPLES}", f"rollout.maxTokens={TOKENS}", "rollout.replicas=1",
            f"rollout.maxStaleness={k}", "algorithm.klCoef=0", "algorithm.lossAgg=token-mean",
            f"trainer.learningRate={LR}", "trainer.maxTokensPerMicroBatch=4096", "schedule.saveEvery=0"]
    cmd = [sys.executable, "-m", "rlhf_launcher.cli", "run", str(ROOT / "examples" / "local-grpo.yaml"),
           "--output", str(out), *[a for s in sets for a in ("--set", s)]]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode:
        raise SystemExit(res.stderr[-3000:])
    return [json.loads(line)["step_seconds"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def trl(model: Path, out: Path, steps: int) -> list[float]:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_trainer.data.prompts import BUILTIN_TASKS
    from rlhf_trainer.rewards import exact_match

    rows = [BUILTIN_TASKS["last-digit"](random.Random(f"0:{i}")) for i in range(PROMPTS * steps)]
    data = Dataset.from_dict({"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]})

    def reward(completions, answer, **_):  # the same exact-match function as reward.type exact_match
        return [exact_match(c, a) for c, a in zip(completions, answer)]

    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=PROMPTS * SAMPLES, num_generations=SAMPLES,
                      max_completion_length=TOKENS, learning_rate=LR, lr_scheduler_type="constant", beta=0.0,
                      loss_type="dapo", scale_rewards="group", epsilon=0.2, temperature=1.0, max_steps=steps,
                      use_cpu=True, report_to="none", logging_steps=1000, save_strategy="no", seed=0,
                      dataloader_num_workers=0, shuffle_dataset=False, warmup_steps=0, weight_decay=0.0,
                      max_grad_norm=1.0,
                      # TRL defaults to bf16 and gradient checkpointing; we train this model in fp32
                      # without checkpointing. bf16 autocast on this CPU made TRL's backward ~15x
                      # slower (15.7 s/step against 0.9), which would flatter us.
                      bf16=False, gradient_checkpointing=False)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(model), reward_funcs=reward, args=args,
                          train_dataset=data, processing_class=AutoTokenizer.from_pretrained(model),
                          callbacks=[Clock()])
    trainer.train()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--k", type=int, default=0, help="our rollout.maxStaleness")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        make_model(model)
        t_trl = trl(model, Path(tmp) / "trl", args.steps)[SKIP:]
        t_ours = ours(model, Path(tmp) / "ours", args.steps, args.k)[SKIP:]
    a, b = statistics.median(t_ours), statistics.median(t_trl)
    print(f"ours (maxStaleness={args.k}): median {a:.3f} s/step over {len(t_ours)} steps")
    print(f"TRL GRPOTrainer:          median {b:.3f} s/step over {len(t_trl)} steps")
    print(f"ratio ours / TRL: {a / b:.2f}")


if __name__ == "__main__":
    main()
