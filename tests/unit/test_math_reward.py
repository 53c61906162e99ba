"""The math reward on real answer styles: equivalent forms, wrong answers, no answer, R1 tags."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlhf_trainer.rewards.math import extract_final_answer, last_boxed, score_math


@pytest.mark.parametrize("response, answer", [
    (r"so the probability is $\boxed{\frac{1}{2}}$.", "0.5"),
    (r"Thus \boxed{0.5}", r"\frac{1}{2}"),
    (r"Thus \boxed{1/2}", r"\dfrac{1}{2}"),
    (r"The side is \boxed{2\sqrt{2}}", r"\sqrt{8}"),
    (r"\boxed{x = 3}", "3"),
    (r"\boxed{\{2, 1\}}", r"\{1,2\}"),
    (r"\boxed{(0, 1]}", "(0,1]"),
    (r"\boxed{(x+1)^2}", "x^2+2x+1"),
    (r"\boxed{-0.75}", r"-\frac{3}{4}"),
    (r"\boxed{1,000}", "1000"),
    (r"\boxed{\frac{\pi}{2}}", r"\pi/2"),
    (r"\boxed{5}", "$5$"),
    (r"First \boxed{4}, no wait: \boxed{6}", "6"),                      # the last one counts
    (r"\boxed{\frac{\sqrt{3}}{\left(2\right)}}", r"\frac{\sqrt{3}}{2}"),  # nested braces
    ("<think>2+2 is 4</think>\n<answer>4</answer>", "4"),
    ("thinking, tag in the prompt</think><answer>\\boxed{\\frac{3}{6}}</answer>", "1/2"),
    (r"<think>maybe \boxed{3}</think><answer>7</answer>", "7"),           # the tag wins
])
def test_equivalent_answers_score_one(response, answer):
    assert score_math(response, answer) == 1.0


@pytest.mark.parametrize("response, answer", [
    (r"\boxed{5}", "6"),
    (r"\boxed{\frac{1}{3}}", "0.5"),
    (r"\boxed{[0, 1)}", "(0,1)"),
    (r"\boxed{3.14159}", r"\pi"),
    (r"First \boxed{6}, no wait: \boxed{4}", "6"),                      # the last one counts
    ("The answer is 5.", "5"),                                         # no final answer
    (r"\boxed{5", "5"),                                                # braces never close
    ("<answer>5</answer>", "5"),                                       # tag without </think>
    (r"\boxed{}", "5"),
    (r"\boxed{5}", ""),
    (r"\boxed{\frac{}{}{}}}\\", "5"),                                  # garbage
    ("\\boxed{" + "9" * 5000 + "}", "9" * 5000),                       # too long to parse
])
def test_wrong_or_missing_answers_score_zero(response, answer):
    assert score_math(response, answer) == 0.0


def test_extraction():
    assert last_boxed(r"a \boxed{1} b \boxed{\frac{a}{b}} c") == r"\frac{a}{b}"
    assert last_boxed(r"\fbox{ 7 }") == " 7 "
    assert last_boxed("no box") is None
    assert extract_final_answer("<think>x</think> <answer> 12 </answer>") == "12"
    assert extract_final_answer("<think>x</think> and \\boxed{3}") == "3"
    assert extract_final_answer("nothing") is None


def test_works_from_worker_threads():
    """math-verify's signal timeouts only work in the main thread; we must still score."""
    cases = [(r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{2}", "3")] * 4
    with ThreadPoolExecutor(4) as pool:
        scores = list(pool.map(lambda c: score_math(*c), cases))
    assert scores == [1.0, 0.0] * 4


def test_pathological_answer_scores_zero_within_its_limit_and_the_worker_is_replaced():
    """`9^{9^{9^{9}}}` makes sympy compute a 370-million-digit integer in C: no signal stops
    it, so only killing the worker process does. Scored from a worker thread, as the trainer does."""
    from rlhf_trainer.rewards.math import MathScorer

    scorer = MathScorer(timeout_s=2.0, workers=1)
    try:
        assert scorer.score(r"\boxed{2}", "2") == 1.0  # the worker is up (start-up not timed)
        before = scorer._all[-1].proc
        start = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            bad = pool.submit(scorer.score, r"\boxed{9^{9^{9^{9}}}}", "1").result()
        elapsed = time.monotonic() - start
        assert bad == 0.0
        assert elapsed < 2.0 + 2.0, elapsed  # the limit, plus the kill (a loaded machine)
        assert before.poll() is not None  # that worker was killed...
        assert scorer.score(r"\boxed{\frac{1}{2}}", "0.5") == 1.0  # ...and a new one scores
    finally:
        scorer.close()


def test_build_reward_math_uses_the_per_answer_limit():
    from rlhf_contract.api.models import RewardSpec
    from rlhf_trainer.rewards import build_reward

    scorer = build_reward(RewardSpec(type="math", timeout_seconds=3))
    items = [(r"\boxed{1/2}", "0.5", {}), (r"\boxed{3}", "4", {}), ("no answer", "1", {})]
    assert scorer.score_batch(items) == [(1.0, 1.0), (0.0, 0.0), (0.0, 0.0)]
