"""Placement decisions: the seed's six verdicts, where data lives, margins and limits."""

from __future__ import annotations

import functools
from dataclasses import replace as dataclasses_replace

import dask
import dask.array as da
import numpy as np
import pytest
from dask.array.optimization import optimize as dask_array_optimize

import eugo_dask
from eugo_dask import array_optimize, load_profile, optimization, runtime
from eugo_dask.config import read_settings
from eugo_dask.devices import cuda
from eugo_dask.graph import ChunkInfo, task_spec_dict
from eugo_dask.plan import ColdStart, Copies
from eugo_dask.report import format_seconds

from .conftest import H200_SERVER

N512M = 512 * 2**20


def host(shape, chunks=None, dtype="f4", name="x"):
    """A host-resident array of any size without allocating it (a broadcast view)."""
    base = np.broadcast_to(np.ones((), dtype=dtype), shape)
    return da.from_array(base, chunks=chunks or shape, name=name)


def gauss_sine(x):
    """The seed's 'elementwise transform': a Gaussian-windowed sine, two transcendentals."""
    return np.exp(-x * x) * np.sin(x)


SEED_ROWS = {
    # name: (build, verdict) -- the seed's table, float32, host-resident, one chunk each
    "matmul 8192²": (lambda: host((8192, 8192), name="a") @ host((8192, 8192), name="b"), "gpu"),
    "elementwise 512M": (lambda: gauss_sine(host((N512M,))), "gpu"),
    "fft 4096²": (lambda: da.fft.fft2(host((4096, 4096))), "gpu"),
    "sum 512M": (lambda: host((N512M,)).sum(), "cpu"),
    "matmul 256²": (lambda: host((256, 256), name="a") @ host((256, 256), name="b"), "cpu"),
    "elementwise 10K": (lambda: gauss_sine(host((10_000,))), "cpu"),
}


#: The h200 preset with staged copies at 20 GB/s each way, its figures before they were set to
#: the measured 8.3 and 4.0 GB/s: the structural tests below (which copies draw work where)
#: chose their shapes under it, and keep it so their products still pay on the device.
FAST_LINK = {"eugo.profile": {**H200_SERVER, "link": {"h2d_bytes_per_s": 2e10, "d2h_bytes_per_s": 2e10}}}


@pytest.fixture
def fast_link(h200_server):
    with dask.config.set(FAST_LINK):
        yield


def main_decision(plan):
    """The task doing the row's work (the most CPU seconds)."""
    return max(plan, key=lambda d: d.cpu_s)


@pytest.mark.parametrize("row", list(SEED_ROWS))
def test_seed_table_verdicts(row, h200_server):
    build, verdict = SEED_ROWS[row]
    plan = eugo_dask.explain(build())
    decision = main_decision(plan)
    assert decision.device == verdict, decision.reason
    # the reason carries the numbers behind the verdict
    assert "GPU" in decision.reason and "CPU" in decision.reason and "vs" in decision.reason
    assert ("H2D" in decision.reason) == (decision.h2d_s > 0)
    if verdict == "gpu":
        assert decision.cpu_s >= 2 * (decision.gpu_s + decision.h2d_s + decision.d2h_s)
    else:
        assert decision.cpu_s < 2 * (decision.gpu_s + decision.h2d_s + decision.d2h_s)


def test_cheap_elementwise_over_host_data_stays_on_cpu(h200_server):
    # x + 1 over 512M host floats: the copy there and back costs most of what the CPU pass does
    decision = main_decision(eugo_dask.explain(host((N512M,)) + 1))
    assert decision.device == "cpu"
    assert decision.h2d_s + decision.d2h_s > decision.cpu_s / 2


def test_chunking_changes_what_pays(h200_server):
    # 2048² blocks: matmul still pays on the GPU; elementwise and sum spread over 32 CPU threads
    a, b = host((8192, 8192), (2048, 2048), name="a"), host((8192, 8192), (2048, 2048), name="b")
    matmul = eugo_dask.explain(a @ b)
    assert {d.device for d in matmul if d.op == "matmul"} == {"gpu"}
    chunked = host((N512M,), (2048 * 2048,))
    for collection in (gauss_sine(chunked), chunked.sum()):
        plan = eugo_dask.explain(collection)
        assert len(plan) > 100
        assert not plan.gpu_keys, str(plan)
        assert any("/ 32 threads" in d.reason for d in plan)


