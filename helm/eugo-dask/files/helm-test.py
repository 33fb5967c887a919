"""`helm test`: connect, wait for the workers, run a computation; with GPU workers, check that
eugo put work on them (GPU tasks ran on GPU workers, per the scheduler plugin) and, where the
chart alone decides it, that the scheduler planned with the cluster's profile (this client leaves
eugo.profile at auto)."""

import os
import sys
import time

import dask
import dask.array as da
import numpy as np
from distributed import Client

import eugo_dask

address = os.environ["DASK_SCHEDULER_ADDRESS"]
workers = int(os.environ.get("EUGO_TEST_WORKERS", "1"))
gpu = os.environ.get("EUGO_TEST_GPU", "false").lower() == "true"
timeout = float(os.environ.get("EUGO_TEST_TIMEOUT", "300"))
expected_profile = os.environ.get("EUGO_TEST_PROFILE")

with Client(address, timeout=timeout) as client:
    client.wait_for_workers(workers, timeout=timeout)
    print(f"connected to {address}: {len(client.scheduler_info()['workers'])} workers")
    data = np.random.default_rng(0).random((600, 400))
    x = da.from_array(data, chunks=200)
    expected = (np.tanh(data @ data.T) + 1).sum(axis=0)
    settings = {"optimizations": [eugo_dask.eugo]}
    if gpu:
        settings["eugo.min-speedup"] = 0  # every task that can run on a device does
    with dask.config.set(settings):
        result = (np.tanh(x @ x.T) + 1).sum(axis=0).compute()
    np.testing.assert_allclose(result, expected, rtol=1e-6)
    if gpu:
        # workers report what their GPU tasks did with their heartbeats: wait for the reports
        deadline = time.monotonic() + 60
        while True:
            summary = client.run_on_scheduler(
                lambda dask_scheduler: dask_scheduler.plugins["eugo"].summary())
            on_gpu = sum(summary["tasks"].get("gpu", {}).values())
            if on_gpu or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        print(f"eugo: {on_gpu} tasks ran on a GPU, as the workers report")
        if not on_gpu:
            problems = {**summary["workers_without_device"], **summary["invalid_settings"]}
            sys.exit(f"no GPU task ran on a device; workers report: {problems or 'nothing'}")
        profile = summary["plans"][-1]["profile"]
        print(f"eugo: the scheduler planned with profile {profile}")
        if expected_profile and profile != expected_profile:
            sys.exit(f"the scheduler planned with {profile}, not the cluster's {expected_profile}")
    print("ok")
