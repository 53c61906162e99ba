"""User reward files and a remote reward service (a real HTTP server on 127.0.0.1)."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_trainer.rewards.custom import RemoteReward, RewardError, normalize_result
from rlhf_trainer.rewards.forms import python_reward
from rlhf_trainer.rewards.sample import Sample


def score(path: str, name: str = "reward_fn", response: str = "x", answer: str = "y", extra_info: dict | None = None):
    """One response scored by the trainer's python reward (`python_reward`) of `name` in `path`."""
    [result] = python_reward(path, name)([Sample(response, answer, extra_info or {})])
    return result


@pytest.mark.parametrize("value, expected", [
    (1, (1.0, 1.0)), (0.25, (0.25, 0.25)), (True, (1.0, 1.0)),
    ({"reward": 0.5}, (0.5, 0.5)), ({"reward": -1, "score": 0}, (-1.0, 0.0)),
    ({"reward": 2.0, "score": None}, (2.0, 2.0)),
])
def test_normalize_result(value, expected):
    assert normalize_result(value) == expected


@pytest.mark.parametrize("value, message", [
    (None, "reward must be a number"), ("1.0", "reward must be a number"),
    ({"score": 1.0}, "needs a 'reward' key"), ({"reward": float("nan")}, "must be finite"),
    ({"reward": 1e308}, r"must be within \+-3.4e\+38 \(float32\), got 1e\+308"),
    ({"reward": 1.0, "score": "high"}, "score must be a number"), ([1.0], "reward must be"),
])
def test_normalize_result_rejects(value, message):
    with pytest.raises(ValueError, match=message):
        normalize_result(value)


