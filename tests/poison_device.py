"""Worker preload for tests: this worker cannot rebuild device arrays (no device layer).

Any device array sent here would be unpickled through ``eugo_dask.devices.emulated._rebuild_emulated``;
this records the attempt and fails it, as a worker without CuPy would.
"""

import eugo_dask.devices.emulated


def dask_setup(worker):
    worker.eugo_device_arrays_received = received = []

    def refuse(data):
        received.append(getattr(data, "shape", None))
        raise ImportError("this worker has no device layer")

    eugo_dask.devices.emulated._rebuild_emulated = refuse
