"""The suite's xdist scheduler (tests/scheduling.py): its order and its rule for the CPU
learners, driven as xdist's DSession drives it (the workers are stand-ins that record what
they are sent; a real `-n 2` run uses it for the whole suite)."""

from __future__ import annotations

from types import SimpleNamespace

from scheduling import FileScheduling, hand_out_order

COLLECTION = [
    "tests/unit/test_a.py::test_1", "tests/unit/test_a.py::test_2",
    "tests/e2e/test_preset_runs.py::test_ppo_with_critic_learns", "tests/e2e/test_preset_runs.py::test_grpo",
    "tests/cluster/test_kueue.py::test_admits", "tests/cluster/test_real_pods.py::test_runs",
    "tests/cluster/test_real_pods.py::test_restarts", "tests/cluster/test_zz.py::test_last",
    "tests/e2e/test_faults.py::test_kill", "tests/vllm/test_real_vllm.py::test_serves",
    "tests/e2e/test_lora_runs.py::test_lora_learns_the_demo_task",
]


class Worker:
    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.shutting_down = False
        self.sent: list[list[str]] = []

    def send_runtest_some(self, indices):
        self.sent.append([COLLECTION[i] for i in indices])

    def shutdown(self):
        self.shutting_down = True


def started() -> tuple[FileScheduling, Worker, Worker]:
    config = SimpleNamespace(getvalue=lambda name: ["2*popen"])
    sched, a, b = FileScheduling(config), Worker("gw0"), Worker("gw1")
    for w in (a, b):
        sched.add_node(w)
        sched.add_node_collection(w, COLLECTION)
    assert sched.collection_is_completed
    sched.schedule()
    return sched, a, b


def finish(sched: FileScheduling, worker: Worker, nodeids: list[str]) -> None:
    for nodeid in nodeids:
        sched.mark_test_complete(worker, COLLECTION.index(nodeid))


def test_units_are_files_and_the_cluster_tier_long_tiers_first():
    assert [unit for unit, _ in hand_out_order(COLLECTION)] == [
        "tests/cluster/", "tests/e2e/test_preset_runs.py", "tests/e2e/test_faults.py", "tests/e2e/test_lora_runs.py",
        "tests/vllm/test_real_vllm.py", "tests/unit/test_a.py"]


def sent(worker: Worker) -> list[str]:
    return [nodeid for unit in worker.sent for nodeid in unit]


def test_learners_wait_while_another_worker_runs_the_real_pods():
    sched, a, b = started()
    assert a.sent == [[n for n in COLLECTION if n.startswith("tests/cluster/")]]
    # gw1 is kept fed (over two tests held) with what is not a learner, although
    # test_preset_runs.py comes first in the queue
    assert b.sent == [["tests/e2e/test_faults.py::test_kill"], ["tests/vllm/test_real_vllm.py::test_serves"],
                      ["tests/unit/test_a.py::test_1", "tests/unit/test_a.py::test_2"]]
    finish(sched, b, sent(b)[:2])  # only learners are left: run one rather than sit idle
    assert b.sent[-1][0].startswith("tests/e2e/test_preset_runs.py")
    assert not sched.tests_finished and sched.has_pending


def test_without_real_pods_running_the_queue_order_holds():
    sched, a, b = started()
    finish(sched, a, ["tests/cluster/test_kueue.py::test_admits", "tests/cluster/test_real_pods.py::test_runs",
                      "tests/cluster/test_real_pods.py::test_restarts"])
    assert a.sent[-1][0].startswith("tests/e2e/test_preset_runs.py")  # the first in the queue


def test_the_suite_ends_when_every_test_is_done():
    sched, a, b = started()
    while not sched.tests_finished:
        for w in (a, b):
            finish(sched, w, [n for n in sent(w) if not sched.work[w][n]][:1])
    assert a.shutting_down and b.shutting_down
    assert sorted(sent(a) + sent(b)) == sorted(COLLECTION)
    finish(sched, a, [n for n in sent(a) if not sched.work[a][n]])
    finish(sched, b, [n for n in sent(b) if not sched.work[b][n]])
    assert not sched.has_pending and sched.remove_node(a) is None
