"""How a weight sync fails over NCCL, on the CPU: the real libnccl binding and the real
sender, with the communicator handle NCCL itself refuses (NULL: every call on it answers
`ncclInvalidArgument`, as calls on a communicator with a broken peer answer an error), and
rollout servers played by a plain HTTP server that answers as vLLM's routes do.

- a wait polls `ncclCommGetAsyncError` and ends within the poll interval, not at the
  round's deadline; a round whose communicator reports an error ends in about a second;
- no call reaches a handle after another thread aborted it (the abort waits for a call
  holding it, and goes ahead under one that never returns);
- an NCCL error while the group forms is a WeightSyncError (exit 75), also when NCCL's
  bootstrap finds no interface of the pinned NCCL_SOCKET_IFNAME;
- a `/reset_prefix_cache` answer of `success: false` is asked again, a bounded number of times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlhf_trainer.preflight import network
from rlhf_trainer.rollout.servers import ServerInfo
from rlhf_trainer.weight_sync import WeightSyncError, WeightSyncSender, nccl, sender as sender_module
from rlhf_trainer.weight_sync.transport import NcclTransport

NULL = 0  # the handle NCCL refuses with ncclInvalidArgument (checked below against the library)


class VllmRoutes(BaseHTTPRequestHandler):
    """The weight-transfer routes as vLLM answers them; /update_weights blocks as a vLLM
    worker does while it waits for the broadcasts; /reset_prefix_cache answers false
    `server.refusals` times first."""

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        path = self.path.split("?")[0]
        self.server.calls.append(path)
        if path == "/update_weights":
            self.server.released.wait(30)
        if path == "/reset_prefix_cache":
            self.server.refusals -= 1
            return self._reply({"success": self.server.refusals < 0})
        self._reply({})

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), VllmRoutes)
    httpd.calls, httpd.released, httpd.refusals = [], threading.Event(), 0
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield httpd
    httpd.released.set()
    httpd.shutdown()


def cpu_transport(handle: int | None) -> NcclTransport:
    """Our NcclTransport with the real binding on the CPU (its constructor wants CUDA)."""
    transport = object.__new__(NcclTransport)
    transport.world_size, transport.device, transport.stream = 2, torch.device("cpu"), None
    transport.nccl = nccl.load()
    transport.unique_id = transport.nccl.unique_id()
    transport.init_state()
    transport.comm = None if handle is None else nccl.Communicator(transport.nccl, handle)
    return transport


def test_the_null_handle_is_refused_by_the_library_itself():
    with pytest.raises(nccl.NcclError, match="ncclCommGetAsyncError failed: NCCL error 4: invalid argument"):
        nccl.load().async_error(NULL)


def test_a_wait_ends_at_the_communicators_error_not_at_a_deadline():
    comm = nccl.Communicator(nccl.load(), NULL)
    start = time.monotonic()
    with pytest.raises(nccl.NcclError, match="NCCL error 4: invalid argument"):
        nccl.wait_polling(lambda: False, comm, "a weight-sync broadcast")  # a kernel that never completes
    assert time.monotonic() - start < 0.5


def test_an_abort_waits_for_the_call_holding_the_handle_and_no_call_reaches_it_after():
    comm = nccl.Communicator(nccl.load(), NULL)
    holding, order = threading.Event(), []

    def collective():
        with comm.use("ncclBroadcast"):
            holding.set()
            time.sleep(0.3)
            order.append("collective returned")

    thread = threading.Thread(target=collective)
    thread.start()
    holding.wait(5)
    comm.abort()
    order.append("aborted")
    thread.join()
    assert order == ["collective returned", "aborted"] and comm.closed
    with pytest.raises(nccl.CommunicatorClosed):  # not the library's "invalid argument": it was not called
        comm.check()
    with pytest.raises(nccl.CommunicatorClosed):
        nccl.wait_polling(lambda: False, comm, "a weight-sync broadcast")
    comm.abort()  # idempotent


def test_no_abort_under_a_collective_that_never_returns():
    """An abort that cannot get the handle in time does nothing: the communicator is not
    freed under the thread inside NCCL (it would be a use after free), it is `stuck`; once
    that call returns, an abort goes ahead."""
    comm = nccl.Communicator(nccl.load(), NULL)
    holding, stuck = threading.Event(), threading.Event()

    def collective():
        with comm.use("ncclBroadcast"):
            holding.set()
            stuck.wait(10)

    thread = threading.Thread(target=collective, daemon=True)
    thread.start()
    holding.wait(5)
    start = time.monotonic()
    assert comm.abort(lock_wait_s=0.2) is False
    assert 0.2 <= time.monotonic() - start < 1.0
    assert comm.stuck and not comm.closed  # the handle is still the one the collective holds
    stuck.set()
    thread.join(5)
    assert comm.abort(lock_wait_s=0.2) is True and comm.closed


class StuckBroadcast(NcclTransport):
    """Our NcclTransport on the CPU whose broadcast never returns from NCCL (it holds the
    communicator as ncclBroadcast does, as a call blocked in the library would)."""

    def broadcast(self, tensor):
        with self._communicator().use("ncclBroadcast"):
            self.release.wait(30)


def test_a_round_that_leaves_a_thread_inside_nccl_ends_the_process_and_forms_no_group_again(server, monkeypatch):
    """The round passes its deadline while its broadcast is inside NCCL: the communicator is
    not aborted under it, the sender ends the process (on_watchdog: exit_process, 75) and
    raises GroupStuck; no group forms again (reform refused, server replacement gives up)."""
    from rlhf_trainer.rl.replacement import ServerReplacement
    from rlhf_trainer.weight_sync.threads import GroupStuck

    monkeypatch.setattr(nccl, "ABORT_LOCK_WAIT_S", 0.2)
    transport = cpu_transport(NULL)
    transport.__class__, transport.release = StuckBroadcast, threading.Event()
    ended = []
    sender = WeightSyncSender([server.url], "127.0.0.1", 0, timeout_s=1.0, on_watchdog=ended.append)
    sender.group = transport
    start = time.monotonic()
    with pytest.raises(GroupStuck, match="still inside an NCCL call"):
        sender.send([("w", [1000], torch.float32)], iter([torch.ones(1000)]))
    assert time.monotonic() - start < 20  # the deadline, the abort's wait, the servers' release
    assert len(ended) == 1 and "can neither be aborted nor formed again" in ended[0]
    assert sender.stuck and transport.comm.stuck and not transport.comm.closed
    assert "/shutdown_weight_transfer_engine" in server.calls
    server.calls.clear()
    with pytest.raises(GroupStuck):
        sender.reform([server.url])
    with pytest.raises(GroupStuck):
        sender.init([ServerInfo(server.url, "0.33.0", "nccl", 1)])
    assert server.calls == []  # no server was asked to join a new group

    class Client:
        left_out: list[str] = []

    assert ServerReplacement(sender, Client(), budget=3).recover(GroupStuck("stuck")) is False
    assert server.calls == []
    transport.release.set()
    sender.close()


def test_a_round_whose_communicator_fails_ends_in_seconds_and_aborts_it(server):
    """The trainer gathers slowly (0.3 s a tensor, 6 s in all) and the servers wait in
    /update_weights; the communicator's error ends the round at the first poll."""
    transport = cpu_transport(NULL)
    sender = WeightSyncSender([server.url], "127.0.0.1", 0, timeout_s=600)
    sender.group = transport

    def gathered():
        for _ in range(20):
            time.sleep(0.3)
            yield torch.ones(1000)

    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="NCCL error 4"):
        sender.send([(f"w{i}", [1000], torch.float32) for i in range(20)], gathered())
    assert time.monotonic() - start < 2.0  # not 6 s of gathering, nor the 600 s deadline
    assert transport.comm.closed and sender.group is None
    assert "/shutdown_weight_transfer_engine" in server.calls
    sender.close()


