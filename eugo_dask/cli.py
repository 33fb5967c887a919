"""Command line: ``eugo-dask calibrate`` (also ``dask eugo calibrate``) and ``eugo-dask explain``."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import click
import yaml


@click.group(name="eugo")
def cli() -> None:
    """eugo-dask: transfer-aware GPU placement for dask.array."""


@cli.command()
@click.option("--quick", is_flag=True, help="Fewer sizes and repeats: seconds, not minutes.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              default=Path("eugo-profile.yaml"), show_default=True,
              help="Where to write the profile (.yaml or .json).")
@click.option("--gpu-preset", default="h200", show_default=True,
              help="GPU and link figures to use when no CUDA device is usable here.")
@click.option("--threads", type=int, default=None,
              help="Worker threads that run chunks side by side (default: all cores).")
def calibrate(quick: bool, output: Path, gpu_preset: str, threads: int | None) -> None:
    """Measure this machine and write a profile for eugo.profile."""
    from eugo_dask.calibrate import calibrate as run_calibration
    from eugo_dask.profile import PRESETS

    if gpu_preset not in PRESETS:
        raise click.BadParameter(f"must be one of {list(PRESETS)}; got {gpu_preset!r}",
                                 param_hint="--gpu-preset")
    profile = run_calibration(quick=quick, gpu_preset=gpu_preset, threads=threads,
                              progress=lambda message: click.echo(f"  {message}", err=True))
    text = (json.dumps(profile, indent=2) if output.suffix == ".json"
            else yaml.safe_dump(profile, sort_keys=False))
    output.write_text(text)
    click.echo(f"wrote {output}; use it with dask.config.set({{'eugo.profile': '{output}'}})")


#: What ``explain``'s TARGET must be; every error about a TARGET ends with it.
TARGET_FORM = "TARGET must be SCRIPT.py:NAME or package.module:NAME, naming a Dask collection"


def _target_error(spec: str, problem: str) -> click.ClickException:
    return click.ClickException(f"{spec}: {problem}. {TARGET_FORM}")


def _load_module(spec: str, target: str) -> ModuleType:
    if target.endswith(".py"):
        if not Path(target).is_file():
            raise _target_error(spec, f"no such script {target!r}")
        module_spec = importlib.util.spec_from_file_location("_eugo_explain_target", target)
        if module_spec is None or module_spec.loader is None:
            raise _target_error(spec, f"cannot load {target!r} as a Python script")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)  # errors in the script are the script's: shown whole
        return module
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):  # a parent package missing, or not a module name at all
        found = None
    if found is None:
        raise _target_error(spec, f"no module named {target!r}" + (
            " (a script must end in .py)" if "/" in target or "\\" in target else ""))
    return importlib.import_module(target)


def load_collection(spec: str) -> Any:
    """The Dask collection ``spec`` names: ``path/to/script.py:NAME`` or ``package.module:NAME``.

    Raises :class:`click.ClickException` with one line saying what is wrong with ``spec`` and
    what it must be. Nothing named is called (``dask.array:ones`` is a function that needs a
    shape, not a collection); only an exception raised by the script or module itself, while it
    runs, propagates as it is."""
    from dask.base import is_dask_collection

    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise _target_error(spec, "no ':NAME' after the script or module" if not target
                            else "no NAME after ':'")
    module = _load_module(spec, target)
    try:
        obj = getattr(module, name)
    except AttributeError:
        raise _target_error(spec, f"{target!r} has no name {name!r}") from None
    if not is_dask_collection(obj):
        hint = " (call it in a script and name the result)" if callable(obj) else ""
        raise _target_error(spec, f"{name!r} is of type {type(obj).__name__}, not a Dask collection{hint}")
    return obj


def _check_settings(settings: dict[str, Any]) -> None:
    """Report a bad --profile or --min-speedup as one line naming the setting."""
    import dask

    from eugo_dask.config import load_profile, read_settings

    try:
        with dask.config.set({f"eugo.{k.replace('_', '-')}": v for k, v in settings.items()}):
            read_settings()
        if "profile" in settings:
            load_profile(settings["profile"])
    except ValueError as e:  # ProfileError too: each names the key and what is allowed
        raise click.ClickException(str(e)) from None


@cli.command()
@click.argument("target")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the plan as an HTML page to this file.")
@click.option("--profile", default=None, help="eugo.profile for this plan.")
@click.option("--min-speedup", type=float, default=None, help="eugo.min-speedup for this plan.")
def explain(target: str, as_json: bool, html_path: Path | None, profile: str | None,
            min_speedup: float | None) -> None:
    """Print the plan for a Dask collection: TARGET is SCRIPT.py:NAME or package.module:NAME."""
    import eugo_dask

    settings = {k: v for k, v in (("profile", profile), ("min_speedup", min_speedup)) if v is not None}
    _check_settings(settings)
    collection = load_collection(target)
    plan = eugo_dask.explain(collection, **settings)
    if html_path is not None:
        html_path.write_text(plan.to_html())
    click.echo(plan.to_json(indent=2) if as_json else str(plan))


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