def test_reduction_follows_its_data(emulated):
    # over host data: the partial sums stay on the CPU; over device data: they run on the device
    with dask.config.set({"eugo.min-speedup": 2.0, **FAST_LINK}):
        x = host((4096, 4096), (1024, 4096))
        plan = eugo_dask.explain(x.sum())
        assert not plan.gpu_keys
        a, b = host((4096, 4096), (1024, 4096), name="a"), host((4096, 4096), (4096, 4096), name="b")
        y = a @ b  # used twice, so Dask cannot fuse the product into either reduction
        plan = eugo_dask.explain(y.sum() + y.max())
    partials = [d for d in plan if d.op == "reduction"]
    assert len(partials) == 8, str(plan)
    for d in partials:
        assert d.device == "gpu", d.reason
        assert d.h2d_s == 0  # its input is already on the device
        assert "+ D2H" in d.reason.split("vs")[1]  # on the CPU it would pay the copy back
    aggregates = [d for d in plan if d.op == "aggregate"]
    assert aggregates and all(d.device == "cpu" for d in aggregates)


def test_min_speedup_is_a_margin(h200_server):
    build, _ = SEED_ROWS["matmul 8192²"]
    decision = main_decision(eugo_dask.explain(build()))
    speedup = decision.cpu_s / (decision.gpu_s + decision.h2d_s + decision.d2h_s)
    with dask.config.set({"eugo.min-speedup": speedup * 1.01}):
        assert main_decision(eugo_dask.explain(build())).device == "cpu"
    with dask.config.set({"eugo.min-speedup": speedup * 0.99}):
        assert main_decision(eugo_dask.explain(build())).device == "gpu"


def test_min_speedup_zero_offloads_everything_capable(h200_server):
    with dask.config.set({"eugo.min-speedup": 0}):
        plan = eugo_dask.explain(gauss_sine(host((10_000,))))
    assert [d.device for d in plan] == ["gpu"]


def test_chunk_too_big_for_device_memory_never_offloads(h200_server):
    build, _ = SEED_ROWS["matmul 8192²"]
    with dask.config.set({"eugo.emulated.memory-limit": "500 MB"}):
        decision = main_decision(eugo_dask.explain(build()))
    assert decision.device == "cpu"
    assert "on the device, more than" in decision.reason


def test_the_device_memory_cap_is_shared_by_the_tasks_that_run_at_once(h200_server):
    """A layer's chunks run side by side on the device, each with its working set there: a task
    gets the device's allowed memory over those that run at once (threads over the devices a
    process drives). Before, each was allowed the whole device."""
    x = host((4096, 4096), (1024, 4096), dtype="f8")  # 4 chunks of 32 MiB: 96 MiB working set each
    one = host((1024, 4096), dtype="f8", name="one")
    limit = {"eugo.min-speedup": 0, "eugo.emulated.memory-limit": "300 MiB"}  # 240 MiB allowed
    for config, device in [({"num_workers": 4}, "cpu"), ({"num_workers": 1}, "gpu"),
                           ({"scheduler": "sync"}, "gpu"),
                           ({"num_workers": 4, "eugo.emulated.devices": 4}, "gpu"),
                           ({"scheduler": "processes", "num_workers": 3}, "cpu")]:
        with dask.config.set({**limit, "scheduler": "threads", **config}):
            plan = eugo_dask.explain(np.sin(x))
        assert {d.device for d in plan} == {device}, config
        if config == {"num_workers": 4}:
            assert main_decision(plan).reason.endswith(
                "needs 101 MB on the device, more than the 62.9 MB allowed (the device's 252 MB "
                "shared by 4 tasks at once)")
    with dask.config.set({**limit, "scheduler": "threads", "num_workers": 4}):
        assert main_decision(eugo_dask.explain(np.sin(one))).device == "gpu"  # alone on the device


