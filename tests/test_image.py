"""The Dockerfile, without a Docker engine: hadolint, the user-creation line run against the
base image's account files, and the versions the images install against the ones CI tests."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
CONSTRAINTS = ROOT / "docker" / "constraints.txt"
UBUNTU_ETC = Path(__file__).parent / "fixtures" / "ubuntu-24.04-etc"
ACCOUNT_FILES = ("passwd", "group", "shadow", "gshadow")
HADOLINT = str(Path(sys.executable).with_name("hadolint"))


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped, as
    Docker reads them."""
    out, current = [], ""
    for line in text.splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not current):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, arguments = current.strip().partition(" ")
        out.append((keyword.upper(), arguments.strip()))
        current = ""
    return out


def user_creation_line() -> str:
    (line,) = [args for kw, args in instructions(DOCKERFILE.read_text()) if kw == "RUN" and "useradd" in args]
    return line


def pins(lines: Iterable[str]) -> dict[str, str]:
    return {m["name"].lower(): m["version"] for line in lines
            if (m := re.match(r"\s*(?P<name>[A-Za-z0-9_.-]+)\s*==\s*(?P<version>[^\s;#]+)", line))}


def test_hadolint_passes_and_would_report():
    result = subprocess.run([HADOLINT, str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    unpinned = "FROM ubuntu\nRUN apt-get update && apt-get install -y curl\n"
    result = subprocess.run([HADOLINT, "-"], input=unpinned, capture_output=True, text=True)
    assert result.returncode == 1 and "DL3008" in result.stdout  # the linter really runs


def test_images_run_tini_as_pid_1_and_user_1000():
    steps = instructions(DOCKERFILE.read_text())
    entrypoints = [args for kw, args in steps if kw == "ENTRYPOINT"]
    # not -g: SIGTERM to the whole process group killed the worker process beside its nanny,
    # instead of letting the nanny close it
    assert entrypoints == ['["tini", "--"]']
    assert [args for kw, args in steps if kw == "USER"][-1] == "1000:1000"
    assert [args.split()[-1] for kw, args in steps if kw == "FROM"] == ["eugo-dask", "eugo-dask-cuda"]


def _sigterm_under(entrypoint: list[str], tmp_path: Path) -> str:
    """Start a scheduler, then a `dask worker` under ``entrypoint`` (as the image runs the
    chart's args), send SIGTERM to the entrypoint as the kubelet does to PID 1, and return the
    worker's log once it has exited."""
    import time

    from .cluster import DASK_CLI, free_port

    port = free_port()
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    scheduler = subprocess.Popen([DASK_CLI, "scheduler", "--host", "127.0.0.1", "--port", str(port),
                                  "--dashboard-address", ":0"], env=env,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log_path = tmp_path / "worker.log"
    try:
        with open(log_path, "w") as log:
            worker = subprocess.Popen([*entrypoint, DASK_CLI, "worker",
                                       f"tcp://127.0.0.1:{port}", "--name", "w", "--nthreads", "1",
                                       "--dashboard-address", ":0"], env=env, stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 60
            while "Registered to" not in log_path.read_text():
                assert time.monotonic() < deadline and worker.poll() is None, log_path.read_text()
                time.sleep(0.2)
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=60)
    finally:
        scheduler.terminate()
        scheduler.wait(timeout=30)
    return log_path.read_text()


@pytest.mark.timeout(180)
@pytest.mark.skipif(not shutil.which("tini"), reason="needs tini (apt-get install tini, as the image does)")
def test_a_sigterm_under_the_images_init_lets_the_worker_close(tmp_path):
    """The kubelet's SIGTERM reaches tini, PID 1: with the image's `tini --` the nanny asks its
    worker to close, and the worker stops as Dask stops it (its plugins' teardown runs); with
    the former `tini -g --` the worker process was killed outright beside its nanny."""
    import json

    (entrypoint,) = [json.loads(args) for kw, args in instructions(DOCKERFILE.read_text()) if kw == "ENTRYPOINT"]
    log = _sigterm_under(entrypoint, tmp_path)
    assert "Nanny asking worker to close" in log and "Stopping worker at" in log, log
    assert "was killed by signal" not in log, log
    group = _sigterm_under(["tini", "-g", "--"], tmp_path)  # the check has teeth
    assert "was killed by signal 15" in group and "Stopping worker at" not in group, group


def run_in_fake_root(etc: Path, home: Path, script: str) -> subprocess.CompletedProcess:
    """Run ``script`` with ``sh -c`` (as Docker's RUN does) in a private mount namespace where
    ``etc`` is /etc and ``home`` is /home: the host's own files are never touched."""
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         'mount --bind "$1" /etc && mount --bind "$2" /home && exec sh -c "$3"', "_",
         str(etc), str(home), script],
        capture_output=True, text=True, timeout=60)


def fake_root(tmp_path: Path, *, with_ubuntu_user: bool) -> tuple[Path, Path]:
    etc, home = tmp_path / "etc", tmp_path / "home"
    shutil.copytree("/etc", etc, symlinks=True)  # login.defs, nsswitch.conf, skel as the host has
    for name in ACCOUNT_FILES:
        lines = (UBUNTU_ETC / name).read_text().splitlines(keepends=True)
        if not with_ubuntu_user:
            lines = [line for line in lines if not line.startswith("ubuntu:")]
        (etc / name).write_text("".join(lines))
    home.mkdir()
    if with_ubuntu_user:
        (home / "ubuntu").mkdir()
        (home / "ubuntu" / ".bashrc").write_text("# ubuntu's\n")
        os.chown(home / "ubuntu", 1000, 1000)
    return etc, home


needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare"),
    reason="needs root and unshare(1) for a private mount namespace (CI and dev machines run as root)")


