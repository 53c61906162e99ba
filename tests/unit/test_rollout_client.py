"""RolloutClient against two real CPU engines: order, load spreading, token ids, logprobs."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import httpx
import pytest
import torch
from helpers import hf_causal_lm

from rlhf_trainer.rollout import RolloutClient, RolloutError, Sample, prompt_seed

FACTS_NCCL = json.loads((Path(__file__).parents[1] / "protocol" / "vllm_facts.json").read_text())["nccl"]
EOS = 1
PAUSE_ROUTE_S = 60
"""/pause and /resume on a CPU engine with nothing in flight: answered at once when quiet; a
loaded 2-core machine can hold a request past httpx's 5 s default (and a resume lost in the
timer thread would leave the request under test waiting until pytest's own timeout)."""
# different lengths, so a mix-up of prompts would show
PROMPTS = [[6, 10, 4, 7, 15], [3, 15], [12, 11, 10, 9, 8, 7, 6, 5, 15], [5, 13, 8, 15],
           [4, 4, 4, 4, 4, 4, 15], [9, 14, 3, 15], [7, 15], [8, 8, 13, 3, 3, 15]]


@pytest.fixture(scope="module")
def engines(tiny_model_dir, start_engines):
    with start_engines(tiny_model_dir, 2) as urls:
        yield urls


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return hf_causal_lm(tiny_model_dir)


def test_samples_in_prompt_order_from_both_endpoints(engines, hf_model):
    client = RolloutClient(engines, max_concurrency=8)
    client.wait_ready(30)
    before = [httpx.get(u + "/stats").json()["num_requests"] for u in engines]
    groups = client.generate_sync(PROMPTS, n=3, max_tokens=10, temperature=1.0, seed=42)
    after = [httpx.get(u + "/stats").json()["num_requests"] for u in engines]

    assert len(groups) == len(PROMPTS)
    for prompt, samples in zip(PROMPTS, groups):
        assert len(samples) == 3 and all(isinstance(s, Sample) for s in samples)
        for s in samples:
            assert s.prompt_token_ids == prompt
            assert 1 <= len(s.token_ids) == len(s.logprobs) <= 10
            assert s.finish_reason == ("stop" if s.token_ids[-1] == EOS else "length")
            with torch.no_grad():
                logits = hf_model(torch.tensor([prompt + s.token_ids])).logits[0]
            lp = torch.log_softmax(logits.float(), -1)
            ref = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(s.token_ids)]
            assert s.logprobs == pytest.approx(ref, abs=1e-4)
    # one request per prompt, spread over both servers
    assert sum(client.requests_sent.values()) == len(PROMPTS)
    assert all(client.requests_sent[u] > 0 for u in engines)
    assert [a - b for a, b in zip(after, before)] == [client.requests_sent[u] for u in engines]
    # the same seed reproduces the samples, wherever each prompt lands
    again = RolloutClient(list(reversed(engines))).generate_sync(
        PROMPTS, n=3, max_tokens=10, temperature=1.0, seed=42)
    assert [[s.token_ids for s in g] for g in again] == [[s.token_ids for s in g] for g in groups]


def test_stop_token_ids_and_greedy(engines):
    client = RolloutClient(engines)
    groups = asyncio.run(client.generate([[6, 10, 4, 7, 15]], n=2, max_tokens=20,
                                         temperature=0.0, stop_token_ids=[10]))
    # this model's greedy continuation is 12, 10, 10, ...: it stops at the first 10
    assert [s.token_ids for s in groups[0]] == [[12, 10], [12, 10]]
    assert [s.finish_reason for s in groups[0]] == ["stop", "stop"]


def test_dead_endpoint_is_retried_elsewhere(engines):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = RolloutClient([dead, engines[0]], backoff_s=0.01)
    groups = client.generate_sync(PROMPTS[:4], n=1, max_tokens=4, temperature=1.0, seed=1)
    assert [g[0].prompt_token_ids for g in groups] == PROMPTS[:4]
    assert client.requests_sent[dead] >= 1  # tried, failed, retried on the live one

    with pytest.raises(RolloutError, match="after 3 attempts"):
        RolloutClient([dead], max_retries=2, backoff_s=0.01).generate_sync(
            PROMPTS[:1], n=1, max_tokens=4, temperature=1.0)