def test_a_cluster_shares_a_device_among_a_workers_gpu_tasks(monkeypatch):
    """Planned on a scheduler: a worker with GPU=4 (time-slicing one GPU) runs four GPU tasks
    on it at once, unless its process drives four GPUs (gpus-per-process: all)."""
    from types import SimpleNamespace

    from eugo_dask.config import read_settings

    def workers(*slots):
        return SimpleNamespace(workers={i: SimpleNamespace(resources={"GPU": units}, nthreads=threads)
                                        for i, (units, threads) in enumerate(slots)})

    monkeypatch.setattr(optimization, "current_submission", lambda: object())
    settings = dataclasses_replace(read_settings(), device="cupy")
    four = load_profile({"base": "h200", "cpu": "server-x86", "gpu": {"count": 4}})
    for scheduler, expected, gpus in [(workers((4, 8)), 4, "one"), (workers((1, 8), (2, 1)), 1, "one"),
                                      (workers((4, 8)), 1, "all"), (workers((8, 16)), 2, "all"),
                                      (None, 1, "one")]:
        monkeypatch.setattr(optimization, "running_scheduler", lambda s=scheduler: s)
        with dask.config.set({"eugo.gpus-per-process": gpus}):
            assert optimization._gpu_tasks_per_device(settings, four) == expected, (scheduler, gpus)


def test_float64_on_a_consumer_gpu(h200_server):
    # an L4 runs float64 at 1/64 of float32: the same matmul pays in float32 only
    with dask.config.set({"eugo.profile": {"base": "l4", "cpu": "server-x86"}}):
        f32 = main_decision(eugo_dask.explain(host((4096, 4096), name="a") @ host((4096, 4096), name="b")))
        f64 = main_decision(eugo_dask.explain(
            host((4096, 4096), dtype="f8", name="a") @ host((4096, 4096), dtype="f8", name="b")))
    assert f32.device == "gpu", f32.reason
    assert f64.device == "cpu", f64.reason
    assert f64.gpu_s > 10 * f32.gpu_s


def test_io_aggregate_creation_and_unknown_never_offload(emulated):
    x = da.random.default_rng(0).random((100, 100), chunks=50)
    plan = eugo_dask.explain(x.map_blocks(lambda b: b + 1).sum())
    reasons = {d.op: d.reason for d in plan}
    assert all(d.device == "cpu" for d in plan if d.op in ("creation", "aggregate", "unknown"))
    assert "runs on the host" in reasons["creation"]
    assert "aggregation of partial results stays on the CPU" in reasons["aggregate"]


# --- a device not started yet (first-use costs, measured by calibrate) ---------------------------
def cold_profile(first_use_s, thread_setup_s=0.0):
    return {"eugo.profile": {**H200_SERVER, "gpu": {"first_use_s": first_use_s,
                                                    "thread_setup_s": thread_setup_s}}}


@pytest.fixture
def cold_device(h200_server, monkeypatch):
    """No device started in this process (as in a fresh one), the threaded scheduler; a profile
    whose start costs nothing unless a test says otherwise. The emulated device stands for a GPU
    whose first use is not paid yet (as CuPy's is before its probe ran)."""
    monkeypatch.setattr(runtime, "_devices", {})
    assert not runtime.device_started("emulated")
    paid = runtime.device_first_use_paid
    monkeypatch.setattr(optimization, "device_first_use_paid",
                        lambda name: runtime.device_started(name) if name == "emulated" else paid(name))
    with dask.config.set({"scheduler": "threads", **cold_profile(first_use_s=0.0)}):
        yield


def test_the_emulated_device_is_planned_as_cupy_after_its_probe(h200_server, monkeypatch):
    """A dry run on the emulated device plans what a GPU machine would: resolving eugo.device
    to CuPy probes the device and pays its first use, so only the threads' set-up is left."""
    monkeypatch.setattr(runtime, "_devices", {})
    profile = load_profile(H200_SERVER)
    with dask.config.set({"scheduler": "threads", "num_workers": 4}):
        assert optimization._cold_start("emulated", profile) == ColdStart(0.0, 3.4e-3, 4)


def test_presets_charge_a_cold_device_its_start(cold_device):
    """A preset's first use (0.32 s, measured on an H200 host) is charged where the device is
    not started: the FFT row of the seed table (40 ms saved) does not repay it. Before, presets
    carried no first-use figures and a cold device started for free."""
    build, _ = SEED_ROWS["fft 4096²"]
    with dask.config.set({"eugo.profile": H200_SERVER}):
        cold = main_decision(eugo_dask.explain(build()))
    assert cold.device == "cpu"
    assert "the device is not started; with its start (" in cold.reason
    assert main_decision(eugo_dask.explain(build())).device == "gpu"  # started for free


