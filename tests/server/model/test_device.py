"""model.device: several models' workers take turns on one device, the batch due first first; and
whether their footprints fit."""

from __future__ import annotations

import threading

from embedserve.model.device import GIB, MISFIT_PREFIX, Device, fits, margin, misfit_message


def test_waiting_batches_run_earliest_due_first_whatever_their_arrival():
    device, order = Device(), []
    holding, release = threading.Event(), threading.Event()

    def hold():
        with device.turn(0.0):
            holding.set()
            release.wait()

    def wait(due: float, queued: threading.Event):
        queued.set()  # about to ask: the holder keeps the device until every waiter has asked
        with device.turn(due):
            order.append(due)

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait()
    waiters = []
    for due in (5.0, 1.0, 3.0):  # arriving latest-due first
        asked = threading.Event()
        t = threading.Thread(target=wait, args=(due, asked))
        t.start()
        asked.wait()
        waiters.append(t)
    while len(device._waiting) < 3:  # all three queued on the condition (no timing: their entries)
        threading.Event().wait(0.001)
    release.set()
    for t in (holder, *waiters):
        t.join(10)
    assert order == [1.0, 3.0, 5.0]


def test_one_turn_at_a_time():
    device, inside, most = Device(), [0], [0]
    lock = threading.Lock()

    def run(i):
        for _ in range(200):
            with device.turn(float(i)):
                with lock:
                    inside[0] += 1
                    most[0] = max(most[0], inside[0])
                with lock:
                    inside[0] -= 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert most[0] == 1


def test_fit_counts_the_margin_and_says_the_numbers():
    device = 10 * GIB
    assert margin(device) == GIB and margin(100 * GIB) == 5 * GIB
    assert fits({"a": 4 * GIB, "b": 5 * GIB}, device)
    assert not fits({"a": 4 * GIB, "b": 5 * GIB + 1}, device)
    assert fits({"a": 100 * GIB}, 0)  # unbounded: a CPU
    said = misfit_message({"a": 4 * GIB, "b": 6 * GIB}, device)
    assert said == MISFIT_PREFIX + "a 4.00 GiB + b 6.00 GiB + margin 1.00 GiB = 11.00 GiB > device 10.00 GiB"
    assert "c (out of memory while loading)" in misfit_message({"a": 4 * GIB}, device, failed="c")


def test_a_lost_device_turns_every_waiter_away():
    """A hung batch holds the device for good: whoever waits for a turn, or asks later, is told."""
    import pytest

    from embedserve.model.device import DeviceLost

    device, outcome = Device(), []
    holding = threading.Event()

    def hang():
        with device.turn(0.0):
            holding.set()
            threading.Event().wait(5)  # the hung kernel, as long as the test lasts

    def wait():
        try:
            with device.turn(1.0):
                outcome.append("ran")
        except DeviceLost:
            outcome.append("lost")

    threading.Thread(target=hang, daemon=True).start()
    holding.wait()
    waiter = threading.Thread(target=wait)
    waiter.start()
    while not device._waiting:  # queued behind the hung batch
        threading.Event().wait(0.001)
    device.lose()
    waiter.join(5)
    assert outcome == ["lost"]
    with pytest.raises(DeviceLost):
        with device.turn(2.0):
            pass
