"""One batched generation loop over a Hugging Face causal LM with a KV cache.

`BatchGenerator.generate(seqs)` left-pads the prompts of all sequences into one batch
(attention mask + position ids counted from each row's first real token), prefills
once, then decodes one token per step for every unfinished row. Each sequence keeps
its own sampling parameters, random generator and stop conditions; finished rows are
dropped from the batch (and from the KV cache) so they cost nothing afterwards.

Sampling follows vLLM's order: temperature, then top-k, then top-p, then a draw from
the sequence's own `torch.Generator`. Temperature below 1e-5 is greedy. The logprobs
returned are vLLM's default `raw_logprobs`: log_softmax of the raw logits, before any
temperature / top-k / top-p processing.

Continuous batching, as vLLM: between two decode steps `admit(free_rows)` may hand over
sequences that arrived meanwhile; they are prefilled on their own, their KV cache is
left-padded (or the running one is) to a common length and joined to the running batch,
and they decode with it from the next step (each row keeps its own positions and mask,
so a joined sequence gets what it would have got alone). `on_finished(seq)` is called
as soon as a sequence is done, so a short request answers without waiting for the
batch's longest one. Each sampled token records `weight_version` as it was at that step:
weights change only between steps, so the label is the one of the weights that computed
the token's logits (the KV cache of earlier tokens is kept across an update, as vLLM's
pause mode "keep" keeps it).

Simplifications (compared with vLLM): no paged KV cache (joining copies the cache), no
chunked prefill, no prefix caching, no stop strings, no penalties, no `min_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
"""vLLM's `--logprobs-mode` values that the engine implements (raw: before temperature /
top-k / top-p; processed: after them, what the sampler drew from)."""
SAMPLING_EPS = 1e-5  # vLLM's threshold below which temperature means greedy


@dataclass(frozen=True)
class SamplingParams:
    """Per-sequence sampling parameters (one sample; `n` is expanded by the caller)."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: sampled token only; k: plus top k; -1: all


@dataclass
class Sequence:
    """One sample being generated; filled in place by `BatchGenerator.generate`."""

    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_versions: list[str | None] = field(default_factory=list)
    """The weight version that sampled each token (a weight update between two decode steps
    changes it mid-sequence: vLLM's `weight_versions` spans)."""
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | None = None  # the stop token id that ended it (None for EOS)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class GenerationAborted(Exception):
    """Raised by a `between_steps` hook to end all running sequences with "abort"."""


