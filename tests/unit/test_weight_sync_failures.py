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
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

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


def test_an_abort_goes_ahead_under_a_collective_that_never_returns():
    comm = nccl.Communicator(nccl.load(), NULL)
    holding, stuck = threading.Event(), threading.Event()

    def collective():
        with comm.use("ncclBroadcast"):
            holding.set()
            stuck.wait(10)

    threading.Thread(target=collective, daemon=True).start()
    holding.wait(5)
    start = time.monotonic()
    comm.abort(lock_wait_s=0.2)
    assert 0.2 <= time.monotonic() - start < 1.0 and comm.closed
    stuck.set()


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


def test_an_nccl_error_minting_the_unique_id_is_a_weight_sync_error_naming_the_interface(server, monkeypatch):
    """ncclGetUniqueId fails when NCCL's bootstrap finds no interface of NCCL_SOCKET_IFNAME
    (NCCL reads it once per process, so here the real call fails on a NULL out argument)."""
    lib = nccl.load()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the constructor's CUDA check
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(lib, "unique_id", lambda: lib._check("ncclGetUniqueId", lib.lib.ncclGetUniqueId(None)))
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "net1")
    sender = WeightSyncSender([server.url], "127.0.0.1", 0, backend="nccl")
    with pytest.raises(WeightSyncError, match=r"cannot start the weight-sync group: ncclGetUniqueId failed: NCCL "
                                              r"error 4: .*NCCL_SOCKET_IFNAME='net1' must name an interface"):
        sender.init([ServerInfo(server.url, "0.33.0", "nccl", 1)])
    assert server.calls == []  # refused before any server was asked to join
    sender.close()


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
