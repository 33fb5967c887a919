"""The machine model: the lower bound on makespan and the simulator of placement policies."""

from __future__ import annotations

import math

import dask
import dask.array as da
import pytest

from eugo_dask import explain
from eugo_dask.schedule import POLICIES, Costs, Machine, lower_bound, simulate

pytest.importorskip("scipy")  # the LP bound (the test extra has SciPy)

GB = 1e9
#: one GPU, a link of 1 GB/s each way and no latency: copies take bytes / 1e9 seconds
ONE_GPU = Machine(cpu_threads=2, gpus=1, h2d_bytes_per_s=GB, d2h_bytes_per_s=GB)


def costs(cpu: list[float], gpu: list[float | None], deps: list[tuple[int, ...]], *,
          nbytes: list[int] | None = None, outputs: set[int] | None = None,
          placement: list[bool] | None = None) -> Costs:
    n = len(cpu)
    return Costs(keys=[f"t-{i}" for i in range(n)], cpu_s=cpu, gpu_s=gpu,
                 nbytes=nbytes or [0] * n, deps=deps,
                 outputs=frozenset(outputs if outputs is not None else {n - 1}),
                 placement=placement or [False] * n)


def test_a_chain_is_bound_by_its_path_at_the_faster_device():
    c = costs([1.0, 1.0, 1.0], [0.25, None, 0.5], [(), (0,), (1,)])
    bound = lower_bound(c, ONE_GPU)
    assert bound.parts["path"] == pytest.approx(0.25 + 1.0 + 0.5)
    assert bound.seconds >= 1.75 - 1e-9


def test_independent_tasks_split_so_both_kinds_finish_together():
    # 6 tasks of 1 s on a thread or 0.5 s on the device; 2 threads, 1 GPU: a task's rate is 1/s
    # per thread, 2/s on the device, so the split of divisible work gives the device half:
    # 6 / (2 + 2) = 1.5 s. The parts bound is that split
    c = costs([1.0] * 6, [0.5] * 6, [()] * 6, outputs=set())
    parts = _parts(c, ONE_GPU)
    assert parts.seconds == pytest.approx(1.5, rel=1e-5)
    assert parts.gpu_share == pytest.approx(0.5)
    assert parts.mixed
    # the LP counts whole tasks: under 2 s a thread runs one task (its second would end at 2 s),
    # so 4 go to the device, which takes 2 s; every split of whole tasks takes 2 s, and the
    # bound is that (less the solver's tolerance)
    lp = lower_bound(c, ONE_GPU)
    assert lp.seconds == pytest.approx(2.0, rel=1e-5)
    assert lp.mixed
    assert min(simulate(c, ONE_GPU, p).makespan_s for p in POLICIES) == pytest.approx(2.0)


def _parts(c: Costs, machine: Machine):
    from eugo_dask.schedule import _parts_bound
    return _parts_bound(c, machine)


def test_the_lp_counts_the_copies_the_split_needs():
    # a host chunk of 4 GB feeds a task 10x faster on the device; the copy (4 s) costs more
    # than the CPU time saved (2 s - 0.2 s): the LP keeps the task on the CPU, the parts bound
    # (which ignores copies) does not see it
    c = costs([0.0, 2.0], [None, 0.2], [(), (0,)], nbytes=[4 * 10**9, 8], outputs={1})
    lp, parts = lower_bound(c, ONE_GPU), _parts(c, ONE_GPU)
    assert lp.method == "lp"
    assert lp.seconds > parts.seconds
    assert lp.seconds == pytest.approx(2.0, rel=1e-5)
    assert simulate(c, ONE_GPU, "all-gpu").makespan_s == pytest.approx(4.0 + 0.2, rel=1e-6)


