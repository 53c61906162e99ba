"""The data plane of a weight sync: a broadcast group of {trainer rank 0} ∪ {all server
workers}, with the trainer as rank 0. Two transports behind one interface; the sender
(sender.py) does not know which one it drives.

- `NcclTransport` (vLLM, `--weight-transfer-config '{"backend":"nccl"}'`): our side of
  vLLM's unique-id rendezvous, through our own libnccl binding (nccl.py; not
  `torch.cuda.nccl`, whose `init_rank` fails on Python <= 3.12). Rank 0 mints an
  `ncclUniqueId`, every server gets it as
  `init_info.nccl_unique_id_b64` (standard base64 of the 128 bytes), and all ranks call
  `ncclCommInitRank` (with RLHF_NCCL_NONBLOCKING_INIT=1 the non-blocking
  `ncclCommInitRankConfig`, aborted at the deadline: nccl.py) at the same time (there is
  no store barrier: the sender makes the `/init_weight_transfer_engine` calls while
  `connect()` blocks). Right after init every
  vLLM worker issues a one-element float32 sum `all_reduce` (PyNcclCommunicator's
  warm-up), so `connect()` issues the matching one before anything else. Broadcasts run
  on the trainer's GPU, root = rank 0, on the caller's CUDA stream. No TCP rendezvous
  address is involved: NCCL's bootstrap connects to the trainer pod's own IP, so the
  weight-sync Service name is not used. After a failed round the communicator is aborted
  (never under a thread still inside NCCL: it is then `stuck`, and the sender exits 75)
  and the process must still end (a peer may be stuck mid-collective; the servers are
  restarted with the trainer: the sender raises, its watchdog ends a hung process). A
  failed peer is noticed by polling `ncclCommGetAsyncError` while the round waits.
- `GlooTransport` (the CPU engine): vLLM's TCP rendezvous fields (`master_address`,
  `master_port`); rank 0 hosts a TCPStore there and forms a gloo group on the CPU
  (`ProcessGroupGloo(store, rank, world)`); the CPU engine joins as `rank_offset`.

`servers_config` picks the backend, and the dtype weights travel in, from what the servers
say of themselves at the handshake.
"""

from __future__ import annotations

import base64
import datetime
import logging
import os
import threading
from typing import Protocol

import torch
import torch.distributed as dist

from ..rollout.servers import RolloutImageError, ServerInfo
from . import nccl
from .buckets import dtype_name
from .nccl import Nccl
from .threads import WeightSyncError

log = logging.getLogger(__name__)

BACKENDS = ("nccl", "gloo", "ipc")
"""The servers' weight-transfer backends the trainer speaks: "ipc" (servers on the trainer's
own GPUs, colocated) has no group of its own (ipc.py)."""