REWARD_FILE = '''
import asyncio
from dataclasses import dataclass

@dataclass
class Weights:
    correct: float = 1.0

def reward_fn(response, answer, extra_info):
    return Weights().correct if response.strip() == answer else 0.0

def shaped(response, answer, extra_info):
    score = float(response.strip() == answer)
    return {"reward": score - 0.01 * len(response), "score": score}

async def async_fn(response, answer, extra_info):
    await asyncio.sleep(0)
    return {"reward": extra_info["weight"] * len(response)}

def broken(response, answer, extra_info):
    return 1 / 0

def bad_value(response, answer, extra_info):
    return "yes"

def two_args(response, answer):
    return 1.0

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return str(path)


def test_load_and_call_user_functions(reward_file):
    assert score(reward_file, response=" 42 ", answer="42") == (1.0, 1.0)
    assert score(reward_file, response="41", answer="42") == (0.0, 0.0)
    assert score(reward_file, "shaped", "42", "42") == pytest.approx((0.98, 1.0))
    assert score(reward_file, "async_fn", "abcd", "", {"weight": 0.5}) == (2.0, 2.0)


def test_user_function_errors_name_file_and_function(reward_file, tmp_path):
    with pytest.raises(RewardError, match=r"reward function 'broken' in .*my_reward.py raised "
                                          r"ZeroDivisionError"):
        score(reward_file, "broken")
    with pytest.raises(RewardError, match=r"'bad_value' in .*my_reward.py returned an invalid "
                                          r"result: reward must be a number, got 'yes'"):
        score(reward_file, "bad_value")
    with pytest.raises(ValueError, match=r"my_reward.py defines no function 'nope'; it defines "
                                         r"reward_fn, shaped, async_fn, broken"):
        python_reward(reward_file, "nope")
    with pytest.raises(ValueError, match=r"'two_args' in .*must accept \(response, answer, "
                                         r"extra_info\)"):
        python_reward(reward_file, "two_args")
    with pytest.raises(ValueError, match=r"reward file .*missing.py does not exist"):
        python_reward(str(tmp_path / "missing.py"), "reward_fn")
    (tmp_path / "syntax.py").write_text("def reward_fn(:\n")
    with pytest.raises(ValueError, match=r"syntax.py failed to import: SyntaxError"):
        python_reward(str(tmp_path / "syntax.py"), "reward_fn")


class _Handler(BaseHTTPRequestHandler):
    calls: Counter = Counter()
    in_flight = max_in_flight = 0
    lock = threading.Lock()

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: str):
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls[self.path] += 1
        correct = float(payload["response"].strip() == payload["answer"])
        if self.path == "/slow":
            with self.lock:
                _Handler.in_flight += 1
                _Handler.max_in_flight = max(_Handler.max_in_flight, _Handler.in_flight)
            time.sleep(0.3)
            with self.lock:
                _Handler.in_flight -= 1
        if self.path == "/flaky" and self.calls[self.path] % 3 != 0:
            return self._send(503, '{"error": "busy"}')
        if self.path == "/bad-request":
            return self._send(400, '{"error": "missing field"}')
        if self.path == "/garbage":
            return self._send(200, "not json")
        if self.path == "/hang":
            time.sleep(2)
        if self.path == "/prompt-length":  # the prompt reaches the service: text, or chat turns
            return self._send(200, json.dumps({"reward": len(payload["prompt"])}))
        self._send(200, json.dumps({"reward": correct * payload["extra_info"].get("w", 1),
                                    "score": correct}))


@pytest.fixture(scope="module")
def server_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_remote_reward_single_and_batch(server_url):
    remote = RemoteReward(server_url + "/score")
    assert remote("7", "7", {"w": 2}) == (2.0, 1.0)
    items = [(str(i), str(i % 2), {}) for i in range(6)]
    assert remote.score_batch(items) == [(1.0, 1.0), (1.0, 1.0)] + [(0.0, 0.0)] * 4


def test_remote_reward_sees_the_prompt(server_url):
    from rlhf_trainer.rewards import Sample

    turns = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    assert RemoteReward(server_url + "/prompt-length").score_batch(
        [Sample("r", "a", {}, "12345:"), Sample("r", "a", {}, turns)]) == [(6.0, 6.0), (2.0, 2.0)]


def test_remote_reward_runs_concurrently(server_url):
    _Handler.max_in_flight = 0
    assert RemoteReward(server_url + "/slow", max_concurrency=4).score_batch(
        [("1", "1", {})] * 8) == [(1.0, 1.0)] * 8
    assert _Handler.max_in_flight == 4  # each request takes 0.3 s: all four slots fill


def test_remote_reward_retries_then_succeeds(server_url):
    _Handler.calls["/flaky"] = 0
    remote = RemoteReward(server_url + "/flaky", max_retries=3, backoff_s=0.01)
    assert remote("1", "1", {}) == (1.0, 1.0)
    assert _Handler.calls["/flaky"] == 3  # two 503s, then the answer


def test_remote_reward_errors_name_the_url(server_url):
    with pytest.raises(RewardError, match=r"/bad-request answered HTTP 400"):
        RemoteReward(server_url + "/bad-request")("1", "1", {})
    with pytest.raises(RewardError, match=r"/garbage answered 'not json'"):
        RemoteReward(server_url + "/garbage").score_batch([("1", "1", {})])
    with pytest.raises(RewardError, match=r"/hang failed 2 times; last: ReadTimeout"):
        RemoteReward(server_url + "/hang", timeout_s=0.2, max_retries=1, backoff_s=0.01)(
            "1", "1", {})
    _Handler.calls["/flaky"] = 0  # 503, then 503: out of retries
    with pytest.raises(RewardError, match=r"/flaky failed 2 times; last: HTTP 503"):
        RemoteReward(server_url + "/flaky", max_retries=1, backoff_s=0.01).score_batch(
            [("1", "1", {})])
    with pytest.raises(ValueError, match="must start with http"):
        RemoteReward("localhost:8000")


def test_a_reward_function_that_calls_exit_is_an_error_not_a_hang(tmp_path):
    """exit() in a scoring thread would end the rollout client's event loop and leave the
    trainer waiting forever: it is a RewardError like any other raise."""
    (tmp_path / "quits.py").write_text("import sys\ndef reward_fn(response, answer, extra_info):\n    sys.exit(2)\n")
    with pytest.raises(RewardError, match=r"raised SystemExit: 2"):
        score(str(tmp_path / "quits.py"))
