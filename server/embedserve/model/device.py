"""One device shared by several models (MODELS): each model keeps its own worker thread (its
CUDA graphs and compiled code live there, as with one model), and the device runs one batch at a
time, the one due first: a batch is due when its oldest row has waited its model's drain budget
(Batch.due). Admission holds every model's queue, all models' work counted, within the budget:
a burst on one model delays another by at most what admission let it queue ahead (within the
budget) and the batch in progress; the rest of the burst is refused, not queued. One model takes
its turns uncontended.

And what fits: each model's footprint as it loads, against the device's memory less a margin.
Pure decisions (`fits`, `misfit_message`) apart from the arbiter, which is the one place threads
meet."""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading

GIB = 2**30
MARGIN_BYTES = GIB  # the CUDA context, cuBLAS workspaces, fragmentation: nothing torch counts per model
MARGIN_FRACTION = 0.05
# What the server writes first in its termination message when the models do not fit: the
# operator recognizes it in a pod's container status (operator: status.py) and reports the service
# Degraded with the message.
MISFIT_PREFIX = "models do not fit the device: "


class ModelsDoNotFit(RuntimeError):
    """The models' measured footprints and the margin exceed the device's memory."""


class DeviceLost(RuntimeError):
    """A batch hung the device every model shares: no turn will come (the pod is restarted)."""


class Device:
    """Turns on the device, earliest due first (`turn`), for several model workers."""

    def __init__(self):
        self._cond = threading.Condition()
        self._busy = False
        self._waiting: list[tuple[float, int]] = []  # (due, seq), a heap
        self._seq = itertools.count()
        self.lost = False

    @property
    def idle(self) -> bool:
        """Nothing runs and nothing waits (read on the event loop: a hint, not a promise)."""
        return not self._busy and not self._waiting

    def lose(self) -> None:
        """A batch hung on the device: whoever waits for a turn, or asks for one, gets DeviceLost."""
        with self._cond:
            self.lost = True
            self._cond.notify_all()

    @contextlib.contextmanager
    def turn(self, due: float):
        """Run what the block does when no batch due earlier waits; ties go in arrival order.
        DeviceLost once the device is lost."""
        entry = (due, next(self._seq))
        with self._cond:
            heapq.heappush(self._waiting, entry)
            while not self.lost and (self._busy or self._waiting[0] is not entry):
                self._cond.wait()
            self._waiting.remove(entry)
            heapq.heapify(self._waiting)
            if self.lost:
                self._cond.notify_all()
                raise DeviceLost("a batch hung the device these models share")
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()


def margin(device_bytes: int) -> int:
    return max(MARGIN_BYTES, int(MARGIN_FRACTION * device_bytes))


def fits(footprints: dict[str, int], device_bytes: int) -> bool:
    """Whether models of these footprints fit a device of `device_bytes` (0: unbounded)."""
    return not device_bytes or sum(footprints.values()) + margin(device_bytes) <= device_bytes


def misfit_message(footprints: dict[str, int], device_bytes: int, failed: str = "") -> str:
    """The refusal, with the numbers: each model's footprint, the margin, their sum and the device
    (`failed`: a model whose loading ran out of memory, its footprint unknown)."""
    parts = [f"{name} {size / GIB:.2f} GiB" for name, size in footprints.items()]
    if failed:
        parts.append(f"{failed} (out of memory while loading)")
    total = sum(footprints.values()) + margin(device_bytes)
    return (MISFIT_PREFIX + " + ".join(parts) + f" + margin {margin(device_bytes) / GIB:.2f} GiB = {total / GIB:.2f} GiB"
            + (" and more" if failed else "") + f" > device {device_bytes / GIB:.2f} GiB")
