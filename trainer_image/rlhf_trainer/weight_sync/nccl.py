"""Our own binding to libnccl (ctypes), for the weight-sync communicator.

Why not `torch.cuda.nccl`: its `init_rank` fails on Python <= 3.12 before any CUDA call
(`SystemError: PY_SSIZE_T_CLEAN macro must be defined for '#' formats`, an unfixed torch
bug in its argument parsing), and a torch communicator can be neither aborted nor asked
for its asynchronous error. vLLM's workers drive NCCL the same way (ctypes over the
library torch loaded, `pynccl_wrapper.py`); `tests/protocol/` checks every function we
declare against the argument types the pinned vLLM release declares for it.

Which library: `RLHF_NCCL_LIBRARY` (a path) if set, else the `nvidia-nccl-cu13` wheel's
`nvidia/nccl/lib/libnccl.so.2` (the file torch itself loads, so the process holds one
NCCL), else `libnccl.so.2` from the loader's path. The trainer pins torch to the pinned
vLLM's torch, so both sides load the same NCCL release (NCCL refuses peers of another
version when a communicator forms); `release_mismatch` compares them before any rank joins.

What works without a GPU: loading, `version()`, `unique_id()` (NCCL's bootstrap only needs
a network interface). `CommInitRank` and the collectives need CUDA; without it NCCL
answers an error, raised as `NcclError` with NCCL's own message.

`Communicator` holds one communicator handle for several threads: the one issuing its
collectives, the one polling `ncclCommGetAsyncError` while it waits (`wait_polling`), and
the one aborting it when a round fails. No call may reach the handle once the abort has
freed it, and the abort never frees it under a call in progress: every call takes the
handle under one lock, and the abort empties it under that lock. An abort that cannot get
the lock in time (a thread inside a broadcast that never returns) does nothing: the
communicator is `stuck`, the group cannot be formed again in this process, and the sender
ends the process with exit code 75.

Forming a group (ncclCommInitRank) blocks until every rank joins and cannot be aborted:
a thread left inside it at the round's deadline stays there, and the process exits 75
without waiting for it (sender.py). Opt-in, `RLHF_NCCL_NONBLOCKING_INIT=1` (read by
NcclTransport.connect), forms it with NCCL's non-blocking mode instead: ncclCommInitRankConfig
with a config of `blocking = 0` returns at once (ncclInProgress), `Communicator.wait_formed`
polls ncclCommGetAsyncError (taking the lock only for each poll), and an abort at the
deadline ends the formation: NCCL's ncclCommAbort sets the communicator's abort flag and
then joins the init thread (src/init.cc: "init thread must be joined before we destroy the
comm, and we should ignore the init error here"), so no thread is left inside NCCL, the
group is not stuck, and the round fails as any failed round does. In that mode any later
call may answer ncclInProgress; `Nccl` polls ncclCommGetAsyncError until it is not before
returning, so callers see the same blocking calls. Not the default until measured on a GPU
(bench/gpu_check_pair.py, `failures`). `NcclConfig` says why the config struct declares
only its first four fields.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

LIBRARY_ENV = "RLHF_NCCL_LIBRARY"
UNIQUE_ID_BYTES = 128


class NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


NONBLOCKING_INIT_ENV = "RLHF_NCCL_NONBLOCKING_INIT"
"""`1`: form the weight-sync group in NCCL's non-blocking mode, abortable at the round's
deadline (module docstring); anything else: ncclCommInitRank, as before."""
NCCL_API_MAGIC = 0xCAFEBEEF  # nccl.h NCCL_API_MAGIC
NCCL_VERSION_2_14 = 21400  # nccl.h NCCL_VERSION(2, 14, 0): the release that added `blocking`


class NcclConfig(ctypes.Structure):
    """The head of nccl.h's ncclConfig_t: `size`, `magic`, `version`, `blocking`, the only
    fields we set, declared alone so one struct fits every release we load (2.30.x here,
    2.28.9 on the GPU machine, whose ncclConfig_t are longer and differ in their tails).

    Why NCCL accepts it (src/init.cc `parseCommConfig`, the same in v2.14.3, v2.28.9 and
    v2.30.7): it starts from its own NCCL_CONFIG_INITIALIZER (every attribute "undefined"),
    reads our first `size_t` as the struct's size, copies min(size, sizeof(its
    ncclConfig_t)) bytes over it, refuses anything whose `magic` is not NCCL_API_MAGIC
    ("ncclConfig_t argument not initialized via NCCL_CONFIG_INITIALIZER", invalid
    argument), and resets to its defaults every attribute added after our `version`
    (`if (version < NCCL_VERSION(2, 17, 0)) cgaClusterSize = default ...`). So `size` is
    the end of `blocking` (20 bytes, not the padded sizeof 24: the 4 padding bytes would
    land on cgaClusterSize), and `version` is 2.14.0, the release that added `blocking`:
    an older library reads a shorter struct the same way, a newer one keeps its defaults
    for everything we do not declare. tests/protocol/test_nccl_binding.py checks the
    offsets and types against the installed nccl.h."""

    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int)]


CONFIG_BYTES = NcclConfig.blocking.offset + ctypes.sizeof(ctypes.c_int)


def nonblocking_config() -> NcclConfig:
    """A config asking for a non-blocking communicator (NcclConfig)."""
    return NcclConfig(size=CONFIG_BYTES, magic=NCCL_API_MAGIC, version=NCCL_VERSION_2_14, blocking=0)


_result = ctypes.c_int  # ncclResult_t
_comm = ctypes.c_void_p  # ncclComm_t
_stream = ctypes.c_void_p  # cudaStream_t
_buffer = ctypes.c_void_p

# nccl.h's ncclDataType_t / ncclRedOp_t values (checked against vLLM's ncclDataTypeEnum)
DATATYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6,
             "float32": 7, "float64": 8, "bfloat16": 9}
SUM = 0

# name: (restype, argtypes), as nccl.h declares them
FUNCTIONS: dict[str, tuple[object, list[object]]] = {
    "ncclGetErrorString": (ctypes.c_char_p, [_result]),
    "ncclGetLastError": (ctypes.c_char_p, [_comm]),
    "ncclGetVersion": (_result, [ctypes.POINTER(ctypes.c_int)]),
    "ncclGetUniqueId": (_result, [ctypes.POINTER(NcclUniqueId)]),
    "ncclCommInitRank": (_result, [ctypes.POINTER(_comm), ctypes.c_int, NcclUniqueId, ctypes.c_int]),
    "ncclCommInitRankConfig": (_result, [ctypes.POINTER(_comm), ctypes.c_int, NcclUniqueId, ctypes.c_int,
                                         ctypes.POINTER(NcclConfig)]),
    "ncclAllReduce": (_result, [_buffer, _buffer, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _comm, _stream]),
    "ncclBroadcast": (_result, [_buffer, _buffer, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, _comm, _stream]),
    "ncclCommGetAsyncError": (_result, [_comm, ctypes.POINTER(_result)]),
    "ncclCommAbort": (_result, [_comm]),
}

NCCL_IN_PROGRESS = 7  # ncclInProgress: a non-blocking operation still running
POLL_S = 0.05
SETTLE_POLL_S = 0.001
"""How often a call that answered ncclInProgress (non-blocking mode) polls until it settles."""
"""How often a wait polls the communicator's asynchronous error: a broken peer ends the
round this long after NCCL notices it, not at the round's deadline."""
ABORT_LOCK_WAIT_S = 2.0
"""How long an abort waits for a thread holding the handle (inside an NCCL call that may
never return). It never aborts under such a thread: freeing a communicator while another
thread is inside a call on it is a use after free, whatever the call then does."""


