"""SIGTERM on one node only (a drain): the trainer's ranks agree over one all-reduce whether
to stop, the least time any of them has left, and the most time any needs to finish the
step (`rlhf_trainer.preemption`), so all of them save or abandon the same step."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import torchrun

WORKER = Path(__file__).parent / "workers" / "preemption_agree.py"


def test_one_rank_signalled_stops_every_rank_with_the_same_decision(tmp_path):
    rank0, rank1 = torchrun(WORKER, 2, out=tmp_path / "decisions.json", timeout=120)
    assert rank0 == rank1  # the same decisions on every rank
    before, after, short = rank0
    assert before["stop"] is False and not before["abandon"]
    assert after["stop"] is True and after["needed_s"] == 20.0  # rank 1's need, though rank 0 got no signal
    assert 25.0 < after["remaining_s"] < 30.0 and not after["abandon"]  # 30 s grace: finish the step
    assert short["stop"] is True and short["remaining_s"] < 5.0 and short["abandon"]  # too little: abandon it
