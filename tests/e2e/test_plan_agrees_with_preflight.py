"""`rlhfctl plan` and the trainer's preflight give one memory answer: for every example
job and for a DeepSpeed job, at GPU sizes where it fits and where it does not, `plan`
exits 2 exactly when preflight's `memory_problems` refuses it, with the same message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_contract.api import load_job
from rlhf_contract.trainer_config import TrainerConfig
from rlhf_launcher.cli import main
from rlhf_trainer.preflight.checks import memory_problems

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=256, intermediate_size=1024,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=4096, num_hidden_layers=3,
             max_position_embeddings=4096, tie_word_embeddings=False)
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
DEEPSPEED = ["trainer.engine=deepspeed", "trainer.deepspeed.zeroStage=2"]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A small causal LM and a one-label classifier of its shape, as config.json directories."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, extra in (("policy", {}), ("rm", dict(architectures=["Qwen2ForSequenceClassification"],
                                                    id2label={"0": "LABEL_0"}))):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({**SMALL, **extra}))
        out[name] = root / name
    return out


def _answers(example: str, sets: list[str], gib: float, models: dict[str, Path], capsys) -> tuple[int, str, list[str]]:
    job = load_job(str(ROOT / "examples" / example), [])
    sets = [*sets, f"trainer.gpuMemoryGiB={gib}"]
    if job.spec.reward.model is not None:
        sets.append(f"reward.model.path={models['rm']}")
    if job.spec.distillation is not None:
        sets.append(f"distillation.teacher.path={models['policy']}")
    code = main(["plan", str(ROOT / "examples" / example), "--model-config", str(models["policy"] / "config.json"),
                 *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    job = load_job(str(ROOT / "examples" / example), sets)
    problems = memory_problems(TrainerConfig.from_job(job), job.spec.trainer_world_size, SMALL)
    return code, err, problems


@pytest.mark.parametrize("example", EXAMPLES)
def test_plan_and_preflight_agree_on_every_example(example, models, capsys):
    for gib in (0.5, 80):  # 0.5 GiB: the CUDA context alone does not fit; 80: the small model does
        code, err, problems = _answers(example, [], gib, models, capsys)
        assert code == (2 if problems else 0), (example, gib, err, problems)
        assert all(p in err for p in problems)
        assert bool(problems) == (gib == 0.5), (example, gib, problems)


@pytest.mark.parametrize("stage", ["2", "3"])
def test_a_deepspeed_job_is_planned_as_deepspeed_by_both(stage, models, capsys):
    """A ZeRO job is planned (no longer skipped by preflight while `plan` planned it as
    FSDP2): both refuse it on a GPU too small and accept it on a large one, and the plan's
    terms are ZeRO's."""
    sets = ["trainer.engine=deepspeed", f"trainer.deepspeed.zeroStage={stage}"]
    for gib in (0.5, 80):
        code, err, problems = _answers("rlhfjob.yaml", sets, gib, models, capsys)
        assert code == (2 if problems else 0) and bool(problems) == (gib == 0.5), (gib, err, problems)
    assert main(["plan", str(ROOT / "examples/rlhfjob.yaml"), "--model-config", str(models["policy"] / "config.json"),
                 "--gpu-memory-gib", "80", "-o", "json", *[a for s in sets for a in ("--set", s)]]) == 0
    terms = {t["name"]: t["bytes"] for t in json.loads(capsys.readouterr().out)["terms"]}
    assert "ZeRO reduction buckets" in terms and "FSDP unsharded params + grads" not in terms
    assert ("ZeRO-3 prefetch bucket" in terms) == (stage == "3")
    assert "policy weights (bf16, partitioned)" in terms if stage == "3" else "policy weights (bf16, whole)" in terms
