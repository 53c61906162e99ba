"""The memory plan (rlhf_trainer/preflight/memory_plan.py) against the allocator's own account of
real layers on the CPU, and the preflight / launcher refusing a job that cannot fit.

The measurement is independent of the plan's: the profiler's allocation events (each
allocation and free with its size, `profile_memory=True`), summed in order, give the peak
of live bytes above what existed before; the plan counts saved tensors of a fake forward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlhf_contract.api import load_job
from rlhf_contract.trainer_config import TrainerConfig
from rlhf_trainer.preflight import memory_plan as mp

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(model_type="qwen2", hidden_size=256, intermediate_size=1024, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=4096, num_hidden_layers=3, max_position_embeddings=4096,
             tie_word_embeddings=False)
"""Small enough for 2 CPU cores, activation-dominated at 1024 tokens."""
QWEN_7B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
               num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, num_hidden_layers=28,
               max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6, torch_dtype="bfloat16")
QWEN_1_5B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536, intermediate_size=8960,
                 num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, num_hidden_layers=28,
                 max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6, torch_dtype="bfloat16")
"""The shapes of the README's cluster example (examples/rlhfjob.yaml: Qwen2.5-Math-1.5B)."""


def peak_bytes(fn) -> int:
    """Peak live bytes allocated by `fn()` above what was live before (CPU allocator events)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()

    def walk(nodes):
        for node in nodes:
            yield node
            yield from walk(node.children)

    events = sorted((n for n in walk(prof.profiler.kineto_results.experimental_event_tree())
                     if n.tag == _EventType.Allocation), key=lambda n: n.start_time_ns)
    live = peak = 0
    for event in events:
        live += event.extra_fields.alloc_size
        peak = max(peak, live)
    return peak


def small_model(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    from rlhf_trainer.parallel.context_parallel import apply_cp

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=torch.float32)
    apply_cp(model, None)  # the trainer's attention, as the plan measures it
    return model.train()


def packed_inputs(tokens: int) -> dict:
    half = tokens // 2
    return dict(position_ids=torch.cat([torch.arange(half), torch.arange(tokens - half)])[None],
                document_ids=torch.cat([torch.zeros(half, dtype=torch.long), torch.ones(tokens - half, dtype=torch.long)])[None],
                document_bounds=(0, half, tokens), use_cache=False)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_activations_match_the_allocator_peak(checkpointing):
    """Forward + backward of a stack of real decoder layers: the plan's activation bytes
    (measured saved set x layers, or kept inputs + one layer's set) within 15 % of the
    allocator's peak. Gradients already exist (a second micro-batch), so the peak above
    them is the activations' alone."""
    tokens = 1024
    model = small_model(SMALL)
    if checkpointing:
        model.activation_checkpointing_enable({"use_reentrant": False})
    embeds = torch.randn(1, tokens, SMALL["hidden_size"], requires_grad=True)
    kwargs = packed_inputs(tokens)

    def micro_batch():
        model.model(inputs_embeds=embeds, **kwargs).last_hidden_state.square().mean().backward()

    micro_batch()  # gradients exist from now on
    measured = peak_bytes(micro_batch)
    act = mp.activations(SMALL, "float32")
    planned = mp.activation_bytes(act, SMALL["num_hidden_layers"], tokens, checkpointing)
    print(f"checkpointing {checkpointing}: measured {measured / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB")
    assert abs(planned - measured) <= 0.15 * measured
    # the saved set is what makes the difference: checkpointing must save a lot
    if checkpointing:
        assert planned < 0.5 * mp.activation_bytes(act, SMALL["num_hidden_layers"], tokens, False)


def test_logprob_head_working_set_matches_the_allocator_peak():
    """HEAD_LIVE_CHUNKS fp32 [chunk, vocab] tensors at the head's peak, in bf16 as on GPUs."""
    from rlhf_trainer.models.logprob_head import HEAD_CHUNK_TOKENS, _linear_chunk_stats, chunked_token_stats

    vocab, hidden, tokens = 16384, 64, 2 * HEAD_CHUNK_TOKENS
    h = torch.randn(1, tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.02).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens))

    def step():
        chunked_token_stats(_linear_chunk_stats, h, (w, None), targets, 1.0).sum().backward()

    step()
    measured = peak_bytes(step)
    planned = mp.HEAD_LIVE_CHUNKS * HEAD_CHUNK_TOKENS * vocab * 4
    print(f"head: measured {measured / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB")
    assert abs(planned - measured) <= 0.15 * measured


def grpo_config(*sets: str) -> TrainerConfig:
    return TrainerConfig.from_job(load_job(ROOT / "examples/local-grpo.yaml", list(sets)))


