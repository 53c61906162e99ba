"""Async rollout client for OpenAI-compatible servers (vLLM or the CPU engine).

Token in, token out: each prompt goes as token ids to `POST /v1/completions` with
`return_token_ids: true` and `logprobs: 0`, and the samples come back as the server's
`token_ids` and `logprobs.token_logprobs` (vLLM's processed logprobs of the sampled tokens:
after the temperature; top-p/top-k are refused for RL, so nothing else changes them).
Text is never re-tokenized. A choice's `weight_versions` spans (the CPU engine sends them;
vLLM's /v1/completions does not) become each token's policy version (`Sample.versions`).

One request per prompt (with `n` samples, so a group sharing a prompt is on one server),
so each server batches whatever is in flight. Routing: a request carrying a trajectory id
(`generate(trajectory_id=...)`: every turn of a multi-turn episode, and the episodes of one
group, share one) goes to the server that served that id before while that server is
healthy, so the server's prefix cache holds its context; any other request, and the first of
an id, goes to the healthy endpoint with the fewest outstanding requests (ties: round robin).
A server that refuses connections or answers 502/504 is marked unhealthy for
`unhealthy_s` (or by `mark_unhealthy`): its ids move to the others at their next request
and stay there; once the time is up one request probes it again (a 503, paused for a
weight sync, is not unhealthy). With `replace_servers` (`rollout.maxServerReplacements` > 0)
such a server, or one that dropped a connection and does not answer /health on a fresh one
(`DROPPED`), is instead left out (`leave_out`) until the trainer re-admits it (`readmit`),
once it has re-joined the weight-sync group with the current weights (rl/replacement.py):
a restarted server never serves the weights it started from. Connection errors are retried
with exponential backoff, on any endpoint (`RolloutClient.retry_policy`); read timeouts are not (the server may still be
working on the request); HTTP errors are not retried (except 502/503/504) and raise `RolloutError` with the
endpoint and the server's body. A 503 from a server paused for a weight sync is sent again
until the client timeout without using up the retries (`RolloutClient.paused_policy`).
With `seed` set, prompt i gets its own seed derived from (seed, i), so a run is reproducible
whatever endpoint serves it (as long as the servers hold the same weights). Every sampling
field vLLM would otherwise fill from the model's generation_config.json is sent explicitly
(neutral penalties, min_p 0).

What each server is (version, weight-transfer engine) is asked once at start, by the
handshake (servers.py); `wait_ready` is its wait for /health.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import itertools
import threading
import logging
import time
from dataclasses import dataclass

import httpx

from rlhf_trainer.retry import Retry, TryAgain

log = logging.getLogger(__name__)

RETRY_STATUS = (502, 503, 504)
PROBE_TIMEOUT_S = 5.0
"""How long a server that dropped a connection has to answer /health to count as alive."""
UNHEALTHY_S = 30.0
"""How long a server that refused a connection (or answered 502/504) is left out of routing."""
MAX_ROUTES = 65536
"""Trajectory ids remembered (least recently used forgotten first): far more than the
trajectories of a few steps in flight."""
PAUSED_POLL_S = 0.2
"""How often a request answered 503 (a server paused for a weight update) is sent again;
such retries last until the client timeout and do not count against `max_retries`."""
# Errors where the request surely or probably did not run to completion on the server.
# A read timeout is not retried: the server may still be generating it.
RETRY_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout,
                httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
"""A broken connection: the server died, or closed an idle one as a request was sent on it."""
KEEPALIVE_S = 2.0
"""The client closes idle connections first: uvicorn's (and vLLM's) keep-alive limit is 5 s."""


@dataclass
class Sample:
    """One generated continuation of a prompt."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # the server's log-prob of each token in token_ids (at the sampling temperature)
    finish_reason: str  # "stop" | "length" | "abort"
    versions: list[int | None] | None = None
    """The policy version that sampled each token (from the choice's `weight_versions` spans;
    None where the server labels none, as vLLM's /v1/completions)."""


class RolloutError(RuntimeError):
    """A rollout request failed for good (after retries, or with a non-retryable error)."""


class _Paused(Exception):
    """HTTP 503 from `endpoint`: a server paused for a weight update (see `PAUSED_POLL_S`)."""

    def __init__(self, endpoint: str, message: str):
        super().__init__(message)
        self.endpoint = endpoint


