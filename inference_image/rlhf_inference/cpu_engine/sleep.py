"""Sleep mode: vLLM's dev routes for sharing devices with the trainer (`--enable-sleep-mode`).

  POST /sleep?level=0|1|2&mode=abort|wait|keep   {"status": "sleeping", "level": L}
  POST /wake_up?tags=weights&tags=kv_cache        {"status": "awake"|"sleeping", "tags": [...]|null}
  GET  /is_sleeping                               {"is_sleeping": bool}

As vLLM (`vllm/entrypoints/serve/dev/sleep/api_router.py`, `vllm/v1/engine/core.py`,
`vllm/v1/executor/abstract.py`): sleeping pauses the engine with `mode` first; level 0 only
pauses; levels 1 and 2 put both tags ("weights", "kv_cache") to sleep. Level 1 keeps a copy
of the weights in host memory and wakes with them; level 2 discards them and wakes with
uninitialised memory of the same shapes (the buffers, e.g. rotary frequencies, are kept).
Waking without tags wakes everything; a tag that is not asleep makes the wake a no-op; the
engine resumes once nothing is asleep. `is_sleeping` is true while paused or any tag sleeps.

Stricter than vLLM, so that a trainer that gets the order wrong fails at once instead of
sampling from discarded weights (trl#5312, vllm#29341): a completion request while a tag
sleeps, or after a level-2 wake before a weight update finished, answers 409; a weight
update while the weights sleep answers 500 (vLLM's state-error status). The CPU engine has
no KV cache that outlives a request, so "kv_cache" is bookkeeping only.
"""

from __future__ import annotations

import asyncio
import logging

import torch
from fastapi import APIRouter, Query, Request

from .engine import PAUSE_MODES, Engine
from .protocol import RequestError

SLEEP_TAGS = ("weights", "kv_cache")

log = logging.getLogger("rlhf_inference.cpu_engine")


class SleepStateError(RuntimeError):
    """A call the sleep state does not allow (a weight update while the weights sleep)."""


class Sleeper:
    """The engine's sleep state; `enabled` is `--enable-sleep-mode`."""

    def __init__(self, engine: Engine, enabled: bool):
        self.engine = engine
        self.enabled = enabled
        self.level = 0
        self.sleeping_tags: set[str] = set()
        self.weights_stale = False
        """Woken from level 2: the weights are uninitialised until a weight update finishes."""
        self._saved: dict[str, torch.Tensor] = {}
        self._shapes = {n: tuple(p.shape) for n, p in engine.model.named_parameters()}
        self._ids = {n: id(p) for n, p in engine.model.named_parameters(remove_duplicate=False)}  # tied names too
        self._updated: set[int] = set()  # parameters loaded since a level-2 wake
        self.counts = {"sleep": 0, "wake_up": 0}

    def stats(self) -> dict:
        """Calls so far, and the bytes of parameters the engine holds now (0 after a sleep)."""
        resident = sum(p.numel() * p.element_size() for p in self.engine.model.parameters())
        return {**self.counts, "resident_parameter_bytes": resident}

    @property
    def is_sleeping(self) -> bool:
        return self.engine.is_paused or bool(self.sleeping_tags)

    def sleep(self, level: int, mode: str) -> None:
        """Blocking (call from a thread)."""
        self.engine.pause(mode)
        self.counts["sleep"] += 1
        if level == 0 or "weights" in self.sleeping_tags:
            return  # vLLM: "Executor is already sleeping."
        with self.engine.hold():
            for name, param in self.engine.model.named_parameters():
                if level == 1:
                    self._saved[name] = param.data.clone()
                param.data = torch.empty(0, dtype=param.dtype)  # the memory goes back
        self.level = level
        self.sleeping_tags = set(SLEEP_TAGS)

    def wake_up(self, tags: list[str] | None) -> bool:
        """Wake `tags` (all when None, none when empty); True when fully awake. Blocking."""
        self.counts["wake_up"] += 1
        if tags == []:
            pass  # "scheduling" alone: resume if nothing else sleeps
        elif tags and any(t not in self.sleeping_tags for t in tags):
            log.warning("wake_up: tags %s are not all asleep (asleep: %s); nothing woken", tags, self.sleeping_tags)
        elif self.sleeping_tags:
            waking = set(tags) if tags else set(self.sleeping_tags)
            if "weights" in waking:
                self._restore_weights()
            self.sleeping_tags -= waking
        if not self.sleeping_tags:
            self.engine.resume()
        return not self.sleeping_tags

    def _restore_weights(self) -> None:
        shapes = self._shapes
        with self.engine.hold():
            for name, param in self.engine.model.named_parameters():
                param.data = self._saved.pop(name) if self.level == 1 else torch.empty(shapes[name], dtype=param.dtype)
        self.weights_stale = self.level == 2
        self._updated.clear()

    def check_generate(self) -> None:
        if self.sleeping_tags:
            raise RequestError(f"the engine is asleep ({', '.join(sorted(self.sleeping_tags))}); "
                               "POST /wake_up before generating", None, 409)
        if self.weights_stale:
            missing = len(set(self._ids.values()) - self._updated)
            raise RequestError(f"the weights were discarded by a level-2 sleep and {missing} of "
                               f"{len(set(self._ids.values()))} parameters were not updated since the wake-up; "
                               "update every weight before generating", None, 409)

    def check_weight_update(self) -> None:
        if "weights" in self.sleeping_tags:
            raise SleepStateError("the weights are asleep: POST /wake_up?tags=weights before updating them")

    def loaded(self, names) -> None:
        """A weight update copied these tensors (HF names) into the model."""
        if self.weights_stale:
            self._updated.update(self._ids[n] for n in names if n in self._ids)

    def weight_update_finished(self) -> None:
        """The update finished: fresh again once it (with those before it) covered every parameter."""
        if self.weights_stale and self._updated >= set(self._ids.values()):
            self.weights_stale = False


def sleep_router(sleeper: Sleeper) -> APIRouter:
    router = APIRouter()

    def enabled() -> None:
        if not sleeper.enabled:
            raise RequestError("sleep mode is off: start the server with --enable-sleep-mode", None, 400)

    @router.post("/sleep")
    async def sleep(level: int = Query(1, ge=0, le=2), mode: str = Query("abort")):
        enabled()
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of {'|'.join(PAUSE_MODES)}, got {mode!r}", "mode")
        await asyncio.to_thread(sleeper.sleep, level, mode)
        return {"status": "sleeping", "level": level}

    @router.post("/wake_up")
    async def wake_up(request: Request):
        enabled()
        tags = request.query_params.getlist("tags") or None
        unknown = sorted(set(tags or ()) - set(SLEEP_TAGS) - {"scheduling"})
        if unknown:
            raise RequestError(f"unknown tags {unknown}: use {', '.join(SLEEP_TAGS)}", "tags")
        waking = [t for t in tags if t != "scheduling"] if tags else None
        fully_awake = await asyncio.to_thread(sleeper.wake_up, waking)
        return {"status": "awake" if fully_awake else "sleeping", "tags": tags}

    @router.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": sleeper.is_sleeping}

    return router