def test_copies_in_the_device_slot_serialise_with_kernels():
    # two independent GPU tasks, each reading its own 1 GB host chunk: on the links the second
    # copy overlaps the first kernel; in the slot it waits for it
    c = costs([0.0, 0.0, 5.0, 5.0], [None, None, 1.0, 1.0], [(), (), (0,), (1,)],
              nbytes=[10**9, 10**9, 0, 0], outputs={2, 3}, placement=[False, False, True, True])
    link = simulate(c, ONE_GPU, "static", copies="link")
    slot = simulate(c, ONE_GPU, "static", copies="slot")
    assert link.makespan_s == pytest.approx(3.0)   # copy 1, kernel 1 || copy 2, kernel 2
    assert slot.makespan_s == pytest.approx(4.0)   # copy, kernel, copy, kernel
    assert link.gpu_tasks == slot.gpu_tasks == 2


def test_copies_on_the_links_run_at_most_ahead_device_tasks_ahead():
    # four independent GPU tasks, each reading its own 1 GB host chunk (a copy of 1 s) and
    # running 1 s: unbounded, the copies run back to back (the last done at 4 s, while the
    # device runs the second kernel); held as eugo's plugin holds them, the copies of the k-th
    # device task start once the (k - ahead)-th has ended
    c = costs([0.0] * 4 + [5.0] * 4, [None] * 4 + [1.0] * 4, [(), (), (), (), (0,), (1,), (2,), (3,)],
              nbytes=[10**9] * 4 + [0] * 4, outputs={4, 5, 6, 7},
              placement=[False] * 4 + [True] * 4)
    unbounded = simulate(c, ONE_GPU, "static")
    assert unbounded.makespan_s == pytest.approx(5.0)  # copies 0-4 s, kernels 1-5 s
    # ahead 2: each copy as soon as the kernel two before it has ended, and the device never
    # waits (copy 3 at 2-3 s, copy 4 at 3-4 s)
    assert simulate(c, ONE_GPU, "static", ahead=2).makespan_s == pytest.approx(5.0)
    # ahead 1: a copy only once the kernel before has ended: copy and kernel alternate
    one = simulate(c, ONE_GPU, "static", ahead=1)
    assert one.makespan_s == pytest.approx(8.0)
    # (the copies in the GPU slot wait for the kernels anyway: no gate there)
    assert simulate(c, ONE_GPU, "static", copies="slot", ahead=1).makespan_s == pytest.approx(8.0)
    with pytest.raises(ValueError, match="ahead must be a whole number >= 1 or None; got 0"):
        simulate(c, ONE_GPU, "static", ahead=0)


def test_dmda_uses_both_kinds_where_the_static_plan_idles_the_cpu():
    # every task 2x faster on the device, all placed there: the two threads idle
    c = costs([1.0] * 8, [0.5] * 8, [()] * 8, outputs=set(), placement=[True] * 8)
    static, dmda = simulate(c, ONE_GPU, "static"), simulate(c, ONE_GPU, "dmda")
    assert static.makespan_s == pytest.approx(4.0)
    assert dmda.makespan_s == pytest.approx(2.0)
    assert 0 < dmda.gpu_tasks < 8
    assert dmda.busy_fraction("cpu") == pytest.approx(1.0)
    assert lower_bound(c, ONE_GPU).seconds == pytest.approx(2.0, rel=1e-5)


def test_an_unknown_policy_is_refused_with_the_allowed_ones():
    c = costs([1.0], [None], [()])
    with pytest.raises(ValueError, match="static, all-cpu, all-gpu, dmda, spill, dual; got 'fastest'"):
        simulate(c, ONE_GPU, "fastest")  # type: ignore[arg-type]


