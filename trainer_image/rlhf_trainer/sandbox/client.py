"""The trainer's side of the sandbox service (`service.py`): `SandboxClient(url).run_many(jobs,
limits)`, with the same signature and results as `run.run_many`, executed by the service.

Jobs go in chunks of `chunk`, up to `max_in_flight` requests at once. Connection errors and
HTTP 502 and above are retried (`SandboxClient.retry_policy`); any other answer but 200 raises
SandboxError with the service's message, as does running out of attempts.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from rlhf_trainer.retry import Retry, TryAgain
from rlhf_trainer.sandbox.limits import Limits, SandboxError, SandboxResult


class SandboxClient:
    """The trainer's side: `run_many` as in `sandbox.run_many`, executed by the service."""

    def __init__(self, url: str, *, chunk: int = 64, max_in_flight: int = 8,
                 retries: int = 3, connect_timeout_s: float = 10.0) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward.sandbox.url {url!r} must start with http:// or https://")
        self.url = url.rstrip("/")
        self.chunk, self.max_in_flight, self.retries = chunk, max_in_flight, retries
        self.connect_timeout_s = connect_timeout_s
        self.retry_policy = Retry(attempts=retries + 1, delay_s=2.0, max_delay_s=30.0)
        """A request that fails to connect or gets HTTP 502+ is sent `retries` more times,
        2, 4, 8, ... s apart (at most 30 s)."""

    def _post(self, jobs: Sequence[tuple[str, str]], limits: Limits,
              require_isolation: bool) -> list[SandboxResult]:
        import httpx

        body = {"jobs": [list(j) for j in jobs], "limits": limits.to_json(),
                "require_isolation": require_isolation}
        # the service queues: allow every run of every chunk in flight its full time, one
        # after another (a bound that holds for a service with a single slot)
        timeout = httpx.Timeout(self.max_in_flight * len(jobs) * (limits.timeout_s + 5) + 60,
                                connect=self.connect_timeout_s)

        def attempt() -> list[SandboxResult]:
            try:
                r = httpx.post(f"{self.url}/run_many", json=body, timeout=timeout)
            except httpx.TransportError as err:
                raise TryAgain(f"{type(err).__name__}: {err}") from err
            if r.status_code >= 502:
                raise TryAgain(f"HTTP {r.status_code}")
            try:
                data = r.json()
            except ValueError:
                data = {"error": r.text[:300]}
            if r.status_code != 200 or "results" not in data:
                raise SandboxError(f"sandbox service {self.url}: HTTP {r.status_code}: "
                                   f"{data.get('error', data)!s:.1000}")
            return [SandboxResult.from_json(x) for x in data["results"]]

        try:
            return self.retry_policy.call(attempt)
        except TryAgain as last:
            raise SandboxError(f"sandbox service {self.url} failed {self.retries + 1} times; "
                               f"last: {last} (is reward.sandbox.url right, and the service "
                               "up?)") from None

    def run_many(self, jobs: Sequence[tuple[str, str]], limits: Limits | None = None, *,
                 require_isolation: bool = True) -> list[SandboxResult]:
        limits = limits or Limits()
        chunks = [jobs[i:i + self.chunk] for i in range(0, len(jobs), self.chunk)]
        if not chunks:
            return []
        with ThreadPoolExecutor(min(len(chunks), self.max_in_flight)) as pool:
            parts = pool.map(lambda c: self._post(c, limits, require_isolation), chunks)
            return [r for part in parts for r in part]
