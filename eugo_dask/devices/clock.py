"""The task clock (:class:`TaskClock`) a task scope yields: the device-side seconds between the
marks the runtime sets (CUDA events on CuPy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class TaskClock:
    """Where one task's time went on its device, measured on the device.

    The runtime calls :meth:`mark` after each phase (say ``"eugo-h2d"`` after copying inputs,
    ``"eugo-device-compute"`` after the chunk function). When the task's scope ends
    (:meth:`~eugo_dask.devices.base.Device.task`), ``seconds`` maps each mark's label to the
    device time since the previous mark (the first counts from the scope's start; time after the
    last mark is added to it; without marks everything is under ``"device"``); ``launch_s`` is
    the host time until the scope's body returned (what an unsynchronised timer sees) and
    ``wall_s`` the host time until the device finished.
    """

    __slots__ = ("ordinal", "seconds", "launch_s", "wall_s", "_marks", "_stamp")

    def __init__(self, ordinal: int, stamp: Callable[[], Any]) -> None:
        self.ordinal = ordinal
        self.seconds: dict[str, float] = {}
        self.launch_s = 0.0
        self.wall_s = 0.0
        self._stamp = stamp
        self._marks: list[tuple[str, Any]] = [("", stamp())]

    def mark(self, label: str) -> None:
        """End a phase called ``label`` here (a CUDA event on the task's stream)."""
        self._marks.append((label, self._stamp()))

    @property
    def device_s(self) -> float:
        """Device seconds of the whole scope (after it ended)."""
        return sum(self.seconds.values())

    def _finish(self, end: Any, elapsed: Callable[[Any, Any], float]) -> None:
        marks = self._marks
        labels = [label for label, _ in marks[1:]] or ["device"]
        stamps = [stamp for _, stamp in marks[1:]] or [end]
        stamps[-1] = end  # time after the last mark counts to it
        seconds: dict[str, float] = {}
        previous = marks[0][1]
        for label, stamp in zip(labels, stamps):
            seconds[label] = seconds.get(label, 0.0) + max(elapsed(previous, stamp), 0.0)
            previous = stamp
        self.seconds = seconds
