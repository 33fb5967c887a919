"""Worker preload for tests: this worker's emulated device takes 50 ms per GPU task, a device
slower than the reads that feed it, whatever else the machine is doing."""

import contextlib
import time

import eugo_dask.devices.emulated

SECONDS = 0.05


def dask_setup(worker):
    scope = eugo_dask.devices.emulated.EmulatedDevice._scope

    @contextlib.contextmanager
    def slow_scope(self, ordinal):
        with scope(self, ordinal) as (stamp, elapsed, synchronise):
            def slow_synchronise():
                time.sleep(SECONDS)
                return synchronise()

            yield stamp, elapsed, slow_synchronise

    eugo_dask.devices.emulated.EmulatedDevice._scope = slow_scope
