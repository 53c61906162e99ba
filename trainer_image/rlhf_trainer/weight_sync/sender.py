"""Trainer rank 0's side of a weight sync, speaking vLLM's weight-transfer HTTP API exactly
as the pinned release (see `rlhf_contract.pod.VLLM_VERSION`) expects it.

`init(servers)` forms the group once, from what the start-up handshake
(rollout/servers.py) read of every server (read then, when not given):
  1. each server's workers (GET /get_world_size: TP x PP x DP); world = 1 + their sum,
     server i gets `rank_offset` = 1 + the sizes before it (vLLM ranks its workers
     rank_offset + dp_rank x TP x PP + worker rank);
  2. the transport (transport.py) is chosen from the servers' own configuration
     (`vllm_config.weight_transfer_config.backend` of /server_info, "nccl" for vLLM,
     "gloo" for the CPU engine) unless given; for NCCL each server's NCCL release must be
     the trainer's (nccl.py `release_mismatch`: else exit code 2 naming rollout.image);
  3. POST /init_weight_transfer_engine {"init_info": {rendezvous fields, rank_offset,
     world_size, packed: true, packed_buffer_size_bytes, packed_num_buffers}} to every
     server, concurrently with this process joining as rank 0. The packed settings live
     in init_info (vLLM reads them there, never from update_info).

One round, `send()`, in the order vLLM requires:
  1. POST /pause?mode=wait (vLLM's start_weight_update does NOT pause: only /pause does;
     "wait" lets requests in flight finish and rejects new ones with 503 until /resume);
     with `pause_mode="keep"` (`rollout.inFlightUpdates`) POST /pause?mode=keep: the
     requests in flight stop between two steps and keep their tokens, new ones are queued,
     and all of them continue on the new weights after /resume;
  2. POST /start_weight_update (an error if an update is already active);
  3. POST /update_weights {"update_info": {names, dtype_names, shapes}} to every server
     at once (each call returns once that server has loaded everything; empty lists
     reuse the metadata of the previous round, as vLLM allows) while this process
     broadcasts the packed buckets;
  4. POST /finish_weight_update {"weight_version"};
  5. POST /reset_prefix_cache: vLLM keeps its prefix cache across a weight update, so
     later requests would reuse KV blocks computed with the old weights; must answer
     {"success": true} (false while blocks are still held, which vLLM documents as
     retryable: asked again, a bounded number of times); in mode "keep" the requests
     paused in flight hold blocks, so it is asked once with `reset_running_requests=true`:
     vLLM moves them to its waiting queue (their tokens kept) and recomputes their KV cache
     with the new weights when they resume (the CPU engine keeps its KV cache instead);
  6. POST /resume.
Every parameter is sent every round under its Hugging Face name.
Weights travel in the servers' dtype (`model_config.dtype`, read at init), each tensor cast as
it is gathered (one dtype per bucket). The round's pack buffers are freed when it ends.

Failure: a server answering an error, a broadcast failing (a peer gone: the transport
polls NCCL's asynchronous error while the round waits, transport.py), or the round passing
`timeout_s` (`rollout.weightSyncTimeoutSeconds`) ends the round at once with
`WeightSyncError`: the group is then dead (an NCCL peer may be stuck in a collective), so
the sender aborts its communicator and calls /shutdown_weight_transfer_engine on every
server (best effort, bounded, on threads of its own), and `group` becomes None. The
trainer then exits with `ExitCode.WEIGHT_SYNC` (75), so the job restarts with its servers
(unless the trainer replaces the lost ones: `reform`). A
watchdog, armed until the teardown is over, ends the process with that code if the round
is still not over `watchdog_grace_s` after its timeout, e.g. because this thread is stuck
in a collective. An NCCL error while the group forms is a `WeightSyncError` too (exit 75:
retried with the servers, not exit 1); NCCL refusing to mint the unique id (no interface it
may use: NCCL_SOCKET_IFNAME) is a `WeightSyncConfigError` (exit 2, naming spec.pod.env).
The communicator is never aborted while a thread is inside an NCCL call on it (nccl.py): a
failed round that leaves one there, or a formation whose thread is still inside
ncclCommInitRank at the deadline (which nothing can abort; with RLHF_NCCL_NONBLOCKING_INIT=1
the formation is non-blocking, the deadline's abort ends it and the sender waits up to
ABORT_LOCK_WAIT_S for its thread to leave: not stuck, nccl.py), makes the sender `stuck`: no
group forms again in this process (no `reform`), the round calls `on_watchdog`
(exit_process: 75) and raises `GroupStuck`.

`reform(endpoints)` (server replacement, rl/replacement.py) forms the group again with some of
the configured servers: /shutdown_weight_transfer_engine and /init_weight_transfer_engine on
each, a new rendezvous, full metadata in the next round (a restarted server has none).

HTTP calls run on threads; tensors are packed on the calling thread (the generator may run
collectives) and broadcast from a helper one bucket behind (broadcast.py), so a server's error
ends the round at once.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import time
from collections.abc import Callable, Iterator

import httpx
import torch

from rlhf_contract.pod import ENV_NCCL_SOCKET_IFNAME

from ..preflight.network import socket_ifname_problem
from ..rollout.servers import ServerInfo, read_servers
from . import nccl
from .broadcast import broadcast_buckets
from .buckets import DEFAULT_BUCKET_BYTES, TensorMeta, dtype_name
from .ipc import IPC_BACKEND, IpcRounds, init_info as ipc_init_info
from .threads import GroupStuck, Watchdog, WeightSyncConfigError, WeightSyncError, exit_process, run_in_thread, wait_all
from .transport import BACKENDS, Transport, make_transport, servers_config

__all__ = ["WeightSyncError", "WeightSyncSender"]

log = logging.getLogger(__name__)

PAUSE_MODES = ("wait", "keep")
"""vLLM's pause modes a round may use ("abort" would end the requests in flight)."""
DEFAULT_NUM_BUFFERS = 2  # vLLM's DEFAULT_PACKED_NUM_BUFFERS (streams on its side; no layout change)
SHUTDOWN_TIMEOUT_S = 10.0
RESET_PREFIX_CACHE_ATTEMPTS = 6
RESET_PREFIX_CACHE_FIRST_DELAY_S = 0.25
"""Pauses between attempts double: 0.25 + 0.5 + ... + 4 s, under 8 s in all."""


