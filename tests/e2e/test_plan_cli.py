"""`rlhfctl plan`: the memory plan as a table, exit 0 when it fits and 2 (with preflight's
message) when not."""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_launcher.cli import main

ROOT = Path(__file__).resolve().parents[2]
QWEN_7B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, num_hidden_layers=28,
               max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6)


def test_plan_refuses_and_accepts(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN_7B))
    job = str(ROOT / "examples/rlhfjob.yaml")
    args = ["plan", job, "--model-config", str(config), "--gpus", "8", "--gpu-memory-gib", "80"]

    assert main([*args, "--set", "trainer.parallelism.activationCheckpointing=false"]) == 2
    out, err = capsys.readouterr()
    assert "policy weights (fp32)" in out and "activations" in out and "total (peak)" in out
    assert "spec.trainer: the plan needs" in err and "of 80.0" in err
    assert "activationCheckpointing: true" in err and "maxTokensPerMicroBatch <=" in err

    assert main(args) == 0  # unset: the plan turns checkpointing on, and then it fits
    out, err = capsys.readouterr()
    assert "the plan turns it on" in " ".join(out.split()) and "fits:" in out and err == ""


def test_plan_of_a_builtin_model_and_missing_inputs(capsys):
    job = str(ROOT / "examples/local-grpo.yaml")
    assert main(["plan", job, "--gpu-memory-gib", "80"]) == 0
    assert "fits:" in capsys.readouterr().out
    # the fixed CUDA context and NCCL alone exceed a 1 GiB GPU
    assert main(["plan", job, "--gpu-memory-gib", "1"]) == 2
    assert "spec.trainer: the plan needs" in capsys.readouterr().err
    assert main(["plan", job, "--gpu-memory-gib", "1", "-o", "json"]) == 2  # the same plan, as numbers
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is False and plan["totalBytes"] > plan["gpuBytes"] == 2**30
    assert plan["message"].startswith("spec.trainer: the plan needs") and "activations" in {t["name"] for t in plan["terms"]}
    assert main(["plan", str(ROOT / "examples/rlhfjob.yaml"), "--gpu-memory-gib", "80"]) == 2  # usage: give --model-config
    assert "--model-config" in capsys.readouterr().err


def test_the_gpu_memory_comes_from_the_gpu_product_the_pods_select(tmp_path, capsys, monkeypatch):
    """examples/rlhfjob.yaml selects NVIDIA-H100-80GB-HBM3: planned with that GPU's memory
    on a machine without one; a product we do not know is named in the error."""
    from rlhf_trainer.preflight import memory_plan

    monkeypatch.setattr(memory_plan, "detect_gpu_bytes", lambda: None)  # no GPU here, whatever this machine has
    config = tmp_path / "config.json"
    config.write_text(json.dumps(QWEN_7B))
    job = str(ROOT / "examples/rlhfjob.yaml")
    assert main(["plan", job, "--model-config", str(config)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "GPUs of 79.6 GiB (nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3)" in out and "of 79.6 GiB per GPU" in out
    unknown = ["--set", 'pod.nodeSelector={"nvidia.com/gpu.product": "NVIDIA-B999"}']
    assert main(["plan", job, "--model-config", str(config), *unknown]) == 2  # usage or invalid job (rlhfctl --help: exit codes)
    assert "nvidia.com/gpu.product 'NVIDIA-B999' is not a product we know" in capsys.readouterr().err


def test_plan_of_a_lora_job_with_no_pod_settings(capsys):
    """A LoRA job (adapters measured on fake tensors) that sets no `spec.pod` at all: planned,
    with the adapters' gradients and no GPU product to read."""
    assert main(["plan", str(ROOT / "examples/local-grpo-lora.yaml"), "--gpu-memory-gib", "80", "-o", "json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    terms = {t["name"]: t for t in plan["terms"]}
    assert plan["fits"] is True and terms["activations"]["bytes"] > 0
    assert "LoRA adapters only" in json.dumps(terms)