def test_an_nccl_error_while_the_group_forms_is_a_weight_sync_error(server, monkeypatch):
    """connect() reaches the real ncclCommInitRank (torch's CUDA device context is all that
    is skipped: no GPU here), which fails: exit 75 material, and the servers are released."""
    import contextlib

    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(sender_module, "make_transport", lambda *a, **k: cpu_transport(None))
    sender = WeightSyncSender([server.url], "127.0.0.1", 0, timeout_s=600, backend="nccl")
    with pytest.raises(WeightSyncError, match="forming the weight-sync group failed: ncclCommInitRank failed"):
        sender.init([ServerInfo(server.url, "0.33.0", "nccl", 1)])
    time.sleep(0.2)  # the init call runs on its own thread: it may arrive after the shutdown
    assert sorted(server.calls) == ["/init_weight_transfer_engine", "/shutdown_weight_transfer_engine"]
    sender.close()


TRAINER_CHILD = """
import sys, torch
torch.cuda.is_available = lambda: True  # past NcclTransport's CUDA check: ncclGetUniqueId needs no GPU
torch.cuda.current_device = lambda: 0
from rlhf_trainer.main import documented_exits
from rlhf_trainer.preflight import network
from rlhf_trainer.rollout.servers import ServerInfo
from rlhf_trainer.weight_sync import WeightSyncSender
url = sys.argv[1]
sender = WeightSyncSender([url], "127.0.0.1", 0, backend="nccl", timeout_s=float(sys.argv[2]))
with documented_exits(0):
    sender.init([ServerInfo(url, "0.33.0", "nccl", 1)])
"""