@pytest.mark.parametrize("machine", [
    Machine(cpu_threads=16, gpus=1, h2d_bytes_per_s=8.3e9, d2h_bytes_per_s=4.0e9,
            latency_s=1e-5),
    Machine(cpu_threads=4, gpus=3, h2d_bytes_per_s=8.3e9, d2h_bytes_per_s=4.0e9,
            latency_s=1e-5),
])
def test_no_policy_beats_the_bound_on_real_plans(machine):
    """Every simulated schedule of real graphs' plans takes at least the bound."""
    x = da.random.random((2048, 2048), chunks=512).astype("float32")
    graphs = [da.exp(da.sin(x @ x)).mean(), (x * 2 + 1).sum(axis=0),
              x.map_overlap(lambda b: b * 2, depth=1, boundary="none").std()]
    for graph in graphs:
        c = _model(graph)
        bound = lower_bound(c, machine)
        assert bound.method == "lp" and bound.seconds > 0
        for policy in POLICIES:
            for copies in ("link", "slot"):
                made = simulate(c, machine, policy, copies=copies)
                assert made.makespan_s >= bound.seconds * (1 - 1e-6), (policy, copies)


def _model(collection) -> Costs:
    with dask.config.set({"eugo.profile": "h200", "eugo.device": "none"}):
        plan = explain(collection)
    assert plan.schedule is not None
    return plan.schedule.costs


def test_explain_says_the_bound_and_the_predicted_makespan():
    x = da.random.random((2048, 2048), chunks=512).astype("float32")
    with dask.config.set({"eugo.profile": "h200", "eugo.device": "none"}):
        plan = explain(da.exp(da.sin(x @ x)).mean())
    summary = plan.schedule
    assert summary is not None
    assert summary.predicted.makespan_s >= summary.bound.seconds > 0
    # (copy tasks ask for none of the GPU slot: they run on the links, beside the kernels,
    # those to the device at most (eugo.read-ahead + 1) x GPUs device tasks ahead: 3 here)
    assert math.isclose(summary.predicted.makespan_s,
                        simulate(summary.costs, summary.machine, "static",
                                 copies="link", ahead=3).makespan_s)
    with dask.config.set({"eugo.profile": "h200", "eugo.device": "none", "eugo.read-ahead": None}):
        unbounded = explain(da.exp(da.sin(x @ x)).mean()).schedule
    assert unbounded is not None and math.isclose(
        unbounded.predicted.makespan_s,
        simulate(unbounded.costs, unbounded.machine, "static", copies="link").makespan_s)
    text = str(plan)
    assert "lower bound" in text and "predicted makespan" in text
    assert plan.to_dict()["schedule"]["bound_s"] == pytest.approx(summary.bound.seconds)


def test_the_bound_holds_on_random_graphs_with_slow_links():
    """Random small graphs, machines with slow links and long latencies: no policy's schedule
    beats the bound, and no part of it is negative (the review's fuzz found the bound taken
    from the split's parts, its tolerance noise times copies of seconds, 190,000x too high)."""
    import random

    rng = random.Random(1)
    for _ in range(150):
        n = rng.randint(2, 12)
        deps = [tuple(sorted(rng.sample(range(i), rng.randint(0, min(i, 3))))) for i in range(n)]
        cpu = [rng.choice([0.0, rng.uniform(0.001, 2.0)]) for _ in range(n)]
        gpu = [rng.choice([None, rng.uniform(0.0001, 1.0)]) for _ in range(n)]
        nbytes = [rng.choice([0, rng.randint(1, 10**9)]) for _ in range(n)]
        c = costs(cpu, gpu, deps, nbytes=nbytes, outputs={n - 1},
                  placement=[g is not None and rng.random() < 0.5 for g in gpu])
        machine = Machine(cpu_threads=rng.randint(1, 8), gpus=rng.randint(1, 3),
                          h2d_bytes_per_s=rng.choice([1e6, 1e9]),
                          d2h_bytes_per_s=rng.choice([1e6, 1e9]),
                          latency_s=rng.choice([0.0, 1.0]))
        bound = lower_bound(c, machine)
        assert all(v >= 0 for v in bound.parts.values()), bound
        assert all(v <= bound.seconds for v in bound.parts.values()), bound
        for policy in POLICIES:
            for copies in ("link", "slot"):
                made = simulate(c, machine, policy, copies=copies).makespan_s
                assert made >= bound.seconds, (policy, copies, made, bound)


