"""What runs inside rewritten tasks: the device path, every kind of fallback and what it
reports, copies back whatever device a value is on, and receiving device arrays safely."""

from __future__ import annotations

import logging

import dask
import numpy as np
import pytest

import eugo_dask
from eugo_dask.devices.emulated import EmulatedDeviceArray
from eugo_dask.runtime import DeviceCall, get_device, to_device, to_host, why_no_device


@pytest.fixture
def emulated_process():
    with dask.config.set({"eugo.device": "emulated"}):
        eugo_dask.reset_device_stats()
        yield get_device("emulated")
    eugo_dask.reset_device_stats()


def test_device_path_runs_on_device_arrays(emulated_process):
    seen = []

    def func(x):
        seen.append(type(x))
        return x * 2

    call = DeviceCall(func, "emulated", "double")
    out = call(np.arange(4.0))
    assert seen == [EmulatedDeviceArray] and isinstance(out, EmulatedDeviceArray)
    np.testing.assert_array_equal(to_host(out, "emulated"), np.arange(4.0) * 2)
    stats = eugo_dask.device_stats()
    assert (stats["tasks"], stats["h2d_count"], stats["d2h_count"], stats["fallbacks"]) == (1, 1, 1, 0)


def test_a_function_that_refuses_device_arrays_falls_back(emulated_process):
    def needs_numpy(x):
        return np.asarray(x) + 1  # implicit conversion, refused as CuPy refuses it

    out = DeviceCall(needs_numpy, "emulated", "needs-numpy")(np.arange(3.0))
    assert type(out) is np.ndarray and out.tolist() == [1.0, 2.0, 3.0]
    assert eugo_dask.device_stats()["fallback_reasons"] == {"unsupported on device: TypeError": 1}


def test_masked_chunks_run_their_cpu_path_and_say_so(emulated_process):
    data = np.ma.masked_greater(np.arange(6.0), 3)
    out = DeviceCall(np.exp, "emulated", "exp")(data)
    assert isinstance(out, np.ma.MaskedArray) and out.mask.tolist() == data.mask.tolist()
    stats = eugo_dask.device_stats()
    assert stats["tasks"] == 0 and stats["h2d_count"] == 0
    assert stats["fallback_reasons"] == {"host-only chunk: MaskedArray": 1}


def _negative_power(x):
    return np.power(x, -1)  # on integers: NumPy's ValueError, wherever it runs


_OWN_ERROR = ("the task's own error, raised to the caller as plain Dask raises it; no fallback "
              "counted")


def _eugo_log(caplog):
    return [(r.name, r.levelname, r.getMessage()) for r in caplog.records
            if r.name.startswith("eugo_dask.runtime")]


def test_an_error_of_the_task_itself_is_raised_as_it_is_and_is_no_fallback(emulated_process,
                                                                             caplog):
    # it raised on the device, ran its CPU path, raised again: the log said "power tasks fell
    # back to the CPU (unsupported on device: ValueError: ...)", a fallback was counted, and
    # the error raised was chained to the device's ("During handling of the above exception")
    from eugo_dask import runtime

    runtime._own_error_prefixes.discard("power")
    caplog.set_level(logging.DEBUG, logger="eugo_dask.runtime")
    for _ in range(2):
        with pytest.raises(ValueError, match="Integers to negative integer powers") as raised:
            DeviceCall(_negative_power, "emulated", "power")(np.arange(1, 4))
        assert raised.value.__context__ is None and raised.value.__cause__ is None
    message = f"eugo: a task of power raised ValueError on the device and again on its CPU path: {_OWN_ERROR}"
    assert _eugo_log(caplog) == [
        ("eugo_dask.runtime", "INFO", f"{message} (later ones at DEBUG on eugo_dask.runtime.tasks):"
                                      " Integers to negative integer powers are not allowed."),
        ("eugo_dask.runtime.tasks", "DEBUG",
         f"{message}: Integers to negative integer powers are not allowed.")]
    stats = eugo_dask.device_stats()
    assert (stats["tasks"], stats["fallbacks"], stats["fallback_reasons"]) == (0, 0, {})
    assert not any(prefix == "power" for prefix, _ in runtime.ledger.tasks)  # nothing ran


def test_a_task_that_raises_on_its_cpu_path_after_a_fallback_says_why_it_ran_there(
        emulated_process, caplog):
    from eugo_dask import runtime

    def refuses_device_arrays(x):
        return np.power(np.asarray(x), -1)  # TypeError on the device, ValueError on the host

    runtime._own_error_prefixes.discard("refusing")
    caplog.set_level(logging.DEBUG, logger="eugo_dask.runtime")
    with pytest.raises(ValueError, match="Integers to negative integer powers"):
        DeviceCall(refuses_device_arrays, "emulated", "refusing")(np.arange(1, 4))
    assert _eugo_log(caplog) == [(
        "eugo_dask.runtime", "INFO",
        "eugo: a task of refusing raised ValueError on its CPU path (run for unsupported on "
        f"device: TypeError): {_OWN_ERROR} (later ones at DEBUG on eugo_dask.runtime.tasks): "
        "Integers to negative integer powers are not allowed.")]
    assert eugo_dask.device_stats()["fallbacks"] == 0


def test_no_device_on_this_worker_is_a_fallback_with_its_reason():
    with dask.config.set({"eugo.device": "none"}):
        eugo_dask.reset_device_stats()
        out = DeviceCall(np.sin, "emulated", "sin")(np.zeros(3))
        assert why_no_device("emulated") == "eugo.device is 'none' on this worker"
    assert out.tolist() == [0.0, 0.0, 0.0]
    assert eugo_dask.device_stats()["fallback_reasons"] == {
        "no device: eugo.device is 'none' on this worker": 1}


def test_invalid_worker_setting_uses_no_device_and_says_why():
    with dask.config.set({"eugo.device": "gpu"}):
        eugo_dask.reset_device_stats()
        assert DeviceCall(np.sin, "emulated", "sin")(np.zeros(2)).tolist() == [0.0, 0.0]
        reason = why_no_device("emulated")
    assert reason.startswith("invalid setting: eugo.device must be one of")
    assert list(eugo_dask.device_stats()["fallback_reasons"]) == [f"no device: {reason}"]


def test_a_rerouted_task_reads_device_inputs_on_its_cpu_path(emulated_process):
    x = to_device(np.arange(3.0), "emulated")  # made on the device by an earlier GPU task
    call = DeviceCall(np.cos, "emulated", "cos", cpu_only=True)
    out = call(x)
    assert type(out) is np.ndarray and np.allclose(out, np.cos(np.arange(3.0)))
    assert eugo_dask.device_stats()["fallbacks"] == 0  # re-routed is the plan, not a fallback


def test_zero_d_device_results_take_the_cpu_path(emulated_process):
    # NumPy returns a scalar or a 0-d array depending on the function; CuPy always a 0-d
    # device array: only the CPU path knows which, so a 0-d device result is not kept
    out = DeviceCall(np.squeeze, "emulated", "squeeze")(np.full((1,), 2))
    assert type(out) is np.ndarray and out.ndim == 0
    assert eugo_dask.device_stats()["fallback_reasons"] == {
        "unsupported on device: ZeroDimensionalResult": 1}


def test_to_host_brings_back_arrays_of_any_device_whatever_the_setting(emulated_process):
    x = to_device(np.arange(3.0), "emulated")
    with dask.config.set({"eugo.device": "none"}):
        value = to_host({"a": [x, 1]}, "cupy")
    assert type(value["a"][0]) is np.ndarray and value["a"][1] == 1