def gpu_work(plan):
    """(CPU seconds of the tasks placed on the GPU, what placing them there costs)."""
    on_cpu = sum(d.cpu_s for d in plan if d.device == "gpu")
    return on_cpu, on_cpu - (plan.totals["all_cpu"] - plan.totals["as_chosen"])


def test_a_cold_device_is_started_only_where_the_graph_repays_it(cold_device):
    build, _ = SEED_ROWS["matmul 8192²"]
    warm = eugo_dask.explain(build())
    assert main_decision(warm).device == "gpu"
    on_cpu, on_gpu = gpu_work(warm)
    # the GPU work, the start added, must still beat the CPU by min-speedup (2)
    repaid = on_cpu / 2 - on_gpu
    assert repaid > 0
    with dask.config.set(cold_profile(first_use_s=repaid * 0.9)):
        assert main_decision(eugo_dask.explain(build())).device == "gpu"
    with dask.config.set(cold_profile(first_use_s=repaid * 1.1)):
        plan = eugo_dask.explain(build())
    assert [d.device for d in plan] == ["cpu"] * len(plan)
    assert plan.totals["as_chosen"] == pytest.approx(plan.totals["all_cpu"])
    reason = main_decision(plan).reason
    assert "the device is not started" in reason
    assert f"with its start ({format_seconds(repaid * 1.1)})" in reason
    assert f"against {format_seconds(on_cpu)} on the CPU" in reason


def test_tasks_that_would_stay_on_the_cpu_anyway_keep_their_reason(cold_device):
    build, _ = SEED_ROWS["matmul 8192²"]
    x = build().sum() + gauss_sine(host((10_000,))).sum()
    warm = eugo_dask.explain(x)
    with dask.config.set(cold_profile(first_use_s=1e6)):
        plan = eugo_dask.explain(x)
    assert {d.device for d in plan} == {"cpu"}
    stayed = [d.key for d in warm if d.device == "cpu" and d.gpu_s is not None]
    moved = [d.key for d in warm if d.device == "gpu"]
    assert stayed and moved
    assert all(plan[k].reason == warm[k].reason for k in stayed)
    assert all("the device is not started" in plan[k].reason for k in moved)


def test_each_thread_that_would_run_device_work_pays_its_setup(cold_device):
    a = host((8192, 8192), chunks=(2048, 8192), name="a")  # 4 row blocks: 4 GPU matmuls
    x = a @ host((8192, 8192), name="b")
    warm = eugo_dask.explain(x)
    assert sum(d.device == "gpu" for d in warm) == 4
    for config, threads in [({"num_workers": 3}, 3), ({"num_workers": 8}, 4),
                            ({"scheduler": "sync"}, 1)]:
        with dask.config.set({**cold_profile(first_use_s=1.0, thread_setup_s=100.0), **config}):
            plan = eugo_dask.explain(x)
        assert {d.device for d in plan} == {"cpu"}
        startup = 1.0 + 100.0 * threads
        assert f"with its start ({format_seconds(startup)})" in main_decision(plan).reason, config


def test_a_started_device_pays_no_first_use(cold_device):
    build, _ = SEED_ROWS["matmul 8192²"]
    runtime.get_device("emulated")  # tasks of an earlier graph ran here
    assert runtime.device_started("emulated")
    with dask.config.set(cold_profile(first_use_s=1e6, thread_setup_s=1e6)):
        assert main_decision(eugo_dask.explain(build())).device == "gpu"


def test_cupys_probe_pays_the_first_use_not_the_threads(cold_device, monkeypatch):
    """Resolving eugo.device to CuPy probes device 0 (context, a kernel compile): the first
    use is paid then; the threads that will run tasks still set up."""
    probe = functools.lru_cache(maxsize=1)(lambda: None)  # a usable device, not probed yet
    monkeypatch.setattr(cuda, "cupy_unusable_reason", probe)
    assert not runtime.device_first_use_paid("cupy")
    profile = load_profile({**H200_SERVER, "gpu": {"first_use_s": 5.0, "thread_setup_s": 1.0}})
    with dask.config.set(num_workers=2):
        assert optimization._cold_start("cupy", profile) == ColdStart(5.0, 1.0, 2)
        probe()
        assert runtime.device_first_use_paid("cupy")
        assert optimization._cold_start("cupy", profile) == ColdStart(0.0, 1.0, 2)


