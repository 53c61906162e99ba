"""Token budgets against the context length of the models that must hold them, where a
model's config is readable (the caller reads it: `rlhfctl validate` reads a local directory's
config.json or a built-in model's config).

  policy (model.path)            data.maxPromptLength + rollout.maxTokens: the rollout
                                 servers' --max-model-len, which vLLM refuses above the
                                 model's own; rollout.maxTokens alone can never exceed it
  teacher, reward model          the same sequences, scored
  the job's own judge            data.maxPromptLength + rollout.maxTokens + judge.maxTokens,
                                 plus the rubric's own text when its tokens can be counted

Pure: no files, no tokenizer; `context_of(path)` and `count_tokens(path, text)` come from the
caller and may answer None (unknown: nothing is checked). Not checked: a judge at
`judge.url` (its context is the endpoint's), offline methods (sft, rm, dpo cut their rows to
`trainer.maxTokensPerMicroBatch`).
"""

from __future__ import annotations

from typing import Any, Callable

from ..judge_prompt import judge_text

CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
"""Where a Hugging Face config.json states the context length (the first present wins)."""


def context_length(config: dict[str, Any]) -> int | None:
    """The context length a model's config.json states (a multimodal model's `text_config`
    too), or None."""
    for node in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            if isinstance(node.get(key), int) and not isinstance(node.get(key), bool) and node[key] > 0:
                return node[key]
    return None


def budget_problems(spec: Any, context_of: Callable[[str], int | None],
                    count_tokens: Callable[[str, str], int | None] = lambda path, text: None
                    ) -> tuple[list[tuple[str, str]], list[str]]:
    """(problems as (field path, message), warnings) of `spec` (an RLHFJobSpec)."""
    if spec.offline:
        return [], []
    problems: list[tuple[str, str]] = []
    warnings: list[str] = []
    prompt, response = spec.data.max_prompt_length, spec.rollout.max_tokens
    models = [("spec.model.path", spec.model.path)]
    if spec.distillation is not None:
        models.append(("spec.distillation.teacher.path", spec.distillation.teacher.path))
    if spec.reward.model is not None:
        models.append(("spec.reward.model.path", spec.reward.model.path))
    for where, path in models:
        context = context_of(path)
        if context is None:
            continue
        if response > context:
            problems.append(("spec.rollout.maxTokens", f"{response} is beyond the context of {where} {path!r} "
                             f"({context} tokens): no response could reach it; lower rollout.maxTokens"))
        elif prompt + response > context:
            text = (f"data.maxPromptLength + rollout.maxTokens ({prompt} + {response} = {prompt + response}) is "
                    f"beyond the context of {where} {path!r} ({context} tokens)")
            if spec.rollout.engine == "vllm":
                problems.append(("spec.rollout.maxTokens", f"{text}: vLLM refuses such a --max-model-len; lower "
                                 "one of them"))
            else:
                warnings.append(f"{text}: the CPU engine runs it, vLLM would refuse it")
    judge = next((f.judge for f in spec.reward.functions() if f.type == "judge" and f.judge and not f.judge.url),
                 None)
    if judge is not None:
        context = context_of(judge.model)
        fixed = count_tokens(judge.model, judge_text(judge, "", "", ""))  # instructions, rubric, tags
        need = prompt + response + judge.max_tokens + (fixed or 0)
        if context is not None and need > context:
            parts = f"{prompt} + {response} + {judge.max_tokens}" + (f" + {fixed} of the judge's own text"
                                                                      if fixed else "")
            problems.append(("spec.reward.judge.maxTokens" if spec.reward.type == "judge" else "spec.reward.components",
                             f"the judge reads the prompt and the response in its rubric and answers: data."
                             f"maxPromptLength + rollout.maxTokens + judge.maxTokens ({parts} = {need}) is beyond "
                             f"the context of the judge model {judge.model!r} ({context} tokens); lower them or use "
                             "a judge with a longer context"))
    return problems, warnings
