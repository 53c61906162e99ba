"""vLLM's OpenAI-compatible completions protocol: the subset RL needs.

Field names and defaults follow vLLM's `CompletionRequest` / `CompletionResponseChoice`
(vllm/entrypoints/openai/completion/protocol.py): `prompt_token_ids` and `token_ids`
sit on each choice when `return_token_ids` is true; `stop_reason` is the stop token id
that ended a choice (null for EOS); legacy completions logprobs (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`) where `top_logprobs` holds the sampled
token plus the top `logprobs` tokens; logprobs are clamped at -9999.0 as vLLM does.

Sampling fields a request omits take the model's `generation_config.json` values when
the server runs with `--generation-config auto` (vLLM's default: temperature, top_p,
top_k, min_p, repetition_penalty, presence_penalty, frequency_penalty), and vLLM's
neutral values with `--generation-config vllm` (what our launcher passes to both
engines, so a model's file never changes how rollouts are sampled).

Not supported (rejected with 400 when set, or when the generation config sets them):
`stream`, `echo`, `stop` strings, `best_of`/`use_beam_search`, penalties, `min_p`,
`logit_bias`. Other unknown fields are ignored.

One field beyond vLLM's completions choice: `weight_versions`, the spans of output tokens
each weight version sampled, in vLLM's own `WeightVersionSpan` form (`{"version", "start",
"end"}`, `[start, end)`; vllm/outputs.py, which vLLM returns on its token-in-token-out
`/generate` route, not on `/v1/completions`). A weight update with pause mode "keep" in the
middle of a response gives it two spans.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from .generator import SamplingParams, Sequence


class RequestError(ValueError):
    """An invalid request: HTTP 400 with an OpenAI-style error naming `param`."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400):
        super().__init__(message)
        self.param = param
        self.status_code = status_code


def error_body(message: str, param: str | None, status_code: int) -> dict:
    """OpenAI / vLLM error body: {"error": {"message", "type", "param", "code"}}."""
    kind = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError",
            503: "ServiceUnavailableError"}.get(
        status_code, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status_code}}


class CompletionRequest(BaseModel):
    """POST /v1/completions body (vLLM names and defaults)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str] | None = None
    n: int = 1
    max_tokens: int | None = 16
    temperature: float | None = None  # default 1.0
    top_p: float | None = None  # default 1.0
    top_k: int | None = None  # default 0 (off); -1 also means off
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    return_token_ids: bool | None = None
    ignore_eos: bool = False
    stream: bool | None = False
    echo: bool | None = False
    stop: str | list[str] | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None


def parse_request(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object", None)
    try:
        return CompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first.get("loc") else None
        raise RequestError(f"{param}: {first['msg']}", param) from exc


GENERATION_CONFIG_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature",
                            "top_k", "top_p", "min_p")


def apply_generation_defaults(req: CompletionRequest, defaults: dict) -> CompletionRequest:
    """Fill the sampling fields the request left out from the model's generation config."""
    unset = {k: v for k, v in defaults.items() if k in GENERATION_CONFIG_FIELDS and getattr(req, k) is None}
    return req.model_copy(update=unset) if unset else req