def test_each_process_of_the_processes_scheduler_starts_its_own_device(cold_device):
    build, _ = SEED_ROWS["matmul 8192²"]
    runtime.get_device("emulated")  # started here: the pool's processes are not
    with dask.config.set({**cold_profile(first_use_s=1e6, thread_setup_s=1.0),
                          "scheduler": "processes", "num_workers": 2}):
        plan = eugo_dask.explain(build())
    assert {d.device for d in plan} == {"cpu"}
    assert f"with its start ({format_seconds(1e6 + 1.0)})" in main_decision(plan).reason


def test_min_speedup_zero_starts_a_cold_device_regardless(cold_device):
    with dask.config.set({**cold_profile(first_use_s=1e6), "eugo.min-speedup": 0}):
        plan = eugo_dask.explain(gauss_sine(host((10_000,))))
    assert [d.device for d in plan] == ["gpu"]


def test_below_one_min_speedup_is_a_margin_for_the_start_too(cold_device):
    """min-speedup 0.05 accepts GPU work 20x slower than the CPU; a start of 0 s changes
    nothing, a start that makes it slower still keeps the graph on the CPU."""
    x = gauss_sine(host((10_000,)))
    with dask.config.set({"eugo.min-speedup": 0.05}):
        warm = eugo_dask.explain(x)
        on_cpu, on_gpu = gpu_work(warm)
        assert [d.device for d in warm] == ["gpu"] and on_cpu < on_gpu
        with dask.config.set(cold_profile(first_use_s=0.0)):
            assert [d.device for d in eugo_dask.explain(x)] == ["gpu"]
        with dask.config.set(cold_profile(first_use_s=on_cpu / 0.05)):
            assert [d.device for d in eugo_dask.explain(x)] == ["cpu"]


def test_graphs_for_a_cluster_pay_no_first_use(cold_device):
    """Workers start their device once in their life: a graph submitted to them is not
    charged it, nor one explained while a distributed client is the default scheduler."""
    from distributed import Client

    build, _ = SEED_ROWS["matmul 8192²"]
    with dask.config.set(cold_profile(first_use_s=1e6)):
        settings = read_settings().resolved()
        profile = optimization._profile(settings)
        assert optimization._cold_start("emulated", profile) is not None
        token = array_optimize._submitted.set(array_optimize.Submission(settings, {}))
        try:
            assert optimization._cold_start("emulated", profile) is None
        finally:
            array_optimize._submitted.reset(token)
        with dask.config.set(scheduler=None), Client(
                processes=False, n_workers=1, threads_per_worker=1, dashboard_address=":0",
                timeout="60s"):
            assert main_decision(eugo_dask.explain(build())).device == "gpu"


# --- several outputs computed together (dask.compute(*outputs)) ----------------------------------
#: An H200 beside a host that streams memory slowly (1 GB/s a thread, 2 threads): its CPU
#: estimate of a copy-like task is 20x the link's.
NARROW_HOST = {"base": "h200", "cpu": {
    "name": "narrow-memory", "threads": 2, "memory_bandwidth_bytes_per_s": 1e9,
    "flops_per_s": {"float32": 2e10, "float64": 1e10},
    "matmul_flops_per_s": {"float32": 2e11, "float64": 1e11},
    "fft_flops_per_s": {"float32": 5e9, "float64": 4e9}, "task_overhead_s": 5e-6}}


def joint_plan(*collections, reverse=False):
    """The plan of ``collections`` computed together, their graph walked in Dask's key order
    or the reverse of it (either is a valid order: Dask's varies with the graph's history)."""
    graph, keys = optimization._joint_graph(collections)
    dsk = task_spec_dict(dask_array_optimize(graph, keys))
    if reverse:
        dsk = dict(reversed(dsk.items()))
    settings = optimization._current_settings()
    described = optimization._split_and_describe(dsk, keys, ChunkInfo.from_graph(graph),
                                                 settings, optimization._profile(settings))
    return described.place(settings)