def test_server_error_is_reported_with_endpoint_and_body(engines):
    with pytest.raises(RolloutError, match=r"127\.0\.0\.1.*HTTP 400.*top_p"):
        RolloutClient(engines).generate_sync(PROMPTS[:1], n=1, max_tokens=4,
                                             temperature=1.0, top_p=0.0)


def test_prompt_seeds_are_distinct_and_stable():
    seeds = [prompt_seed(7, i) for i in range(1000)]
    assert len(set(seeds)) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [prompt_seed(7, i) for i in range(1000)]
    assert prompt_seed(8, 0) != seeds[0]


# ---- start-up check ---------------------------------------------------------------------

class _FakeServer:
    """A real HTTP server answering fixed JSON per path (404 elsewhere), healthy after
    `healthy_after_s`: stands for a rollout image we do not build (an old vLLM, a vLLM
    without dev mode or without a weight-transfer engine)."""

    def __init__(self, replies: dict[str, dict], healthy_after_s: float = 0.0):
        import http.server
        import json
        import threading
        import time

        start = time.monotonic()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                path = self.path.split("?")[0]
                if path == "/health":
                    self.send_response(200 if time.monotonic() - start >= healthy_after_s else 503)
                    self.end_headers()
                    return
                if path not in replies:
                    self.send_response(404)
                    self.end_headers()
                    return
                body = json.dumps(replies[path]).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()


def vllm_replies(version="0.33.0", transfer={"backend": "nccl"}, dev_mode=True, world_size=2,  # noqa: B006
                 nccl_package=None):
    """What vLLM answers; `system_env.pip_packages` as its collect_env lists them (its own
    NCCL wheel: by default the one the pinned vLLM's torch requires, as in its image)."""
    if nccl_package is None:
        nccl_package = FACTS_NCCL["nccl_requirement"]
    replies = {"/version": {"version": version}}
    if dev_mode:
        replies["/server_info"] = {"vllm_config": {"weight_transfer_config": transfer},
                                   "system_env": {"pip_packages": f"numpy==2.2.6\n{nccl_package}\n"
                                                                 f"{FACTS_NCCL['torch_requirement']}"}}
        replies["/get_world_size"] = {"world_size": world_size}
    return replies


def test_startup_check_reports_every_servers_capabilities(engines):
    from rlhf_contract.images import VLLM_VERSION
    from rlhf_trainer.rollout import handshake

    fake = _FakeServer(vllm_replies(world_size=4))
    try:
        infos = handshake([*engines, fake.url], startup_timeout_s=30)
    finally:
        fake.close()
    assert [(i.endpoint, i.version, i.weight_transfer_backend, i.world_size) for i in infos] == [
        (engines[0], VLLM_VERSION, "gloo", 1), (engines[1], VLLM_VERSION, "gloo", 1), (fake.url, "0.33.0", "nccl", 4)]
    release = FACTS_NCCL["nccl_requirement"].partition("==")[2]
    assert infos[2].nccl == tuple(int(x) for x in release.split(".")) and infos[2].dtype is None
    assert infos[0].dtype == "torch.float32"  # the CPU engine's model_config.dtype, what the sender casts to


@pytest.mark.parametrize("replies, says", [
    (vllm_replies(version="0.11.0"), "runs vLLM 0.11.0, older than the weight-transfer API this trainer speaks"),
    # 0.32 has the API but not empty metadata meaning "as last round": its second round would receive nothing
    (vllm_replies(version="0.32.1"), "runs vLLM 0.32.1, older than the weight-transfer API this trainer speaks (0.33)"),
    (vllm_replies(nccl_package="nvidia-nccl-cu13==2.29.7"), "runs NCCL 2.29.7, the trainer runs NCCL "
     + FACTS_NCCL["nccl_requirement"].partition("==")[2]),
    ({}, "runs vLLM (no /version)"),
    (vllm_replies(dev_mode=False), "VLLM_SERVER_DEV_MODE=1"),
    (vllm_replies(transfer=None), "no --weight-transfer-config"),
])
def test_startup_check_exits_2_naming_rollout_image(replies, says, capsys):
    """The handshake refuses what no trainer could work with; the sender, forming its group
    from the handshake's result, refuses a server of another NCCL release."""
    from rlhf_trainer.rollout import RolloutImageError, handshake
    from rlhf_trainer.weight_sync import WeightSyncSender

    fake = _FakeServer(replies)
    try:
        with pytest.raises(RolloutImageError) as info:
            servers = handshake([fake.url], startup_timeout_s=30)
            WeightSyncSender([fake.url], "127.0.0.1", 0).init(servers)
    finally:
        fake.close()
    assert isinstance(info.value, SystemExit) and info.value.code == 2
    assert str(info.value).startswith("rollout.image: ") and says in str(info.value)
    assert says in capsys.readouterr().err  # the reason reaches the pod's log


