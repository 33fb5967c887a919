"""Gates on the scheduler (eugo_dask/gates.py): a task held until another ends, by a dependency
the scheduler alone knows, on a real in-process cluster (``gen_cluster``: the scheduler checks
its own state after every transition), and that nothing holds a task forever: a gate that ends,
errs, is cancelled or released, whose worker leaves, or that cannot run at all.

A small scheduler plugin here makes the gates (``Holding``: task -> its gate, at the held task's
``update_graph``) and hands Gates its transitions, as eugo's plugin does for its graphs. Tasks
submitted within a minute of each other share the scheduler's generation: a gate is given a
higher priority than its task (``priority=1``), so that it comes first in the scheduler's order,
as a device task comes before the reads of later blocks in Dask's.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from distributed import get_worker
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.utils_test import gen_cluster
from distributed.worker import thread_state

from eugo_dask import gates as gates_module
from eugo_dask.gates import Gates

pytestmark = pytest.mark.timeout(120)

#: what the gate tasks wait for (in-process workers: the same process)
GO = threading.Event()


@pytest.fixture(autouse=True)
def _go():
    GO.clear()
    yield
    GO.set()  # never leave a worker thread waiting


class Holding(SchedulerPlugin):
    """Holds each task of ``pairs`` on its gate (``Gates.hold``), when the task is submitted."""

    name = "holding"

    def __init__(self, scheduler, pairs):
        self.scheduler, self.pairs = scheduler, pairs
        self.gates = Gates()
        self.made: list[tuple[str, bool]] = []

    def update_graph(self, scheduler, *, tasks=None, **kwargs):
        for key in tasks or ():
            if key in self.pairs:
                self.made.append((key, self.gates.hold(scheduler, key, self.pairs[key])))

    def transition(self, key, start, finish, *args, **kwargs):
        self.gates.transition(self.scheduler, key, finish)


def gate_fn():
    """A gate: ends once GO is set; when it ended."""
    assert GO.wait(30)
    return time.time()


def nap(seconds):
    time.sleep(seconds)
    return time.time()


def fail():
    raise ValueError("the gate failed")


def fail_on_go():
    assert GO.wait(30)
    fail()


def held_fn():
    """A held task: when it ran, and the dependencies its worker was told it has."""
    ts = get_worker().state.tasks[thread_state.key]
    return time.time(), {str(d.key) for d in ts.dependencies}


async def until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def holding(s, pairs):
    plugin = Holding(s, pairs)
    s.add_plugin(plugin)
    return plugin


@gen_cluster(client=True)
async def test_a_held_task_runs_once_its_gate_ends_and_fetches_nothing(c, s, a, b):
    plugin = holding(s, {"held": "gate"})
    gate = c.submit(gate_fn, key="gate", priority=1, workers=[a.address])
    held = c.submit(held_fn, key="held", workers=[b.address])  # (another worker than the gate's)
    await until(lambda: "held" in s.tasks and s.tasks["held"].state == "waiting")
    assert plugin.made == [("held", True)]
    assert s.tasks["gate"] in s.tasks["held"].waiting_on
    await asyncio.sleep(0.3)
    assert s.tasks["held"].state == "waiting"  # its gate runs: it waits
    GO.set()
    ended = await gate
    ran, dependencies = await held
    # after its gate, with no dependency on it where it ran: its worker fetched nothing
    assert ran >= ended and dependencies == set()
    assert not s.tasks["held"].dependencies and not s.tasks["gate"].dependents
    assert plugin.gates.summary() == {"held": 0, "gates": 0, "made": 1, "forced": 0}


@gen_cluster(client=True)
async def test_a_gate_is_made_only_where_it_can_end_before_the_task(c, s, a, b):
    plugin = holding(s, {"after-done": "done", "before": "late", "earlier": "first"})
    done = c.submit(nap, 0, key="done")
    await done
    # a gate in memory already holds nothing
    assert (await c.submit(held_fn, key="after-done"))[1] == set()
    # a gate after the task in the scheduler's order (a higher priority given to the task)
    # would let the task wait, through other tasks, on what it holds: refused
    late = c.submit(gate_fn, key="late")
    before = c.submit(held_fn, key="before", priority=10)
    await before
    # a gate submitted after the task: the task is scheduled already
    earlier = c.submit(held_fn, key="earlier")
    first = c.submit(gate_fn, key="first", priority=1)
    await earlier
    assert plugin.made == [("after-done", False), ("before", False), ("earlier", False)]
    GO.set()
    await late
    await first


@gen_cluster(client=True)
async def test_the_watchdog_releases_gates_where_nothing_finishes(c, s, a, b):
    plugin = holding(s, {"held": "gate"})
    stall = gates_module.STALL_S
    gates_module.STALL_S = 0.3
    try:
        gate = c.submit(gate_fn, key="gate", priority=1)
        held = c.submit(held_fn, key="held")
        await until(lambda: "held" in s.tasks and s.tasks["held"].state == "waiting")
        while not held.done():  # (the plugin runs the check from a periodic callback)
            plugin.gates.check(s)
            await asyncio.sleep(0.05)
        await held
        assert s.tasks["gate"].state == "processing"  # still running: the watchdog let go
        assert plugin.gates.summary()["forced"] == 1 and not plugin.gates.held
    finally:
        gates_module.STALL_S = stall
        GO.set()
    await gate


@pytest.mark.parametrize("cancel", ["held", "both", "released"])
def test_a_cancelled_or_released_task_leaves_nothing_held(cancel):
    @gen_cluster(client=True)
    async def run(c, s, a, b):
        plugin = holding(s, {"held": "gate"})
        gate = c.submit(gate_fn, key="gate", priority=1)
        held = c.submit(held_fn, key="held")
        await until(lambda: "held" in s.tasks and s.tasks["held"].state == "waiting")
        if cancel == "held":
            await c.cancel([held])
            await until(lambda: "held" not in s.tasks)
            assert not s.tasks["gate"].dependents and not plugin.gates.paced
            GO.set()
            await gate  # the gate ends as any task does, and lets go of its record
            assert not plugin.gates.held
            del gate
        elif cancel == "both":
            await c.cancel([held, gate])
        else:
            del held, gate  # the graph released
        await until(lambda: not s.tasks)
        GO.set()
        assert not plugin.gates.held and not plugin.gates.paced

    run()


@gen_cluster(client=True)
async def test_the_gates_worker_leaving_recomputes_the_gate_and_the_task_waits(c, s, a, b):
    plugin = holding(s, {"held": "gate"})
    gate = c.submit(nap, 1.0, key="gate", priority=1, workers=[a.address], allow_other_workers=True)
    held = c.submit(held_fn, key="held", workers=[b.address])
    await until(lambda: s.tasks.get("gate") is not None and s.tasks["gate"].state == "processing")
    # the gate's worker leaves while it runs: the scheduler runs it again on b
    await a.close(executor_wait=False)
    ended = await gate
    ran, dependencies = await held
    assert ran >= ended and dependencies == set()
    assert s.tasks["gate"].who_has == {s.workers[b.address]}
    assert plugin.gates.summary()["forced"] == 0


@gen_cluster(client=True)
async def test_a_gate_that_cannot_run_anywhere_is_released(c, s, a, b):
    plugin = holding(s, {"held": "gate"})
    gate = c.submit(gate_fn, key="gate", priority=1, workers=[a.address])  # only a
    held = c.submit(held_fn, key="held")
    await until(lambda: s.tasks.get("gate") is not None and s.tasks["gate"].state == "processing")
    await a.close(executor_wait=False)
    await until(lambda: s.tasks["gate"].state == "no-worker")
    while not held.done():
        plugin.gates.check(s)
        await asyncio.sleep(0.05)
    await held
    assert plugin.gates.summary()["forced"] == 1 and not plugin.gates.held
    await c.cancel([gate])
    GO.set()  # (the closed worker's thread ends)


@pytest.mark.parametrize("where", ["processing", "waiting"])
def test_a_gate_that_errs_lets_go_and_what_it_held_runs_as_in_plain_dask(where):
    # a read does not depend on its gate: the gate failing (running, or a dependency of it
    # failing while it waits) fails the gate's own dependents, not what it held, which runs
    # and fetches nothing (old code: the held task erred with the gate's exception)
    @gen_cluster(client=True)
    async def run(c, s, a, b):
        plugin = holding(s, {"held": "gate"})
        if where == "processing":
            gate = c.submit(fail_on_go, key="gate", priority=1)
        else:
            gate = c.submit(lambda x: x, c.submit(fail_on_go, key="before", priority=2),
                            key="gate", priority=1)
        after = c.submit(lambda x: x, gate, key="after")
        held = c.submit(held_fn, key="held")
        # (the gate fails once the task is held on it, not before: a gate already erred holds
        # nothing)
        await until(lambda: "held" in s.tasks and s.tasks["held"].state == "waiting")
        GO.set()
        for future in (gate, after):
            with pytest.raises(ValueError, match="the gate failed"):
                await future
        ran, dependencies = await held
        assert dependencies == set() and s.tasks["held"].state == "memory"
        assert s.tasks["held"].exception_blame is None
        assert not plugin.gates.held and plugin.made == [("held", True)]

    run()


@gen_cluster(client=True, nthreads=[("", 1), ("", 1)])
async def test_held_root_tasks_are_queued_once_their_gate_ends(c, s, a, b):
    # 20 root tasks of one group (more than twice the cluster's threads) held on one gate: when
    # it ends they go through root-task queuing, as they would with no gate
    plugin = holding(s, {f"read-{i}": "gate" for i in range(20)})
    gate = c.submit(gate_fn, key="gate", priority=1)
    reads = [c.submit(nap, 0.05, key=f"read-{i}") for i in range(20)]
    await until(lambda: all(s.tasks.get(f"read-{i}") is not None
                            and s.tasks[f"read-{i}"].state == "waiting" for i in range(20)))
    GO.set()
    await gate
    await c.gather(reads)
    # (worker-saturation 1.1: two tasks per 1-thread worker go straight to it, the rest queue)
    queued = {t.key for t in s.transition_log if t.finish == "queued"}
    assert s.is_rootish(s.tasks["read-0"]) and len(queued) >= 20 - 2 * 2, queued
    assert plugin.gates.summary()["made"] == 20 and not plugin.gates.held


class Pacing(SchedulerPlugin):
    """Paces a graph's copies (``c-…``) to its device tasks (``A-…``, ``B-…``) as eugo's
    plugin does, ``ahead`` device tasks ahead; no reads held."""

    name = "pacing"
    reads_ahead = None

    def __init__(self, scheduler, ahead):
        self.scheduler, self.ahead = scheduler, ahead
        self.gates = Gates()

    def update_graph(self, scheduler, *, tasks=None, **kwargs):
        keys = [str(k) for k in tasks or ()]
        self.gates.pace(scheduler, [k for k in keys if k.startswith("c-")],
                        [k for k in keys if k.startswith(("A-", "B-"))], self.reads_ahead,
                        self.ahead)
        self.made = {k: gate for gate, held in self.gates.held.items() for k in held}
        self.within = set(self.gates.within)

    def transition(self, key, start, finish, *args, **kwargs):
        self.gates.transition(self.scheduler, key, finish)


def ident(*args):
    return 0


def submit_blocks(c, stages, blocks):
    """A graph of ``blocks`` chains, each through ``stages`` (key prefixes, first a root) and
    into one output ``out``; submitted (its future)."""
    from dask.delayed import Delayed

    dsk = {}
    for k in range(blocks):
        dsk[f"{stages[0]}-{k}"] = (ident,)
        for before, stage in zip(stages, stages[1:]):
            dsk[f"{stage}-{k}"] = (ident, f"{before}-{k}")
    dsk["out"] = (ident, *[f"{stages[-1]}-{k}" for k in range(blocks)])
    return c.compute(Delayed("out", dsk), optimize_graph=False)


@gen_cluster(client=True)
async def test_a_copy_waits_for_the_copying_device_task_ahead_places_before(c, s, a, b):
    # each block: its copy c-k, the device task A-k reading it, then B-k reading A-k only. With
    # ahead 1 a copy waits for the previous block's A (old code counted B too: c-k waited for
    # B-(k-1)... and with chains of 6 device tasks a block, less than a block of copies ran ahead)
    from distributed import wait

    plugin = Pacing(s, ahead=1)
    s.add_plugin(plugin)
    future = submit_blocks(c, ("c", "A", "B"), 4)
    await until(lambda: "out" in s.tasks)
    order = [k for _, k in sorted((s.tasks[f"A-{k}"].priority, k) for k in range(4))]
    await wait(future, timeout=20)
    # (Dask's order runs the blocks one by one, in some order)
    assert all(s.tasks[f"A-{k}"].priority < s.tasks[f"c-{j}"].priority
               for k, j in zip(order, order[1:]))
    expected = {f"c-{j}": f"A-{k}" for k, j in zip(order, order[1:])}
    assert plugin.made == expected, plugin.made
    assert not plugin.gates.held


@pytest.mark.parametrize("installed", [True, False])
@gen_cluster(client=True)
async def test_a_held_task_submitted_again_is_the_same_task_to_the_scheduler(c, s, a, b,
                                                                             installed):
    # the same collection computed twice at once (or two graphs sharing their reads) sends a
    # held task again: the scheduler compares its dependencies with the new graph's, and the
    # gate among them made distributed warn "Detected different `run_spec` ... can cause
    # failures and deadlocks" and skip adding the graph's dependencies to it
    from distributed import Client
    from distributed.utils_test import captured_logger

    plugin = holding(s, {"held": "gate"})
    if installed:  # (as eugo's plugin does when it starts; not: the scheduler as it is)
        assert plugin.gates.install(s) and not plugin.gates.install(s)  # (once)
    gate = c.submit(gate_fn, key="gate", priority=1, workers=[a.address])
    held = c.submit(held_fn, key="held", workers=[b.address])
    await until(lambda: "held" in s.tasks and s.tasks["held"].state == "waiting")
    with captured_logger("distributed.scheduler") as log:
        async with Client(s.address, asynchronous=True) as other:
            again = other.submit(held_fn, key="held", workers=[b.address])
            await until(lambda: len(s.tasks["held"].who_wants) == 2)
            assert s.tasks["gate"] in s.tasks["held"].dependencies  # still held
            GO.set()
            ended = await gate
            ran, dependencies = await again
            assert (ran, dependencies) == await held
    warned = "Detected different `run_spec`" in log.getvalue()
    assert warned is not installed, log.getvalue()
    assert ran >= ended and dependencies == set()
    assert plugin.gates.summary()["held"] == 0



class ReadPacing(Pacing):
    """Paces reads (``r-…``, read by copies only) too, 2 device tasks ahead."""

    name = "read-pacing"
    reads_ahead = 2


@gen_cluster(client=True)
async def test_the_reads_a_window_lets_run_count_as_paced_and_are_forgotten_with_the_graph(
        c, s, a, b):
    # the first reads_ahead reads are never held (they are the window), so the plugin's
    # warning of reads running ahead of a GPU worker counted them as unpaced and warned while
    # the plugin paced the graph
    from distributed import wait

    from eugo_dask.plugin import _unpaced_read

    plugin = ReadPacing(s, ahead=100)
    s.add_plugin(plugin)
    future = submit_blocks(c, ("r", "c", "A"), 6)
    await until(lambda: "out" in s.tasks)
    held = {k for keys in plugin.gates.held.values() for k in keys}
    assert len(plugin.within) == 2 and held and not plugin.within & held
    # (a read whose gate would not come before it in Dask's order is neither: not paced)
    assert plugin.within | held <= {f"r-{k}" for k in range(6)}
    assert not any(_unpaced_read(s.tasks[k], plugin.gates) for k in plugin.within | held)
    await wait(future, timeout=20)
    del future
    await until(lambda: not s.tasks)
    assert not plugin.gates.within and not plugin.gates.paced