def moved_bytes(plan):
    return plan.copies.to_device_bytes + plan.copies.to_host_bytes


def placement(plan, word):
    """Where the tasks whose work names ``word`` go, by key."""
    return {d.key: d.device for d in plan if word in d.detail}


def test_a_copy_made_for_another_operation_does_not_draw_work_to_the_device(fast_link):
    """``x`` is copied to the device for the product; the sine of ``x``, which would not pay
    for that copy alone, is not put there for it: its result would have to come back (64 MB
    more over the link than computing the two apart), and which consumer of ``x`` the walk
    met first would decide where the sine runs."""
    x = host((4096, 4096), (2048, 4096), name="x")
    product, wave = x @ x.T, np.sin(x) * 2
    alone = eugo_dask.explain(wave)
    assert set(placement(alone, "sin").values()) == {"cpu"}
    separately = moved_bytes(eugo_dask.explain(product)) + moved_bytes(alone)
    for reverse in (False, True):
        plan = joint_plan(product, wave, reverse=reverse)
        assert set(placement(plan, "sin").values()) == {"cpu"}, str(plan)
        assert set(placement(plan, "matmul").values()) == {"gpu"}
        assert moved_bytes(plan) <= separately
        sine = next(d for d in plan if "sin" in d.detail)
        assert sine.h2d_s > 0, sine.reason  # charged its own copy of x


def test_a_copy_back_made_for_an_output_does_not_draw_work_to_the_host(fast_link):
    """``y`` is an output (copied back) and read by work that pays on the device: that work
    stays on the device (charged the copy back it would need on the CPU), rather than run on
    the host copy and have its own result copied to the device for the next product."""
    x = host((4096, 4096), (1024, 4096), name="x")
    y = x @ x.T
    w = y * 2
    products = ((w @ w).sum(), np.exp(w).sum())
    for reverse in (False, True):
        plan = joint_plan(y, *products, reverse=reverse)
        assert set(placement(plan, "multiply").values()) == {"gpu"}, str(plan)
        alone = [eugo_dask.explain(p) for p in products]
        assert moved_bytes(plan) <= moved_bytes(eugo_dask.explain(y)) + sum(map(moved_bytes, alone))


def test_data_movement_over_host_data_stays_on_the_cpu(h200_server):
    """A rechunk of host data: its pieces would be copied to the device only to be moved
    there and copied back, however much faster than this host the estimates make the move."""
    x = host((4096, 4096), (1024, 4096))
    with dask.config.set({"eugo.profile": NARROW_HOST}):
        plan = eugo_dask.explain(x.rechunk((4096, 1024)))
    moves = [d for d in plan if d.op == "movement"]
    assert moves and {d.device for d in moves} == {"cpu"}
    merge = max(moves, key=lambda d: d.cpu_s)
    assert merge.cpu_s > 2 * merge.gpu_total_s  # the bare estimate would offload it
    assert "moves host data" in merge.reason and "stays where its inputs live" in merge.reason
    assert plan.copies == Copies()


def test_data_movement_over_device_data_stays_on_the_device(h200_server):
    a, b = host((4096, 4096), (1024, 4096), name="a"), host((4096, 4096), name="b")
    with dask.config.set({"eugo.profile": NARROW_HOST}):
        plan = eugo_dask.explain((np.exp((a @ b).rechunk((4096, 1024)) / 4096)).sum())
    moves = [d for d in plan if d.op == "movement"]
    assert moves and {d.device for d in moves} == {"gpu"}, str(plan)
    assert all(d.h2d_s == 0 for d in moves)


def test_a_shared_move_follows_its_inputs_copies_to_its_consumers(fast_link):
    """``x.T``, shared by two products, is a task of its own: its input ``x`` is copied to the
    device for the first product and both products run there, so the transpose runs there too
    and its result is not copied: each input chunk crosses once."""
    x = da.random.default_rng(0).random((4096, 4096), chunks=1024, dtype="f4")
    z = da.random.default_rng(1).random((4096, 4096), chunks=1024, dtype="f4")
    outputs = ((x @ x.T).mean(), x.T @ z)
    plan = eugo_dask.explain(*outputs)
    transposes = [d for d in plan if d.detail == "transpose"]
    assert transposes and {d.device for d in transposes} == {"gpu"}, str(plan)
    assert "its inputs are on the device (copied for other tasks)" in transposes[0].reason
    assert plan.copies.to_device == 32  # x and z, 16 chunks each
    assert moved_bytes(plan) < sum(moved_bytes(eugo_dask.explain(o)) for o in outputs)