class NcclError(RuntimeError):
    """An NCCL call answered an error (the message is NCCL's own)."""

    def __init__(self, call: str, code: int, message: str):
        super().__init__(f"{call} failed: NCCL error {code}: {message}")
        self.code = code


class CommunicatorClosed(NcclError):
    """The communicator was aborted (by another thread, as a failed round ends)."""

    def __init__(self, call: str):
        RuntimeError.__init__(self, f"{call}: the communicator was aborted")
        self.code = -1


def _unique_id(unique_id: bytes) -> NcclUniqueId:
    if len(unique_id) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
    uid = NcclUniqueId()
    ctypes.memmove(ctypes.byref(uid), unique_id, UNIQUE_ID_BYTES)
    return uid


def library_path() -> str:
    """The libnccl this process loads (see the module docstring)."""
    if os.environ.get(LIBRARY_ENV):
        return os.environ[LIBRARY_ENV]
    try:
        spec = importlib.util.find_spec("nvidia.nccl")
    except (ImportError, ValueError):
        spec = None
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(root) / "lib" / "libnccl.so.2"
        if candidate.exists():
            return str(candidate)
    return "libnccl.so.2"


class Nccl:
    """The functions of one loaded libnccl."""

    def __init__(self, path: str | None = None):
        self.path = path or library_path()
        try:
            self.lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise OSError(f"cannot load NCCL from {self.path}: {exc} (install nvidia-nccl-cu13, the trainer "
                          f"image has it, or set {LIBRARY_ENV} to a libnccl.so.2)") from exc
        for name, (restype, argtypes) in FUNCTIONS.items():
            fn = getattr(self.lib, name)
            fn.restype, fn.argtypes = restype, argtypes

    def _check(self, call: str, code: int, comm: int | None = None) -> None:
        if code != 0:
            message = self.lib.ncclGetErrorString(code).decode(errors="replace")
            if comm:
                last = self.lib.ncclGetLastError(comm)
                if last:
                    message += f" ({last.decode(errors='replace')})"
            raise NcclError(call, code, message)

    def version(self) -> tuple[int, int, int]:
        value = ctypes.c_int()
        self._check("ncclGetVersion", self.lib.ncclGetVersion(ctypes.byref(value)))
        code = value.value  # NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9
        return code // 10000, code % 10000 // 100, code % 100

    def unique_id(self) -> bytes:
        uid = NcclUniqueId()
        self._check("ncclGetUniqueId", self.lib.ncclGetUniqueId(ctypes.byref(uid)))
        return bytes(uid.internal)

    def comm_init_rank(self, world_size: int, unique_id: bytes, rank: int) -> int:
        """A communicator on the calling thread's current CUDA device (blocks until every
        rank has joined)."""
        uid = _unique_id(unique_id)
        comm = _comm()
        self._check("ncclCommInitRank", self.lib.ncclCommInitRank(ctypes.byref(comm), world_size, uid, rank))
        return comm.value

    def comm_init_rank_nonblocking(self, world_size: int, unique_id: bytes, rank: int,
                                   config: NcclConfig | None = None) -> int:
        """Start forming a non-blocking communicator on the current CUDA device; returns its
        handle at once, still forming (ncclInProgress): `Communicator.wait_formed` polls it,
        `Communicator.abort` ends it. `config` defaults to `nonblocking_config()`."""
        uid = _unique_id(unique_id)
        comm = _comm()
        config = config if config is not None else nonblocking_config()
        code = self.lib.ncclCommInitRankConfig(ctypes.byref(comm), world_size, uid, rank, ctypes.byref(config))
        if code not in (0, NCCL_IN_PROGRESS):
            if comm.value:  # NCCL may leave a half-made communicator: free it, never leak a thread
                with contextlib.suppress(NcclError):
                    self.abort(comm.value)
            self._check("ncclCommInitRankConfig", code)
        return comm.value

    def _settle(self, call: str, code: int, comm: int) -> None:
        """A non-blocking communicator answers ncclInProgress while the call still runs, and
        the next call on it must wait until its asynchronous error is no longer in progress:
        wait here, so every call returns as it does in blocking mode (never in blocking mode)."""
        while code == NCCL_IN_PROGRESS:
            time.sleep(SETTLE_POLL_S)
            code = self.async_error(comm)
        self._check(call, code, comm)

    def all_reduce_sum(self, ptr: int, count: int, datatype: str, comm: int, stream: int) -> None:
        self._settle("ncclAllReduce", self.lib.ncclAllReduce(ptr, ptr, count, DATATYPES[datatype], SUM, comm,
                                                             stream), comm)

    def broadcast(self, ptr: int, count: int, datatype: str, root: int, comm: int, stream: int) -> None:
        self._settle("ncclBroadcast", self.lib.ncclBroadcast(ptr, ptr, count, DATATYPES[datatype], root, comm,
                                                             stream), comm)

    def async_error(self, comm: int) -> int:
        """The communicator's asynchronous error code (0: none; NCCL_IN_PROGRESS: busy)."""
        code = _result()
        self._check("ncclCommGetAsyncError", self.lib.ncclCommGetAsyncError(comm, ctypes.byref(code)))
        return code.value

    def abort(self, comm: int) -> None:
        """Free a communicator without waiting for its peers or its operations. A non-blocking
        communicator may answer ncclInProgress: the abort then goes on on NCCL's own thread,
        and the handle is NOT polled: NCCL's abort job (src/init.cc `commReclaim`, launched
        with destroyFlag, so src/group.cc never sets its asynchronous error again) frees the
        communicator itself, and a poll could read it after that. No call reaches the
        handle after an abort (Communicator.abort empties it)."""
        code = self.lib.ncclCommAbort(comm)
        if code != NCCL_IN_PROGRESS:
            self._check("ncclCommAbort", code)


