"""Partial rollouts (`rollout.inFlightUpdates` with `maxStaleness` = k >= 1): rank 0 keeps a
pool of prompt groups generating all the time, and a step takes the first
`schedule.promptsPerStep` groups that COMPLETE (every sample of the prompt finished), so the
longest response no longer sets the step's pace: a group still generating when its step's
batch is taken goes on, across the weight update (the servers pause with mode "keep": its
later tokens come from the new weights, each labelled with its version), and is trained by a
later step.

Pool: the prompts handed out and not yet taken (generating, or finished and waiting) are at
most k x promptsPerStep, and one step's more once the weights trained on the last batch taken
reach the servers (at the start too), never more than the run trains. In completion order
that trains a group at most k versions after its start (AReaL's admission rule), as the
whole-batch gate of prefetch.py does, while a step can be taken with up to promptsPerStep
groups still generating (k = 1 included: 2 x promptsPerStep in the pool after a push, and
the take needs promptsPerStep of them finished). Each group is one request of
`samplesPerPrompt` samples, seeded by (job seed, prompt index), so a regenerated prompt
samples as it did. A group records the version the servers held when it started; a token
with no version from the server (vLLM's /v1/completions) gets that one, a lower bound.

Staleness: a group finishing late (after groups started later) may be trained more than k
versions after it started; its
tokens are then bounded one by one as everywhere (staleness.py): a token more than k versions
behind the trained policy leaves the loss (`stale_token_fraction`); the group is trained, not
dropped or regenerated, so no prompt is trained twice.

Exactly once: every group the pool starts is taken by exactly one step (taken in completion
order, removed when taken). Resume: the position a step records (`data_position`) is the
source's position plus `pending`, the prompts handed out before it and not yet taken (still
generating or finished after the step's batch); a resumed source hands those out again first
(data/prompts.py `next_prompt`), then goes on from the position, so a resume trains exactly
the prompts not trained before it. Used with the plain sampler only: multi-turn
environments, tools, agents and dynamic sampling keep whole-batch prefetching (prefetch.py).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..data.sequences import Row
from .staleness import bound_stale_tokens
from .types import RolloutBatch

POLL_S = 0.02
"""How often the pool looks whether the servers' version advanced (a push landing)."""


def supports_partial(orchestrator: Any) -> bool:
    """Partial rollouts apply: in-flight updates, the plain sampler, no dynamic sampling."""
    cfg, sampler = orchestrator.config, orchestrator.sampler
    return (cfg.sampling.in_flight_updates and sampler.env_step is None and sampler.tools is None
            and not cfg.algorithm.dynamic_sampling)


class PartialPrefetcher:
    whole_batches = False
    """A batch's groups started at different versions (the per-token bound applies)."""

    def __init__(self, orchestrator: Any, *, max_staleness: int, first_step: int, last_step: int,
                 served_version: Callable[[], int]):
        self.orchestrator, self.k, self.served_version = orchestrator, max_staleness, served_version
        self.data = orchestrator.data
        self.per_step = orchestrator.config.schedule.prompts_per_step
        self.left = max(0, last_step - first_step + 1) * self.per_step  # prompts the pool may still start
        self.seed = orchestrator.sampler.seed(0, 0)
        self._cond = threading.Condition()
        self._generating: dict[int, int] = {}  # prompt index -> version at its start
        self._done: list[tuple[int, int, list[Row]]] = []  # (index, start version, rows), completion order
        self._error: BaseException | None = None
        self._version_at_take = served_version() - 1  # at the start the pool may fill at once
        self._stop = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        orchestrator.sampler.reward.begin_step(orchestrator.trainer_state(first_step))
        self._thread = threading.Thread(target=self._run, name="rollout-pool", daemon=True)
        self._thread.start()

    # ---- the producer (the rollout client's event loop) -------------------------------

    def _run(self) -> None:
        client = self.orchestrator.sampler.client
        try:
            (client.run if hasattr(client, "run") else asyncio.run)(self._produce())
        except BaseException as err:  # surfaces in the trainer's take()
            with self._cond:
                self._error = self._error or err
                self._cond.notify_all()

    async def _produce(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        tasks: set[asyncio.Future] = set()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward") as pool:
            try:
                while True:
                    self._wake.clear()  # before reading the state: a take() after it wakes us
                    with self._cond:
                        if self._stop:
                            return
                        pushed = self.served_version() > self._version_at_take  # the last take's update landed
                        limit = (self.k + pushed) * self.per_step
                        while self.left and len(self._generating) + len(self._done) < limit:
                            index, prompt = self.data.next_prompt()
                            self._generating[index] = version = self.served_version()
                            self.left -= 1
                            tasks.add(asyncio.ensure_future(self._group(index, prompt, version, pool)))
                    if not tasks and not self.left:
                        return
                    wake = asyncio.ensure_future(self._wake.wait())
                    # a finished group, a take, or (polled) the weight update landing open room
                    done, _ = await asyncio.wait(tasks | {wake}, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                    wake.cancel()
                    for task in done - {wake}:
                        tasks.discard(task)
                        task.result()  # a failed group ends the run (raised in take)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _group(self, index: int, prompt: Any, version: int, pool: Any) -> None:
        rows = await self.orchestrator.sampler.group_rows(index, prompt, seed=self.seed, pool=pool)
        for row in rows:  # no labels from the server: the version at the group's start
            if row.versions is None:
                row.versions = [version] * len(row.response_ids)
        with self._cond:
            del self._generating[index]
            self._done.append((index, version, rows))
            self._cond.notify_all()

    # ---- the trainer's side -----------------------------------------------------------

    def take(self, step: int) -> RolloutBatch:
        """Step `step`'s batch: the first promptsPerStep groups to complete (blocks until then)."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or len(self._done) >= self.per_step)
            if self._error is not None:
                raise self._error
            taken, self._done = self._done[:self.per_step], self._done[self.per_step:]
            self._version_at_take = self.served_version()
            pending = set(self._generating) | {i for i, _, _ in self._done} | set(self.data.pending)
            position = {"position": self.data.position, **({"pending": sorted(pending)} if pending else {})}
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)  # room in the pool
        batch = self._batch(step, taken, position)
        batch.token_staleness = bound_stale_tokens(batch, trained_version=self.served_version(), max_staleness=self.k)
        return batch

    def _batch(self, step: int, taken: list[tuple[int, int, list[Row]]], position: dict) -> RolloutBatch:
        from .orchestrator import rollout_stats

        orch, groups = self.orchestrator, [rows for _, _, rows in taken]
        rows = [row for g in groups for row in g]
        if orch.config.output.save_rollouts:
            orch._save_rollouts(step, rows)
        stats = rollout_stats(groups, sampled=len(groups), dropped=0, dropped_prompts=getattr(self.data, "num_dropped", 0),
                              skipped_rows=getattr(self.data, "num_skipped", 0))
        reward = orch.sampler.reward
        stats.reward_counters = {**reward.drain_counters(), **reward.drain_metrics()}
        reward.begin_step(orch.trainer_state(step + 1))  # the groups scored from now on
        return RolloutBatch(rows, orch.config.sampling.samples_per_prompt, stats, step=step,
                            policy_version=min(v for _, v, _ in taken), data_position=position,
                            prompt_indices=[i for i, _, _ in taken])

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the pool: cancel the groups generating; wait up to `timeout_s` for it to end."""
        with self._cond:
            self._stop = True
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)
        self._thread.join(timeout_s)