def test_startup_check_waits_as_long_as_allowed_and_no_longer():
    import time

    from rlhf_trainer.rollout import handshake

    slow = _FakeServer(vllm_replies(), healthy_after_s=2.0)
    try:
        start = time.monotonic()
        assert handshake([slow.url], startup_timeout_s=30)[0].world_size == 2
        assert time.monotonic() - start >= 2.0
        never = _FakeServer(vllm_replies(), healthy_after_s=1e9)
        try:
            start = time.monotonic()
            with pytest.raises(RolloutError, match="not ready after 1.5 s"):
                handshake([never.url], startup_timeout_s=1.5)
            assert time.monotonic() - start < 10
        finally:
            never.close()
    finally:
        slow.close()


def test_client_sends_every_field_vllm_would_fill_from_generation_config(tmp_path, tiny_model_dir, start_engines):
    """A model whose generation_config.json sets a repetition penalty, served with vLLM's
    default --generation-config auto: the client's explicit neutral values win."""
    import json
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1, "min_p": 0.05}))
    with start_engines(model, 1) as (url,):
        samples = RolloutClient([url]).generate_sync([PROMPTS[0]], n=2, max_tokens=4, temperature=1.0, seed=3)
    assert [len(s.token_ids) > 0 for s in samples[0]] == [True, True]


def test_a_paused_server_is_waited_out_and_one_pool_serves_the_run(engines):
    """With rollouts running ahead (rollout.maxStaleness), a weight sync pauses the servers
    ("wait": new requests get 503) while a request is being sent: the request waits for the
    resume without using up its retry budget, on the run's one connection pool."""
    import threading
    import time

    import httpx

    from rlhf_trainer.rollout import RolloutClient

    client = RolloutClient(engines, max_retries=0, backoff_s=0.05)
    try:
        client.generate_sync([[4, 5]], n=1, max_tokens=2, temperature=1.0, seed=1)
        pool = client._http
        for url in engines:
            assert httpx.post(f"{url}/pause", params={"mode": "wait"}, timeout=PAUSE_ROUTE_S).status_code == 200
        threading.Timer(1.0, lambda: [httpx.post(f"{url}/resume", timeout=PAUSE_ROUTE_S) for url in engines]).start()
        start = time.monotonic()
        [[sample]] = client.generate_sync([[4, 5]], n=1, max_tokens=2, temperature=1.0, seed=2)
        assert time.monotonic() - start >= 0.9 and len(sample.token_ids) >= 1  # waited for the resume
        assert client._http is pool  # the same keep-alive pool across calls
        assert sum(client.requests_sent.values()) >= 4  # 503s were retried, beyond max_retries=0
    finally:
        client.close()


# ---- routing: trajectory ids, least outstanding requests, unhealthy servers ---------------

def served(engines: list[str]) -> list[int]:
    """Each engine's own count of the generation requests it has received."""
    return [httpx.get(u + "/stats").json()["num_requests"] for u in engines]


def test_every_turn_of_a_trajectory_goes_to_the_server_that_served_its_first(engines):
    """Four trajectories of three turns each, one request at a time (each turn's prompt is the
    one before plus its answer, as in a multi-turn episode): the servers' own counters show
    which server got each request; every turn of an id lands where its first turn did, and
    the first turns, with nothing in flight, are spread over both servers."""
    client = RolloutClient(engines)
    try:
        where: dict[str, set[str]] = {}
        for t, prompt in enumerate(PROMPTS[:4]):
            context = list(prompt)
            for turn in range(3):
                before = served(engines)
                [[s]] = client.generate_sync([context], n=1, max_tokens=3, temperature=1.0, seed=turn,
                                             trajectory_id=f"traj-{t}")
                delta = [a - b for a, b in zip(served(engines), before)]
                assert sorted(delta) == [0, 1], delta
                where.setdefault(f"traj-{t}", set()).add(engines[delta.index(1)])
                context += s.token_ids
        assert all(len(servers) == 1 for servers in where.values()), where
        assert {next(iter(s)) for s in where.values()} == set(engines)
        assert {t: next(iter(s)) for t, s in where.items()} == dict(client.routes)
    finally:
        client.close()