def run_trainer_child(tmp_path, url: str, env: dict, timeout_s: float = 600, code: str = TRAINER_CHILD,
                      limit_s: float = 120) -> tuple[subprocess.CompletedProcess, str, str]:
    """Run `code` (a sender's init under main.py's `documented_exits`) in a process of its
    own (NCCL reads its environment once per process); returns it, the marker file the
    launcher reads its exit code from, and the termination message."""
    marker, termination = tmp_path / "exit-code", tmp_path / "termination-log"
    termination.write_text("")
    full = {**os.environ, "RLHF_CONFIG_ERROR_FILE": str(marker), "RLHF_TERMINATION_LOG": str(termination), **env}
    done = subprocess.run([sys.executable, "-c", code, url, str(timeout_s)], env=full, capture_output=True,
                          text=True, timeout=limit_s)
    return done, marker.read_text() if marker.exists() else "", termination.read_text()


def test_an_interface_name_matching_no_interface_exits_2_naming_spec_pod_env(server, tmp_path):
    """The real libnccl refuses to mint a unique id when NCCL_SOCKET_IFNAME names no interface
    of the pod (NCCL error 5, invalid usage): a config error, through main.py's own handling:
    exit 2 (no restart spent), the launcher's marker says 2, and no server was asked to join."""
    done, marker, termination = run_trainer_child(tmp_path, server.url, {"NCCL_SOCKET_IFNAME": "doesnotexist0"})
    assert done.returncode == 2, done.stderr[-3000:]
    assert marker == "2"
    assert "ncclGetUniqueId failed: NCCL error 5: invalid usage" in done.stderr
    assert "spec.pod.env NCCL_SOCKET_IFNAME: 'doesnotexist0' matches no network interface" in done.stderr
    assert termination.startswith("rank 0: WeightSyncConfigError: cannot start the weight-sync group")
    assert server.calls == []


FORMATION_BLOCKED = TRAINER_CHILD.replace("from rlhf_trainer.main import", """
import contextlib, ctypes
from rlhf_trainer.weight_sync import nccl
torch.cuda.device = lambda device: contextlib.nullcontext()
libc = ctypes.CDLL(None)
libc.sleep.argtypes = [ctypes.c_uint]
# ncclCommInitRank waits in C for ranks that never join: a C call that does not return
nccl.Nccl.comm_init_rank = lambda self, world, uid, rank: libc.sleep(3600)
from rlhf_trainer.main import""")