def test_a_creation_fused_into_its_consumer_leaves_the_placement_alike(fast_link):
    """Alone, ``exp(x).sum(axis=0)`` fuses the creation of ``x`` into its tasks; with another
    output of ``x`` it does not. The creation runs on the host wherever its consumer runs: it
    weighs on neither side, and the consumer goes the same way in both graphs."""
    x = da.random.default_rng(0).random((2048, 4096), chunks=(1024, 4096), dtype="f4")
    sums = np.exp(x).sum(axis=0)
    alone, joint = eugo_dask.explain(sums), eugo_dask.explain(sums, x.std())
    fused = [d for d in alone if "exp" in d.detail]
    assert fused and all(d.detail.startswith("_apply_random_func") for d in fused)
    assert {d.device for d in fused} == {d.device for d in joint if "exp" in d.detail} == {"gpu"}
    assert "creation on the host either way" in fused[0].reason
    assert moved_bytes(joint) <= moved_bytes(alone) + moved_bytes(eugo_dask.explain(x.std()))


# ---------------------------------------------------------------------------------------------
# eugo.dispatch: balanced: each layer where the makespan bound's split on the machine puts it
# ---------------------------------------------------------------------------------------------
def _seed_transform(n=4096, chunk=1024):
    """The seed's transform with its creation fused in: 16 chunks of 1024², 4.73 ms each on
    a thread; on a device each pays 4 MiB back over a 4 GB/s link (1.05 ms)."""
    x = da.random.default_rng(0).random((n, n), chunks=chunk, dtype=np.float32)
    return da.exp(-x * x) * da.sin(x)


def _machine(threads, gpus, **link):
    from eugo_dask.schedule import Machine

    rates = {"h2d_bytes_per_s": 8.3e9, "d2h_bytes_per_s": 4.0e9, "latency_s": 1e-5, **link}
    return Machine(cpu_threads=threads, gpus=gpus, name=f"{threads}c+{gpus}g", **rates)


def _balanced(collection, machine, **settings):
    with dask.config.set({"eugo.profile": H200_SERVER, "eugo.device": "none",
                          "eugo.dispatch": "balanced", **settings}):
        return eugo_dask.explain(collection, machine=machine)


def test_balanced_splits_a_layer_where_neither_kind_of_device_can_take_it_alone():
    """On 8 threads and 2 GPUs the 16 chunks split: the threads take one round of 8 (4.73 ms),
    the devices 4 each (about 1.05 ms apiece, their copies back): both finish near 4.7 ms, where
    all on the threads takes two rounds (9.46 ms) and all on the devices 8 each (9.65 ms). The
    static plan keeps every chunk on the CPU (the copy back loses the margin)."""
    from eugo_dask.schedule import simulate

    machine = _machine(8, 2)
    with dask.config.set({"eugo.profile": H200_SERVER, "eugo.device": "none"}):
        static = eugo_dask.explain(_seed_transform(), machine=machine)
    plan = _balanced(_seed_transform(), machine)
    assert len(static.gpu_keys) == 0
    assert len(plan.gpu_keys) == 8 and len(plan) == 16
    layer = {d.share for d in plan}
    assert layer == {0.5}  # (one layer: one share)
    assert "the makespan bound's split puts 50% of its layer on the GPU" in plan[plan.gpu_keys[0]].reason
    costs = plan.schedule.costs
    ours = simulate(costs, machine, "static").makespan_s
    assert ours < min(simulate(costs, machine, p).makespan_s for p in ("all-cpu", "all-gpu"))
    assert plan.schedule.predicted.makespan_s == pytest.approx(ours)
    assert ours >= plan.schedule.bound.seconds