def test_a_group_shares_one_server_and_a_new_id_goes_to_the_least_busy_one(engines):
    """Two groups of four samples, each sample its own request with the group's id, all sent
    at once: group g's first request takes a server; g's other three follow it, making it
    the busier one; group h's first request then goes to the server with fewer outstanding
    requests, and h's others follow h."""
    client = RolloutClient(engines)

    async def both() -> None:
        calls = [client.generate([PROMPTS[k]], n=1, max_tokens=8, temperature=1.0, seed=k, trajectory_id=group)
                 for group in ("g", "h") for k in range(4)]
        await asyncio.gather(*calls)

    try:
        before = served(engines)
        client.run(both())
        delta = dict(zip(engines, (a - b for a, b in zip(served(engines), before))))
        assert client.routes["g"] != client.routes["h"]
        assert delta == {client.routes["g"]: 4, client.routes["h"]: 4}
    finally:
        client.close()


def test_a_server_marked_unhealthy_hands_its_trajectories_to_the_others(engines):
    client = RolloutClient(engines)
    try:
        def turn(tid: str) -> str:
            before = served(engines)
            client.generate_sync([PROMPTS[0]], n=1, max_tokens=2, temperature=1.0, seed=0, trajectory_id=tid)
            return engines[[a - b for a, b in zip(served(engines), before)].index(1)]

        first = turn("t")
        other = next(e for e in engines if e != first)
        client.mark_unhealthy(first)
        assert turn("t") == other and client.routes["t"] == other and client.moves == 1
        assert turn("new") == other  # nothing new goes to an unhealthy server
        client.mark_healthy(first)
        assert turn("t") == other  # a moved trajectory stays where its context now is
    finally:
        client.close()


def test_a_dead_server_is_marked_unhealthy_then_probed_again(engines):
    """A server that refuses connections: the request is retried on a live one, which keeps
    the trajectory; new ids avoid the dead one for `unhealthy_s`, then one request probes it."""
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = RolloutClient([dead, *engines], backoff_s=0.01, unhealthy_s=1.0)
    try:
        client.generate_sync([PROMPTS[1]], n=1, max_tokens=2, temperature=1.0, seed=0, trajectory_id="a")
        assert client.requests_sent[dead] == 1 and client.routes["a"] in engines and not client.healthy(dead)
        for k in range(4):
            client.generate_sync([PROMPTS[k]], n=1, max_tokens=2, temperature=1.0, seed=k, trajectory_id=f"b{k}")
        assert client.requests_sent[dead] == 1
        time.sleep(1.1)
        assert client.healthy(dead)
        client.generate_sync([PROMPTS[2]], n=1, max_tokens=2, temperature=1.0, seed=0, trajectory_id="c")
        assert client.requests_sent[dead] == 2 and client.routes["c"] in engines  # probed, failed, moved on
    finally:
        client.close()


