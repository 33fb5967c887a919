"""measure: timing, the rounds' spread, the share of a core and the load while measuring, and the
CPU section measure_cpu makes, at sizes small enough to run in seconds.

(Stability's extra rounds and warnings are tested in test_calibrate; the cache and contention
from real spinning processes in test_profile.)"""

from __future__ import annotations

import os

import pytest

from eugo_dask import measure
from eugo_dask import profile as profile_mod
from eugo_dask.measure import (
    CONTENDED_SHARE,
    UFUNC_CLASSES,
    CoreShare,
    _spread,
    best_seconds,
    contention_warning,
    machine_load_warning,
)

TINY = {"matmul": (16, 32), "elementwise": (1 << 10, 1 << 20), "fft": (1 << 8,),
        "reduction": (1 << 10, 1 << 20)}


class Clock:
    """A perf_counter that moves only when told (``step`` a read)."""

    def __init__(self, step: float = 0.0) -> None:
        self.now, self.step = 100.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_best_seconds_is_the_best_of_its_calls_after_a_warm_up(monkeypatch):
    calls, syncs = [], []
    durations = iter([9.0, 3.0, 1.0, 2.0])  # seconds each timed call takes
    clock = Clock()

    def fn():
        calls.append(1)
        if len(calls) > 1:  # the warm-up is not timed
            clock.now += next(durations)

    monkeypatch.setattr(measure.time, "perf_counter", clock)
    assert best_seconds(fn, repeat=3, budget_s=100, sync=lambda: syncs.append(1)) == 1.0
    assert len(calls) == 4 and len(syncs) == 4  # a sync after each call, the warm-up's too


def test_best_seconds_stops_past_its_budget_and_is_never_zero(monkeypatch):
    clock = Clock()
    calls = []

    def slow():
        calls.append(1)
        clock.now += 0.6

    monkeypatch.setattr(measure.time, "perf_counter", clock)
    assert best_seconds(slow, repeat=10, budget_s=1.0, warm_up=False) == pytest.approx(0.6)
    assert len(calls) == 2  # 1.2 s spent past the 1 s budget: no third call
    assert best_seconds(lambda: None, repeat=2) == 1e-9  # a clock that did not move


def test_the_spread_of_rounds_leaves_the_slowest_out_where_others_outvote_it():
    assert _spread([1.0, 100.0, 110.0]) == pytest.approx(1.1)
    assert _spread([1.0, 100.0]) == 100.0  # two rounds: neither outvotes the other
    assert _spread([5.0]) == 1.0 and _spread([]) == 1.0


def test_contention_is_warned_below_the_contended_share():
    assert contention_warning(CONTENDED_SHARE) is None and contention_warning(1.0) is None
    text = contention_warning(0.3)
    assert text.startswith("this process had 30% of a core while measuring")


def test_a_load_above_the_core_count_is_warned(monkeypatch):
    cores = os.cpu_count() or 1
    monkeypatch.setattr(measure.os, "getloadavg", lambda: (cores + 0.5, 0.0, 0.0))
    assert machine_load_warning() == (f"load average {cores + 0.5:.1f} on {cores} cores when measuring: "
                                      "other processes compete for the CPU and the rates may be low")
    monkeypatch.setattr(measure.os, "getloadavg", lambda: (cores - 0.5, 0.0, 0.0))
    assert machine_load_warning() is None

    def unavailable():
        raise OSError("no load average here")

    monkeypatch.setattr(measure.os, "getloadavg", unavailable)
    assert machine_load_warning() is None


def test_the_share_of_a_core_is_one_minus_the_time_spent_waiting_for_it(monkeypatch):
    clock = Clock()
    waited = iter([5.0, 5.75])  # schedstat: 0.75 s more spent runnable, waiting for a CPU
    monkeypatch.setattr(measure.time, "perf_counter", clock)
    monkeypatch.setattr(measure, "_runqueue_wait_s", lambda: next(waited))
    core = CoreShare()
    clock.now += 1.0
    assert core.share() == pytest.approx(0.25)
    waited = iter([0.0, 3.0])  # waited longer than the wall time: no share at all, not below 0
    core = CoreShare()
    clock.now += 1.0
    assert core.share() == 0.0


