"""The emulated device behaves like CuPy where placement depends on it; counters count."""

from __future__ import annotations

import dask
import numpy as np
import pytest

from eugo_dask import EmulatedDeviceArray, EmulatedOutOfMemoryError, device_stats, reset_device_stats
from eugo_dask.devices import resolve_device_name
from eugo_dask.emulated import EmulatedDevice
from eugo_dask.runtime import get_device


@pytest.fixture
def device():
    reset_device_stats()
    yield EmulatedDevice(10**6)
    reset_device_stats()


def test_numpy_calls_dispatch_and_stay_on_device(device):
    x = device.to_device(np.arange(12.0).reshape(3, 4))
    for result in (np.sin(x), x + 1, x @ x.T, np.sum(x, axis=0), np.concatenate([x, x]),
                   np.where(x > 3, x, 0), x.T, x[1:], x.reshape(4, 3), np.fft.fft(x)):
        assert isinstance(result, EmulatedDeviceArray)
    assert float(np.sum(x).get()) == 66.0


def test_implicit_conversion_raises_like_cupy(device):
    x = device.to_device(np.ones(3))
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(x)
    with pytest.raises(TypeError, match="does not mix host and device arrays"):
        x + np.ones(3)


def test_capacity_and_release(device):
    a = device.to_device(np.ones(100_000))  # 800 kB of 1 MB
    with pytest.raises(EmulatedOutOfMemoryError, match="Out of memory allocating"):
        device.to_device(np.ones(50_000))
    del a
    b = device.to_device(np.ones(50_000))  # freed memory is reusable
    assert device.used_bytes == b.nbytes


def test_counters(device):
    x = device.to_device(np.ones(10))
    device.to_device(np.ones(5, dtype="f4"))
    device.to_host(x)
    stats = device_stats()
    assert (stats["h2d_count"], stats["h2d_bytes"]) == (2, 80 + 20)
    assert (stats["d2h_count"], stats["d2h_bytes"]) == (1, 80)
    reset_device_stats()
    assert device_stats()["h2d_count"] == 0


def test_resolve_device_names():
    assert resolve_device_name("none") is None
    assert resolve_device_name("emulated") == "emulated"
    try:
        import cupy  # noqa: F401
    except ImportError:
        assert resolve_device_name("auto") is None  # no CuPy: nothing to offload to
    with pytest.raises(ValueError, match="eugo.device must be one of"):
        resolve_device_name("tpu")


def test_emulated_capacity_from_config():
    with dask.config.set({"eugo.emulated.memory-limit": "1 kiB"}):
        dev = get_device("emulated")
        assert dev.memory_limit_bytes == 1024


def test_pickled_device_array_arrives_on_device():
    import pickle

    dev = get_device("emulated")
    x = dev.to_device(np.arange(3.0))
    with dask.config.set({"eugo.device": "emulated"}):  # a process that holds device arrays
        y = pickle.loads(pickle.dumps(x))
    assert isinstance(y, EmulatedDeviceArray)
    np.testing.assert_array_equal(y.get(), np.arange(3.0))


@pytest.mark.parametrize("setting", ["none", "auto"])
def test_device_array_arrives_as_host_array_where_no_device(setting):
    # a CPU worker (or a retiring GPU worker's peer) receives what the device array carried
    import pickle

    x = get_device("emulated").to_device(np.arange(3.0))
    with dask.config.set({"eugo.device": setting}):
        y = pickle.loads(pickle.dumps(x))
    assert type(y) is np.ndarray
    np.testing.assert_array_equal(y, np.arange(3.0))


def test_device_array_arrives_as_host_array_when_the_device_is_full():
    import pickle

    x = get_device("emulated").to_device(np.arange(1000.0))
    reset_device_stats()
    with dask.config.set({"eugo.device": "emulated", "eugo.emulated.memory-limit": 100}):
        y = pickle.loads(pickle.dumps(x))
    assert type(y) is np.ndarray and y.sum() == np.arange(1000.0).sum()
    assert device_stats()["fallback_reasons"] == {"device error on receive: out of memory": 1}
