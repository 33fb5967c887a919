"""Makespan against the lower bound: how each placement policy uses a machine as a whole, in the
schedule model (:mod:`eugo_dask.schedule`), on graphs a user builds.

For each graph, eugo's plan (``explain()``, profile ``h200`` with the ``server-x86`` CPU: fixed
figures, the same on every machine) is list-scheduled on two machine shapes with the staged
copy rates measured on an H200 (8.3 GB/s to the device, 4.0 GB/s back, 10 µs a copy):

- ``32c+1g``: 32 CPU threads and one GPU;
- ``8c+4g``: 8 CPU threads and four GPUs;

under the policies

- ``static``: today's plan as it runs today, its copies beside the kernels on the links (a copy
  asks for none of the GPU slot: ``link``), those to a device at most
  ``(eugo.read-ahead + 1) x GPUs`` device tasks ahead of the devices (eugo's scheduler plugin
  holds each until the device task that many places before its consumer has ended; every
  policy whose copies are on the links is held so);
- ``static-slot``: the same placement with copies holding the GPU slot, as they did before
  (``slot``: a copy and a kernel never overlapped);
- ``all-cpu``, ``all-gpu``: every task on the CPU; every task that can, on a device;
- ``dmda``: each task, in Dask's order, where it finishes first, copies counted (StarPU's dmda),
  copies on the links: what run-time dispatch would do with exact estimates;
- ``spill``: the plan's GPU tasks only, each where it finishes first (a GPU task spilled to an
  idle CPU thread), copies in the GPU slot: dispatch that can only move GPU work to the CPU;
- ``dual``: the plan made with ``eugo.dispatch: dual``: its fixed tasks as ``static``, its dual
  tasks each sent as it becomes ready to the CPU thread or GPU slot the scheduler plugin's rule
  picks (the dual task's copies inside it, holding the slot and taking the link). With
  ``--timed``, the dual tasks are placed at run time by eugo's scheduler plugin itself;
- ``eugo``: the plan made with ``eugo.dispatch: balanced`` for the machine it runs on
  (``explain(machine=...)``): each layer where the split of least work that reaches the bound
  on that machine puts it, a split layer's chunks shared in whole rounds; its copies on the
  links, as ``static``'s.

Each line: the makespan, the lower bound (LP, HiGHS) and their ratio, how busy the CPU threads
and GPUs were, and whether the bound itself uses both kinds of device (``mixed``). This is the
model's arithmetic, not a run: it says what a policy can gain before it is built, and the timed
emulated cluster (a run on real workers with these durations) is what checks a built one.

    python benchmarks/makespan.py                  # the sizes below
    python benchmarks/makespan.py --quick          # a quarter of the data, chunks as large
    python benchmarks/makespan.py --json out.json  # also one record per graph x machine x policy
    python benchmarks/makespan.py --timed 1        # also run each schedule on the timed cluster
    python benchmarks/makespan.py --quick --timed 1 --graphs seed,tensordot --policies static,eugo

``--timed S`` runs each schedule on the timed emulated cluster (:mod:`eugo_dask.timed`: a real
scheduler, a CPU worker with the machine's threads and a worker per GPU, every task sleeping its
estimate) dilated so the bound takes S seconds, and prints the achieved makespan / bound beside
the simulated one (minutes: about 80 runs of 2 to 20 S each).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from typing import Any

import _common
import dask
import dask.array as da
import numpy as np

from eugo_dask import explain
from eugo_dask.config import read_ahead
from eugo_dask.pace import copies_ahead
from eugo_dask.schedule import Costs, Machine, lower_bound, simulate
from eugo_dask.timed import run_timed

PROFILE = {"base": "h200", "cpu": "server-x86"}
LINK = {"h2d_bytes_per_s": 8.3e9, "d2h_bytes_per_s": 4.0e9, "latency_s": 1e-5}
MACHINES = [Machine(cpu_threads=32, gpus=1, name="32c+1g", **LINK),
            Machine(cpu_threads=8, gpus=4, name="8c+4g", **LINK)]
#: (label, policy, copies, the plan's eugo.dispatch)
POLICIES = [("static", "static", "link", "dual"), ("static-slot", "static", "slot", "dual"),
            ("all-cpu", "all-cpu", "link", "dual"), ("all-gpu", "all-gpu", "link", "dual"),
            ("dmda", "dmda", "link", "dual"), ("spill", "spill", "slot", "dual"),
            ("dual", "dual", "link", "dual"), ("eugo", "static", "link", "balanced")]


def graphs(scale: int, store: str) -> dict[str, Callable[[], Any]]:
    """Each graph built when called; ``scale`` 1 for the full sizes, 2 for a quarter of them."""
    rng = da.random.default_rng(0)

    def matmul_mean() -> Any:
        n = 8192 // scale
        a = rng.random((n, n), chunks=1024, dtype=np.float32)
        return da.exp(da.sin(a @ a)).mean()

    def seed_elementwise() -> Any:
        n = 16384 // scale
        x = rng.random((n, 2 * n), chunks=2048, dtype=np.float32)
        return da.exp(-x * x) * da.sin(x)

    def fft_projection() -> Any:
        n = 8192 // scale
        x = rng.random((n, 4096), chunks=(1024, 4096), dtype=np.float32)
        spectrum = da.fft.rfft(x, axis=1)
        low = spectrum[:, :1024]
        filtered = da.fft.irfft(low, n=2048, axis=1).astype(np.float32)
        basis = rng.random((2048, 256), chunks=(2048, 256), dtype=np.float32)
        return (filtered @ basis).std(axis=0)

    def stencil() -> Any:
        n = 16384 // scale
        x = rng.random((n, n), chunks=2048, dtype=np.float32)
        smooth = x.map_overlap(lambda b: (b[:-2, 1:-1] + b[2:, 1:-1] + b[1:-1, :-2]
                                          + b[1:-1, 2:]) * 0.25,
                               depth=1, boundary="none", trim=False,
                               chunks=(2046, 2046), dtype=np.float32)
        return da.sqrt(smooth * smooth + 1).sum(axis=0)

    def anomaly() -> Any:
        days = 3600 // scale
        field = rng.random((days, 180, 360), chunks=(days // 10, 180, 360), dtype=np.float32)
        years = field.reshape(10, days // 10, 180, 360)
        climatology = years.mean(axis=0)
        return (years - climatology).std(axis=(0, 1))

    def tensordot_chain() -> Any:
        n = 4096 // scale
        a = rng.random((n, n), chunks=512, dtype=np.float32)
        b = rng.random((n, n), chunks=512, dtype=np.float32)
        return da.tanh(da.tensordot(da.tensordot(a, b, axes=1), a, axes=1)).sum()

    def zarr_read() -> Any:
        return (da.log1p(da.from_zarr(store) ** 2) * 3).mean(axis=0)

    def tall_skinny_qr() -> Any:
        rows = 2**21 // scale
        x = rng.random((rows, 128), chunks=(rows // 32, 128), dtype=np.float32)
        q, r = da.linalg.qr(x)
        return (q * 2).sum(axis=0) + r.sum()

    return {"matmul exp/sin mean": matmul_mean, "seed elementwise": seed_elementwise,
            "rfft low-pass matmul std": fft_projection, "map_overlap stencil": stencil,
            "groupby anomaly std": anomaly, "tensordot chain": tensordot_chain,
            "zarr read transform mean": zarr_read, "tall-skinny QR": tall_skinny_qr}


def zarr_store(directory: str, scale: int) -> str:
    """An 8192² float32 zarr array (a quarter of it with ``scale`` 2) in 1024² chunks."""
    n = 8192 // scale
    path = f"{directory}/field.zarr"
    da.random.default_rng(2).random((n, n), chunks=1024, dtype=np.float32).to_zarr(path)
    return path


def costs_of(collection: Any, dispatch: str = "dual", machine: Machine | None = None) -> Costs:
    """The model of ``collection``'s plan under ``eugo.dispatch`` (dual: the static placement,
    its dual tasks marked, which static ignores; balanced: for ``machine``)."""
    with dask.config.set({"eugo.profile": PROFILE, "eugo.device": "none",
                          "eugo.dispatch": dispatch}):
        plan = explain(collection, machine=machine)
    if plan.schedule is None:
        raise SystemExit(f"{len(plan)} tasks: more than explain() simulates")
    return plan.schedule.costs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the data")
    parser.add_argument("--json", metavar="FILE", help="write one record per line set")
    parser.add_argument("--timed", metavar="S", type=float,
                        help="also run each schedule on the timed cluster, the bound dilated to S s")
    parser.add_argument("--graphs", metavar="NAMES",
                        help="only the graphs whose names contain one of these (comma-separated)")
    parser.add_argument("--policies", metavar="LABELS",
                        help="only these policies (comma-separated labels)")
    args = _common.parse_args(parser, argv)
    policies = [p for p in POLICIES if not args.policies or p[0] in args.policies.split(",")]
    if args.timed:  # (each timed run starts and stops a cluster: its INFO lines are noise here)
        import logging

        logging.getLogger("distributed").setLevel(logging.ERROR)
    scale = 2 if args.quick else 1
    ahead_setting = read_ahead()  # eugo.read-ahead
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as directory:
        built = {name: build for name, build in graphs(scale, zarr_store(directory, scale)).items()
                 if not args.graphs or any(part in name for part in args.graphs.split(","))}
        width = 26 if args.timed else 17
        print(f"{'graph':<26} {'machine':<7} {'tasks':>6} {'bound':>9} {'mixed':>5}  "
              + "  ".join(f"{label:>{width}}" for label, *_ in policies)
              + ("\n(simulated; in brackets: achieved on the timed cluster)" if args.timed else ""))
        for name, build in built.items():
            start = time.perf_counter()
            collection = build()
            costs = costs_of(collection)
            # (the graph's tasks: the model adds a value for chunks embedded in device tasks)
            tasks = sum(1 for k in costs.keys if not (isinstance(k, tuple) and k[0] == "eugo-embedded"))
            for machine in MACHINES:
                bound = lower_bound(costs, machine)
                balanced = (costs_of(collection, "balanced", machine)
                            if any(p[3] == "balanced" for p in policies) else None)
                cells = []
                for label, policy, copies, dispatch in policies:
                    plan_costs = balanced if dispatch == "balanced" and balanced else costs
                    # (copies on the links run at most `ahead` device tasks ahead, as eugo's
                    # scheduler plugin holds them)
                    ahead = copies_ahead(ahead_setting, machine.gpus) if (
                        copies == "link" and ahead_setting is not None) else None
                    run = simulate(plan_costs, machine, policy,  # type: ignore[arg-type]
                                   copies=copies, ahead=ahead)
                    ratio = run.makespan_s / bound.seconds
                    cells.append(f"{run.makespan_s * 1e3:8.1f} ms {ratio:5.2f}x")
                    timed = None
                    if args.timed:
                        timed = run_timed(plan_costs, run, dilation=args.timed / bound.seconds,
                                          copies=copies,  # type: ignore[arg-type]
                                          ahead=ahead).makespan_s
                        cells[-1] += f" ({timed / bound.seconds:5.2f}x)"
                    records.append({
                        "timed_s": timed,
                        "graph": name, "machine": machine.name, "policy": label,
                        "makespan_s": run.makespan_s, "bound_s": bound.seconds,
                        "mixed": bound.mixed, "bound_method": bound.method,
                        "busy_cpu": run.busy_fraction("cpu"),
                        "busy_gpu": run.busy_fraction("gpu"), "gpu_tasks": run.gpu_tasks,
                        "tasks": tasks})
                print(f"{name[:26]:<26} {machine.name:<7} {tasks:>6} "
                      f"{bound.seconds * 1e3:6.1f} ms {'yes' if bound.mixed else 'no':>5}  "
                      + "  ".join(cells), flush=True)
            print(f"{'':<26} (planned and simulated in {time.perf_counter() - start:.1f} s)")
    _summary(records, policies)
    if args.json:
        with open(args.json, "w") as out:
            json.dump(records, out, indent=1)


def _summary(records: list[dict[str, Any]], policies: list[tuple[str, str, str, str]]) -> None:
    """The worst ratio to the bound of each policy; where the bound uses both kinds of device,
    dmda, dual and eugo against static; copies off the GPU slot against in it; eugo against the
    better of all-CPU and all-GPU, and how busy each kind of device was under eugo where the
    bound uses both (of the policies run). Timed figures beside where they were run."""
    labels = [label for label, *_ in policies]
    timed = any(r["timed_s"] is not None for r in records)

    def worst(label: str, field: str) -> str:
        return f"{max(r[field] / r['bound_s'] for r in records if r['policy'] == label):.2f}x"

    print("\nworst makespan / bound, by policy:", ", ".join(
        f"{label} {worst(label, 'makespan_s')}" + (f" (timed {worst(label, 'timed_s')})"
                                                   if timed else "") for label in labels))
    key = {(r["graph"], r["machine"], r["policy"]): r for r in records}
    everywhere = sorted({(g, m) for g, m, _ in key})
    mixed = sorted({(g, m) for (g, m, _), r in key.items() if r["mixed"]})
    fields = ["makespan_s", "timed_s"] if timed else ["makespan_s"]
    for slower, faster, where in (("static", "dmda", "mixed"), ("static", "dual", "mixed"),
                                  ("static", "eugo", "mixed"), ("static-slot", "static", "all")):
        rows = mixed if where == "mixed" else everywhere
        for field in fields:
            gains = [key[(g, m, slower)][field] / key[(g, m, faster)][field]
                     for g, m in rows if (g, m, slower) in key and (g, m, faster) in key]
            if gains:
                print(f"{slower} / {faster} on {len(gains)} graph x machine ({where}"
                      f"{', timed' if field == 'timed_s' else ''}): "
                      f"{min(gains):.2f}x to {max(gains):.2f}x")
    if {"eugo", "all-cpu", "all-gpu"} <= set(labels):
        for field in fields:
            against = [key[(g, m, "eugo")][field] / min(key[(g, m, "all-cpu")][field],
                                                         key[(g, m, "all-gpu")][field])
                       for g, m in everywhere]
            print(f"eugo / the better of all-cpu and all-gpu"
                  f"{' (timed)' if field == 'timed_s' else ''}: {min(against):.2f}x to "
                  f"{max(against):.2f}x")
    if "eugo" in labels and mixed:
        busy = [(key[(g, m, "eugo")]["busy_cpu"], key[(g, m, "eugo")]["busy_gpu"]) for g, m in mixed]
        print(f"eugo where the bound is mixed: CPU busy {min(c for c, _ in busy):.0%} to "
              f"{max(c for c, _ in busy):.0%}, GPU busy {min(g for _, g in busy):.0%} to "
              f"{max(g for _, g in busy):.0%} (simulated)")


if __name__ == "__main__":
    main()
