"""`reward.type: judge` (rewards/judge.py): the score parser, and the client against a real
HTTP server on 127.0.0.1 that answers in OpenAI's shape with what the test scripts (the
judge's answer is the response itself, so each response picks the judge's reply): the
rubric it sees, bounded concurrency, retries, a judge that hangs or answers garbage, the
parse-failure and token counters. The same client against the real vLLM CPU server and our
CPU engine: tests/vllm/test_real_vllm.py and tests/e2e/test_data_and_rewards.py."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlhf_contract.api.task import JudgeSpec, RewardSpec
from rlhf_trainer.rewards import Sample, build_reward
from rlhf_trainer.rewards.custom import RewardError
from rlhf_trainer.rewards.judge import Judge, parse_score, render

NUMBER = JudgeSpec(model="m", min_score=1, max_score=5)
CHOICE = JudgeSpec(model="m", choices={"correct": 1.0, "incorrect": 0.0, "partial": 0.5})


@pytest.mark.parametrize("text, expected", [
    ("3", 0.5), (" 5.\n", 1.0), ("1", 0.0), ("Score: 4", 0.75), ("<score>2</score>", 0.25),
    ("The answer has 3 steps and 2 errors. Score: 2/5", 0.25),  # the labelled number, not the last
    ("I count 7 steps, so 4", 0.75),  # no label, not alone: the last number
    ("6", None), ("0", None), ("-3", None),  # outside [minScore, maxScore]: unparsable, not clipped
    ("no idea", None), ("", None),
])
def test_a_number_in_range_scaled_to_0_1(text, expected):
    assert parse_score(text, NUMBER) == expected


@pytest.mark.parametrize("text, expected", [
    ("correct", 1.0), ("Incorrect.", 0.0), ("It is partial... no: CORRECT", 1.0),  # the last one named
    ("incorrectly", None), ("maybe", None),
])
def test_a_choice_as_a_whole_word(text, expected):
    assert parse_score(text, CHOICE) == expected


def test_the_rubric_sees_prompt_response_and_answer():
    chat = Sample("4", "4", {}, [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}])
    text = render(JudgeSpec(model="m", template="{prompt}|{response}|{answer}|{min_score}-{max_score}"), chat)
    assert text == "system: Be terse.\nuser: 2+2?|4|4|0-10"
    with pytest.raises(ValueError, match=r"judge.template: KeyError 'question'; its placeholders are"):
        JudgeSpec(model="m", template="{question}")
    with pytest.raises(ValueError, match=r"judge.minScore \(5.0\) must be below judge.maxScore \(5.0\)"):
        JudgeSpec(model="m", min_score=5, max_score=5)


class _Judge(BaseHTTPRequestHandler):
    """Answers with the response found in the rubric (`...Response:\n<r>\n...`)."""

    calls: Counter = Counter()
    bodies: list = []
    headers_seen: list = []
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
        try:
            self.wfile.write(data)
        except BrokenPipeError:  # the client gave up (the timeout case)
            pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        route = self.path.split("/v1/")[0]
        self.calls[route] += 1
        with self.lock:
            self.bodies.append(body)
            self.headers_seen.append(self.headers.get("Authorization"))
            _Judge.in_flight += 1
            _Judge.max_in_flight = max(_Judge.max_in_flight, _Judge.in_flight)
        try:
            if route == "/hang":
                time.sleep(2)
            if route == "/flaky" and self.calls[route] % 2:
                return self._send(503, '{"error": "busy"}')
            if route == "/garbage":
                return self._send(200, '{"answer": "7"}')
            rubric = body["messages"][0]["content"] if "messages" in body else body["prompt"]
            reply = rubric.split("Response:\n")[1].split("\n")[0]
            time.sleep(0.1)
            choice = {"message": {"role": "assistant", "content": reply}} if "messages" in body else {"text": reply}
            self._send(200, json.dumps({"choices": [choice], "usage": {"prompt_tokens": 10, "completion_tokens": 2,
                                                                        "total_tokens": 12}}))
        finally:
            with self.lock:
                _Judge.in_flight -= 1


@pytest.fixture(scope="module")
def judge_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def spec(url: str, **judge) -> RewardSpec:
    return RewardSpec(type="exact_match", components=[
        {"name": "judge", "type": "judge", "timeoutSeconds": judge.pop("timeout", 5.0),
         "judge": {"url": url + "/v1", "model": "grader", **judge}}])


def test_a_judge_component_scores_counts_and_logs(judge_url, monkeypatch, caplog):
    monkeypatch.setenv("RLHF_JUDGE_API_KEY", "sk-test")
    _Judge.bodies.clear(), _Judge.headers_seen.clear()
    _Judge.max_in_flight = 0
    reward = build_reward(spec(judge_url + "/ok", maxConcurrency=3))
    batch = [Sample(r, "7", {}, "q") for r in ["7", "10", "banana", "3", "11", "0"]]
    results = reward.score_batch(batch)
    assert [total for total, _, _ in results] == [1.7, 1.0, 0.0, 0.3, 0.0, 0.0]  # exact match + judge's score
    parts = [p["judge"] for _, _, p in results]
    assert parts[:2] == [0.7, 1.0] and math.isnan(parts[2]) and parts[3] == 0.3 and math.isnan(parts[4])
    assert reward.drain_counters() == {"judge_parse_failures": 2, "judge_judge_tokens": 6 * 12}
    assert reward.drain_counters() == {"judge_parse_failures": 0, "judge_judge_tokens": 0}  # per step
    assert "2 of 6 answers unparsable (left out of the reward), the first: 'banana'" in caplog.text
    assert _Judge.max_in_flight == 3
    assert {b["model"] for b in _Judge.bodies} == {"grader"} and set(_Judge.headers_seen) == {"Bearer sk-test"}
    assert any("Prompt:\nq\n\nReference answer:\n7\n\nResponse:\n10\n" in b["messages"][0]["content"]
               for b in _Judge.bodies)
    completions = build_reward(spec(judge_url + "/ok", api="completions"))
    assert completions.score_batch([Sample("5", "", {}, "q")])[0][2] == {"exact_match": 0.0, "judge": 0.5}
    assert "prompt" in _Judge.bodies[-1] and _Judge.bodies[-1]["max_tokens"] == 32


def test_a_judge_that_fails_is_retried_then_an_error_naming_it(judge_url):
    _Judge.calls.clear()
    assert build_reward(spec(judge_url + "/flaky", maxRetries=1)).score_batch([Sample("5", "", {}, "q")])[0][2] == \
        {"exact_match": 0.0, "judge": 0.5}
    assert _Judge.calls["/flaky"] == 2  # a 503, then the answer
    with pytest.raises(RewardError, match=r"/hang/v1/chat/completions failed 2 times \(reward.timeoutSeconds 0.3 "
                                          r"each\); last: ReadTimeout"):
        build_reward(spec(judge_url + "/hang", maxRetries=1, timeout=0.3)).score_batch([Sample("5", "", {}, "q")])
    with pytest.raises(RewardError, match=r"answered '\{\"answer\": \"7\"\}', not an OpenAI chat completion"):
        build_reward(spec(judge_url + "/garbage")).score_batch([Sample("5", "", {}, "q")])
    with pytest.raises(ValueError, match=r"reward.judge.url is not set and the job has no judge servers"):
        Judge(JudgeSpec(model="/models/judge"), timeout_s=1)