def unique_id_hint() -> str:
    """What to set when NCCL refuses to mint a unique id: its bootstrap found no interface
    it may use, which only the spec changes (exit 2, no restart)."""
    problem = socket_ifname_problem()
    if problem:
        return problem
    return (f"NCCL found no network interface it may use ({ENV_NCCL_SOCKET_IFNAME}="
            f"{os.environ.get(ENV_NCCL_SOCKET_IFNAME, '')!r}); set spec.pod.env {ENV_NCCL_SOCKET_IFNAME} to the "
            "interface the trainer and the rollout servers share (e.g. =eth0)")


def init_info(rendezvous: dict, *, world_size: int, rank_offset: int, bucket_bytes: int) -> dict:
    """One server's `init_info`: rendezvous, group size, first rank, packed settings (vLLM reads them there)."""
    return {**rendezvous, "world_size": world_size, "packed": True, "packed_buffer_size_bytes": bucket_bytes,
            "packed_num_buffers": DEFAULT_NUM_BUFFERS, "rank_offset": rank_offset}


class WeightSyncSender(IpcRounds):
    """Pushes full weights from trainer rank 0 to rollout servers (vLLM or the CPU engine).
    `endpoints` are base URLs (http://host:port); `listen_host:listen_port` is where rank 0
    hosts the gloo group's TCPStore (the NCCL transport needs no address). `bucket_bytes`
    is the packed buffer size (sent to the servers in init_info). `backend` is "nccl" or
    "gloo"; None asks the servers. `timeout_s` bounds `init()` and each round.
    """

    def __init__(self, endpoints: list[str], listen_host: str, listen_port: int, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, timeout_s: float = 600.0,
                 backend: str | None = None, watchdog_grace_s: float = 60.0,
                 on_watchdog: Callable[[str], None] | None = None, pause_mode: str = "wait"):
        if not endpoints:
            raise ValueError("weight sync needs at least one rollout endpoint")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None, got {backend!r}")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {', '.join(PAUSE_MODES)}, got {pause_mode!r}")
        self.pause_mode = pause_mode
        self.endpoints = [e.rstrip("/") for e in endpoints]
        self.configured = list(self.endpoints)  # every server of the job; `endpoints`: the group's members
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.backend = backend
        self.watchdog_grace_s = watchdog_grace_s
        self.on_watchdog = on_watchdog or exit_process  # also ends the process when the group is stuck
        self.stuck = False  # a thread is inside NCCL on a failed group: no group forms again here
        self.group: Transport | None = None
        self.world_size: int | None = None
        self.rank_offsets: list[int] = []
        self.calls: list[str] = []  # "POST /path" of every call of the last init / round, in order
        self.phase_seconds: dict[str, float] = {}  # seconds of each step of the last round
        self._sent_metadata: list[TensorMeta] | None = None
        self.serving_dtype: torch.dtype | None = None  # the servers' model dtype, read at init()
        self._http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=30.0))
        self._pool = cf.ThreadPoolExecutor(max_workers=max(2, len(self.endpoints)),
                                           thread_name_prefix="weight-sync-http")

    # ---- HTTP ------------------------------------------------------------------

    def _call(self, method: str, endpoint: str, path: str, body: dict | None = None, *,
              params: dict | None = None, timeout: float | None = None) -> dict:
        url = endpoint + path
        try:
            response = self._http.request(method, url, json=body, params=params,
                                          timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT)
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"{method} {url} failed: {exc!r}") from exc
        if response.status_code != 200:
            raise WeightSyncError(
                f"{method} {url} answered HTTP {response.status_code}: {response.text[:2000]}")
        return response.json() if response.content else {}

    def _call_all(self, path: str, bodies: list[dict | None] | None = None, *,
                  params: dict | None = None) -> list[cf.Future]:
        self.calls.append(f"POST {path}")
        bodies = bodies if bodies is not None else [None] * len(self.endpoints)
        return [self._pool.submit(self._call, "POST", ep, path, body, params=params)
                for ep, body in zip(self.endpoints, bodies)]

    def _all(self, path: str, bodies: list[dict | None] | None = None, *, params: dict | None = None,
             deadline: float) -> list[dict]:
        start = time.perf_counter()
        replies = wait_all(self._call_all(path, bodies, params=params), deadline)
        self.phase_seconds[path] = time.perf_counter() - start
        return replies

    # ---- group -------------------------------------------------------------------

    def init(self, servers: list[ServerInfo] | None = None) -> None:
        """Form the broadcast group with every server (blocks until all have joined), from
        the handshake's `servers` (one per endpoint, in order; read now when None)."""
        self.calls = []
        if self.stuck:
            raise GroupStuck("the weight-sync group cannot be formed again in this process: a thread is still inside "
                             "NCCL (a failed round or formation); the job restarts")
        deadline = time.monotonic() + self.timeout_s
        servers = servers if servers is not None else read_servers(self.endpoints, request_timeout_s=self.timeout_s)
        if [s.endpoint for s in servers] != self.endpoints:
            raise ValueError(f"the handshake's servers {[s.endpoint for s in servers]} are not {self.endpoints}")
        sizes = [s.world_size for s in servers]
        backend, self.serving_dtype = servers_config(servers)
        if self.backend is None:
            self.backend = backend
        if self.backend == IPC_BACKEND:  # no group: the servers map rank buffers (ipc.py `push_ipc`)
            self._all("/init_weight_transfer_engine", [{"init_info": ipc_init_info()}] * len(self.endpoints),
                      deadline=deadline)
            self._sent_metadata = None
            return
        self.world_size = 1 + sum(sizes)
        self.rank_offsets = [1 + sum(sizes[:i]) for i in range(len(sizes))]
        try:
            group = make_transport(self.backend, self.world_size, listen_host=self.listen_host,
                                   listen_port=self.listen_port, timeout_s=self.timeout_s)
        except nccl.NcclError as exc:  # ncclGetUniqueId: NCCL's bootstrap found no usable interface
            raise WeightSyncConfigError.reported(f"cannot start the weight-sync group: {exc}; "
                                                 + unique_id_hint()) from exc
        bodies = [{"init_info": init_info(group.rendezvous(), world_size=self.world_size, rank_offset=offset,
                                          bucket_bytes=self.bucket_bytes)} for offset in self.rank_offsets]
        replies = self._call_all("/init_weight_transfer_engine", bodies)
        connect = run_in_thread(group.connect)
        try:
            wait_all([*replies, connect], deadline)
        except BaseException as exc:
            group.close()
            if getattr(group, "formation_abortable", False):  # the abort ends the formation: let it leave
                cf.wait([connect], timeout=nccl.ABORT_LOCK_WAIT_S)
            # ncclCommInitRank cannot be aborted (the non-blocking formation can, above): a thread
            # still inside it stays there, and no group may form beside it (exit 75: main.py)
            self.stuck = self.stuck or not connect.done() or group.stuck
            self._shutdown_servers()
            if isinstance(exc, nccl.NcclError):  # retryable, as a failed round is: exit 75, not 1
                raise WeightSyncError(f"forming the weight-sync group failed: {exc}") from exc
            raise
        self.group = group
        self._sent_metadata = None

    def reform(self, endpoints: list[str]) -> None:
        """Form the group again with `endpoints`, some of `configured` (module docstring)."""
        members = [e.rstrip("/") for e in endpoints]
        if not members or any(e not in self.configured for e in members):
            raise ValueError(f"reform needs some of {self.configured}, got {members}")
        if self.group is not None:
            self.group.close()
            self.stuck = self.stuck or self.group.stuck
        if self.stuck:
            raise GroupStuck("the weight-sync group cannot be formed again in this process: a thread is still inside "
                             "NCCL on the old one; the job restarts")
        self.group, self._sent_metadata = None, None
        self.endpoints = [e for e in self.configured if e in members]
        self._shutdown_servers()
        self.init()

    # ---- one round -----------------------------------------------------------------

    def send(self, metadata: list[TensorMeta], tensors: Iterator[torch.Tensor],
             weight_version: str | None = None) -> dict:
        """Push every tensor (yielded in `metadata` order) to every server.

        Returns {"bytes", "buckets", "num_tensors", "seconds"}.
        """
        if self.backend == IPC_BACKEND:
            raise WeightSyncError("the servers take weights by CUDA IPC: every trainer rank sends (ipc.push_ipc)")
        if self.group is None:
            raise WeightSyncError("the weight-sync group is not formed: call init() first (a failed round "
                                  "ends the group)")
        self.calls, self.phase_seconds = [], {}
        source = [(name, [int(s) for s in shape], dtype) for name, shape, dtype in metadata]
        # sent as the servers hold them (a bf16 server receives bf16, not the fp32 master weights):
        # one dtype, cast tensor by tensor as it is gathered, and half the bytes
        metadata = [(name, shape, self._wire_dtype(dtype)) for name, shape, dtype in source]
        start = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        watchdog = Watchdog(self.timeout_s + self.watchdog_grace_s, self.on_watchdog,
                             f"weight sync to {', '.join(self.endpoints)} did not finish within "
                             f"{self.timeout_s + self.watchdog_grace_s:.0f} s")
        stats = {"bytes": 0, "buckets": 0, "num_tensors": len(metadata)}
        try:
            self._all("/pause", params={"mode": self.pause_mode}, deadline=deadline)
            self._all("/start_weight_update", deadline=deadline)
            if metadata == self._sent_metadata:
                update_info = {"names": [], "dtype_names": [], "shapes": []}  # reuse the last round's
            else:
                update_info = {"names": [name for name, _, _ in metadata],
                               "dtype_names": [dtype_name(dtype) for _, _, dtype in metadata],
                               "shapes": [shape for _, shape, _ in metadata]}
            update_start = time.perf_counter()
            replies = self._call_all("/update_weights", [{"update_info": update_info}] * len(self.endpoints))
            broadcast = broadcast_buckets(self.group, source, metadata, tensors, stats, self.bucket_bytes,
                                          watch=replies, deadline=deadline)
            wait_all([*replies, broadcast], deadline)
            self.phase_seconds["/update_weights"] = time.perf_counter() - update_start
            self._sent_metadata = metadata
            version = None if weight_version is None else str(weight_version)
            self._all("/finish_weight_update", [{"weight_version": version}] * len(self.endpoints),
                      deadline=deadline)
            self._reset_prefix_caches(deadline)
            self._all("/resume", deadline=deadline)
        except BaseException as exc:
            if self._abandon_group():  # a thread inside NCCL: not aborted, not recoverable here
                message = (f"weight sync failed ({exc}) and a thread is still inside an NCCL call on the group "
                           "after the abort's wait: the group can neither be aborted nor formed again here")
                self.on_watchdog(message)  # exit_process: exit code 75, the job restarts with its servers
                raise GroupStuck(message) from exc
            if isinstance(exc, WeightSyncError):
                raise
            raise WeightSyncError(f"weight sync failed: {exc!r}") from exc
        finally:
            watchdog.disarm()
        stats["seconds"] = time.perf_counter() - start
        return stats

    def _reset_prefix_caches(self, deadline: float) -> None:
        """POST /reset_prefix_cache to every server until each answers {"success": true}.
        vLLM answers false while KV blocks are still held (requests finishing, async KV
        offload transfers) and documents that callers may retry: a server that answers false
        is asked again, up to RESET_PREFIX_CACHE_ATTEMPTS times with a growing pause."""
        start, pending, delay = time.perf_counter(), list(self.endpoints), RESET_PREFIX_CACHE_FIRST_DELAY_S
        if self.pause_mode == "keep":  # paused requests hold KV blocks: move them aside (module docstring)
            replies = self._all("/reset_prefix_cache", params={"reset_running_requests": "true"}, deadline=deadline)
            refused = [(ep, r) for ep, r in zip(self.endpoints, replies) if r.get("success") is not True]
            if refused:
                raise WeightSyncError(f"{refused[0][0]}/reset_prefix_cache?reset_running_requests=true answered "
                                      f"{refused[0][1]}: its prefix cache still holds KV blocks of the old weights")
            return
        for attempt in range(1, RESET_PREFIX_CACHE_ATTEMPTS + 1):
            self.calls.append("POST /reset_prefix_cache")
            futures = [self._pool.submit(self._call, "POST", ep, "/reset_prefix_cache") for ep in pending]
            replies = wait_all(futures, deadline)
            refused = [(ep, reply) for ep, reply in zip(pending, replies) if reply.get("success") is not True]
            if not refused:
                self.phase_seconds["/reset_prefix_cache"] = time.perf_counter() - start
                return
            if attempt == RESET_PREFIX_CACHE_ATTEMPTS or time.monotonic() + delay > deadline:
                break
            log.info("reset_prefix_cache refused by %s (attempt %d): retrying in %.1f s",
                     ", ".join(ep for ep, _ in refused), attempt, delay)
            time.sleep(delay)
            pending, delay = [ep for ep, _ in refused], delay * 2
        endpoint, reply = refused[0]
        raise WeightSyncError(f"{endpoint}/reset_prefix_cache answered {reply} {attempt} times: its prefix cache "
                              "still holds KV blocks computed with the old weights")

    def _wire_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter travels in: the servers' (floating point only)."""
        if self.serving_dtype is not None and dtype.is_floating_point:
            return self.serving_dtype
        return dtype

    def _abandon_group(self) -> bool:
        """After a failed round: the group is unusable; release it on every server. Returns
        whether it is stuck (a thread still inside NCCL: not aborted, see nccl.py)."""
        if self.group is not None:
            self.group.close()
            self.stuck = self.stuck or self.group.stuck
        self.group = None
        self._sent_metadata = None
        self._shutdown_servers()
        return self.stuck

    def _shutdown_servers(self) -> None:
        """Best effort, bounded, on threads of its own (the round's HTTP threads may still be
        blocked in /update_weights). vLLM refuses it during an active update, or queues it
        behind a worker stuck in NCCL: the job's restart, servers included, is what cleans up."""
        pool = cf.ThreadPoolExecutor(max_workers=len(self.endpoints), thread_name_prefix="weight-sync-shutdown")
        futures = [pool.submit(self._call, "POST", ep, "/shutdown_weight_transfer_engine",
                               timeout=SHUTDOWN_TIMEOUT_S) for ep in self.endpoints]
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S + 5
        for endpoint, future in zip(self.endpoints, futures):
            try:
                future.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                log.warning("could not release the weight-transfer group on %s: %s", endpoint, exc)
        pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> WeightSyncSender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