def test_a_whole_micro_batch_and_optimizer_step_match_the_plan():
    """Two micro-batches through the policy with the chunked log-prob head, then the
    AdamW step, on one CPU process: the plan's peak of the micro-batch and optimizer phases
    (weights, gradients and optimizer state existing before) within 15 % of the allocator's."""
    from rlhf_trainer.models.logprob_head import attach_logprob_head, request_stats
    from rlhf_trainer.optim import adamw

    tokens = 1024
    config = grpo_config("algorithm.klCoef=0", f"trainer.maxTokensPerMicroBatch={tokens}",
                         "trainer.parallelism.activationCheckpointing=false")
    model = attach_logprob_head(small_model(SMALL))
    optimizer = adamw(model, config.optim)
    ids = torch.randint(0, SMALL["vocab_size"], (1, tokens))
    targets = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)

    def step():
        for _ in range(2):
            request_stats(model, targets)
            stats = model(input_ids=ids, **packed_inputs(tokens)).logits
            request_stats(model, None)
            (-stats[..., 0].mean() - 0.01 * stats[..., 1].mean()).backward()
        optimizer.step()

    step()  # gradients and AdamW state exist from now on
    measured = peak_bytes(step)
    plan = mp.plan(config, SMALL, 1, mp.gib(80), dtype="float32", cuda=False)
    phases = {}
    for term in plan.terms:
        phases[term.phase] = phases.get(term.phase, 0) + term.bytes
    planned = max(phases["micro-batch"], phases["optimizer step"])
    print(f"step: measured {measured / 2**20:.1f} MiB, planned {planned / 2**20:.1f} MiB")
    assert abs(planned - measured) <= 0.15 * measured
    assert not plan.activation_checkpointing


def test_parameter_counts_are_the_models_own():
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        real = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**QWEN_7B, "num_hidden_layers": 3}))
    shape = mp.model_shape({**QWEN_7B, "num_hidden_layers": 3})
    assert shape.total() == sum(p.numel() for p in real.parameters())
    assert shape.largest == real.model.embed_tokens.weight.numel()


def write_model(tmp_path: Path, config: dict) -> str:
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    from rlhf_trainer.models.builtin import build_tokenizer

    build_tokenizer().save_pretrained(directory)  # for preflight's data checks of the built-in task
    return str(directory)


def test_preflight_refuses_a_7b_job_that_cannot_fit_and_names_what_fits(tmp_path):
    from rlhf_trainer.preflight import check

    model = write_model(tmp_path, QWEN_7B)
    config = grpo_config(f"model.path={model}", "trainer.gpuMemoryGiB=80",
                         "trainer.parallelism.activationCheckpointing=false", "trainer.maxTokensPerMicroBatch=16384")
    problems = [p for p in check(config, 8) if "the plan needs" in p]
    assert len(problems) == 1, problems
    message = problems[0]
    assert message.startswith("spec.trainer: the plan needs ") and "of 80.0" in message
    assert "trainer.parallelism.activationCheckpointing: true" in message
    suggested = int(message.split("trainer.maxTokensPerMicroBatch <= ")[1].split()[0])
    assert suggested % mp.TOKEN_STEP == 0 and suggested < 16384

    def plan_at(tokens: int, checkpointing: bool | None = False):
        c = config.model_copy(update={"optim": config.optim.model_copy(update={"max_tokens_per_micro_batch": tokens})})
        return mp.plan(c, QWEN_7B, 8, mp.gib(80), checkpointing=checkpointing)

    assert plan_at(suggested).fits and not plan_at(suggested + mp.TOKEN_STEP).fits
    assert plan_at(16384, checkpointing=True).fits  # what the message's first fix promises


def test_unset_checkpointing_is_decided_by_the_plan(tmp_path):
    config = grpo_config("trainer.maxTokensPerMicroBatch=16384")
    assert config.optim.parallelism.activation_checkpointing is None
    big = mp.plan(config, QWEN_7B, 8, mp.gib(80))
    assert big.checkpointing_decided and big.activation_checkpointing and big.fits
    small = mp.plan(config, QWEN_1_5B, 16, mp.gib(80))
    assert small.checkpointing_decided and not small.activation_checkpointing and small.fits
    assert mp.resolve_checkpointing(config, QWEN_7B, 8, mp.gib(80), cuda=True)
    assert not mp.resolve_checkpointing(config, QWEN_7B, 8, mp.gib(80), cuda=False)  # CPU: off unless asked


def test_the_readme_cluster_example_fits_on_8_x_80_gb(tmp_path):
    """examples/rlhfjob.yaml with its defaults (its model's shapes): accepted by preflight."""
    from rlhf_trainer.preflight import memory_problems

    model = write_model(tmp_path, QWEN_1_5B)
    job = load_job(ROOT / "examples/rlhfjob.yaml", [f"model.path={model}", "trainer.gpuMemoryGiB=80"])
    config = TrainerConfig.from_job(job)
    assert memory_problems(config, 8, QWEN_1_5B) == []
    assert memory_problems(config, job.spec.trainer.num_nodes * job.spec.trainer.nproc_per_node, QWEN_1_5B) == []
    # and not vacuously: the same job on 24 GB GPUs without checkpointing does not fit
    off = config.optim.parallelism.model_copy(update={"activation_checkpointing": False})
    tight = config.model_copy(update={"optim": config.optim.model_copy(update={"gpu_memory_gib": 24.0,
                                                                                "parallelism": off})})
    assert memory_problems(tight, 8, QWEN_1_5B) != []


