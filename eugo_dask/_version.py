"""The package version (one place: the package, the pass tokens and the build read it)."""

__version__ = "0.1.0"
