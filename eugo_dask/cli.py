"""Command line: ``eugo-dask calibrate`` (also ``dask eugo calibrate``) and ``eugo-dask explain``.

Exit status: 0 done; 2 a mistake in what was asked (an option's value, a path, a TARGET, an
``eugo.*`` setting, also from ``DASK_EUGO__*`` variables), reported as one line on stderr before
anything is measured or run; 1 the user's own script or module raised while it ran (its
traceback is shown, it is the user's), or a file could not be written after all."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, TracebackType
from typing import IO, Any

import click
import yaml

from eugo_dask._version import __version__


class UserError(click.ClickException):
    """A mistake in what the user asked: one line on stderr (``Error: ...``), exit status 2
    (click's own usage errors' status)."""

    exit_code = 2


class ScriptError(click.ClickException):
    """The user's script or module raised while it ran: its own traceback (the frames from
    the script on), then one line; exit status 1."""

    exit_code = 1

    def __init__(self, target: str, error: BaseException) -> None:
        first = str(error).strip().splitlines()
        what = type(error).__name__ + (f": {first[0]}" if first else "")
        super().__init__(f"{target} raised an exception while it ran (its traceback is above): "
                         f"{what}")
        self.error = error

    def show(self, file: IO[Any] | None = None) -> None:
        tb: TracebackType | None = self.error.__traceback__
        while tb is not None and _is_loader_frame(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next  # the CLI's and importlib's frames: the rest is the script's
        traceback.print_exception(type(self.error), self.error, tb, file=sys.stderr)
        super().show(file)


def _is_loader_frame(filename: str) -> bool:
    return (filename == __file__ or filename.startswith("<frozen importlib")
            or Path(filename).parent == Path(importlib.__file__).parent)


class _OneLine:
    """Click's usage errors (an unknown option, a value of the wrong type, a missing argument)
    as one line, ``Error: ... Try '... --help'.``, exit status 2, as every other mistake."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)  # type: ignore[misc]
        except click.UsageError as e:
            raise _one_line(e, ctx) from None


def _one_line(error: click.UsageError, ctx: click.Context) -> UserError:
    return UserError(f"{error.format_message()} Try '{ctx.command_path} --help'.")


class _Command(_OneLine, click.Command):
    pass