def test_no_gpu_no_plan(monkeypatch):
    """Local CPU mode: no trainer.gpuMemoryGiB and no nvidia-smi, nothing is refused."""
    from rlhf_trainer import preflight

    monkeypatch.setattr(preflight.checks, "detect_gpu_bytes", lambda: None)
    config = grpo_config("trainer.parallelism.activationCheckpointing=false")
    assert preflight.memory_problems(config, 1, QWEN_7B) == []


def test_the_launcher_exits_2_on_a_plan_that_does_not_fit(tmp_path, monkeypatch, capsys):
    from rlhf_contract.pod import ENV_TRAINER_CONFIG
    from rlhf_trainer import launch

    model = write_model(tmp_path, QWEN_7B)
    config = grpo_config(f"model.path={model}", "trainer.gpuMemoryGiB=80",
                         "trainer.parallelism.activationCheckpointing=false")
    path = tmp_path / "trainer.json"
    path.write_text(config.to_json())
    monkeypatch.setenv(ENV_TRAINER_CONFIG, str(path))
    monkeypatch.setenv("RLHF_TERMINATION_LOG", str(tmp_path / "termination-log"))
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: pytest.fail("torchrun started"))
    assert launch.main(["--nnodes=1", "--nproc-per-node=8"]) == 2
    assert "spec.trainer: the plan needs" in capsys.readouterr().err


def test_the_launcher_skips_only_the_check_rlhfctl_ran_on_that_very_file(tmp_path, monkeypatch, capsys):
    """Local mode: `rlhfctl run` has checked the config file and passes its digest; the launcher
    starts the trainer without checking it again. A file changed since is checked (exit 2)."""
    from rlhf_contract.pod import ENV_TRAINER_CONFIG
    from rlhf_trainer import launch

    model = write_model(tmp_path, QWEN_7B)
    config = grpo_config(f"model.path={model}", "trainer.gpuMemoryGiB=80",
                         "trainer.parallelism.activationCheckpointing=false")
    path = tmp_path / "trainer.json"
    path.write_text(config.to_json())
    monkeypatch.setenv(ENV_TRAINER_CONFIG, str(path))
    monkeypatch.setenv("RLHF_TERMINATION_LOG", str(tmp_path / "termination-log"))
    monkeypatch.setenv(launch.ENV_CHECKED_CONFIG, launch.config_digest(path))

    class Started(Exception):
        pass

    def popen(command, **kwargs):
        raise Started(command)

    monkeypatch.setattr("subprocess.Popen", popen)
    with pytest.raises(Started, match="torch.distributed.run"):
        launch.main(["--nnodes=1", "--nproc-per-node=8"])
    path.write_text(config.to_json() + "\n")  # not the file that was checked
    assert launch.main(["--nnodes=1", "--nproc-per-node=8"]) == 2
    assert "spec.trainer: the plan needs" in capsys.readouterr().err


def test_weight_sync_term_holds_the_packing_codes_peak_wherever_the_largest_tensor_falls():
    """The sender's real packing (`checked_bytes`: fp32 gathered, cast to bf16; `pack_buckets`
    into its 3-buffer ring, two buckets in flight) over a 7B-like tensor sequence scaled to a
    1 MiB bucket (embedding and head 1.015 buckets, layers of q, k, v, o and three MLP
    weights): the plan's term is above the allocator's peak for every fill of the bucket the
    head closes, and at most 15 % above the worst."""
    import collections

    from rlhf_trainer.weight_sync.buckets import BufferRing, pack_buckets
    from rlhf_trainer.weight_sync.buckets import checked_bytes

    bucket = 1 << 20
    largest = int(1.015 * bucket / 2)  # elements: bf16 on the wire
    layer = [int(f * bucket / 2) for f in (0.0239, 0.0034, 0.0034, 0.0239, 0.1265, 0.1265, 0.1265)]
    planned = mp.weight_sync_bytes(bucket, largest)
    worst = 0
    for layers, filler in [(3, 0.0), (6, 0.5), (6, 1.0), (8, 0.7), (8, 0.95)]:
        sizes = [largest, *layer * layers, *([int(filler * bucket / 2)] if filler else []), largest]
        meta = [(f"t{i}", [n], torch.float32) for i, n in enumerate(sizes)]
        wire = [(name, shape, torch.bfloat16) for name, shape, _ in meta]

        def gathered():
            for _, shape, _ in meta:
                tensor = torch.ones(shape)  # held by the generator while it is cast, as a gather is
                yield tensor

        def round_():
            in_flight = collections.deque(maxlen=2)  # one queued, one broadcasting
            for packed in pack_buckets(checked_bytes(meta, gathered(), torch.device("cpu"), wire), bucket,
                                       BufferRing("cpu", 3)):
                in_flight.append(packed)

        measured = peak_bytes(round_)
        assert measured <= planned, (layers, filler, measured / bucket)
        worst = max(worst, measured)
    assert planned <= 1.15 * worst, (planned / bucket, worst / bucket)