def test_balanced_follows_the_machine_it_is_given():
    """The same layer: with a thread per chunk it stays on the CPU; with few threads and four
    GPUs it goes wholly to the devices."""
    assert _balanced(_seed_transform(), _machine(16, 1)).gpu_keys == []
    many_gpus = _balanced(_seed_transform(), _machine(8, 4))
    assert len(many_gpus.gpu_keys) == 16
    assert {d.share for d in many_gpus} == {1.0}


def test_balanced_puts_on_the_devices_what_the_margin_kept_on_few_threads():
    """A matmul chain in 256² chunks: the profile's 32 threads beat the copies (the static plan
    keeps every product on the CPU), 2 threads do not: balanced offloads the products on
    2 threads and 4 GPUs, and the model's makespan falls many times over."""
    a = da.random.default_rng(0).random((1024, 1024), chunks=256, dtype=np.float32)
    graph = (a @ a).sum()
    machine = _machine(2, 4)
    with dask.config.set({"eugo.profile": H200_SERVER, "eugo.device": "none"}):
        static = eugo_dask.explain(graph, machine=machine)
    plan = _balanced(graph, machine)
    assert static.gpu_keys == []
    products = [d for d in plan if d.op == "matmul"]
    assert products and all(d.device == "gpu" and d.share == 1.0 for d in products)
    assert plan.schedule.predicted.makespan_s * 10 < static.schedule.predicted.makespan_s


def test_balanced_keeps_on_the_cpu_what_a_slow_link_makes_not_worth_it():
    """2048² matmul products go to the GPU by the margin (the profile's link); on a machine of
    64 threads whose link moves 100 MB/s, the bound's split keeps them on the CPU, and the
    model finishes sooner so."""
    a = da.random.default_rng(0).random((4096, 4096), chunks=2048, dtype=np.float32)
    graph = (a @ a).sum()
    machine = _machine(64, 1, h2d_bytes_per_s=1e8, d2h_bytes_per_s=1e8)
    with dask.config.set({"eugo.profile": H200_SERVER, "eugo.device": "none"}):
        static = eugo_dask.explain(graph, machine=machine)
    plan = _balanced(graph, machine)
    assert static.gpu_keys and not plan.gpu_keys
    assert plan.schedule.predicted.makespan_s < static.schedule.predicted.makespan_s


def test_balanced_leaves_min_speedup_0_and_data_movement_as_static_places_them():
    a = da.random.default_rng(0).random((1024, 1024), chunks=256, dtype=np.float32)
    graph = (a.T + 1).sum()
    with dask.config.set({"eugo.profile": H200_SERVER, "eugo.device": "none"}):
        everything = eugo_dask.explain(graph, min_speedup=0)
    balanced = _balanced(graph, _machine(32, 1), **{"eugo.min-speedup": 0})
    assert balanced.gpu_keys == everything.gpu_keys
    assert all(d.share is None for d in balanced)


def test_balanced_computes_what_plain_dask_computes(emulated, h200_server):
    """Placed by the bound's split on the profile's machine (32 threads, 1 GPU: it offloads a
    third of a matmul's 256² products, which the margin keeps on the CPU, and the FFTs),
    computed on the emulated device: plain Dask's values and types."""
    x = da.random.default_rng(1).random((1024, 1024), chunks=256, dtype=np.float32)
    y = da.random.default_rng(2).random((1024, 2048), chunks=(256, 2048), dtype=np.float32)
    graphs = [(x @ x).sum(), (x @ x.T).mean(axis=0), da.fft.fft(y, axis=1).real.std(),
              da.exp(-x * x) * da.sin(x), (x + 1)[::2].std()]
    with dask.config.set(optimizations=[]):
        expected = dask.compute(*graphs, scheduler="sync")
    with dask.config.set({"eugo.dispatch": "balanced", "eugo.min-speedup": 2}):
        assert len(eugo_dask.explain(graphs[0]).gpu_keys) > 0
        assert len(eugo_dask.explain(graphs[0], dispatch="static").gpu_keys) == 0
        got = dask.compute(*graphs, scheduler="sync")
    assert eugo_dask.device_stats()["tasks"] > 0
    for e, g in zip(expected, got):
        assert type(g) is type(e) and g.dtype == e.dtype and g.shape == e.shape
        np.testing.assert_array_equal(g, e)