class BatchGenerator:
    """Runs batched generation loops on one model; counts forward passes.

    Not thread-safe: one loop at a time (the engine's worker thread owns it).
    """

    def __init__(self, model, *, eos_token_ids: set[int], pad_token_id: int, max_model_len: int,
                 logprobs_mode: str = "raw_logprobs"):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.model = model
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_model_len = max_model_len
        self.num_forward_steps = 0
        self.num_batches = 0
        self.num_generated_tokens = 0
        self.max_batch_size = 0
        self.weight_version: str | None = None
        """The label of the weights now loaded; set only between two steps (the engine's hold)."""

    @torch.inference_mode()
    def generate(self, seqs: list[Sequence], between_steps: Callable[[], None] = lambda: None,
                 admit: Callable[[int], list[Sequence]] | None = None,
                 on_finished: Callable[[Sequence], None] = lambda seq: None) -> None:
        """Generate until every sequence in `seqs` (and every admitted one) is finished.

        `between_steps` runs after each forward pass and sampling (the engine parks the
        loop there while paused); it may raise `GenerationAborted`. `admit(n)` (if given)
        then returns at most n new sequences to join the batch.
        """
        if not seqs:
            return
        self.num_batches += 1
        device = next(self.model.parameters()).device
        seqs = list(seqs)
        reported: set[int] = set()

        def report(rows: list[Sequence]) -> None:
            for seq in rows:
                if seq.finished and id(seq) not in reported:
                    reported.add(id(seq))
                    on_finished(seq)

        cache, attention_mask, last_position, logits = self._prefill(seqs, device)
        active = list(range(len(seqs)))  # batch row -> index into seqs
        self.max_batch_size = max(self.max_batch_size, len(active))
        try:
            while True:
                next_tokens = self._sample_and_check(logits, [seqs[i] for i in active])
                report([seqs[i] for i in active])
                keep = [row for row, i in enumerate(active) if not seqs[i].finished]
                if not keep:  # sequences queued now start the worker's next loop
                    return
                between_steps()
                new = admit(self.max_num_seqs - len(keep)) if admit is not None else []
                if len(keep) < len(active):
                    rows = torch.tensor(keep, dtype=torch.long, device=device)
                    cache.batch_select_indices(rows)
                    attention_mask = attention_mask[rows]
                    next_tokens = next_tokens[rows]
                    last_position = last_position[rows]
                    active = [active[row] for row in keep]
                if new:
                    (cache, attention_mask, last_position, next_tokens, active, seqs) = self._join(
                        new, seqs, active, cache, attention_mask, last_position, next_tokens, device, report)
                attention_mask = torch.cat(
                    [attention_mask, attention_mask.new_ones((len(active), 1))], dim=1
                )
                last_position = last_position + 1
                logits = self._forward(
                    next_tokens[:, None], attention_mask, last_position[:, None], cache
                )
        except GenerationAborted:
            for i in active:
                if not seqs[i].finished:
                    seqs[i].finish_reason = "abort"
            report([seqs[i] for i in active])

    max_num_seqs = 256
    """Rows a running batch may hold (the engine sets its own)."""

    def _prefill(self, seqs: list[Sequence], device: torch.device):
        """Left-padded prompts of `seqs` through the model: (cache, mask, last positions,
        logits of each row's last prompt token)."""
        width = max(len(s.prompt_token_ids) for s in seqs)
        input_ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids = seq.prompt_token_ids
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[row, width - len(ids):] = 1
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        input_ids, attention_mask, position_ids = (t.to(device) for t in (input_ids, attention_mask, position_ids))
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(input_ids, attention_mask, position_ids, cache)
        return cache, attention_mask, position_ids[:, -1], logits

    def _join(self, new: list[Sequence], seqs: list[Sequence], active: list[int], cache, attention_mask,
              last_position, next_tokens, device, report):
        """Prefill `new`, sample their first tokens, and join the unfinished ones to the
        running batch (KV caches and masks left-padded to one length)."""
        new_cache, new_mask, new_last, new_logits = self._prefill(new, device)
        new_tokens = self._sample_and_check(new_logits, new)
        report(new)
        keep = [row for row, seq in enumerate(new) if not seq.finished]
        base = len(seqs)
        seqs = seqs + new
        if not keep:
            return cache, attention_mask, last_position, next_tokens, active, seqs
        if len(keep) < len(new):
            rows = torch.tensor(keep, dtype=torch.long, device=device)
            new_cache.batch_select_indices(rows)
            new_mask, new_last, new_tokens = new_mask[rows], new_last[rows], new_tokens[rows]
        if not active:
            return new_cache, new_mask, new_last, new_tokens, [base + r for r in keep], seqs
        length = max(attention_mask.shape[1], new_mask.shape[1])
        for old_layer, new_layer in zip(cache.layers, new_cache.layers):
            old_layer.keys, old_layer.values = (
                torch.cat([_left_pad(a, length, dim=2), _left_pad(b, length, dim=2)], dim=0)
                for a, b in ((old_layer.keys, new_layer.keys), (old_layer.values, new_layer.values)))
        attention_mask = torch.cat([_left_pad(attention_mask, length, dim=1), _left_pad(new_mask, length, dim=1)])
        self.max_batch_size = max(self.max_batch_size, len(active) + len(keep))
        return (cache, attention_mask, torch.cat([last_position, new_last]), torch.cat([next_tokens, new_tokens]),
                active + [base + r for r in keep], seqs)

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.num_forward_steps += 1
        return out.logits[:, -1, :].float()

    def _sample_and_check(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Sample one token per row, record logprobs, apply stop conditions."""
        processed = torch.stack([_processed_logits(logits[row], seq.params) for row, seq in enumerate(seqs)])
        raw_logprobs = torch.log_softmax(logits if self.logprobs_mode == "raw_logprobs" else processed, dim=-1)
        tokens = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        for row, seq in enumerate(seqs):
            tokens[row] = _draw(processed[row], seq.params, seq.generator)
        token_list = tokens.tolist()
        sampled_lps = raw_logprobs.gather(1, tokens[:, None])[:, 0].tolist()
        for row, (seq, token, lp) in enumerate(zip(seqs, token_list, sampled_lps)):
            seq.token_ids.append(token)
            seq.logprobs.append(lp)
            seq.token_versions.append(self.weight_version)
            if seq.params.logprobs is not None:
                seq.top_logprobs.append(_top_logprobs(raw_logprobs[row], seq.params.logprobs))
            self.num_generated_tokens += 1
            self._check_stop(seq, token)
        return tokens

    def _check_stop(self, seq: Sequence, token: int) -> None:
        # Same precedence as vLLM: EOS, then stop_token_ids, then length.
        if not seq.params.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif token in seq.params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif (
            len(seq.token_ids) >= seq.params.max_tokens
            or len(seq.prompt_token_ids) + len(seq.token_ids) >= self.max_model_len
        ):
            seq.finish_reason = "length"


def _processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature -> top-k -> top-p (masked to -inf): what the draw samples from, and what
    `processed_logprobs` are the log-softmax of. Greedy leaves the logits as they are."""
    if params.temperature < SAMPLING_EPS:
        return logits
    x = logits / params.temperature
    if 0 < params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=False)
        cumulative = torch.softmax(sorted_x, dim=-1).cumsum(-1)
        drop_sorted = cumulative <= 1.0 - params.top_p
        drop_sorted[-1] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def _draw(x: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Argmax when greedy, else a multinomial draw with the sequence's generator."""
    if params.temperature < SAMPLING_EPS:
        return int(x.argmax())
    return int(torch.multinomial(torch.softmax(x, dim=-1), 1, generator=generator))


def _top_logprobs(logprobs: torch.Tensor, k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, raw logprob) pairs; k = -1 means the whole vocabulary."""
    if k == 0:
        return []
    k = logprobs.numel() if k < 0 else min(k, logprobs.numel())
    values, ids = torch.topk(logprobs, k)
    return list(zip(ids.tolist(), values.tolist()))


def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """Zeros prepended along `dim` up to `length` (masked positions of the KV cache)."""
    missing = length - x.shape[dim]
    if missing <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)