class Communicator:
    """One communicator handle shared by threads (see the module docstring): `use()` lends
    the handle under the lock, `abort()` frees it under the lock, and after that every
    call raises `CommunicatorClosed` instead of reaching freed memory."""

    def __init__(self, nccl: Nccl, handle: int | None):
        self.nccl = nccl
        self._handle = handle
        self._lock = threading.Lock()
        self.stuck = False  # an abort found a thread inside NCCL and could not go ahead

    @property
    def closed(self) -> bool:
        return self._handle is None

    @contextlib.contextmanager
    def use(self, call: str) -> Iterator[int]:
        """The handle, for one call (the lock is held until it returns)."""
        with self._lock:
            if self._handle is None:
                raise CommunicatorClosed(call)
            yield self._handle

    def check(self, call: str = "ncclCommGetAsyncError") -> None:
        """Raise `NcclError` if the communicator reports an asynchronous error (a peer
        gone, a network failure), `CommunicatorClosed` if it was aborted."""
        with self.use(call) as handle:
            code = self.nccl.async_error(handle)
        if code not in (0, NCCL_IN_PROGRESS):
            raise NcclError(call, code, self.nccl.lib.ncclGetErrorString(code).decode(errors="replace"))

    def wait_formed(self, poll_s: float = POLL_S) -> None:
        """Wait until a non-blocking communicator has formed (its asynchronous error is no
        longer ncclInProgress), taking the lock only for each poll, so an abort from another
        thread (the round's deadline) gets in: the wait then raises `CommunicatorClosed`, and
        a formation NCCL gave up on raises `NcclError`."""
        while True:
            with self.use("ncclCommInitRankConfig") as handle:
                code = self.nccl.async_error(handle)
            if code == 0:
                return
            if code != NCCL_IN_PROGRESS:
                raise NcclError("ncclCommInitRankConfig", code,
                                self.nccl.lib.ncclGetErrorString(code).decode(errors="replace"))
            time.sleep(poll_s)

    def abort(self, lock_wait_s: float | None = None) -> bool:
        """Free the communicator without waiting for its peers or operations (idempotent).
        Never while another thread is inside an NCCL call on it: the abort waits up to
        `lock_wait_s` (default ABORT_LOCK_WAIT_S) for that call to return. Returns True once
        the communicator is freed (now or before); False when a call still held it: the
        communicator is then left alone and `stuck`, and only the process's exit ends it
        (the sender exits 75)."""
        if not self._lock.acquire(timeout=ABORT_LOCK_WAIT_S if lock_wait_s is None else lock_wait_s):
            self.stuck = True
            return False
        try:
            handle, self._handle = self._handle, None
            if handle is not None:
                self.nccl.abort(handle)
        finally:
            self._lock.release()
        return True


