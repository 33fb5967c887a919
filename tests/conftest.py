"""Shared fixtures: settings that run every GPU path on the emulated device."""

from __future__ import annotations

import dask
import pytest

import eugo_dask

#: The seed's machine: an H200 beside a server-class CPU (both from presets, no measurement).
H200_SERVER = {"base": "h200", "cpu": "server-x86"}


@pytest.fixture
def emulated():
    """eugo on, emulated device, every device-capable task offloaded; counters reset."""
    with dask.config.set(
        {
            "optimizations": [eugo_dask.eugo],
            "eugo.device": "emulated",
            "eugo.min-speedup": 0,
            "eugo.profile": H200_SERVER,
        }
    ):
        eugo_dask.reset_device_stats()
        yield
    eugo_dask.reset_device_stats()


@pytest.fixture
def h200_server():
    """Plan under the h200 preset with the server-class CPU, default min-speedup, on a started
    device (as on a worker that ran GPU tasks before: presets charge a device's first use,
    which a cold device pays, see ``cold_device`` in test_plan)."""
    from eugo_dask import runtime

    with dask.config.set({"eugo.device": "emulated", "eugo.profile": H200_SERVER}):
        runtime.get_device("emulated")
        yield


def pytest_terminal_summary(terminalreporter):
    """After a run of tests/test_docs.py: how many snippets of the pages were not run, and why."""
    ran = (getattr(report, "nodeid", "") for reports in terminalreporter.stats.values()
           for report in reports)
    if any(nodeid.startswith("tests/test_docs.py") for nodeid in ran):
        from tests.snippets import skipped_summary

        terminalreporter.write_line(skipped_summary())
