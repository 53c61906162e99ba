"""The suite's pytest-xdist scheduler (`make test`: `-n 2`), written against xdist's public
interface only: the hook `pytest_xdist_make_scheduler` (tests/conftest.py) returns this class,
which implements xdist's documented `Scheduling` protocol (xdist/scheduler/protocol.py) and
drives the workers through `WorkerController.send_runtest_some` and `shutdown`. It subclasses
none of xdist's schedulers, so no private method of theirs is overridden.

(Why not `--dist loadgroup` with `xdist_group` marks: xdist 3.8 rewrites each grouped test's
node id to `id@group`, and pytest 9.2 no longer matches those to items; and it would not give
the order or the rule below.)

The rules:
- a unit of work is a test file (a module fixture, such as one torchrun of every parity
  case, is built once), or a whole tier of SHARED_TIERS (tests/cluster/: one control plane);
- units go out by tier (FIRST_TIERS first, in that order; the many short files last, so
  both workers end together), by number of tests within a tier;
- a LEARNERS file (a CPU run that must learn within its deadline) is not started while
  another worker still has REAL_POD_FILE's tests to run: that job builds or pulls images and
  runs a kubelet and containerd beside the control plane, and a learner beside it took 549 s
  instead of 82. The worker takes the next other unit instead; if only learners are left, it
  takes one anyway (an idle worker costs more).
"""

from __future__ import annotations

from collections.abc import Sequence

from xdist.workermanage import WorkerController, parse_tx_spec_config

SHARED_TIERS = ("tests/cluster/",)
"""Tiers whose tests share one session-wide process group (tests/cluster/: the control
plane), so they run on one worker."""

FIRST_TIERS = ("tests/cluster/", "tests/e2e/", "tests/vllm/", "tests/distributed/")
"""Handed out first, in this order: the long work units (the control plane's tier, runs of
whole jobs, a real vLLM, torchrun worlds). (xdist's own order, most tests first, left the
single-test end-to-end files for the end: one worker ran them for minutes while the other
sat idle.)"""

REAL_POD_FILE = "tests/cluster/test_real_pods.py"
LEARNERS = ("tests/e2e/test_preset_runs.py", "tests/e2e/test_lora_runs.py", "tests/e2e/test_local_mode.py",
            "tests/e2e/test_data_and_rewards.py")
"""Files whose tests run a CPU trainer that must learn within its deadline."""


def unit_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return next((tier for tier in SHARED_TIERS if path.startswith(tier)), path)


def tier_rank(unit: str) -> int:
    return next((i for i, tier in enumerate(FIRST_TIERS) if unit.startswith(tier)), len(FIRST_TIERS))


def hand_out_order(collection: Sequence[str]) -> list[tuple[str, list[str]]]:
    """(unit, its node ids) in the order they go out: by tier, then most tests first."""
    units: dict[str, list[str]] = {}
    for nodeid in collection:
        units.setdefault(unit_of(nodeid), []).append(nodeid)
    return sorted(units.items(), key=lambda unit: (tier_rank(unit[0]), -len(unit[1])))


class FileScheduling:
    """xdist's `Scheduling` protocol: file units, tiers first, learners apart from real pods."""

    def __init__(self, config, log=None) -> None:
        self.numnodes = len(parse_tx_spec_config(config))
        self.log = log.filescheduling if log is not None else (lambda *args: None)
        self.collection: list[str] | None = None
        self.collections: dict[WorkerController, list[str]] = {}
        self.queue: list[tuple[str, list[str]]] = []
        self.work: dict[WorkerController, dict[str, bool]] = {}
        """Per worker: the node ids sent to it, and whether each is done."""

    # -- the protocol's properties
    @property
    def nodes(self) -> list[WorkerController]:
        return list(self.work)

    @property
    def collection_is_completed(self) -> bool:
        return len(self.collections) >= self.numnodes

    @property
    def tests_finished(self) -> bool:
        # as xdist's own: a worker holds its last test until it is told to shut down
        return self.collection_is_completed and not self.queue and all(
            self.pending(node) < 2 for node in self.work)

    @property
    def has_pending(self) -> bool:
        return bool(self.queue) or any(self.pending(node) for node in self.work)

    def pending(self, node: WorkerController) -> int:
        return sum(not done for done in self.work[node].values())

    # -- the protocol's calls
    def add_node(self, node: WorkerController) -> None:
        self.work[node] = {}

    def add_node_collection(self, node: WorkerController, collection: Sequence[str]) -> None:
        if self.collection is not None and list(collection) != self.collection:
            self.log(f"{node.gateway.id} collected other tests; it gets no work")
            return
        self.collections[node] = list(collection)

    def schedule(self) -> None:
        if self.collection is None:
            collections = list(self.collections.values())
            if any(c != collections[0] for c in collections):
                self.log("the workers collected different tests; nothing is run")
                return
            self.collection = collections[0]
            self.queue = hand_out_order(self.collection)
        for node in self.nodes:
            self.refill(node)

    def mark_test_complete(self, node: WorkerController, item_index: int, duration: float = 0) -> None:
        self.work[node][self.collections[node][item_index]] = True
        self.refill(node)

    def mark_test_pending(self, item: str) -> None:
        raise NotImplementedError("FileScheduling does not take tests back")

    def remove_pending_tests_from_node(self, node: WorkerController, indices: Sequence[int]) -> None:
        raise NotImplementedError("FileScheduling does not take tests back")

    def remove_node(self, node: WorkerController) -> str | None:
        """A worker is gone (finished, or crashed: its unfinished tests go back in the queue and
        the one it was running is returned as the crashed item)."""
        work = self.work.pop(node)
        left = [nodeid for nodeid, done in work.items() if not done]
        if not left:
            return None
        self.queue.insert(0, (f"{unit_of(left[0])} (again)", left))
        for other in self.nodes:
            self.refill(other)
        return left[0]

    # -- ours
    def refill(self, node: WorkerController) -> None:
        """Give `node` units until it holds more than two tests: an xdist worker runs a test only
        once it knows the next one (or is told to shut down), so one left would wait forever."""
        if node.shutting_down or node not in self.collections:
            return
        while self.queue and self.pending(node) <= 2:
            unit, nodeids = self.queue.pop(self.next_index(node))
            self.log(f"{unit} ({len(nodeids)} tests) to {node.gateway.id}")
            self.work[node].update(dict.fromkeys(nodeids, False))
            index = {nodeid: i for i, nodeid in enumerate(self.collections[node])}
            node.send_runtest_some([index[nodeid] for nodeid in nodeids])
        if not self.queue:
            node.shutdown()

    def next_index(self, node: WorkerController) -> int:
        """The first unit in the queue, or, while another worker has real-pod tests left, the
        first that is not a learner (the first of all if there is none)."""
        real_pods_running = any(not done and nodeid.startswith(REAL_POD_FILE)
                                for other, work in self.work.items() if other is not node
                                for nodeid, done in work.items())
        if real_pods_running:
            return next((i for i, (unit, _) in enumerate(self.queue) if not unit.startswith(LEARNERS)), 0)
        return 0