def validate(req: CompletionRequest, *, vocab_size: int) -> None:
    """The checks vLLM's SamplingParams and renderer make, with the field named."""
    if req.stream:
        raise RequestError("stream is not supported by the CPU engine", "stream")
    if req.echo:
        raise RequestError("echo is not supported by the CPU engine", "echo")
    if req.stop:
        raise RequestError("stop strings are not supported by the CPU engine; use "
                           "stop_token_ids", "stop")
    if req.use_beam_search or (req.best_of is not None and req.best_of != req.n):
        raise RequestError("beam search / best_of is not supported by the CPU engine",
                           "best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0.0):
            raise RequestError(f"{name} is not supported by the CPU engine", name)
    if req.repetition_penalty not in (None, 1.0):
        raise RequestError("repetition_penalty is not supported by the CPU engine",
                           "repetition_penalty")
    if req.min_p not in (None, 0.0):
        raise RequestError("min_p is not supported by the CPU engine", "min_p")
    if req.logit_bias:
        raise RequestError("logit_bias is not supported by the CPU engine", "logit_bias")
    if req.n < 1:
        raise RequestError(f"n must be at least 1, got {req.n}.", "n")
    if req.max_tokens is None or req.max_tokens < 1:
        raise RequestError(f"max_tokens must be at least 1, got {req.max_tokens}.",
                           "max_tokens")
    if req.temperature is not None and req.temperature < 0:
        raise RequestError(f"temperature must be non-negative, got {req.temperature}.",
                           "temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {req.top_p}.", "top_p")
    if req.top_k is not None and req.top_k < -1:
        raise RequestError(f"top_k must be -1 (disable), or at least 1, got {req.top_k}.",
                           "top_k")
    if req.logprobs is not None and req.logprobs < -1:
        raise RequestError("`logprobs` must be a positive value or -1.", "logprobs")
    if req.seed is not None and not -(2**63) <= req.seed < 2**63:
        raise RequestError("seed must fit in a signed 64-bit integer", "seed")
    for token in req.stop_token_ids or []:
        if not 0 <= token < vocab_size:
            raise RequestError(f"stop_token_ids: token id {token} is out of vocabulary "
                               f"[0, {vocab_size})", "stop_token_ids")


def prompts_as_ids(req: CompletionRequest, tokenizer, vocab_size: int,
                   max_model_len: int) -> list[list[int]]:
    """Normalise the four prompt forms into token-id lists; check them."""
    prompt = req.prompt
    if prompt is None or prompt == "" or prompt == []:
        raise RequestError("Either prompt or prompt_embeds must be provided and non-empty.",
                           "prompt")
    if isinstance(prompt, str):
        prompts = [tokenizer(prompt).input_ids]
    elif all(isinstance(p, int) for p in prompt):
        prompts = [list(prompt)]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [tokenizer(p).input_ids for p in prompt]
    else:
        prompts = [list(p) for p in prompt]
    for ids in prompts:
        if not ids:
            raise RequestError("prompt: every prompt must have at least one token", "prompt")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"prompt: token id {bad[0]} is out of vocabulary "
                               f"[0, {vocab_size})", "prompt")
        if len(ids) + req.max_tokens > max_model_len:
            raise RequestError(
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"you requested {req.max_tokens} output tokens and your prompt contains "
                f"{len(ids)} input tokens, for a total of {len(ids) + req.max_tokens} "
                "tokens. Please reduce the length of the input prompt or the number of "
                "requested output tokens.", "max_tokens")
    return prompts


def sampling_params(req: CompletionRequest) -> SamplingParams:
    return SamplingParams(
        max_tokens=req.max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        stop_token_ids=frozenset(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
    )


def completion_response(req: CompletionRequest, model_name: str, tokenizer,
                        per_prompt: list[list[Sequence]]) -> dict:
    """The OpenAI completions response; choices ordered prompt by prompt, then sample."""
    choices = []
    prompt_tokens = completion_tokens = 0
    for seqs in per_prompt:
        prompt_tokens += len(seqs[0].prompt_token_ids)
        for seq in seqs:
            completion_tokens += len(seq.token_ids)
            choices.append({
                "index": len(choices),
                "text": tokenizer.decode(seq.token_ids, skip_special_tokens=True),
                "logprobs": _logprobs(seq, tokenizer) if req.logprobs is not None else None,
                "finish_reason": seq.finish_reason,
                "stop_reason": seq.stop_reason,
                "token_ids": list(seq.token_ids) if req.return_token_ids else None,
                "prompt_logprobs": None,
                "prompt_token_ids": list(seq.prompt_token_ids) if req.return_token_ids else None,
                "weight_versions": weight_version_spans(seq.token_versions),
            })
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def weight_version_spans(labels: list[str | None]) -> list[dict] | None:
    """vLLM's `_weight_version_spans` (vllm/v1/engine/output_processor.py): a span starts where a
    token's label differs from the last span's; unlabelled tokens extend the span before
    them; None when no token is labelled."""
    starts: list[tuple[str, int]] = []
    for i, label in enumerate(labels):
        if label is not None and (not starts or starts[-1][0] != label):
            starts.append((label, i))
    if not starts:
        return None
    ends = [start for _, start in starts[1:]] + [len(labels)]
    return [{"version": v, "start": s, "end": e} for (v, s), e in zip(starts, ends)]


def _logprobs(seq: Sequence, tokenizer) -> dict:
    def token_str(token_id: int) -> str:
        return tokenizer.decode([token_id], skip_special_tokens=False)

    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    offset = 0
    for token_id, lp, top in zip(seq.token_ids, seq.logprobs, seq.top_logprobs):
        token = token_str(token_id)
        tokens.append(token)
        token_logprobs.append(max(lp, -9999.0))
        step = {token: max(lp, -9999.0)}  # the sampled token first, then the top k
        for top_id, top_lp in top:
            step.setdefault(token_str(top_id), max(top_lp, -9999.0))
        top_logprobs.append(step)
        text_offset.append(offset)
        offset += len(token)
    return {"text_offset": text_offset, "token_logprobs": token_logprobs,
            "tokens": tokens, "top_logprobs": top_logprobs}