def test_a_machine_and_a_copy_mode_that_cannot_be_are_refused():
    with pytest.raises(ValueError, match="h2d_bytes_per_s must be a positive finite number; got 0"):
        Machine(cpu_threads=2, gpus=1, h2d_bytes_per_s=0, d2h_bytes_per_s=GB)
    with pytest.raises(ValueError, match="latency_s must be zero or more; got -1"):
        Machine(cpu_threads=2, gpus=1, h2d_bytes_per_s=GB, d2h_bytes_per_s=GB, latency_s=-1)
    with pytest.raises(ValueError, match="copies must be 'link' or 'slot'; got 'wire'"):
        simulate(costs([1.0], [None], [()]), ONE_GPU, "static", copies="wire")  # type: ignore[arg-type]


def test_explain_bounds_large_graphs_by_parts_and_small_ones_by_the_lp():
    """explain() solves the LP only for graphs it solves quickly (the review: 9 s for a
    5,717-task graph, 141 s for 19,777); past that the parts bound, which is linear."""
    from eugo_dask.schedule import EXPLAIN_LP_MAX_TASKS

    small = da.random.random((1024, 1024), chunks=512).astype("float32")
    large = da.random.random((4096, 4096), chunks=128).astype("float32")
    assert len(_model(small @ small)) <= EXPLAIN_LP_MAX_TASKS < len(_model(large @ large))
    with dask.config.set({"eugo.profile": "h200", "eugo.device": "none"}):
        assert explain(small @ small).schedule.bound.method == "lp"
        assert explain(large @ large).schedule.bound.method == "parts"


def test_chunks_embedded_in_device_tasks_are_copied_in_the_model_as_in_the_plan():
    """A creation fused into a GPU task (ones into the matmul's chunk products) makes its chunk
    on the host, which the plan counts as a copy to the device: so does the model (the review:
    the model had no copy at all, 13 ms short of the plan's own task-seconds)."""
    ones = da.ones((2048, 2048), chunks=512)
    with dask.config.set({"eugo.profile": "h200", "eugo.device": "none"}):
        plan = explain((ones @ ones).sum(), min_speedup=0)
    summary = plan.schedule
    machine, copies = summary.machine, plan.copies
    assert copies.to_device > 0
    expected = (copies.to_device * machine.latency_s
                + copies.to_device_bytes / machine.h2d_bytes_per_s)
    assert summary.predicted.busy["h2d"] == pytest.approx(expected)


def test_a_free_thread_takes_the_next_ready_task_rather_than_wait_for_dask_s_next():
    """Four 1 s tasks on two threads, one of them waiting for another: 2 s, as a worker runs
    them (the review: taken strictly in Dask's order, a thread waited for the chain and it
    read 3 s)."""
    c = costs([1.0] * 4, [None] * 4, [(), (0,), (), ()], outputs={1, 2, 3})
    c.priority = [0, 1, 2, 3]
    machine = Machine(cpu_threads=2, gpus=0, h2d_bytes_per_s=GB, d2h_bytes_per_s=GB)
    assert simulate(c, machine, "all-cpu").makespan_s == pytest.approx(2.0)
    assert lower_bound(c, machine).seconds == pytest.approx(2.0)


def _many_small_chains(scale: float) -> Costs:
    """200 chains of three tasks, microseconds each (times ``scale``), a few KiB a value: a
    graph of the size and scale explain() bounds for a map_overlap."""
    cpu, gpu, deps, nbytes = [], [], [], []
    for c in range(200):
        base = len(cpu)
        for j in range(3):
            cpu.append((3 + (c * 7 + j) % 5) * 1e-6 * scale)
            gpu.append((2 + (c * 3 + j) % 4) * 1e-6 * scale if j != 1 else None)
            deps.append((base + j - 1,) if j else ())
            nbytes.append(int(4096 * scale))
    return costs(cpu, gpu, deps, nbytes=nbytes, outputs={i for i in range(len(cpu)) if i % 3 == 2})


