"""FLOPs and bytes of the cost model against hand counts, through the pass that reads them from
each task: matmul in every orientation, tensordot over several axes, einsum, created chunks,
reductions; and the seconds that follow from them under fixed presets."""

from __future__ import annotations

import dask
import dask.array as da
import numpy as np
import pytest

import eugo_dask
from eugo_dask import load_profile
from eugo_dask.cost_model import Op, Step, estimate_step, estimate_task
from eugo_dask.graph import ArraySpec

#: Fixed presets: the numbers below depend on nothing measured here.
PROFILE = {"base": "h200", "cpu": "server-x86"}
F8 = np.dtype("f8")


def host(shape, name, dtype="f8"):
    """A one-chunk host array of any size without allocating it (a broadcast view)."""
    return da.from_array(np.broadcast_to(np.ones((), dtype), shape), chunks=shape, name=name)


def decisions(collection):
    with dask.config.set({"eugo.device": "emulated", "eugo.profile": PROFILE}):
        return list(eugo_dask.explain(collection))


def work(collection, family):
    """The one task of ``family`` in ``collection``'s plan."""
    (d,) = [d for d in decisions(collection) if d.op == family]
    return d


@pytest.mark.parametrize("build, flops, nbytes", [
    # A is 300x200, B 200x100 (float64); bytes: what the task reads plus what it returns
    (lambda A, B: A @ B, 2 * 300 * 200 * 100, (300 * 200 + 200 * 100 + 300 * 100) * 8),
    # A.T @ A contracts A's long axis; A is read once although used twice
    (lambda A, B: A.T @ A, 2 * 200 * 300 * 200, (300 * 200 + 200 * 200) * 8),
    (lambda A, B: A @ A.T, 2 * 300 * 200 * 300, (300 * 200 + 300 * 300) * 8),
    # dot goes through tensordot, and Dask sums its (300, 1, 100) partial in the same task
    (lambda A, B: da.dot(A, B), 2 * 300 * 200 * 100 + 300 * 100,
     (300 * 200 + 200 * 100 + 300 * 100) * 8),
], ids=["A@B", "A.T@A", "A@A.T", "dot"])
def test_matmul_in_every_orientation(build, flops, nbytes):
    d = work(build(host((300, 200), "A"), host((200, 100), "B")), "matmul")
    assert d.flops == flops
    assert d.bytes == nbytes


def test_tall_and_skinny_gram_matrix():
    # X.T @ X with X chunks of (50000, 4): 2 * 4 * 50000 * 4 FLOPs, not a square product
    X = da.from_array(np.broadcast_to(np.ones((), "f8"), (200_000, 4)), chunks=(50_000, 4))
    partials = [d for d in decisions(X.T @ X) if d.op == "matmul"]
    assert len(partials) == 4
    for d in partials:
        # the partial product, then the sum of the (4, 1, 4) partials Dask keeps per chunk
        assert d.flops == 2 * 4 * 50_000 * 4 + 4 * 4
        assert d.device == "cpu"  # 1.6 MFLOP per chunk is not worth a copy


def test_tensordot_over_two_axes():
    a, b = host((10, 20, 30), "a"), host((20, 30, 40), "b")
    d = work(da.tensordot(a, b, axes=((1, 2), (0, 1))), "matmul")
    # the contraction, then Dask's sum over the (10, 1, 1, 40) partial
    assert d.flops == 2 * 10 * 40 * (20 * 30) + 10 * 40
    assert d.bytes == (10 * 20 * 30 + 20 * 30 * 40) * 8 + 10 * 40 * 8


def test_einsum_from_its_subscripts():
    c, e = host((30, 40), "c"), host((40, 50), "e")
    d = work(da.einsum("ij,jk->ik", c, e), "matmul")
    assert d.flops == 2 * 30 * 40 * 50 + 30 * 50
    assert d.bytes == (30 * 40 + 40 * 50) * 8 + 30 * 50 * 8


def test_weighted_mean_einsum_is_priced_by_its_subscripts():
    # what xarray's weighted().mean() builds: where > chunk_einsum > sum
    w = da.from_array(np.broadcast_to(np.ones((), "f8"), (1000, 2000)), chunks=(500, 1000))
    weights = da.from_array(np.broadcast_to(np.ones((), "f8"), (2000,)), chunks=1000)
    partials = [d for d in decisions(da.einsum("ij,j->i", da.where(w > 0, w, 0), weights))
                if d.op == "matmul"]
    assert partials
    for d in partials:
        assert d.flops < 3 * 500 * 1000 * 4  # a few flops per element, not a cube