def wait_polling(done: Callable[[], bool], comm: Communicator, call: str, poll_s: float = POLL_S) -> None:
    """Wait until `done()` (e.g. a CUDA event after the last collective), polling the
    communicator's asynchronous error meanwhile: a broken peer raises `NcclError` within
    `poll_s`, an abort from another thread `CommunicatorClosed`, instead of the wait
    blocking until a deadline."""
    while not done():
        comm.check(call)
        time.sleep(poll_s)
    comm.check(call)


_LOADED: Nccl | None = None


def load() -> Nccl:
    """The process's binding (loaded once)."""
    global _LOADED
    if _LOADED is None:
        _LOADED = Nccl()
    return _LOADED


def release_mismatch(endpoint: str, theirs: tuple[int, int, int] | None) -> str | None:
    """NCCL refuses peers of another release when the weight-sync communicator forms (the
    servers would sit in ncclCommInitRank): compare a server's NCCL wheel (`theirs`, from its
    /server_info at the handshake: rollout/servers.py) with the library this trainer opens.
    Returns what is wrong and what to change, or None."""
    import logging

    ours = load().version()
    if theirs is None:
        logging.getLogger(__name__).warning(
            "%s/server_info names no nvidia-nccl package: cannot check that it runs NCCL %s as the trainer does",
            endpoint, ".".join(map(str, ours)))
        return None
    if tuple(theirs) == ours:
        return None
    a, b = ".".join(map(str, theirs)), ".".join(map(str, ours))
    return (f"runs NCCL {a}, the trainer runs NCCL {b} ({load().path}); NCCL refuses peers of another release, so "
            f"the weight sync could never form. Set rollout.image to an image whose torch brings NCCL {b} (the "
            "default image does), or the trainer image to one matching the server")
