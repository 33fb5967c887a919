"""eugo-dask: put each chunk task of a dask.array graph on the GPU only where it pays.

>>> import dask, dask.array as da
>>> from eugo_dask import eugo, explain
>>> a = da.random.default_rng(0).random((4096, 4096), chunks=1024, dtype="float32")
>>> with dask.config.set(optimizations=[eugo]):   # doctest: +SKIP
...     result = (a @ a.T).sum().compute()

Importing this package registers the ``eugo.*`` config defaults and the bridge that runs the
``optimizations`` config list (see :mod:`eugo_dask.array_optimize`; in array-expression mode,
:mod:`eugo_dask.array_expressions`); with that list empty no graph changes. CuPy is imported
only when a CuPy device is asked for.
"""

from eugo_dask._version import __version__
from eugo_dask.array_expressions import install_expression_hook
from eugo_dask.array_optimize import bridge, install_bridge
from eugo_dask.config import Settings, load_profile, read_settings, register_defaults
from eugo_dask.devices import device_stats, reset_device_stats
from eugo_dask.devices.emulated import EmulatedDeviceArray, EmulatedOutOfMemoryError
from eugo_dask.optimization import eugo, explain
from eugo_dask.plan import Decision, Plan
from eugo_dask.profile import PRESETS, Profile, ProfileError
from eugo_dask.ran import PrefixRan, RanReport, what_ran

register_defaults()
install_bridge()
install_expression_hook()


__all__ = [
    "__version__",
    "PRESETS",
    "Decision",
    "EmulatedDeviceArray",
    "EmulatedOutOfMemoryError",
    "Plan",
    "PrefixRan",
    "Profile",
    "ProfileError",
    "RanReport",
    "Settings",
    "bridge",
    "device_stats",
    "eugo",
    "explain",
    "load_profile",
    "read_settings",
    "reset_device_stats",
    "what_ran",
]