def test_a_created_chunk_is_priced_at_its_own_size():
    # ones made inside the matmul task are made on the host and copied: their bytes, not the
    # result's, are what the copy moves
    d = work(da.ones((4000, 50), chunks=(4000, 50)) @ host((50, 60), "B"), "matmul")
    created, b, out = 4000 * 50 * 8, 50 * 60 * 8, 4000 * 60 * 8
    assert d.bytes == created + b + out
    profile = load_profile(PROFILE)
    expected_h2d = profile.link.latency_s + (created + b) / profile.link.h2d_bytes_per_s
    assert d.h2d_s == pytest.approx(expected_h2d, rel=0.2)


def test_random_chunk_fused_into_a_reduction_is_copied_at_its_size():
    x = da.random.default_rng(1).random((4000, 50), chunks=(2000, 50)).sum()
    with dask.config.set({"eugo.device": "emulated", "eugo.profile": PROFILE,
                          "eugo.min-speedup": 0}):
        plan = eugo_dask.explain(x)
    partials = [d for d in plan if d.detail == "_apply_random_func>sum"]
    assert len(partials) == 2
    profile = load_profile(PROFILE)
    for d in partials:
        assert d.bytes == 2000 * 50 * 8 + 8
        assert d.h2d_s == pytest.approx(profile.link.latency_s + 2000 * 50 * 8
                                        / profile.link.h2d_bytes_per_s)


def test_a_creation_fused_into_a_task_is_host_work_on_either_side():
    """A creation inside a task makes its chunk on the host wherever the task runs: its time is
    in the task's CPU and GPU seconds alike, and said apart (``host_s``) for the comparison."""
    profile = load_profile(PROFILE)
    chunk = ArraySpec((2000, 50), F8)
    make = Step(Op("creation", "_apply_random_func"), (), chunk)
    add = Step(Op("elementwise", "add", 2), (chunk, chunk), chunk)
    _, made_s, _ = estimate_step(make, chunk.size, F8, profile)
    alone = estimate_task([add], [chunk], chunk, profile)
    fused = estimate_task([make, add], [chunk], chunk, profile)
    assert alone.host_s == 0 and fused.host_s == pytest.approx(made_s) and made_s > 0
    assert fused.cpu_s - alone.cpu_s == pytest.approx(made_s)
    assert fused.gpu_s - alone.gpu_s == pytest.approx(made_s)


@pytest.mark.parametrize("axis, out_elements", [(None, 1), (0, 1000), (1, 1000)])
def test_reduction_reads_its_chunk_once(axis, out_elements):
    d = work(host((1000, 1000), "s").sum(axis=axis), "reduction")
    assert d.flops == 1000 * 1000
    assert d.bytes == 1000 * 1000 * 8 + out_elements * 8


def test_fft_flops_from_the_transformed_lengths():
    # a batch of 1-D transforms along the last axis: 5 |x| log2(L), L the transform length
    z = host((64, 4096), "z", dtype="c16")
    d = work(da.fft.fft(z, axis=-1), "fft")
    assert d.flops == pytest.approx(5 * 64 * 4096 * np.log2(4096))
    d2 = work(da.fft.fft2(host((1024, 1024), "z2", dtype="c16")), "fft")
    assert d2.flops == pytest.approx(5 * 1024 * 1024 * np.log2(1024 * 1024))


@pytest.mark.parametrize("known", ["left", "right", "neither", "left alone"])
def test_a_product_with_one_operand_unknown_is_priced_from_the_other_and_its_result(known):
    """The QR's Q blocks times R, R unknown: (65536, 128) @ ? -> (65536, 128) is 2 m n k with
    k = 128, not a 65536 x 65536 product (it was priced 512 times too high and its chain,
    17.9 s in makespan.py's tall-skinny QR, bound the schedule)."""
    profile = load_profile(PROFILE)
    m, k, n = 65536, 128, 256
    a, out = ArraySpec((m, k), F8), ArraySpec((m, n), F8)
    b = ArraySpec((k, n), F8)
    ins = {"left": (a,), "right": (b,), "neither": (), "left alone": (a,)}[known]
    step = Step(Op("matmul", "dot", 2), ins, None if known == "left alone" else out)
    if known == "neither":  # the result alone: its smaller side taken for the contraction
        k = min(m, n)
    if known == "left alone":  # the operand alone (the QR's case): a product with (k, k)
        n = k
    flops, _, _ = estimate_step(step, out.size, F8, profile)
    assert flops == pytest.approx(2.0 * m * n * k)


def test_step_seconds_follow_the_profile():
    profile = load_profile(PROFILE)
    a = ArraySpec((4096, 4096), F8)
    flops = 2.0 * 4096**3
    step = Step(Op("matmul", "matmul", 2), (a, a), a, flops)
    f, cpu_s, gpu_s = estimate_step(step, a.size, F8, profile)
    assert f == flops
    size = (flops / 2) ** (1 / 3)
    cpu_rate = profile.cpu.matmul_flops_per_s.float64 * size / (size + (profile.cpu.matmul_half_n or 32))
    assert cpu_s == pytest.approx(flops / cpu_rate, rel=1e-3)
    assert gpu_s < cpu_s / 10


