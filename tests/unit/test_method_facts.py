"""Method facts as data (rlhf_contract/api/common.py METHOD_FACTS): the reference model
each method has (TrainerConfig.reference_model, read by the loaders, both engines and the
memory plan), and whether it syncs weights, which the memory plan reads once for both the
sync buffers and the sync communicator."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf_contract.api import load_job
from rlhf_contract.api.common import METHOD_FACTS, Method
from rlhf_contract.trainer_config import TrainerConfig
from rlhf_trainer.preflight.memory_plan import GIB, NCCL_COMMUNICATOR_BYTES, plan

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=256, intermediate_size=1024,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=4096, num_hidden_layers=3,
             max_position_embeddings=4096, tie_word_embeddings=False)


def config_of(example: str, *sets: str) -> TrainerConfig:
    return TrainerConfig.from_job(load_job(ROOT / "examples" / example, list(sets)))


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("teacher")
    (path / "config.json").write_text(json.dumps(SMALL))
    return path


def test_every_method_has_its_facts():
    assert set(METHOD_FACTS) == set(Method)
    assert [m for m in Method if m.syncs_weights] == [Method.RL, Method.DISTILL]
    assert [m for m in Method if m.offline] == [Method.SFT, Method.RM, Method.DPO]
    assert [m for m in Method if not m.facts.lm_head] == [Method.RM]


def test_the_reference_model_of_each_method(teacher):
    assert config_of("local-sft.yaml").reference_model() is None
    assert config_of("local-rm.yaml").reference_model() is None
    dpo = config_of("local-dpo.yaml").reference_model()
    assert dpo is not None and dpo.copy and not dpo.teacher and dpo.path == "builtin://tiny-qwen2"
    assert config_of("local-dpo.yaml", "model.lora.rank=4").reference_model().copy is False  # adapters off
    assert config_of("local-grpo.yaml", "algorithm.klCoef=0").reference_model() is None
    kl = config_of("local-grpo.yaml", "algorithm.klCoef=0.01").reference_model()
    assert kl is not None and kl.copy and not kl.teacher
    distill = config_of("local-distill.yaml", f"distillation.teacher.path={teacher}").reference_model()
    assert distill is not None and distill.copy and distill.teacher and distill.path == str(teacher)


def test_a_distill_jobs_plan_holds_its_weight_sync_like_an_rl_jobs(teacher):
    """A distill job syncs its weights to the rollout servers as an RL job does: its plan has
    the sync buffers AND the sync communicator (1 GiB, which it once left out)."""
    sets = ["trainer.nprocPerNode=2", "trainer.device=gpu"]
    distill = plan(config_of("local-distill.yaml", f"distillation.teacher.path={teacher}", *sets), SMALL, 2, 80 * GIB)
    rl = plan(config_of("local-grpo.yaml", *sets), SMALL, 2, 80 * GIB)
    sft = plan(config_of("local-sft.yaml", *sets), SMALL, 2, 80 * GIB)

    def term(p, prefix):
        return next((t for t in p.terms if t.name.startswith(prefix)), None)

    for p in (distill, rl):
        assert term(p, "weight-sync buffers") is not None
        assert "weight sync (rank 0)" in term(p, "NCCL communicators").note
    assert term(sft, "weight-sync buffers") is None and "weight sync" not in term(sft, "NCCL communicators").note
    assert term(distill, "NCCL communicators").bytes == term(rl, "NCCL communicators").bytes \
        == term(sft, "NCCL communicators").bytes + NCCL_COMMUNICATOR_BYTES
    assert term(distill, "distillation teacher") is not None


def test_the_pod_checks_the_colocation_rules_again():
    """The trainer config keeps `rollout.placement` and `rollout.colocated` under the spec's
    names, so the rules the spec obeys are checked again on the config in the pod (they were
    not: its rebuilt spec had no placement)."""
    config = config_of("local-grpo.yaml", "rollout.placement=colocated")
    assert config.sampling.placement == "colocated" and config.rule_problems(1) == []
    stale = config.model_copy(update={"sampling": config.sampling.model_copy(update={"max_staleness": 1})})
    assert any(p.startswith("spec.rollout.maxStaleness: must be 0 with rollout.placement colocated")
               for p in stale.rule_problems(1))
    vllm = config.model_copy(update={"sampling": config.sampling.model_copy(update={"engine": "vllm"})})
    assert any(p.startswith("spec.rollout.vllm.kvCacheMemoryBytes") for p in vllm.rule_problems(1))
    assert TrainerConfig.from_json(config.to_json()) == config
