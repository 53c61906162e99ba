"""Colocated placement (`rollout.placement: colocated`): the rollout servers share the
trainer's devices and the two take turns.

Between two steps the servers hold the current weights with their KV cache asleep, and the
trainer's state is resident (checkpoints and evaluation see it as in separate placement).
A step then goes:

  generate  the trainer's engines offload their state to the host (`offloadTrainer`); all
            ranks meet; rank 0 wakes the servers' KV cache (POST /wake_up?tags=kv_cache)
  train     rank 0 puts the servers to sleep (POST /sleep?level=L: level 2 discards their
            weights and KV cache, level 1 keeps the weights in host memory); all ranks meet;
            the engines reload their state
  sync      rank 0 wakes the servers' weights (POST /wake_up?tags=weights) and the weights
            are pushed as in separate placement: after a level-2 sleep the servers hold
            uninitialised memory until then, which is why every step syncs, even one whose
            optimizer steps were all skipped

Evaluation between steps generates the same way, then goes back to sleep and pushes the
weights again, so the state between steps is always the same. Servers that get these calls
in the wrong order refuse to generate (HTTP 409 from the CPU engine): rollouts are never
sampled from discarded weights.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging

import httpx
import torch.distributed as dist

from rlhf_contract.api.models import ColocatedSpec

log = logging.getLogger("rlhf_trainer")


class ColocationError(RuntimeError):
    """A rollout server refused a sleep or wake-up call."""


class ServerSleep:
    """Rank 0: the sleep and wake-up calls to every rollout server, in parallel."""

    def __init__(self, endpoints: list[str], timeout_s: float):
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=30.0))
        self._pool = cf.ThreadPoolExecutor(max_workers=max(1, len(self.endpoints)), thread_name_prefix="sleep-http")

    def _post(self, endpoint: str, path: str, params: dict | list) -> dict:
        try:
            response = self._http.post(endpoint + path, params=params)
        except httpx.HTTPError as exc:
            raise ColocationError(f"POST {endpoint}{path} failed: {exc!r}") from exc
        if response.status_code != 200:
            raise ColocationError(f"POST {endpoint}{path} answered HTTP {response.status_code}: {response.text[:1000]}")
        return response.json()

    def _all(self, path: str, params: dict | list) -> list[dict]:
        return [f.result() for f in [self._pool.submit(self._post, e, path, params) for e in self.endpoints]]

    def sleep(self, level: int) -> None:
        self._all("/sleep", {"level": level, "mode": "abort"})

    def wake_up(self, tags: list[str]) -> list[dict]:
        return self._all("/wake_up", [("tags", t) for t in tags])

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self._http.close()


class Colocation:
    """Every rank's side of the turns (see the module docstring); `servers` on rank 0 only."""

    def __init__(self, spec: ColocatedSpec, engines: list, servers: ServerSleep | None):
        self.spec = spec
        self.engines = engines
        self.servers = servers
        self.generating = True  # the servers start awake, with the weights they loaded
        self.turns = 0

    def _meet(self) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()

    def to_generation(self) -> None:
        """Collective: the servers may generate (a no-op when they already may)."""
        if self.generating:
            return
        if self.spec.offload_trainer:
            for engine in self.engines:
                engine.offload()
        self._meet()
        if self.servers is not None:
            self.servers.wake_up(["kv_cache"])
        self.generating = True
        self.turns += 1

    def to_training(self) -> None:
        """Collective: the servers sleep and the trainer's state is resident."""
        if not self.generating:
            return
        if self.servers is not None:
            self.servers.sleep(self.spec.sleep_level)
        self._meet()
        for engine in self.engines:
            engine.reload()
        self.generating = False

    def before_sync(self) -> None:
        """Collective: the servers sleep, then their weights wake for the push."""
        self.to_training()
        if self.servers is not None:
            self.servers.wake_up(["weights"])

    def close(self) -> None:
        if self.servers is not None:
            self.servers.close()
