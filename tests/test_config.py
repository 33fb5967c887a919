"""Config defaults, their schema twin, and clear errors for bad values."""

from __future__ import annotations

import decimal
import os
import pickle
import re
import subprocess
import sys

import dask
import dask.array as da
import jsonschema
import numpy as np
import pytest

import eugo_dask
import eugo_dask.array_optimize
from eugo_dask.config import _load_yaml, read_settings, schema
from eugo_dask.profile import ProfileError


def _keys(tree, prefix=""):
    out = set()
    for k, v in tree.items():
        out.add(prefix + k)
        if isinstance(v, dict):
            out |= _keys(v, prefix + k + ".")
    return out


def _schema_keys(node, prefix=""):
    out = set()
    for k, v in node.get("properties", {}).items():
        out.add(prefix + k)
        out |= _schema_keys(v, prefix + k + ".")
    return out


def test_defaults_and_schema_in_sync():
    defaults = _load_yaml("eugo.yaml")
    assert _keys(defaults) == _schema_keys(schema())
    jsonschema.validate(defaults, schema())


def test_defaults_registered():
    assert dask.config.get("eugo.device") == "auto"
    assert dask.config.get("eugo.min-speedup") == 2.0
    assert dask.config.get("eugo.resource") == "GPU"


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("eugo.device", "gpu", r"eugo.device must be one of \['auto', 'cupy', 'emulated', 'none'\]; got 'gpu'"),
        ("eugo.min-speedup", -1, r"eugo.min-speedup must be a number >= 0; got -1"),
        ("eugo.min-speedup", "fast", r"eugo.min-speedup must be a number >= 0; got 'fast'"),
        ("eugo.min-speedup", "2", r"eugo.min-speedup must be a number >= 0; got '2'"),
        ("eugo.dual-from", "4", r"eugo.dual-from must be a number >= 0; got '4'"),
        ("eugo.min-speedup", float("nan"), r"eugo.min-speedup must be a number >= 0; got nan"),
        ("eugo.min-speedup", True, r"eugo.min-speedup must be a number >= 0; got True"),
        ("eugo.min-speedup", decimal.Decimal("sNaN"), r"eugo.min-speedup must be a number >= 0; got Decimal\('sNaN'\)"),
        ("eugo.min-speedup", "++inf", r"eugo.min-speedup must be a number >= 0; got '\+\+inf'"),
        ("eugo.device-memory-fraction", "inf", r"eugo.device-memory-fraction must be a number > 0 and <= 1; got 'inf'"),
        ("eugo.min-speedup", np.True_, r"eugo.min-speedup must be a number >= 0; got np.True_"),
        ("eugo.device-memory-fraction", 0, r"eugo.device-memory-fraction must be a number > 0 and <= 1; got 0"),
        ("eugo.device-memory-fraction", 1.5, r"eugo.device-memory-fraction must be a number > 0 and <= 1"),
        ("eugo.resource", "", r"eugo.resource must be a non-empty worker resource name"),
        ("eugo.emulated.memory-limit", "lots", r"eugo.emulated.memory-limit must be a positive byte count or a size like .16 GiB.; got .lots."),
        ("eugo.emulated.devices", 0, r"eugo.emulated.devices must be a whole number >= 1; got 0"),
        ("eugo.fft-plan-cache-size", -1, r"eugo.fft-plan-cache-size must be a whole number >= 0; got -1"),
        ("eugo.fft-plan-cache-memory", "huge", r"eugo.fft-plan-cache-memory must be a byte count or size like '1 GiB', or null; got 'huge'"),
        ("eugo.device-idle-release", "soon", r"eugo.device-idle-release must be a duration like '60s' \(> 0\) or null; got 'soon'"),
        ("eugo.device-idle-release", 0, r"eugo.device-idle-release must be a duration"),
        ("eugo.staging-buffer", "1 kiB", r"eugo.staging-buffer must be 0 or at least 64 KiB; got 1024"),
        ("eugo.staging-buffer", -5, r"eugo.staging-buffer must be a byte count or size like '1 GiB'; got -5"),
        ("eugo.pinned-results-min", "big", r"eugo.pinned-results-min must be auto, a byte count or size like '1 GiB'; got 'big'"),
        ("eugo.pinned-results-min", None, r"eugo.pinned-results-min must be auto, a byte count or size like '1 GiB'; got None"),
        ("eugo.register-in-place", True, r"eugo.register-in-place must be auto, a byte count or size like '1 GiB', or null; got True"),
        ("eugo.register-in-place", "-1 MiB", r"eugo.register-in-place must be auto, a byte count or size like '1 GiB', or null; got '-1 MiB'"),
        ("eugo.copy-threads", "many", r"eugo.copy-threads must be auto or a whole number from 1 to 64; got 'many'"),
        ("eugo.copy-threads", 0, r"eugo.copy-threads must be auto or a whole number from 1 to 64; got 0"),
        ("eugo.read-ahead", -1, r"eugo.read-ahead must be a whole number >= 0 \(blocks per GPU slot\) or null \(reads not paced\); got -1"),
        ("eugo.read-ahead", "2", r"eugo.read-ahead must be a whole number >= 0 .*; got '2'"),
        ("eugo.read-ahead", True, r"eugo.read-ahead must be a whole number >= 0 .*; got True"),
    ],
)
def test_bad_settings_raise_clear_errors(key, value, match):
    with dask.config.set({key: value}):
        with pytest.raises(ValueError, match=match):
            read_settings()