def test_the_lp_is_limited_by_its_work_not_the_clock():
    # explain()'s LP gave up after a second of wall time: on a loaded machine it fell back to
    # the parts bound, and explain()'s text depended on how busy the machine was. A limit of
    # simplex iterations gives one answer: the LP's, or the parts bound where the work runs out
    c = _many_small_chains(1.0)
    full = lower_bound(c, ONE_GPU)
    assert full.method == "lp"
    assert lower_bound(c, ONE_GPU, lp_iterations=1).method == "parts"
    limited = lower_bound(c, ONE_GPU, lp_iterations=100_000)
    assert (limited.method, limited.seconds) == (full.method, full.seconds)


def test_a_task_too_long_for_a_thread_is_bound_whole_on_the_device():
    """Four 1 GB host chunks, each read by a task of 10 s on the one thread or 0.1 s on the
    device: under 10 s every task runs on the device, so all four chunks cross the 1 GB/s link
    (4 s) before the last kernel (0.1 s). The LP with divisible tasks let each be 9/10 on the
    device and 9/10 copied, and read 3.64 s: below every schedule (the review's matmul on
    8 threads + 4 GPUs: its bound left out that each product runs whole)."""
    gb = 10**9
    c = costs([0.0] * 4 + [10.0] * 4, [None] * 4 + [0.1] * 4, [()] * 4 + [(i,) for i in range(4)],
              nbytes=[gb] * 4 + [0] * 4, outputs={4, 5, 6, 7}, placement=[False] * 4 + [True] * 4)
    machine = Machine(cpu_threads=1, gpus=1, h2d_bytes_per_s=GB, d2h_bytes_per_s=GB)
    bound = lower_bound(c, machine)
    assert bound.seconds == pytest.approx(4.1, rel=1e-5)
    assert simulate(c, machine, "static").makespan_s == pytest.approx(4.1)


def test_copies_wait_for_the_host_work_that_makes_what_they_copy():
    """Four chains, each a creation of 1 s on a thread making 1 GB, then a task of 100 s on a
    thread or 0.1 s on the device: the link can copy nothing before the first creation ends
    (1 s), and after its last copy a kernel must still run: 1 + 4 + 0.1 s. The LP had the
    link's 4 s of copies anywhere below the makespan (it read 4 s)."""
    gb = 10**9
    c = costs([1.0] * 4 + [100.0] * 4, [None] * 4 + [0.1] * 4,
              [()] * 4 + [(i,) for i in range(4)], nbytes=[gb] * 4 + [0] * 4,
              outputs={4, 5, 6, 7}, placement=[False] * 4 + [True] * 4)
    machine = Machine(cpu_threads=4, gpus=1, h2d_bytes_per_s=GB, d2h_bytes_per_s=GB)
    assert lower_bound(c, machine).seconds == pytest.approx(5.1, rel=1e-5)
    assert simulate(c, machine, "static").makespan_s == pytest.approx(5.1)


def test_a_copy_task_runs_as_soon_as_the_value_it_copies_is_made():
    """GPU task 4 reads a 1 GB chunk made at once and the result of a 5 s host task; GPU task 5
    reads a 1 GB chunk a 4 s host task makes. eugo's copies are tasks of their own: the first
    chunk crosses the link while the host tasks run, the second at 4 s, and both kernels run by
    5.2 s. The model copied a chunk only once its reader was ready: the second chunk took the
    link at 4 s, the first waited for it and its kernel ended at 6.1 s."""
    gb = 10**9
    c = costs([0.0, 5.0, 4.0, 0.0, 10.0, 10.0], [None, None, None, None, 0.1, 0.1],
              [(), (), (), (2,), (0, 1), (3,)], nbytes=[gb, 0, 0, gb, 0, 0], outputs={4, 5},
              placement=[False, False, False, False, True, True])
    machine = Machine(cpu_threads=2, gpus=1, h2d_bytes_per_s=GB, d2h_bytes_per_s=GB)
    assert simulate(c, machine, "static").makespan_s == pytest.approx(5.2)