@needs_root
@pytest.mark.parametrize("with_ubuntu_user", [True, False], ids=["ubuntu-24.04", "no-uid-1000"])
def test_user_creation_line_gives_uid_1000_to_dask(tmp_path, with_ubuntu_user):
    etc, home = fake_root(tmp_path, with_ubuntu_user=with_ubuntu_user)
    result = run_in_fake_root(etc, home, user_creation_line())
    assert result.returncode == 0, result.stderr
    passwd = (etc / "passwd").read_text().splitlines()
    assert [line for line in passwd if line.split(":")[2] == "1000"] == ["dask:x:1000:1000::/home/dask:/bin/bash"]
    group = (etc / "group").read_text().splitlines()
    assert [line for line in group if line.split(":")[2] == "1000"] == ["dask:x:1000:"]
    for name in ("shadow", "gshadow"):
        entries = [line.split(":")[0] for line in (etc / name).read_text().splitlines()]
        assert "dask" in entries and "ubuntu" not in entries, name
    stat = (home / "dask").stat()
    assert (stat.st_uid, stat.st_gid) == (1000, 1000)
    assert not (home / "ubuntu").exists()


@needs_root
def test_the_fixture_reproduces_the_base_images_uid_clash(tmp_path):
    """The line the Dockerfile had before fails on these account files, as it did on the image."""
    etc, home = fake_root(tmp_path, with_ubuntu_user=True)
    result = run_in_fake_root(etc, home, "useradd --uid 1000 --create-home --home-dir /home/dask dask")
    assert result.returncode != 0 and "UID 1000 is not unique" in result.stderr


def _supported_range(package: str) -> SpecifierSet:
    from packaging.requirements import Requirement

    text = (ROOT / "pyproject.toml").read_text()
    deps = text.split("dependencies = [\n", 1)[1].split("\n]", 1)[0]
    for line in deps.splitlines():
        line = line.strip().strip('",')
        if line and Requirement(line).name == package:
            return Requirement(line).specifier
    raise AssertionError(f"{package} is not a dependency")


def test_images_pin_a_dask_the_package_supports_and_ci_tests():
    image = pins(CONSTRAINTS.read_text().splitlines())
    for package in ("dask", "distributed"):
        assert image[package] in _supported_range(package), (
            f"docker/constraints.txt pins {package}=={image[package]}, outside what "
            f"pyproject.toml supports ({_supported_range(package)})")
    assert image["dask"] == image["distributed"], "the images must pin a matching pair"
    # dask-cuda's own pins (rapids-dask-dependency) must allow the same Dask
    assert image["rapids-dask-dependency"].split(".")[:2] == image["dask-cuda"].split(".")[:2]
    # .ci/run runs the suite a second time in an environment made with the images' pins
    # (EUGO_IMAGE_CONSTRAINTS=1 there): there, the Dask under test is the images'
    if os.environ.get("EUGO_IMAGE_CONSTRAINTS") == "1":
        for package in ("dask", "distributed"):
            assert version(package) == image[package], (
                f"this environment runs {package} {version(package)} but the images pin "
                f"{image[package]}")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "-c docker/constraints.txt" in ci and "EUGO_IMAGE_CONSTRAINTS=1" in ci