def test_zero_sized_operands_do_not_crash():
    # QR/SVD pipelines make empty chunks; they must not divide by zero anywhere
    profile = load_profile(PROFILE)
    empty = ArraySpec((0,), F8)
    estimate = estimate_task([Step(Op("matmul", "dot", 2), (empty, empty), None)], [empty, empty],
                             ArraySpec((0, 0), F8), profile)
    assert estimate.flops == 0 and np.isfinite(estimate.cpu_s)


def test_zero_d_results_stay_on_the_host():
    x = host((1,), "one", dtype="i8")
    (d,) = [d for d in decisions(da.squeeze(x)) if d.shape == ()]
    assert d.device == "cpu" and "a 0-d result" in d.reason, d.reason


# ---------------------------------------------------------------------------------------------
# Copies priced per size
# ---------------------------------------------------------------------------------------------
MiB = 1 << 20
#: slow at 1 MiB, near the link from 64 MiB: what a calibration that found pinned results and
#: registration paying for large chunks writes
PER_SIZE = {"h2d": [{"bytes": MiB, "bytes_per_s": 1e9, "path": "direct"},
                    {"bytes": 64 * MiB, "bytes_per_s": 4.5e10, "path": "registered"}],
            "d2h": [{"bytes": MiB, "bytes_per_s": 1e9, "path": "direct"},
                    {"bytes": 64 * MiB, "bytes_per_s": 4.5e10, "path": "pinned"}]}


@pytest.mark.parametrize("name", eugo_dask.profile.PRESETS)
def test_presets_price_copies_at_their_one_rate_each_way(name):
    from eugo_dask.cost_model import estimate_d2h_seconds, estimate_h2d_seconds

    link = load_profile({"base": name, "cpu": "server-x86"}).link
    for nbytes in (8, MiB, 64 * MiB, 1 << 30):
        assert estimate_h2d_seconds(nbytes, load_profile({"base": name, "cpu": "server-x86"})) == \
            link.latency_s + nbytes / link.h2d_bytes_per_s
        assert estimate_d2h_seconds(nbytes, load_profile({"base": name, "cpu": "server-x86"})) == \
            link.latency_s + nbytes / link.d2h_bytes_per_s
    assert estimate_h2d_seconds(0, load_profile({"base": name, "cpu": "server-x86"})) == 0.0


def test_copies_are_priced_from_the_per_size_rates():
    from eugo_dask.cost_model import estimate_d2h_seconds, estimate_h2d_seconds

    profile = load_profile({**PROFILE, "link": {"copies_by_size": PER_SIZE, "latency_s": 0}})
    assert estimate_h2d_seconds(MiB, profile) == pytest.approx(MiB / 1e9)
    assert estimate_h2d_seconds(8 * MiB, profile) == pytest.approx(8 * MiB / 2.3e10)  # half way in log size
    assert estimate_d2h_seconds(1 << 30, profile) == pytest.approx((1 << 30) / 4.5e10)  # flat past the end
    one_way = load_profile({**PROFILE, "link": {"copies_by_size": {"h2d": PER_SIZE["h2d"]}}})
    assert estimate_d2h_seconds(MiB, one_way) == pytest.approx(1e-5 + MiB / 4.0e9)  # the link's rate back


def test_the_per_size_rate_flips_the_decision_where_it_should():
    """sin over a 64 MiB chunk stays on the CPU with the h200 preset's staged rates (8.3 and
    4.0 GB/s: its two copies cost 25 ms against 17 ms of CPU work) and goes to the GPU where
    the per-size rates say copies of that size run at 45 GB/s; a 1 MiB chunk, whose copies the
    same profile prices at 1 GB/s, stays on the CPU either way, now for a dearer copy."""
    def sin_of(mib, profile):
        x = host((mib * MiB // 8,), f"x{mib}")
        with dask.config.set({"eugo.device": "emulated", "eugo.profile": profile}):
            (d,) = [d for d in eugo_dask.explain(np.sin(x)) if d.op == "elementwise"]
        return d

    per_size = {**PROFILE, "link": {"copies_by_size": PER_SIZE}}
    assert sin_of(64, PROFILE).device == "cpu" and sin_of(64, per_size).device == "gpu"
    assert sin_of(64, per_size).h2d_s == pytest.approx(1e-5 + 64 * MiB / 4.5e10)
    small, small_per_size = sin_of(1, PROFILE), sin_of(1, per_size)
    assert small.device == small_per_size.device == "cpu"
    assert small_per_size.h2d_s > 5 * small.h2d_s