def test_bad_setting_fails_compute_not_silently():
    x = da.ones(10, chunks=5) + 1
    with dask.config.set({"optimizations": [eugo_dask.eugo], "eugo.device": "gpu"}):
        with pytest.raises(ValueError, match="eugo.device must be one of"):
            x.compute(scheduler="sync")


@pytest.mark.parametrize("device", ["none", "auto", "emulated"])
def test_profile_typo_raises_whatever_the_device(device):
    """``h300`` for ``h200`` is an error even where the device resolves to none and no profile
    would be loaded: in read_settings, in compute with eugo on, and in explain."""
    match = (r"eugo.profile must be auto, one of the presets \[.*'h200'.*\], a path to a "
             r"\.yaml/\.json profile, or a mapping; got 'h300'")
    x = da.ones(10, chunks=5) + 1
    with dask.config.set({"eugo.device": device, "eugo.profile": "h300"}):
        with pytest.raises(ProfileError, match=match):
            read_settings()
        with dask.config.set(optimizations=[eugo_dask.eugo]), pytest.raises(ProfileError, match=match):
            x.compute(scheduler="sync")
        with pytest.raises(ProfileError, match=match):
            eugo_dask.explain(x)


def test_environment_variables():
    code = "import eugo_dask, dask; print(dask.config.get('eugo.min-speedup'), dask.config.get('eugo.device'))"
    env = {**os.environ, "DASK_EUGO__MIN_SPEEDUP": "3.5", "DASK_EUGO__DEVICE": "emulated"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["3.5", "emulated"]


def test_infinity_from_the_environment_and_other_number_types():
    """Dask reads DASK_EUGO__MIN_SPEEDUP=inf as the text 'inf' (no Python literal spells
    infinity): it means infinity, as min-speedup's docs say; a Decimal or Fraction is a number."""
    import fractions

    code = ("import eugo_dask; from eugo_dask.config import read_settings; s = read_settings(); "
            "print(s.min_speedup, s.dual_from)")
    env = {**os.environ, "DASK_EUGO__MIN_SPEEDUP": "inf", "DASK_EUGO__DUAL_FROM": "Infinity"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["inf", "inf"]
    for value in (decimal.Decimal("2.5"), fractions.Fraction(5, 2)):
        with dask.config.set({"eugo.min-speedup": value}):
            assert read_settings().min_speedup == 2.5
    with dask.config.set({"eugo.min-speedup": "-inf"}), pytest.raises(
            ValueError, match=r"eugo.min-speedup must be a number >= 0; got '-inf'"):
        read_settings()


def test_device_settings_from_config():
    from eugo_dask.config import device_settings, emulated_device_count

    with dask.config.set({"eugo.device-memory-fraction": 0.5, "eugo.fft-plan-cache-size": 2,
                          "eugo.fft-plan-cache-memory": None, "eugo.device-idle-release": "2 minutes",
                          "eugo.staging-buffer": "16 MiB", "eugo.emulated.devices": 4}):
        settings = device_settings()
        assert emulated_device_count() == 4
    assert (settings.memory_fraction, settings.fft_plan_cache_size, settings.fft_plan_cache_bytes,
            settings.idle_release_s, settings.staging_bytes) == (0.5, 2, None, 120, 16 << 20)
    defaults = device_settings()
    assert (defaults.memory_fraction, defaults.fft_plan_cache_size, defaults.fft_plan_cache_bytes,
            defaults.idle_release_s, defaults.staging_bytes) == (0.8, 8, 1 << 30, 60, 8 << 20)


# Records every module that tries to import CuPy, and refuses each try so that CuPy never lands
# in sys.modules and every later try is seen too. Dask itself imports CuPy at ``import
# dask.array`` where it is installed (dask/array/chunk_types.py), so ``'cupy' in sys.modules``
# says nothing about eugo; what matters is that no eugo module tries.
_WATCH_CUPY_IMPORT = """
import json, sys, traceback
importers = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "cupy":
            frames = [f for f in traceback.extract_stack()[:-1]
                      if "importlib" not in f.filename and not f.filename.startswith("<frozen")]
            importers.append(frames[-1].filename)
            raise ModuleNotFoundError("No module named 'cupy' (refused by the test)")
        return None
sys.meta_path.insert(0, Watch())
import dask, dask.array as da
import eugo_dask, eugo_dask.plugin, eugo_dask.dashboard, eugo_dask.cli, eugo_dask.calibrate
for device in ("none", "emulated"):
    with dask.config.set({"optimizations": [eugo_dask.eugo], "eugo.device": device,
                          "eugo.profile": {"base": "h200", "cpu": "server-x86"}}):
        (da.ones(4, chunks=2) + 1).compute()
        eugo_dask.explain(da.ones(4, chunks=2) @ da.ones(4, chunks=2))
print(json.dumps(importers))
"""


def test_import_does_not_import_cupy():
    import json

    out = subprocess.run([sys.executable, "-c", _WATCH_CUPY_IMPORT], capture_output=True, text=True,
                         check=True)
    importers = json.loads(out.stdout)
    package = os.path.dirname(eugo_dask.__file__)
    assert not [f for f in importers if f.startswith(package)], importers
    # the watch works: it sees Dask's own attempt (made whether or not CuPy is installed)
    assert importers and importers[0].endswith(os.path.join("dask", "array", "chunk_types.py"))


def test_cupy_device_without_cupy_says_how_to_install():
    try:
        import cupy  # noqa: F401
    except ImportError:
        with dask.config.set({"eugo.device": "cupy"}):
            with pytest.raises(ImportError, match=r"pip install cupy-cuda12x \(or, from a checkout "
                                                  r"of eugo-dask, pip install -e '\.\[gpu\]'\)"):
                read_settings().resolved()
    else:  # pragma: no cover - machines with CuPy
        pytest.skip("CuPy is installed here")


def test_cluster_profile_first_usable_candidate(tmp_path):
    from eugo_dask.config import cluster_profile

    assert cluster_profile() is None  # unset by default
    calibrated = tmp_path / "calibrated.yaml"
    with dask.config.set({"eugo.cluster-profile": [str(calibrated), "l4"]}):
        assert cluster_profile() == "l4"  # the calibration has not written its file yet
        calibrated.write_text("base: t4\n")
        assert cluster_profile() == str(calibrated)


def test_a_bad_profile_mapping_raises_on_every_read():
    """Checking a profile mapping is remembered per process (it runs on every pass); an error
    is not: the second read of the same bad mapping raises as the first did."""
    bad = {"base": "h200", "link": {"h2d_bytes_per_s": -5}}
    with dask.config.set({"eugo.device": "emulated", "eugo.profile": bad}):
        for _ in range(2):
            with pytest.raises(ProfileError, match=r"link.h2d_bytes_per_s must be a positive number; got -5"):
                read_settings()
    good = {"base": "h200", "cpu": "server-x86"}
    with dask.config.set({"eugo.device": "emulated", "eugo.profile": good}):
        assert read_settings().profile == good


# ---------------------------------------------------------------------------------------------
# Keys eugo does not know: an error naming the closest known one, never a silent default
# ---------------------------------------------------------------------------------------------
_ALLOWED = r"; allowed: eugo\.device, eugo\.profile, .*eugo\.emulated\.memory-limit, eugo\.emulated\.devices$"


@pytest.mark.parametrize("key, closest", [
    ("eugo.devise", "eugo.device"),
    ("eugo.min_spedup", "eugo.min-speedup"),
    ("eugo.emulated.memory-limt", "eugo.emulated.memory-limit"),
    ("eugo.profiles", "eugo.profile"),
])
def test_a_misspelt_key_raises_naming_the_closest(key, closest):
    match = rf"^unknown setting {re.escape(key)} \(did you mean {re.escape(closest)}\?\)" + _ALLOWED
    x = da.ones(10, chunks=5) + 1
    with dask.config.set({key: "emulated"}):
        with pytest.raises(ValueError, match=match):
            read_settings()
        with dask.config.set(optimizations=[eugo_dask.eugo]):
            with pytest.raises(ValueError, match=match):  # on the client, as the graph is made
                x.compute(scheduler="sync")
            with pytest.raises(ValueError, match=match):  # as it is pickled for a scheduler
                pickle.dumps(eugo_dask.array_optimize.bridge)
        with pytest.raises(ValueError, match=match):
            eugo_dask.explain(x)
        from eugo_dask.config import worker_setting_problems

        assert any(re.match(match, p) for p in worker_setting_problems())


def test_a_key_far_from_any_names_none_and_lists_them_all():
    with dask.config.set({"eugo.zzz": 1}), pytest.raises(ValueError, match="^unknown setting eugo.zzz" + _ALLOWED):
        read_settings()
    with dask.config.set({"eugo.emulated": 3}), pytest.raises(
            ValueError, match=r"^eugo.emulated must be a mapping of eugo.emulated.memory-limit, "
                              r"eugo.emulated.devices; got 3$"):
        read_settings()


def test_every_known_spelling_is_accepted():
    """Underscores for hyphens (as Dask's config takes them), and settings whose values are
    mappings or lists (their own keys are values, not eugo's)."""
    with dask.config.set({"eugo.min_speedup": 3, "eugo.emulated.memory_limit": "1 GiB",
                          "eugo.device_memory_fraction": 0.5,
                          "eugo.profile": {"base": "h200", "cpu": "server-x86"},
                          "eugo.cluster-profile": [{"base": "t4"}, "l4"]}):
        settings = read_settings()
    assert (settings.min_speedup, settings.emulated_memory_limit, settings.device_memory_fraction,
            settings.profile) == (3, 1 << 30, 0.5, {"base": "h200", "cpu": "server-x86"})


_READ_SETTINGS = """
import eugo_dask
try:
    print(eugo_dask.read_settings().min_speedup)
except ValueError as e:
    print(e)
"""


@pytest.mark.parametrize("env, out", [
    ({"DASK_EUGO__MIN_SPEEDUP": "3.5", "DASK_EUGO__EMULATED__MEMORY_LIMIT": "1GiB"}, "3.5"),
    ({"DASK_EUGO__MIN_SPEDUP": "3.5"}, "unknown setting eugo.min_spedup (did you mean eugo.min-speedup?)"),
    ({"DASK_EUGO__EMULATED__DEVICE": "2"}, "unknown setting eugo.emulated.device (did you mean eugo.emulated.devices?)"),
])
def test_keys_from_the_environment_and_config_files(env, out, tmp_path):
    (tmp_path / "eugo.yaml").write_text("eugo:\n  device_memory_fraction: 0.5\n  emulated:\n    devices: 2\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("DASK_")}
    result = subprocess.run([sys.executable, "-c", _READ_SETTINGS], capture_output=True, text=True,
                            env={**base, "DASK_CONFIG": str(tmp_path), **env}, check=True, timeout=120)
    assert result.stdout.startswith(out), result


def test_explain_names_an_unknown_setting():
    x = da.ones(10, chunks=5) + 1
    with pytest.raises(TypeError, match=r"^unknown explain\(\) setting min_spedup \(did you mean "
                                        r"min_speedup\?\); allowed: device, profile, .*min_speedup"):
        eugo_dask.explain(x, min_spedup=0)
    assert eugo_dask.explain(x, min_speedup=0, device="emulated").gpu_keys  # the known ones work