def test_a_dual_task_copies_on_the_link_other_copies_use():
    """A dual task sent to the idle GPU copies its 1 GB input on the link a copy task of 4 GB
    took first: its copy waits for that one, and the kernel that copy feeds waits for the dual
    task's slot. The model had a dual task's copies beside the link's and ended at 4.6 s,
    below the bound: the link alone carries 5 GB."""
    gb = 10**9
    c = costs([0.0, 0.0, 4.5, 50.0, 50.0], [None, None, None, 0.1, 0.1],
              [(), (), (), (0, 2), (1,)], nbytes=[4 * gb, gb, 0, 0, 0], outputs={3, 4},
              placement=[False, False, False, True, False])
    c.dual = frozenset({4})
    machine = Machine(cpu_threads=1, gpus=1, h2d_bytes_per_s=GB, d2h_bytes_per_s=GB)
    made = simulate(c, machine, "dual")
    assert made.assignment[4] == 0  # (on the GPU: 50 s on the thread)
    # its copy after the 4 GB one (4 s to 5 s), its kernel, then the other kernel
    assert made.makespan_s == pytest.approx(5.2)
    assert made.makespan_s >= lower_bound(c, machine).seconds > 5.0


def test_the_bound_is_below_every_placement_of_small_graphs():
    """Random graphs of up to six tasks and random layers of like tasks: every placement, in
    two orders, with copies on the links or in the slot, and dual tasks, takes at least the
    bound (whole tasks, windows and rounds included)."""
    import itertools
    import random

    rng = random.Random(7)
    for trial in range(120):
        if trial % 2:
            n = rng.randint(2, 6)
            deps = [tuple(sorted(rng.sample(range(i), rng.randint(0, min(i, 3)))))
                    for i in range(n)]
            cpu = [rng.choice([0.0, rng.uniform(0.001, 2.0), rng.uniform(1, 20)])
                   for _ in range(n)]
            gpu = [rng.choice([None, rng.uniform(0.0001, 1.0)]) for _ in range(n)]
            nbytes = [rng.choice([0, rng.randint(1, 10**9)]) for _ in range(n)]
        else:  # two layers of like tasks
            w1, w2 = rng.randint(1, 6), rng.randint(1, 6)
            n = w1 + w2
            c1, c2 = rng.uniform(0.01, 5), rng.uniform(0.01, 5)
            g1, g2 = rng.choice([None, rng.uniform(0.01, 1)]), rng.uniform(0.01, 1)
            deps = [()] * w1 + [(rng.randrange(w1),) for _ in range(w2)]
            cpu, gpu = [c1] * w1 + [c2] * w2, [g1] * w1 + [g2] * w2
            b1, b2 = rng.randint(0, 10**9), rng.randint(0, 10**9)
            nbytes = [b1] * w1 + [b2] * w2
        outputs = {n - 1} | {i for i in range(n) if rng.random() < 0.2}
        machine = Machine(cpu_threads=rng.randint(1, 4), gpus=rng.randint(1, 3),
                          h2d_bytes_per_s=rng.choice([1e8, 1e9]),
                          d2h_bytes_per_s=rng.choice([1e8, 1e9]),
                          latency_s=rng.choice([0.0, 0.01, 1.0]))
        bound = lower_bound(costs(cpu, gpu, deps, nbytes=nbytes, outputs=outputs), machine)
        capable = [i for i in range(n) if gpu[i] is not None]
        for bits in itertools.product([False, True], repeat=len(capable)):
            placement = [False] * n
            for i, on in zip(capable, bits):
                placement[i] = on
            c = costs(cpu, gpu, deps, nbytes=nbytes, outputs=outputs, placement=placement)
            for order in (list(range(n)), rng.sample(range(n), n)):
                c.priority = order
                for copies in ("link", "slot"):
                    made = simulate(c, machine, "static", copies=copies).makespan_s
                    assert made >= bound.seconds, (trial, bits, copies)
            c.dual = frozenset(i for i in capable if not placement[i])
            assert simulate(c, machine, "dual").makespan_s >= bound.seconds, (trial, bits)