def prompt_seed(seed: int, index: int) -> int:
    """A 63-bit seed for prompt `index` of a call seeded with `seed`."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class RolloutClient:
    """Sends prompts to all endpoints (least outstanding requests) and collects samples."""

    def __init__(self, endpoints: list[str], *, timeout_s: float = 600.0,
                 max_concurrency: int = 256, max_retries: int = 5,
                 backoff_s: float = 0.5, model: str | None = None, unhealthy_s: float = UNHEALTHY_S,
                 replace_servers: bool = False):
        if not endpoints:
            raise ValueError("RolloutClient needs at least one endpoint")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.retry_policy = Retry(attempts=max_retries + 1, delay_s=backoff_s)
        """RETRY_ERRORS and HTTP 502/503/504: `max_retries` more attempts, each on an endpoint
        that has not failed this request while one is left, `backoff_s` apart, then twice as
        long each time."""
        self.paused_policy = Retry(attempts=None, delay_s=min(backoff_s, PAUSED_POLL_S),
                                   factor=1.0, retry_on=(_Paused,), deadline_s=timeout_s)
        """HTTP 503: sent again every min(backoff_s, PAUSED_POLL_S) until `timeout_s` after the
        request started, before it counts as one of `retry_policy`'s attempts."""
        self.model = model
        self.outstanding = dict.fromkeys(self.endpoints, 0)
        self.requests_sent = dict.fromkeys(self.endpoints, 0)
        self._turn = itertools.count()
        self.unhealthy_s = unhealthy_s
        self.routes: collections.OrderedDict[str, str] = collections.OrderedDict()
        """Trajectory id -> the endpoint that serves it (see the module docstring)."""
        self.moves = 0
        """Trajectory ids moved off an unhealthy endpoint."""
        self._down_until: dict[str, float] = {}
        self.replace_servers = replace_servers
        self.left_out: set[str] = set()
        """Endpoints never routed to until `readmit` (see the module docstring)."""
        self._loop: asyncio.AbstractEventLoop | None = None  # the run's event loop (a thread), see run()
        self._http: httpx.AsyncClient | None = None  # one connection pool for the run, on that loop
        self._loop_lock = threading.Lock()

    # ---- the run's event loop and connection pool -----------------------------------

    def run(self, coro):
        """Run `coro` on the client's own event loop (a daemon thread started on first use)
        and return its result: every call of the run shares one `httpx.AsyncClient`, so
        connections to the servers are kept alive across steps. Callable from any thread."""
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="rollout-client", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def close(self) -> None:
        """Close the connection pool and stop the loop (the client can be used again after)."""
        with self._loop_lock:
            loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._http is not None:
            asyncio.run_coroutine_threadsafe(self._http.aclose(), loop).result()
            self._http = None
        loop.call_soon_threadsafe(loop.stop)

    def _new_http(self) -> httpx.AsyncClient:
        timeout = httpx.Timeout(self.timeout_s, connect=min(30.0, self.timeout_s))
        limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency,
                              keepalive_expiry=KEEPALIVE_S)
        return httpx.AsyncClient(timeout=timeout, limits=limits)

    # ---- endpoint choice ----------------------------------------------------------

    def healthy(self, endpoint: str) -> bool:
        """Not marked unhealthy, or marked more than `unhealthy_s` ago."""
        return time.monotonic() >= self._down_until.get(endpoint, 0.0)

    def mark_unhealthy(self, endpoint: str) -> None:
        """Leave `endpoint` out of routing for `unhealthy_s`: its trajectory ids move to the
        other endpoints at their next request (while any is healthy)."""
        self._down_until[endpoint.rstrip("/")] = time.monotonic() + self.unhealthy_s

    def leave_out(self, endpoint: str) -> None:
        """Route nothing to `endpoint` until `readmit` (its ids move to the others)."""
        self.left_out.add(endpoint.rstrip("/"))

    def readmit(self, endpoint: str) -> None:
        """Route to `endpoint` again: it holds the current weights."""
        self.left_out.discard(endpoint.rstrip("/"))
        self.mark_healthy(endpoint)

    def mark_healthy(self, endpoint: str) -> None:
        """Route to `endpoint` again (ids that moved off it stay where they are)."""
        self._down_until.pop(endpoint.rstrip("/"), None)

    def _pick(self, avoid: set[str] = frozenset(), trajectory_id: str | None = None) -> str:
        """The endpoint of `trajectory_id` if it has one, is healthy and is not in `avoid`
        (the endpoints that already failed this request); else the endpoint with the fewest
        outstanding requests among the healthy ones not in `avoid` (or, when none is left,
        among all not in `avoid`, then all), ties round robin, which then serves the id."""
        if trajectory_id is not None and (held := self.routes.get(trajectory_id)) is not None:
            if held not in avoid and held not in self.left_out and self.healthy(held):
                self.routes.move_to_end(trajectory_id)
                return held
            self.moves += 1
        serving = [e for e in self.endpoints if e not in self.left_out]
        if not serving:
            raise RolloutError(f"every rollout server is gone ({', '.join(self.endpoints)}): none holds the current weights")
        allowed = [e for e in serving if e not in avoid] or serving
        candidates = [e for e in allowed if self.healthy(e)] or allowed
        least = min(self.outstanding[e] for e in candidates)
        tied = [e for e in candidates if self.outstanding[e] == least]
        chosen = tied[next(self._turn) % len(tied)]
        if trajectory_id is not None:
            self.routes[trajectory_id] = chosen
            self.routes.move_to_end(trajectory_id)
            while len(self.routes) > MAX_ROUTES:
                self.routes.popitem(last=False)
        return chosen

    # ---- generation -----------------------------------------------------------------

    async def generate(self, prompts: list[list[int]], *, n: int, max_tokens: int,
                       temperature: float, top_p: float = 1.0, top_k: int = -1,
                       stop_token_ids: list[int] | None = None,
                       seed: int | None = None, first_index: int = 0,
                       trajectory_id: str | None = None) -> list[list[Sample]]:
        """n samples for each prompt (token ids); one inner list per prompt, in order.
        Prompt i's seed is `prompt_seed(seed, first_index + i)` (a call for one prompt of a
        larger batch samples exactly as the whole batch would). With `trajectory_id`, every
        request of the call goes where that id's earlier requests went (module docstring)."""
        if n < 1 or max_tokens < 1:
            raise ValueError(f"n ({n}) and max_tokens ({max_tokens}) must be >= 1")
        base = {
            "n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
            "top_k": top_k, "logprobs": 0, "return_token_ids": True,
            # vLLM fills omitted fields from the model's generation_config.json: never omit
            "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        }
        if stop_token_ids:
            base["stop_token_ids"] = list(stop_token_ids)
        if self.model is not None:
            base["model"] = self.model
        limit = asyncio.Semaphore(self.max_concurrency)

        async def all_prompts(http: httpx.AsyncClient) -> list[list[Sample]]:
            async def one(i: int, prompt: list[int]) -> list[Sample]:
                body = {**base, "prompt": list(prompt)}
                if seed is not None:
                    body["seed"] = prompt_seed(seed, first_index + i)
                async with limit:
                    reply = await self._post(http, body, trajectory_id)
                return _samples(reply, prompt, n)

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

        if self._loop is not None and asyncio.get_running_loop() is self._loop:  # the run's pool
            if self._http is None:
                self._http = self._new_http()
            return await all_prompts(self._http)
        async with self._new_http() as http:  # called on another loop: a pool for this call
            return await all_prompts(http)

    async def _send(self, http: httpx.AsyncClient, endpoint: str, body: dict) -> httpx.Response:
        self.outstanding[endpoint] += 1
        self.requests_sent[endpoint] += 1
        try:
            return await http.post(endpoint + "/v1/completions", json=body)
        finally:
            self.outstanding[endpoint] -= 1

    async def _answers(self, endpoint: str) -> bool:
        """Whether `endpoint` answers /health on a fresh connection (still there: a restarted one loads)."""
        try:
            async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as probe:
                return (await probe.get(endpoint + "/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def _post(self, http: httpx.AsyncClient, body: dict, trajectory_id: str | None = None) -> dict:
        failed: set[str] = set()  # a dead endpoint answers fastest: never let it win every retry
        paused_until = time.monotonic() + self.timeout_s

        async def send() -> dict:
            endpoint = self._pick(failed, trajectory_id)
            try:
                response = await self._send(http, endpoint, body)
            except RETRY_ERRORS as exc:
                failed.add(endpoint)
                alive = self.replace_servers and isinstance(exc, DROPPED) and await self._answers(endpoint)
                if not alive:
                    self.mark_unhealthy(endpoint)
                    if self.replace_servers and isinstance(exc, (httpx.ConnectError, *DROPPED)):
                        log.warning("rollout server %s is gone (%r): routed nothing until it holds the current "
                                    "weights", endpoint, exc)
                        self.leave_out(endpoint)  # back only with the current weights
                raise TryAgain(f"{endpoint}: {exc!r}") from exc
            except httpx.ReadTimeout:
                raise RolloutError(f"{endpoint} did not answer a generation request within {self.timeout_s:g} s "
                                   "(rollout.requestTimeoutSeconds): the server hangs or is overloaded") from None
            if response.status_code == 200:
                self.mark_healthy(endpoint)  # a probe after `unhealthy_s` succeeded
                return response.json()
            if response.status_code not in RETRY_STATUS:
                raise RolloutError(f"{endpoint}/v1/completions answered HTTP "
                                   f"{response.status_code}: {response.text[:2000]}")
            last_error = f"{endpoint}: HTTP {response.status_code}: {response.text[:500]}"
            if response.status_code == 503:
                raise _Paused(endpoint, last_error)
            failed.add(endpoint)
            self.mark_unhealthy(endpoint)
            raise TryAgain(last_error)

        async def attempt() -> dict:
            # paused for a weight update (another thread's sync while rollouts run ahead): wait
            # for the resume without using up the retry budget, until the request's timeout
            try:
                return await self.paused_policy.acall(send, deadline=paused_until)
            except _Paused as still:
                failed.add(still.endpoint)
                raise TryAgain(str(still)) from None

        try:
            return await self.retry_policy.acall(attempt)
        except TryAgain as last:
            raise RolloutError(f"rollout request failed after {self.max_retries + 1} attempts; "
                               f"last error: {last}") from None

    def generate_sync(self, prompts: list[list[int]], **kwargs) -> list[list[Sample]]:
        """`generate` for callers without an event loop (on the run's loop: `run`)."""
        return self.run(self.generate(prompts, **kwargs))

    # ---- readiness ------------------------------------------------------------------

    async def wait_ready_async(self, timeout_s: float = 1800.0, interval_s: float = 0.5) -> None:
        """Poll GET /health on every endpoint until all answer 200."""
        deadline = time.monotonic() + timeout_s
        waiting = set(self.endpoints)
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0)) as http:
            while True:
                for endpoint in sorted(waiting):
                    try:
                        if (await http.get(endpoint + "/health")).status_code == 200:
                            waiting.discard(endpoint)
                    except httpx.HTTPError:
                        pass
                if not waiting:
                    return
                if time.monotonic() > deadline:
                    raise RolloutError(f"rollout servers not ready after {timeout_s} s: "
                                       + ", ".join(sorted(waiting)))
                await asyncio.sleep(interval_s)

    def wait_ready(self, timeout_s: float = 1800.0) -> None:
        """Block until every endpoint's /health answers 200 (RolloutError on timeout)."""
        asyncio.run(self.wait_ready_async(timeout_s))


def _samples(reply: dict, prompt: list[int], n: int) -> list[Sample]:
    choices = sorted(reply.get("choices", []), key=lambda c: c["index"])
    if len(choices) != n:
        raise RolloutError(f"expected {n} choices, the server returned {len(choices)}")
    samples = []
    for choice in choices:
        token_ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if token_ids is None or logprobs is None:
            raise RolloutError("the server returned no token_ids / logprobs: it must "
                               "support vLLM's return_token_ids and logprobs")
        if len(logprobs) != len(token_ids):
            raise RolloutError(f"{len(token_ids)} token ids but {len(logprobs)} logprobs")
        samples.append(Sample(
            prompt_token_ids=list(choice.get("prompt_token_ids") or prompt),
            token_ids=list(token_ids),
            logprobs=[float(x) for x in logprobs],
            finish_reason=str(choice.get("finish_reason")),
            versions=token_versions(choice.get("weight_versions"), len(token_ids)),
        ))
    return samples


def token_versions(spans: list[dict] | None, num_tokens: int) -> list[int | None] | None:
    """Per-token policy versions from vLLM's `WeightVersionSpan`s (`{"version", "start", "end"}`,
    output tokens `[start, end)`); None without spans. Tokens no span covers, or whose label is
    not a policy version (a server started from a checkpoint's own label), get None."""
    if not spans:
        return None
    versions: list[int | None] = [None] * num_tokens
    for span in spans:
        try:
            version = int(span["version"])
        except (TypeError, ValueError):
            continue
        for i in range(max(0, int(span["start"])), min(num_tokens, int(span["end"]))):
            versions[i] = version
    return versions
