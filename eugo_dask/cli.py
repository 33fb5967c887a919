"""Command line: ``eugo-dask calibrate`` (also ``dask eugo calibrate``) and ``eugo-dask explain``."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

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


def load_object(spec: str):
    """``path/to/script.py:name`` or ``package.module:name`` -> the object."""
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise click.BadParameter(f"expected SCRIPT_OR_MODULE:OBJECT; got {spec!r}")
    if target.endswith(".py"):
        module_spec = importlib.util.spec_from_file_location("_eugo_explain_target", target)
        if module_spec is None or module_spec.loader is None:
            raise click.BadParameter(f"cannot load {target!r}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    try:
        return getattr(module, name)
    except AttributeError:
        raise click.BadParameter(f"{target!r} has no object {name!r}") from None


@cli.command()
@click.argument("target")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the plan as an HTML page to this file.")
@click.option("--profile", default=None, help="eugo.profile for this plan.")
@click.option("--min-speedup", type=float, default=None, help="eugo.min-speedup for this plan.")
def explain(target: str, as_json: bool, html_path: Path | None, profile: str | None,
            min_speedup: float | None) -> None:
    """Print the plan for a collection: TARGET is SCRIPT_OR_MODULE:OBJECT."""
    import eugo_dask

    collection = load_object(target)
    if callable(collection) and not hasattr(collection, "__dask_graph__"):
        collection = collection()
    settings = {k: v for k, v in (("profile", profile), ("min_speedup", min_speedup)) if v is not None}
    plan = eugo_dask.explain(collection, **settings)
    if html_path is not None:
        html_path.write_text(plan.to_html())
    click.echo(plan.to_json(indent=2) if as_json else str(plan))


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
