"""The engine: a model, a queue of sequences and one background worker thread.

Requests are expanded into sequences (prompts x n) and queued. The worker thread takes
everything queued (up to `max_num_seqs` sequences) and runs a batched generation loop
over them (`BatchGenerator`); sequences queued while it runs join it between two decode
steps (continuous batching), and each request's asyncio future is resolved as soon as
its last sequence is done. The event loop thread never runs model code, so `/health` answers
while a batch is generating or weights are being received.

Pausing works at step granularity, as vLLM's pause modes (POST /pause?mode=...):
- "keep": the running loop parks between two forward passes (KV cache kept) and the
  queue is frozen; new requests are still accepted and queued; `resume` continues.
- "wait": new requests are rejected (HTTP 503, as vLLM) from the moment the pause starts;
  in-flight requests run to completion, then the engine is paused.
- "abort": new requests are rejected (503); in-flight requests end at once with
  finish_reason "abort".
Weights are changed only while no step runs: a weight update holds the worker between
two steps (`hold`) whether or not generation is paused, as vLLM runs its weight RPCs
between engine steps. Pausing is never implied by a weight update (vLLM's
start_weight_update does not pause either).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import threading
from collections import deque
from dataclasses import dataclass

import torch

from .generator import BatchGenerator, GenerationAborted, SamplingParams, Sequence

PAUSE_MODES = ("abort", "wait", "keep")


@dataclass
class _Request:
    seqs: list[Sequence]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    remaining: int


class Engine:
    """Owns the model; thread-safe entry points for the HTTP layer."""

    def __init__(self, model, tokenizer, *, max_num_seqs: int = 256, seed: int = 0,
                 max_model_len: int | None = None, logprobs_mode: str = "raw_logprobs"):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or int(
            getattr(model.config, "max_position_embeddings", 2048)
        )
        self.vocab_size = int(model.config.vocab_size)
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = next(iter(self.eos_token_ids), 0)
        self.generator = BatchGenerator(
            self.model, eos_token_ids=self.eos_token_ids, pad_token_id=pad,
            max_model_len=self.max_model_len, logprobs_mode=logprobs_mode,
        )
        self.generator.max_num_seqs = max_num_seqs
        self._rng = random.Random(seed)  # seeds for requests that bring none
        self.num_requests = 0
        self._cv = threading.Condition()
        self._queue: deque[tuple[_Request, Sequence]] = deque()
        self._running: list[_Request] = []
        self._paused = False
        self._pause_mode: str | None = None
        self._holds = 0  # weight updates holding the worker between two steps
        self._abort = False
        self._in_step = False  # a forward pass / sampling step is running
        self._batch_running = False  # a generation loop is running (maybe parked)
        self._stopped = False
        self._worker = threading.Thread(target=self._work, name="cpu-engine-worker", daemon=True)
        self._worker.start()

    @property
    def weight_version(self) -> str | None:
        """The label of the loaded weights (vLLM's /finish_weight_update `weight_version`)."""
        return self.generator.weight_version

    @weight_version.setter
    def weight_version(self, version: str | None) -> None:
        # set between two steps (a weight update holds or pauses the worker), so every token
        # is labelled with the weights that sampled it
        self.generator.weight_version = version

    # ---- generation -------------------------------------------------------------

    def new_sequences(self, prompt: list[int], params: SamplingParams, n: int,
                      seed: int | None) -> list[Sequence]:
        """n sequences for one prompt; sample i uses seed + i as vLLM's parallel sampling."""
        with self._cv:
            base = self._rng.getrandbits(63) if seed is None else seed
        return [
            Sequence(list(prompt), params, torch.Generator().manual_seed(_seed64(base + i)))
            for i in range(n)
        ]

    async def generate(self, seqs: list[Sequence]) -> list[Sequence]:
        """Queue the sequences of one request; return them once all are finished."""
        loop = asyncio.get_running_loop()
        request = _Request(seqs, loop, loop.create_future(), len(seqs))
        with self._cv:
            self.num_requests += 1
            self._queue.extend((request, s) for s in seqs)
            self._cv.notify_all()
        await request.future
        return seqs

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopped or (self._queue and not self._parked))
                if self._stopped:
                    return
                batch = self._take(self.max_num_seqs)
                self._in_step = self._batch_running = True
            owner = {id(s): r for r, s in batch}

            def admit(free: int) -> list[Sequence]:
                """Sequences queued since the loop started join it (continuous batching)."""
                with self._cv:
                    if self._parked or self._abort:
                        return []
                    joined = self._take(free)
                owner.update((id(s), r) for r, s in joined)
                return [s for _, s in joined]

            def on_finished(seq: Sequence) -> None:
                request = owner[id(seq)]
                request.remaining -= 1
                if request.remaining == 0:
                    _resolve(request, None)

            error: BaseException | None = None
            try:
                self.generator.generate([s for _, s in batch], self._between_steps, admit, on_finished)
            except BaseException as exc:  # resolve futures rather than kill the worker
                error = exc
            finally:
                with self._cv:
                    self._in_step = self._batch_running = False
                    self._cv.notify_all()
            for request in {id(r): r for r in owner.values()}.values():
                if error is not None or request.remaining <= 0:
                    _resolve(request, error if request.remaining > 0 else None)

    def _take(self, limit: int) -> list[tuple[_Request, Sequence]]:
        """Up to `limit` queued sequences (call with the lock held)."""
        taken = []
        while self._queue and len(taken) < limit:
            taken.append(self._queue.popleft())
        return taken

    def _between_steps(self) -> None:
        """Runs in the worker between forward passes: park while paused, honour aborts."""
        with self._cv:
            if self._abort:
                raise GenerationAborted
            if self._parked:
                self._in_step = False
                self._cv.notify_all()
                self._cv.wait_for(lambda: not self._parked or self._abort or self._stopped)
                self._in_step = True
                if self._abort:
                    raise GenerationAborted

    # ---- pause / resume (blocking: call from a thread) --------------------------

    @property
    def _parked(self) -> bool:
        return self._paused or self._holds > 0

    def pause(self, mode: str = "abort") -> None:
        """vLLM's pause_generation(mode): see the module docstring."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        with self._cv:
            self._pause_mode = mode
            if mode == "wait" and not self._paused:
                self._cv.wait_for(lambda: not self._queue and not self._batch_running)
            self._paused = True
            if mode == "abort":
                self._abort = True
                while self._queue:
                    request, seq = self._queue.popleft()
                    seq.finish_reason = "abort"
                    request.remaining -= 1
                    if request.remaining == 0:
                        _resolve(request, None)
                self._cv.notify_all()
                # the running loop (even a parked one) must see the flag before it is reset
                self._cv.wait_for(lambda: not self._batch_running)
                self._abort = False
            self._cv.wait_for(lambda: not self._in_step)

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._pause_mode = None
            self._cv.notify_all()

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def rejects_new_requests(self) -> bool:
        """vLLM rejects new requests (503) while paused in "abort" or "wait" mode."""
        return self._pause_mode in ("abort", "wait")

    @property
    def is_idle(self) -> bool:
        """No generation loop is running or queued (nothing holds KV blocks)."""
        with self._cv:
            return not self._queue and not self._batch_running

    @contextlib.contextmanager
    def hold(self):
        """Keep the worker between two steps (weights may change) for the `with` body."""
        with self._cv:
            self._holds += 1
            self._cv.wait_for(lambda: not self._in_step)
        try:
            yield
        finally:
            with self._cv:
                self._holds -= 1
                self._cv.notify_all()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    # ---- weights -----------------------------------------------------------------

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF parameter (and persistent buffer) names -> tensors, tied names included."""
        return dict(self.model.state_dict(keep_vars=False))

    def checksums(self) -> dict[str, str]:
        """sha256 of each parameter's raw bytes, by HF name (as vLLM's weight_checker)."""
        return {name: tensor_sha256(p) for name, p in self.model.named_parameters()}

    def stats(self) -> dict:
        g = self.generator
        with self._cv:
            queued = len(self._queue)
        return {
            "num_requests": self.num_requests,
            "num_batches": g.num_batches,
            "num_forward_steps": g.num_forward_steps,
            "num_generated_tokens": g.num_generated_tokens,
            "max_batch_size": g.max_batch_size,
            "num_queued_sequences": queued,
            "is_paused": self._paused,
            "pause_mode": self._pause_mode,
            "weight_version": self.weight_version,
        }


def tensor_sha256(tensor: torch.Tensor) -> str:
    flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def _resolve(request: _Request, error: BaseException | None) -> None:
    def done():
        if request.future.done():
            return
        if error is None:
            request.future.set_result(None)
        else:
            request.future.set_exception(error)

    request.loop.call_soon_threadsafe(done)


def _seed64(seed: int) -> int:
    return seed % (1 << 63)


def _eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return ids