class Transport(Protocol):
    backend: str
    device: torch.device

    def rendezvous(self) -> dict:
        """The rendezvous fields of `init_info` that the servers need to join."""

    def connect(self) -> None:
        """Join as rank 0; blocks until every rank has joined."""

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` (on `device`) from rank 0; may return before it is sent."""

    def check(self) -> None:
        """Raise if the group has failed (polled between buckets; cheap)."""

    def synchronize(self) -> None:
        """Block until every broadcast issued so far has completed; raise if the group fails
        meanwhile."""

    def close(self) -> None:
        """Release the group (an NCCL communicator: abort it, unless a thread is still inside
        an NCCL call on it: then `stuck` is true and nothing is released)."""

    @property
    def stuck(self) -> bool:
        """A failed group that could not be released in this process (the process must exit)."""


class GlooTransport:
    """Rank 0 of a gloo group formed over a TCPStore that this process hosts."""

    backend = "gloo"
    stuck = False  # gloo's calls end at their timeout
    formation_abortable = False

    def __init__(self, world_size: int, *, listen_host: str, listen_port: int, timeout_s: float):
        self.world_size = world_size
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.device = torch.device("cpu")
        self.store = self.pg = None

    def rendezvous(self) -> dict:
        return {"master_address": self.listen_host, "master_port": self.listen_port}

    def connect(self) -> None:
        self.store = dist.TCPStore(self.listen_host, self.listen_port, self.world_size, is_master=True,
                                   timeout=self.timeout)
        self.pg = dist.ProcessGroupGloo(self.store, 0, self.world_size, self.timeout)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.pg.broadcast(tensor, 0).wait()

    def check(self) -> None:
        pass  # gloo's broadcasts raise their errors themselves

    def synchronize(self) -> None:
        pass  # gloo broadcasts above are synchronous

    def close(self) -> None:
        self.pg = self.store = None


def nccl_rendezvous(unique_id: bytes) -> dict:
    """The rendezvous fields of vLLM's NCCL `init_info`: the communicator's unique id."""
    return {"nccl_unique_id_b64": base64.b64encode(unique_id).decode("ascii")}


class NcclTransport:
    """Rank 0 of an NCCL communicator made from a unique id this process mints, through
    our own libnccl binding (nccl.py).

    Waits never block blind: `synchronize()` records a CUDA event after the broadcasts and
    polls it and the communicator's asynchronous error (`nccl.wait_polling`), and `check()`
    polls the error between buckets, so a peer that dies mid-round ends the round within
    `nccl.POLL_S` of NCCL noticing, not at the round's deadline. `close()` aborts through
    `nccl.Communicator`, which keeps every other thread off the freed handle."""

    backend = "nccl"

    def __init__(self, world_size: int, *, device: torch.device | int | None = None, library: Nccl | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("the NCCL weight transfer needs a CUDA device on trainer rank 0")
        self.world_size = world_size
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.nccl = library or nccl.load()
        self.unique_id: bytes = self.nccl.unique_id()
        self.stream: torch.cuda.Stream | None = None
        self.init_state()

    def init_state(self) -> None:
        """No communicator yet (also for tests that build the transport without CUDA)."""
        self.comm: nccl.Communicator | None = None
        self.nonblocking = os.environ.get(nccl.NONBLOCKING_INIT_ENV) == "1"
        self.formed = False
        self._closed = False
        self._state = threading.Lock()  # connect's thread vs close's: who sees the handle first

    @property
    def formation_abortable(self) -> bool:
        """Whether close() ends a formation still in progress (the non-blocking mode), so the
        thread in connect() leaves it (the sender waits for that thread, not stuck)."""
        return self.nonblocking

    def rendezvous(self) -> dict:
        return nccl_rendezvous(self.unique_id)

    def connect(self) -> None:
        self.nonblocking = os.environ.get(nccl.NONBLOCKING_INIT_ENV) == "1"
        log.info("joining the weight-transfer NCCL group as rank 0 of %d on %s (NCCL %s from %s, %s formation)",
                 self.world_size, self.device, ".".join(map(str, self.nccl.version())), self.nccl.path,
                 "non-blocking" if self.nonblocking else "blocking")
        with torch.cuda.device(self.device):  # ncclCommInitRank binds the current device
            if self.nonblocking:
                self._form_nonblocking()
            else:
                self.comm = nccl.Communicator(self.nccl,
                                              self.nccl.comm_init_rank(self.world_size, self.unique_id, 0))
            self.formed = True
            warmup = torch.zeros(1, dtype=torch.float32, device=self.device)
            stream = torch.cuda.current_stream(self.device)
            with self.comm.use("ncclAllReduce") as handle:  # vLLM's warm-up
                self.nccl.all_reduce_sum(warmup.data_ptr(), 1, "float32", handle, stream.cuda_stream)
            self._wait(stream, "the weight-sync warm-up all_reduce")

    def _form_nonblocking(self) -> None:
        """ncclCommInitRankConfig (blocking = 0), then poll until formed; a close() from the
        sender at the round's deadline aborts it and the wait raises CommunicatorClosed."""
        handle = self.nccl.comm_init_rank_nonblocking(self.world_size, self.unique_id, 0)
        with self._state:
            comm = nccl.Communicator(self.nccl, handle)
            if not self._closed:
                self.comm = comm
        if self.comm is not comm:  # closed while NCCL started: end it here
            comm.abort()
            raise nccl.CommunicatorClosed("ncclCommInitRankConfig")
        comm.wait_formed()

    def use_stream(self, stream: torch.cuda.Stream) -> None:
        """Issue the broadcasts on `stream` (the stream the buckets are packed on)."""
        self.stream = stream

    def broadcast(self, tensor: torch.Tensor) -> None:
        stream = self.stream or torch.cuda.current_stream(self.device)
        with self._communicator().use("ncclBroadcast") as handle:
            self.nccl.broadcast(tensor.data_ptr(), tensor.numel(), dtype_name(tensor.dtype), 0, handle,
                                stream.cuda_stream)

    def check(self) -> None:
        self._communicator().check("a weight-sync broadcast")

    def synchronize(self) -> None:
        self._wait(self.stream or torch.cuda.current_stream(self.device), "a weight-sync broadcast")

    def _wait(self, stream: torch.cuda.Stream, what: str) -> None:
        done = torch.cuda.Event()
        done.record(stream)
        nccl.wait_polling(done.query, self._communicator(), what)

    def _communicator(self) -> nccl.Communicator:
        if self.comm is None:
            raise nccl.CommunicatorClosed("the weight-sync communicator (not connected)")
        return self.comm

    @property
    def stuck(self) -> bool:
        return self.comm is not None and self.comm.stuck

    def close(self) -> None:
        """Abort the communicator: frees it without waiting for peers that may be gone; not
        while a thread is inside an NCCL call on it (then `stuck`: nccl.Communicator.abort).
        In the non-blocking mode this also ends a formation still in progress."""
        with self._state:
            self._closed = True
        if self.comm is not None:
            if not self.formed and self.nonblocking:
                log.error("the weight-sync NCCL group did not form: aborting the non-blocking formation "
                          "(ncclCommAbort); no thread is left inside NCCL")
            try:
                if not self.comm.abort():
                    log.error("a thread is still inside an NCCL call on the weight-sync communicator after %.0f s: "
                              "not aborting it under that call (the process must exit)", nccl.ABORT_LOCK_WAIT_S)
            except nccl.NcclError as exc:
                log.warning("aborting the weight-sync communicator: %s", exc)


def make_transport(backend: str, world_size: int, *, listen_host: str, listen_port: int,
                   timeout_s: float) -> Transport:
    if backend == "nccl":
        return NcclTransport(world_size)
    if backend == "gloo":
        return GlooTransport(world_size, listen_host=listen_host, listen_port=listen_port, timeout_s=timeout_s)
    raise ValueError(f"weight-transfer backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def servers_config(servers: list[ServerInfo]) -> tuple[str, torch.dtype | None]:
    """The servers' weight-transfer backend and the dtype they serve in (vLLM's
    `model_config.dtype`); every server must agree on both, and on NCCL run the trainer's
    NCCL release."""
    backends = {s.weight_transfer_backend for s in servers}
    dtypes = {_serving_dtype(s.dtype) for s in servers}
    if len(backends) != 1 or not backends <= set(BACKENDS):
        raise WeightSyncError(f"the rollout servers use weight-transfer backends {sorted(map(str, backends))}; "
                              f"the trainer needs one of {', '.join(BACKENDS)}, the same on every server")
    if len(dtypes) != 1:
        raise WeightSyncError(f"the rollout servers serve in different dtypes {sorted(map(str, dtypes))}")
    backend = backends.pop()
    for server in servers if backend == "nccl" else ():
        mismatch = nccl.release_mismatch(server.endpoint, server.nccl)
        if mismatch:
            raise RolloutImageError.reported(
                f"rollout.image: the server at {server.endpoint} (vLLM {server.version}) {mismatch}")
    return backend, dtypes.pop()


def _serving_dtype(name) -> torch.dtype | None:
    """"torch.bfloat16" or "bfloat16" (how /server_info dumps a torch.dtype) as a dtype."""
    if not isinstance(name, str):
        return None
    dtype = getattr(torch, name.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None