def test_a_formation_stuck_in_c_at_its_deadline_exits_75_without_hanging(server, tmp_path):
    """ncclCommInitRank cannot be aborted: at the round's deadline the trainer exits 75
    through main.py's handling (exit_process) while a thread is still inside the C call,
    and the servers were asked to release the group."""
    start = time.monotonic()
    done, marker, termination = run_trainer_child(tmp_path, server.url, {}, timeout_s=2, code=FORMATION_BLOCKED,
                                                  limit_s=60)
    assert done.returncode == 75, done.stderr[-3000:]
    assert time.monotonic() - start < 40  # imports, the 2 s deadline, the servers' release: not 3600 s
    assert marker == "75" and "weight sync timed out" in termination
    assert "FATAL: weight sync timed out" in done.stderr
    assert sorted(server.calls) == ["/init_weight_transfer_engine", "/shutdown_weight_transfer_engine"]


def test_a_formation_left_inside_nccl_at_its_deadline_forms_no_group_again(server, monkeypatch):
    """In the process: the thread inside the formation call cannot be aborted, so the sender
    is stuck and refuses to form another group beside it (server replacement's reform)."""
    import contextlib
    from rlhf_trainer.weight_sync.threads import GroupStuck

    release = threading.Event()
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    transport = cpu_transport(None)
    monkeypatch.setattr(transport.nccl.__class__, "comm_init_rank", lambda self, *a: release.wait(30))
    monkeypatch.setattr(sender_module, "make_transport", lambda *a, **k: transport)
    sender = WeightSyncSender([server.url], "127.0.0.1", 0, timeout_s=1, backend="nccl")
    with pytest.raises(WeightSyncError, match="timed out"):
        sender.init([ServerInfo(server.url, "0.33.0", "nccl", 1)])
    assert sender.stuck and sender.group is None
    server.calls.clear()
    with pytest.raises(GroupStuck):
        sender.reform([server.url])
    assert server.calls == []
    release.set()
    sender.close()


@pytest.mark.parametrize("value, selected", [
    ("eth", ["eth0", "eth10"]), ("=eth0", ["eth0"]), ("=eth0,eth1", ["eth0"]), ("=eth", []),
    ("^docker", ["lo", "eth0", "eth10", "ib0"]), ("^=docker0", ["lo", "eth0", "eth10", "ib0", "docker01"]),
    ("^eth,lo", ["ib0", "docker0", "docker01"]), ("ib0:1024", ["ib0"]), ("net", []), ("^e,i,l,d", [])])
def test_the_interface_check_reads_nccls_syntax(value, selected):
    """NCCL's syntax: comma-separated prefixes, a leading ^ excludes, = makes every entry
    exact, :port names no interface."""
    names = ["lo", "eth0", "eth10", "ib0", "docker0", "docker01"]
    assert sorted(network.ifname_matches(value, names)) == sorted(selected)


def test_preflight_finds_a_bad_interface_name_and_a_missing_infiniband_device(tmp_path, monkeypatch):
    """Against this machine's own interfaces (socket.if_nameindex) and a device directory."""
    ours = network.interfaces()
    assert "lo" in ours
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "doesnotexist0")
    monkeypatch.setenv("NCCL_NET", "ib")
    problems = network.network_problems()
    assert len(problems) == 2 and all(p.startswith("spec.") for p in problems)
    assert f"it has {', '.join(ours)}" in problems[0] and "spec.rollout.weightSyncNetwork: ib" in problems[1]
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "^doesnotexist0")  # everything but it: fine
    assert network.socket_ifname_problem() is None
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "=" + ours[-1])
    assert network.socket_ifname_problem() is None
    assert network.infiniband_problem(device_dir=tmp_path / "missing") is not None
    (tmp_path / "mlx5_0").mkdir()
    assert network.infiniband_problem(device_dir=tmp_path) is None
    assert network.infiniband_problem("Socket", device_dir=tmp_path / "missing") is None


def test_the_launcher_exits_2_on_a_bad_interface_before_any_model_loads(tmp_path, monkeypatch, capsys):
    from rlhf_contract.pod import ENV_TRAINER_CONFIG
    from rlhf_trainer import launch
    from test_memory_plan import QWEN_1_5B, grpo_config, write_model

    config = grpo_config(f"model.path={write_model(tmp_path, QWEN_1_5B)}")
    path = tmp_path / "trainer.json"
    path.write_text(config.to_json())
    monkeypatch.setenv(ENV_TRAINER_CONFIG, str(path))
    monkeypatch.setenv("RLHF_TERMINATION_LOG", str(tmp_path / "termination-log"))
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "doesnotexist0")
    monkeypatch.setattr("subprocess.Popen", lambda *a, **k: pytest.fail("the trainer started"))
    assert launch.main(["--nnodes=1", "--nproc-per-node=1"]) == 2
    assert "spec.pod.env NCCL_SOCKET_IFNAME: 'doesnotexist0' matches no network interface" in capsys.readouterr().err