def test_without_schedstat_the_share_is_the_lower_of_two_samples(monkeypatch):
    monkeypatch.setattr(measure, "_runqueue_wait_s", lambda: None)
    samples = iter([0.9, 0.4])
    monkeypatch.setattr(measure, "cpu_share", lambda: next(samples))
    assert CoreShare().share() == 0.4
    samples = iter([0.3, 0.8])
    assert CoreShare().share() == 0.3


def test_schedstat_counts_up_where_the_system_has_it():
    first = measure._runqueue_wait_s()
    if first is None:  # (not Linux: the fallback above is what runs)
        assert not os.path.exists("/proc/thread-self/schedstat")
        return
    assert first >= 0 and measure._runqueue_wait_s() >= first


@pytest.mark.parametrize("level", ["probe", "quick"])
def test_a_cpu_section_at_small_sizes(monkeypatch, level):
    """measure_cpu's section at each level: its tables hold the sizes it measured, the quick
    level every ufunc class and the probe two, and the profile builder takes it."""
    monkeypatch.setitem(measure.SIZES, level, TINY)
    monkeypatch.setattr(measure, "machine_load_warning", lambda: None)
    messages = []
    section = measure.measure_cpu(level=level, progress=messages.append, threads=3)
    steps = [m for m in messages if not m.startswith("warning: ")]  # (tiny sizes: rounds may spread)
    assert steps == ["cpu: matmul", "cpu: elementwise (memory-bound, divide, sqrt, exp, sin, power)",
                     "cpu: fft", "cpu: reductions", "cpu: per-task overhead of Dask's scheduler"]
    assert section["threads"] == 3
    assert section["source"].endswith(f"({level})")
    for dtype in ("float32", "float64"):
        assert [n for n, _ in section["matmul_s_per_flop"][dtype]["matmul"]] == [16, 32]
        assert [n for n, _ in section["fft_s_per_flop"][dtype]["fft"]] == [256]
        assert [n for n, _ in section["reduction_s_per_element"][dtype]["sum"]] == [1 << 10, 1 << 20]
        classes = set(section["elementwise_s_per_element"][dtype])
        assert classes == ({"add", "sin"} if level == "probe" else set(UFUNC_CLASSES.values()))
        for table in section["elementwise_s_per_element"][dtype].values():
            assert [n for n, _ in table] == [1 << 10, 1 << 20]
            assert all(s > 0 for _, s in table)
        assert section["matmul_flops_per_s"][dtype] > 0 and section["flops_per_s"][dtype] > 0
    assert section["memory_bandwidth_bytes_per_s"] > 0 and section["task_overhead_s"] > 0
    built = profile_mod._build(profile_mod.profile_dict("h200"), section)
    assert built.cpu.threads == 3


def test_the_older_spelling_and_a_loaded_machine(monkeypatch):
    """``quick=False`` is the full level; a load above the cores is among the section's
    warnings and said as it is found."""
    monkeypatch.setitem(measure.SIZES, "full", TINY)
    monkeypatch.setattr(measure, "machine_load_warning", lambda: "load average 9.0 on 2 cores")
    messages = []
    section = measure.measure_cpu(quick=False, progress=messages.append)
    assert "(" not in section["source"].split(" on ")[-1]  # the full level says no level
    assert section["warnings"][0] == "load average 9.0 on 2 cores"
    assert "warning: load average 9.0 on 2 cores" in messages
    assert [n for n, _ in section["matmul_s_per_flop"]["float64"]["matmul"]] == [16, 32]


def test_no_level_but_the_three():
    with pytest.raises(ValueError, match="level must be one of"):
        measure.measure_cpu(level="medium")
