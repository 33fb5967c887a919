"""The timed emulated cluster: a simulated schedule run on a real scheduler and workers."""

from __future__ import annotations

import pytest

from eugo_dask.schedule import Costs, Machine, lower_bound, simulate
from eugo_dask.timed import run_timed, timed_graph

MACHINE = Machine(cpu_threads=4, gpus=2, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)


def costs() -> Costs:
    """Two host chunks of 10 MB, four tasks on each (a device runs them 4x faster), a sum."""
    cpu = [0.0, 0.0, *[0.04] * 8, 0.01]
    gpu: list[float | None] = [None, None, *[0.01] * 8, None]
    deps = [(), (), *[(0,)] * 4, *[(1,)] * 4, tuple(range(2, 10))]
    return Costs(keys=[f"k-{i}" for i in range(11)], cpu_s=cpu, gpu_s=gpu,
                 nbytes=[10**7, 10**7, *[10**6] * 8, 8], deps=deps, outputs=frozenset({10}),
                 placement=[False, False, *[True] * 8, False])


def test_the_graph_has_a_task_per_task_and_a_copy_per_crossing():
    c = costs()
    schedule = simulate(c, MACHINE, "dmda")
    graph, done = timed_graph(c, schedule, MACHINE, dilation=1.0, copies="link",
                              cpu_worker="cpu", gpu_workers=["gpu-0", "gpu-1"])
    tasks = {key for layer in graph.layers.values() for key in layer}
    assert {f"task-{i}" for i in range(11)} | {done} <= tasks
    on_gpu = [i for i, g in enumerate(schedule.assignment) if g >= 0]
    assert on_gpu  # dmda offloads some of them
    # each host chunk a device reads is copied there once; each device result the sum reads,
    # back once
    ups = {k for k in tasks if k.startswith("up-")}
    downs = {k for k in tasks if k.startswith("down-")}
    assert ups == {f"up-{u}-{schedule.assignment[i]}" for i in on_gpu for u in c.deps[i]}
    assert downs == {f"down-{i}" for i in on_gpu}
    for name, layer in graph.layers.items():  # placed where the schedule says, nowhere else
        restriction = layer.annotations
        assert restriction["allow_other_workers"] is False
        assert restriction["workers"] == (["cpu"] if name in ("cpu", done) else
                                          [f"gpu-{name.rsplit('-', 1)[1]}"])


@pytest.mark.parametrize("copies", ["link", "slot"])
def test_a_schedule_runs_where_it_was_assigned_and_never_beats_the_bound(copies):
    c = costs()
    schedule = simulate(c, MACHINE, "dmda", copies=copies)
    run = run_timed(c, schedule, dilation=5.0, copies=copies, timeout_s=120)
    assert run.ran == schedule.assignment
    assert run.tasks == 11 + run.copies + 1  # the tasks, their copies, the gathering task
    assert run.makespan_s >= lower_bound(c, MACHINE).seconds


def most_copies_ahead(spans):
    """The most copies to the device started, less device tasks ended, at any copy's start."""
    ups = sorted(start for key, (start, _) in spans.items() if key.startswith("up-"))
    ends = sorted(stop for key, (_, stop) in spans.items()
                  if key.startswith("task-") and int(key[5:]) >= 8)  # (the device tasks)
    return max(i + 1 - sum(e <= start for e in ends) for i, start in enumerate(ups))


def test_gated_copies_run_at_most_ahead_device_tasks_ahead():
    # eight independent GPU tasks on one GPU, each reading its own host chunk, the copies 4x
    # shorter than the kernels: free, the copies run on their link far ahead of the device;
    # with ahead 1 the scheduler holds each (eugo_dask.gates) until the device task before its
    # consumer has ended, so at most one copy is started whose device task has not ended
    machine = Machine(cpu_threads=2, gpus=1, h2d_bytes_per_s=1e9, d2h_bytes_per_s=1e9)
    n = 8
    c = Costs(keys=[f"k-{i}" for i in range(2 * n)], cpu_s=[0.0] * n + [0.16] * n,
              gpu_s=[None] * n + [0.04] * n, nbytes=[10**7] * n + [8] * n,
              deps=[()] * n + [(i,) for i in range(n)], outputs=frozenset(range(n, 2 * n)),
              placement=[False] * n + [True] * n)
    schedule = simulate(c, machine, "static", ahead=1)
    free = run_timed(c, schedule, dilation=5.0, timeout_s=120)
    held = run_timed(c, schedule, dilation=5.0, ahead=1, timeout_s=120)
    assert held.ran == free.ran == schedule.assignment
    assert free.gated == 0 and most_copies_ahead(free.spans) >= 3
    assert held.gated == n - 1 and most_copies_ahead(held.spans) == 1
    assert held.makespan_s >= lower_bound(c, machine).seconds
    # (the model makes copies when their value is made, held only by device tasks already
    # placed: here every value is made at once, before any, so it cannot show the hold; the
    # timed cluster above is what holds them as the plugin does)
    assert schedule.makespan_s >= lower_bound(c, machine).seconds


def test_dual_tasks_are_placed_at_run_time_by_the_plugin_and_never_beat_the_bound():
    # the 8 device-capable tasks dual: eugo's scheduler plugin sends each where it expects it
    # to finish first; the timed cluster's workers sleep the durations of where they ran
    c = costs()
    c.dual = frozenset(range(2, 10))
    c.placement = [False] * 11
    schedule = simulate(c, MACHINE, "dual")
    graph, _ = timed_graph(c, schedule, MACHINE, dilation=1.0, copies="link",
                           cpu_worker="cpu", gpu_workers=["gpu-0", "gpu-1"])
    assert set(graph.layers["dual"]) == {f"dual-{i}" for i in range(2, 10)}
    assert graph.layers["dual"].annotations["eugo"]["role"] == "dual"  # no restriction
    assert not any(k.startswith(("up-", "down-")) for layer in graph.layers.values()
                   for k in layer)  # (a dual task copies inside itself)
    run = run_timed(c, schedule, dilation=5.0, timeout_s=120)
    ran = [run.ran[i] for i in range(2, 10)]
    assert -1 in ran and any(g >= 0 for g in ran), ran  # both kinds of worker
    assert run.makespan_s >= lower_bound(c, MACHINE).seconds


def test_a_dual_task_on_a_gpu_slot_copies_holding_its_worker_s_link(monkeypatch):
    """A dual task granted the slot sleeps its copy in holding the worker's link up, its
    kernel holding neither, its copy back holding the link down: the locks copy tasks hold
    too, so a dual task's copies and the copy tasks' take turns, as on a real link."""
    from eugo_dask import timed

    held = []
    monkeypatch.setattr(timed, "granted_resources", lambda: {"GPU": 1})

    def link(direction):  # the lock of the link (a worker outside a worker: address "")
        with timed._links_lock:
            return timed._links.setdefault(f"-{direction}", timed.threading.Lock())

    monkeypatch.setattr(timed.time, "sleep", lambda seconds: held.append(
        (seconds, link("up").locked(), link("down").locked())))
    assert timed._sleep_dual(9.0, 1.0, 2.0, 3.0) == 0
    assert held == [(1.0, True, False), (2.0, False, False), (3.0, False, True)]
    held.clear()
    monkeypatch.setattr(timed, "granted_resources", lambda: {})  # a CPU thread: its CPU time
    timed._sleep_dual(9.0, 1.0, 2.0, 3.0)
    assert held == [(9.0, False, False)]
    held.clear()
    timed._sleep_on_link("-down", 4.0)
    assert held == [(4.0, False, True)]