def test_a_refused_prefix_cache_reset_is_asked_again(server, monkeypatch):
    server.refusals = 2
    sender = WeightSyncSender([server.url], "127.0.0.1", 0, timeout_s=60)
    sender._reset_prefix_caches(time.monotonic() + 60)
    assert server.calls == ["/reset_prefix_cache"] * 3
    server.calls.clear()
    server.refusals = 100
    monkeypatch.setattr(sender_module, "RESET_PREFIX_CACHE_FIRST_DELAY_S", 0.01)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"reset_prefix_cache answered {{'success': False}} "
                                              rf"{sender_module.RESET_PREFIX_CACHE_ATTEMPTS} times"):
        sender._reset_prefix_caches(time.monotonic() + 60)
    assert server.calls == ["/reset_prefix_cache"] * sender_module.RESET_PREFIX_CACHE_ATTEMPTS
    assert time.monotonic() - start < 2
    sender.close()


# ---- the opt-in non-blocking formation (RLHF_NCCL_NONBLOCKING_INIT=1) --------------------------
# No CUDA here, so NCCL cannot form a communicator: these tests stand in for the library's
# answers (a handle that stays ncclInProgress, ncclCommAbort ending it) and run our binding's
# polling, the transport and the real sender around them. bench/gpu_check_pair.py's
# "never joins (non-blocking formation)" runs the real thing on a GPU.

FORMING = 0xF0  # a stand-in handle: never given to the real library below


class FormingLibrary:
    """ncclCommInitRankConfig / ncclCommGetAsyncError / ncclCommAbort as NCCL answers them for
    a formation whose peer never joins: in progress until aborted (or `fail_with`)."""

    def __init__(self, fail_with: int | None = None):
        self.aborted, self.polls, self.fail_with = [], 0, fail_with

    def install(self, monkeypatch, lib: nccl.Nccl) -> None:
        monkeypatch.setattr(lib.__class__, "comm_init_rank_nonblocking", lambda _, *a: FORMING)
        monkeypatch.setattr(lib.__class__, "async_error", lambda _, handle: self.async_error(handle))
        monkeypatch.setattr(lib.__class__, "abort", lambda _, handle: self.aborted.append(handle))

    def async_error(self, handle: int) -> int:
        assert handle == FORMING and not self.aborted  # never polled after the abort
        self.polls += 1
        return self.fail_with if self.fail_with is not None and self.polls > 2 else nccl.NCCL_IN_PROGRESS


def _nonblocking_sender(server, monkeypatch, library: FormingLibrary) -> tuple[WeightSyncSender, NcclTransport]:
    import contextlib

    monkeypatch.setenv(nccl.NONBLOCKING_INIT_ENV, "1")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    transport = cpu_transport(None)
    library.install(monkeypatch, transport.nccl)
    monkeypatch.setattr(sender_module, "make_transport", lambda *a, **k: transport)
    return WeightSyncSender([server.url], "127.0.0.1", 0, timeout_s=1, backend="nccl"), transport


def _formation_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "weight-sync-group" and t.is_alive()]


