"""`trainer.engine: deepspeed` end to end with `rlhfctl run`: two trainer processes under
ZeRO-3 with the default local job (GRPO, rollout servers, weight sync after every step),
a SIGKILLed trainer resumed from DeepSpeed's own checkpoint files exactly as an
uninterrupted run, and the checkpoints exported (`rlhfctl export`, through DeepSpeed's
`zero_to_fp32`) to the run's `final/` bit for bit, which transformers loads alone. The
step-by-step numerics against FSDP2 are tests/distributed/test_engine_parity.py."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_lora_runs import SMALL, logits, metrics, rlhfctl, run, run_killed_once

pytestmark = pytest.mark.slow

ZERO3 = ["trainer.engine=deepspeed", "trainer.nprocPerNode=2", "trainer.deepspeed.zeroStage=3"]


def test_a_sigkilled_zero3_run_resumes_exactly_and_its_checkpoints_export(tmp_path):
    from transformers import AutoModelForCausalLM

    common = [*SMALL, *ZERO3, "schedule.saveEvery=2", "schedule.totalSteps=4", "trainer.learningRate=0.01"]
    straight = run(tmp_path / "straight", *common)
    out = tmp_path / "killed"
    assert run_killed_once(out, common, at_step=2) == 2  # both ranks
    assert "attempt 2 resumes from step-2" in (out / "logs" / "attempts.log").read_text()
    killed = metrics(out)
    assert [r["step"] for r in killed] == [1, 2, 3, 4]
    for a, b in zip(straight, killed):
        for key in ("reward_mean", "loss", "grad_norm", "kl", "entropy", "logprob_mismatch"):
            assert a.get(key) == b.get(key), (a["step"], key)
    a, b = (load_file(d / "final" / "model.safetensors") for d in (tmp_path / "straight", out))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)

    # each rank's ZeRO partition in DeepSpeed's layout, exported whole
    step = out / "checkpoints" / "step-4"
    assert sorted(p.name for p in (step / "policy").glob("*model_states.pt")) == [
        "zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
    res = rlhfctl("export", str(step), str(out / "exported"))
    assert res.returncode == 0, res.stderr[-3000:]
    exported = load_file(out / "exported" / "model.safetensors")
    assert set(exported) == set(b) and all(torch.equal(exported[k], b[k]) for k in b)
    base = AutoModelForCausalLM.from_pretrained(out / "builtin-model")
    final = AutoModelForCausalLM.from_pretrained(out / "final")  # transformers alone
    assert {n: p.shape for n, p in final.named_parameters()} == {n: p.shape for n, p in base.named_parameters()}
    assert not torch.allclose(logits(final), logits(base), atol=1e-4)  # trained