def test_the_split_of_a_layer_is_rounded_to_whole_rounds_on_both_kinds_of_unit():
    """Fourteen like tasks, 1 s on a thread or 0.4 s on a device, on 2 threads and 4 GPUs:
    divisible, the threads (2/s) and the devices (10/s) would share them to end at 1.17 s. Whole
    tasks: 12 on the devices (3 rounds, 1.2 s) and 2 on the threads (one round, 1 s); all 14 on
    the devices take 4 rounds (1.6 s), 10 leave the threads two rounds (2 s). By hand, 12."""
    from eugo_dask.schedule import balanced_shares

    group = Costs(keys=["layer"], cpu_s=[1.0], gpu_s=[0.4], nbytes=[0], deps=[()],
                  outputs=frozenset(), placement=[False], counts=[14])
    machine = Machine(cpu_threads=2, gpus=4, h2d_bytes_per_s=GB, d2h_bytes_per_s=GB)
    found = balanced_shares(group, machine)
    assert found is not None
    bound, shares = found
    assert shares == {0: pytest.approx(12 / 14)}
    assert bound.seconds == pytest.approx(1.2, rel=1e-5)
    # the same tasks one by one: the bound sees whole tasks and rounds too, and 12 on the
    # devices reach it
    tasks = costs([1.0] * 14, [0.4] * 14, [()] * 14, outputs=set())
    assert lower_bound(tasks, machine).seconds == pytest.approx(1.2, rel=1e-5)
    placed = costs([1.0] * 14, [0.4] * 14, [()] * 14, outputs=set(),
                   placement=[True] * 12 + [False] * 2)
    assert simulate(placed, machine, "static").makespan_s == pytest.approx(1.2)


def test_work_by_group_counts_a_layer_s_chunks_together():
    """The seed's transform (16 chunks, each fused with its creation) is one group of 16 that
    reads its fused creations (a group of 16 host values of a chunk's bytes), and each task's
    group is given."""
    from dask.array.optimization import optimize as dask_array_optimize

    from eugo_dask.describe import describe_graph
    from eugo_dask.graph import ChunkInfo, task_spec_dict
    from eugo_dask.profile import load_profile
    from eugo_dask.schedule import work_by_group

    x = da.random.default_rng(0).random((4096, 4096), chunks=1024, dtype="float32")
    y = da.exp(-x * x) * da.sin(x)
    graph = task_spec_dict(dask_array_optimize(y.__dask_graph__(), y.__dask_keys__()))
    description = describe_graph(graph, ChunkInfo.from_graph(y.__dask_graph__()),
                                 load_profile({"base": "h200", "cpu": "server-x86"}), None)
    groups, of_task = work_by_group(description, y.__dask_keys__(), cpu_threads=32)
    assert len(of_task) == len(description.task_keys) == 16
    (layer,) = set(of_task)
    assert groups.counts[layer] == 16 and groups.gpu_s[layer] is not None
    (source,) = groups.deps[layer]
    assert groups.counts[source] == 16 and groups.gpu_s[source] is None
    assert groups.nbytes[source] == 1024 * 1024 * 4  # (a chunk's bytes, made on the host)
    assert groups.outputs == {layer}