def test_a_nonblocking_formation_is_aborted_at_its_deadline_and_leaves_no_thread(server, monkeypatch, caplog):
    """The opt-in path: at init's deadline the formation is aborted (once, on the handle that
    was forming), the thread polling it leaves, the sender is not stuck and may form again."""
    library = FormingLibrary()
    sender, transport = _nonblocking_sender(server, monkeypatch, library)
    before = _formation_threads()
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="timed out"):
        sender.init([ServerInfo(server.url, "0.33.0", "nccl", 1)])
    assert time.monotonic() - start < 1 + nccl.ABORT_LOCK_WAIT_S + 1
    assert library.aborted == [FORMING] and library.polls > 2  # polled while forming, then aborted
    assert not sender.stuck and not transport.stuck and transport.comm.closed and not transport.formed
    assert _formation_threads() == before  # no thread left inside the formation
    assert "aborting the non-blocking formation" in caplog.text
    assert sorted(server.calls) == ["/init_weight_transfer_engine", "/shutdown_weight_transfer_engine"]
    server.calls.clear()
    transport.init_state()  # a fresh transport for the second attempt (make_transport makes one per init)
    library.aborted, library.polls = [], 0
    with pytest.raises(WeightSyncError, match="timed out") as again:  # forms again: not GroupStuck
        sender.init([ServerInfo(server.url, "0.33.0", "nccl", 1)])
    assert type(again.value) is WeightSyncError and "/init_weight_transfer_engine" in server.calls
    assert library.aborted == [FORMING] and _formation_threads() == before
    sender.close()


def test_without_the_variable_the_formation_is_blocking_as_before(server, monkeypatch):
    monkeypatch.delenv(nccl.NONBLOCKING_INIT_ENV, raising=False)
    transport = cpu_transport(None)
    assert not transport.nonblocking and not transport.formation_abortable
    monkeypatch.setenv(nccl.NONBLOCKING_INIT_ENV, "0")
    transport.init_state()
    assert not transport.formation_abortable
    monkeypatch.setenv(nccl.NONBLOCKING_INIT_ENV, "1")
    transport.init_state()
    assert transport.formation_abortable


def test_a_nonblocking_formation_nccl_gives_up_on_is_a_weight_sync_error_at_once(server, monkeypatch):
    library = FormingLibrary(fail_with=2)  # ncclSystemError while forming (a bootstrap failure)
    sender, transport = _nonblocking_sender(server, monkeypatch, library)
    start = time.monotonic()
    with pytest.raises(WeightSyncError, match="forming the weight-sync group failed: ncclCommInitRankConfig "
                                              "failed: NCCL error 2"):
        sender.init([ServerInfo(server.url, "0.33.0", "nccl", 1)])
    assert time.monotonic() - start < 1  # NCCL's answer, not the deadline
    assert library.aborted == [FORMING] and not sender.stuck
    sender.close()


def test_a_call_answering_in_progress_waits_until_the_communicator_settles(monkeypatch):
    """Non-blocking mode: ncclBroadcast / ncclAllReduce may answer ncclInProgress; the binding
    polls ncclCommGetAsyncError until it is not, and raises what it then says."""
    lib = nccl.Nccl()
    answers = iter([nccl.NCCL_IN_PROGRESS, nccl.NCCL_IN_PROGRESS, 0])
    monkeypatch.setattr(lib, "async_error", lambda handle: next(answers))
    lib.lib.ncclBroadcast = lambda *args: nccl.NCCL_IN_PROGRESS
    lib.broadcast(0, 1, "float32", 0, FORMING, 0)
    assert next(answers, "drained") == "drained"  # polled until it settled, not once more
    answers = iter([nccl.NCCL_IN_PROGRESS, 6])
    lib.lib.ncclAllReduce = lambda *args: nccl.NCCL_IN_PROGRESS
    lib.lib.ncclGetLastError = lambda comm: b"a peer went away"
    with pytest.raises(nccl.NcclError, match="ncclAllReduce failed: NCCL error 6: remote process exited"):
        lib.all_reduce_sum(0, 1, "float32", FORMING, 0)


def test_an_abort_answering_in_progress_is_not_polled(monkeypatch):
    """NCCL frees an aborted communicator on its own thread (commReclaim): an abort that
    answers ncclInProgress has started, and the handle is not touched again."""
    lib = nccl.Nccl()
    monkeypatch.setattr(lib, "async_error", lambda handle: pytest.fail("polled an aborted communicator"))
    lib.lib.ncclCommAbort = lambda comm: nccl.NCCL_IN_PROGRESS
    lib.abort(FORMING)
    lib.lib.ncclCommAbort = lambda comm: 3
    with pytest.raises(nccl.NcclError, match="ncclCommAbort failed: NCCL error 3"):
        lib.abort(FORMING)