class _Group(_OneLine, click.Group):
    command_class = _Command

    def resolve_command(self, ctx: click.Context, args: list[str]
                        ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as e:  # no such command
            raise _one_line(e, ctx) from None


@click.group(name="eugo", cls=_Group, epilog=(
    "Exit status: 0 done; 2 a mistake in the command (one line on stderr, before anything is "
    "measured or run); 1 the script or module named by explain's TARGET raised (its own "
    "traceback is shown)."))
@click.version_option(__version__, "--version", prog_name="eugo-dask",
                      message="%(prog)s %(version)s")
def cli() -> None:
    """eugo-dask: transfer-aware GPU placement for dask.array."""


def check_writable(path: Path, option: str) -> None:
    """Raise :class:`UserError` unless ``path`` can be written: not a directory, in an existing
    directory that may be written, and, where it exists, a file that may be written."""
    def refuse(problem: str) -> UserError:
        return UserError(f"{option} {str(path)!r}: {problem}; it must be a file path in an "
                         "existing directory you can write to")

    parent = path.parent
    if path.is_dir():
        raise refuse("is a directory")
    if not parent.exists():
        raise refuse(f"no directory {str(parent)!r}")
    if not parent.is_dir():
        raise refuse(f"{str(parent)!r} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise refuse(f"directory {str(parent)!r} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise refuse("the file is not writable")


def _write(path: Path, text: str, option: str) -> None:
    try:
        path.write_text(text)
    except OSError as e:  # checked before; changed since (or a full disk)
        raise click.ClickException(f"{option}: cannot write {str(path)!r}: {e.strerror or e}") from None


def _positive_threads(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise UserError(f"--threads must be a whole number >= 1 (worker threads; leave it out "
                        f"for all {os.cpu_count() or 1} cores here); got {value}")
    return value


@cli.command()
@click.option("--quick", is_flag=True, help="Fewer sizes and repeats: seconds, not minutes.")
@click.option("-o", "--output", type=click.Path(path_type=Path),
              default=Path("eugo-profile.yaml"), show_default=True,
              help="Where to write the profile: JSON for a .json name, YAML otherwise. Its "
                   "directory must exist and be writable (checked before measuring).")
@click.option("--gpu-preset", default="h200", show_default=True,
              help="GPU and link figures to use when no CUDA device is usable here.")
@click.option("--threads", type=int, default=None, callback=_positive_threads,
              help="Worker threads that run chunks side by side, 1 or more (default: all "
                   "cores).")
def calibrate(quick: bool, output: Path, gpu_preset: str, threads: int | None) -> None:
    """Measure this machine and write a profile for eugo.profile.

    Every option is checked before anything is measured."""
    from eugo_dask.profile import PRESETS

    if gpu_preset not in PRESETS:
        raise UserError(f"--gpu-preset must be one of {', '.join(PRESETS)}; got {gpu_preset!r}")
    check_writable(output, "--output")
    from eugo_dask.calibrate import calibrate as run_calibration

    profile = run_calibration(quick=quick, gpu_preset=gpu_preset, threads=threads,
                              progress=lambda message: click.echo(f"  {message}", err=True))
    text = (json.dumps(profile, indent=2) if output.suffix == ".json"
            else yaml.safe_dump(profile, sort_keys=False))
    _write(output, text, "--output")
    click.echo(f"wrote {output}; use it with dask.config.set({{'eugo.profile': '{output}'}})")


#: What ``explain``'s TARGET must be; every error about a TARGET ends with it.
TARGET_FORM = "TARGET must be SCRIPT.py:NAME or package.module:NAME, naming a Dask collection"


def _target_error(spec: str, problem: str) -> UserError:
    return UserError(f"{spec}: {problem}. {TARGET_FORM}")


def _run_module(target: str, run: Any) -> Any:
    """``run()``, which runs the user's script or module: what it raises is the script's own
    (:class:`ScriptError`), a KeyboardInterrupt excepted."""
    try:
        return run()
    except SystemExit as e:
        raise click.ClickException(
            f"{target} called sys.exit({e.code!r}) while it ran; explain needs it to run to its "
            "end (it runs as a module, not as __main__)") from None
    except Exception as e:
        raise ScriptError(target, e) from None


def _load_module(spec: str, target: str) -> ModuleType:
    if target.endswith(".py"):
        path = Path(target)
        if path.is_dir():
            raise _target_error(spec, f"{target!r} is a directory, not a script")
        if not path.is_file():
            raise _target_error(spec, f"no such script {target!r}")
        try:
            path.read_bytes()
        except OSError as e:
            raise _target_error(spec, f"cannot read {target!r} ({e.strerror or e})") from None
        module_spec = importlib.util.spec_from_file_location("_eugo_explain_target", target)
        if module_spec is None or module_spec.loader is None:
            raise _target_error(spec, f"cannot load {target!r} as a Python script")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module
        loader = module_spec.loader
        _run_module(target, lambda: loader.exec_module(module))
        return module
    if "" not in sys.path and os.getcwd() not in sys.path:  # (as python -m: the cwd first)
        sys.path.insert(0, os.getcwd())
    found = _run_module(target, lambda: _find_spec(target))  # a parent package runs
    if found is None:
        raise _target_error(spec, f"no module named {target!r}" + (
            " (a script must end in .py)" if "/" in target or "\\" in target else ""))
    imported: ModuleType = _run_module(target, lambda: importlib.import_module(target))
    return imported


def _find_spec(target: str) -> Any:
    try:
        return importlib.util.find_spec(target)
    except (ImportError, ValueError):  # a parent package missing, or not a module name at all
        return None


def load_collection(spec: str) -> Any:
    """The Dask collection ``spec`` names: ``path/to/script.py:NAME`` or ``package.module:NAME``.

    Raises :class:`click.ClickException` with one line saying what is wrong with ``spec`` and
    what it must be. Nothing named is called (``dask.array:ones`` is a function that needs a
    shape, not a collection); only an exception raised by the script or module itself, while it
    runs, is raised as :class:`ScriptError` (its traceback is the script's)."""
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
        raise UserError(str(e)) from None


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """What is written to stdout inside goes to stderr: Python's ``print`` and, where stdout is
    a file descriptor, what C code or a child process writes to it too."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
        saved = os.dup(fd)
    except (AttributeError, OSError, ValueError):  # not a real file (click's test runner)
        fd = saved = -1
    try:
        if saved >= 0:
            sys.stderr.flush()
            os.dup2(sys.stderr.fileno(), fd)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved >= 0:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)


@cli.command(epilog="TARGET's script or module is run first (as a module, not as __main__); "
             "what it prints goes to stderr, so stdout carries only the plan (with --json, "
             "only the JSON). If it raises, its own traceback is shown and the exit status "
             "is 1; a mistake in the command itself exits with 2 before the script runs.")
@click.argument("target")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--html", "html_path", type=click.Path(path_type=Path), default=None,
              help="Also write the plan as an HTML page to this file (its directory must "
                   "exist and be writable).")
@click.option("--profile", default=None, help="eugo.profile for this plan.")
@click.option("--min-speedup", type=float, default=None, help="eugo.min-speedup for this plan.")
def explain(target: str, as_json: bool, html_path: Path | None, profile: str | None,
            min_speedup: float | None) -> None:
    """Print the plan for a Dask collection: TARGET is SCRIPT.py:NAME or package.module:NAME."""
    import eugo_dask

    profile_setting: Any = profile
    if profile is not None and not profile.strip():
        from eugo_dask.profile import PRESETS

        raise UserError(f"--profile must be auto, one of the presets {', '.join(PRESETS)}, a "
                        f"path to a .yaml/.json profile, or an inline mapping such as "
                        f"'{{base: h200, cpu: server-x86}}'; got {profile!r}")
    if profile is not None and profile.lstrip().startswith("{"):  # an inline mapping (YAML/JSON)
        import yaml

        try:
            profile_setting = yaml.safe_load(profile)
        except yaml.YAMLError as e:
            raise UserError(f"--profile: {profile!r} is not a YAML/JSON mapping "
                            f"({str(e).splitlines()[0]})") from None
    settings: dict[str, Any] = {k: v for k, v in (("profile", profile_setting),
                                                  ("min_speedup", min_speedup)) if v is not None}
    _check_settings(settings)
    if html_path is not None:
        check_writable(html_path, "--html")
    with _stdout_to_stderr():
        collection = load_collection(target)
        plan = eugo_dask.explain(collection, **settings)
    if html_path is not None:
        try:
            _write(html_path, plan.to_html(), "--html")
        except click.ClickException as e:  # a path the check could not see through: the command's
            raise UserError(e.message) from None
    click.echo(plan.to_json(indent=2) if as_json else str(plan))


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
