"""``eugo.device`` resolved: which device runs GPU tasks in this process (:func:`resolve_device_name`)."""

from __future__ import annotations

from eugo_dask.devices.cuda import cupy_device_count, cupy_unusable_reason, import_cupy

#: The values of ``eugo.device``.
DEVICES = ("auto", "cupy", "emulated", "none")


def resolve_device_name(setting: str, *, explicit_error: bool = False) -> str | None:
    """Map an ``eugo.device`` setting to the device that will run GPU tasks here, or None.

    ``auto`` is ``cupy`` where CuPy has a working device and None otherwise; ``cupy`` raises
    when CuPy is missing (the user asked for it) and, with ``explicit_error``, when CuPy finds
    no usable device, saying why; without it, it is None there.
    """
    if setting == "none":
        return None
    if setting == "emulated":
        return "emulated"
    if setting == "cupy":
        import_cupy()
        reason = cupy_unusable_reason()
        if reason is not None and explicit_error:
            raise RuntimeError(
                f"eugo.device is 'cupy' but no CUDA device can run GPU tasks here: {reason}. "
                f"Set eugo.device to 'auto' to run on the CPU where there is none; allowed: "
                f"{list(DEVICES)}")
        return "cupy" if reason is None else None
    if setting == "auto":
        return "cupy" if cupy_device_count() else None
    raise ValueError(f"eugo.device must be one of {list(DEVICES)}; got {setting!r}")