def test_multi_turn_groups_keep_their_turns_on_one_server(engines, tiny_model_dir):
    """multi_turn.collect against the real servers: three prompts x three trajectories of up
    to three turns (an environment that asks for two more turns): each group's every request
    (its id: group_id(seed, i)) goes to one server, and each server's own request count is
    exactly the turns of the groups routed to it."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from rlhf_trainer.rollout.multi_turn import collect, group_id

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)

    async def step(state, action, extra_info):
        turns = extra_info.get("turns", 0) + 1
        return {"next_state": state + action, "reward": 0.0, "done": turns == 3,
                "extra_info": {**extra_info, "turns": turns}}

    prompts = [SimpleNamespace(text=tok.decode(p), token_ids=p, extra_info={}, answer="") for p in PROMPTS[:3]]
    client = RolloutClient(engines)
    try:
        before = served(engines)
        groups = collect(client, step, tok, prompts, n=3, max_turns=3, max_tokens=12,
                         sampling={"temperature": 1.0, "stop_token_ids": [EOS]}, seed=5)
        delta = dict(zip(engines, (a - b for a, b in zip(served(engines), before))))
        want = dict.fromkeys(engines, 0)
        for i, group in enumerate(groups):
            want[client.routes[group_id(5, i)]] += sum(t.num_turns for t in group)
        assert delta == want and sum(want.values()) > 9  # some trajectories took several turns
    finally:
        client.close()


def test_with_replacement_a_dead_server_is_left_out_until_readmitted(engines):
    """`replace_servers` (rollout.maxServerReplacements > 0): a server that refused a connection
    is not probed again after `unhealthy_s` (restarted, it would serve the weights it started
    from): nothing reaches it until the trainer re-admits it after a push."""
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = RolloutClient([dead, *engines], backoff_s=0.01, unhealthy_s=0.2, replace_servers=True)
    try:
        client.generate_sync([PROMPTS[1]], n=1, max_tokens=2, temperature=1.0, seed=0, trajectory_id="a")
        assert client.requests_sent[dead] == 1 and dead in client.left_out
        time.sleep(0.3)
        for k in range(4):
            client.generate_sync([PROMPTS[k]], n=1, max_tokens=2, temperature=1.0, seed=k, trajectory_id=f"b{k}")
        assert client.requests_sent[dead] == 1  # past unhealthy_s, still left out
        client.readmit(engines[0])  # not left out: a no-op
        client.leave_out(engines[0])
        client.leave_out(engines[1])
        with pytest.raises(RolloutError, match="every rollout server is gone"):
            client.generate_sync([PROMPTS[0]], n=1, max_tokens=2, temperature=1.0, seed=0)
        client.readmit(dead)
        assert client._pick() == dead
    finally:
        client.close()


class DroppingProxy:
    """A TCP proxy to `target` on a free port that closes the first `drops` connections (all of
    them when None) as soon as a request arrives on them, without an answer, as a server does
    that dies or closes an idle kept-alive connection while a request is sent on it."""

    def __init__(self, target: str, drops: int | None):
        import threading

        self.host, self.port = target.removeprefix("http://").split(":")
        self.drops, self.dropped = drops, 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()

        async def start():
            self.server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
            self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
            ready.set()

        threading.Thread(target=lambda: (self.loop.run_until_complete(start()), self.loop.run_forever()),
                         daemon=True).start()
        ready.wait(10)

    async def serve(self, reader, writer):
        first = await reader.read(65536)
        if self.drops is None or self.dropped < self.drops:
            self.dropped += 1
            writer.transport.abort()  # a reset, no answer
            return
        up_reader, up_writer = await asyncio.open_connection(self.host, int(self.port))
        up_writer.write(first)

        async def pipe(src, dst):
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def close(self):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_with_replacement_a_dropped_connection_to_a_live_server_is_retried_not_left_out(engines):
    """A server that drops a connection but answers /health on a fresh one is alive (the same
    process, the current weights): with replacement on, the request is sent again and the
    server stays routed to; one sole server is not "gone". A server that drops every
    connection (and so the probe too) is left out, and the request goes to another."""
    flaky, dead = DroppingProxy(engines[0], drops=1), DroppingProxy(engines[0], drops=None)
    try:
        client = RolloutClient([flaky.url], backoff_s=0.01, replace_servers=True)
        try:
            [[sample]] = client.generate_sync([PROMPTS[0]], n=1, max_tokens=3, temperature=1.0, seed=0)
            assert len(sample.token_ids) == 3 and flaky.dropped == 1
            assert client.requests_sent[flaky.url] == 2 and not client.left_out and client.healthy(flaky.url)
        finally:
            client.close()
        client = RolloutClient([dead.url, engines[1]], backoff_s=0.01, replace_servers=True)
        try:
            client.generate_sync([PROMPTS[1]], n=1, max_tokens=3, temperature=1.0, seed=0, trajectory_id="d")
            assert client.requests_sent[dead.url] == 1 and dead.url in client.left_out
            assert client.requests_sent[engines[1]] == 1
        finally:
            client.close()
    finally:
        flaky.close()
        dead.close()
