"""The gate on an injected clock: offers counted once, bookings claimed, early retries told the
rest of their wait, held callers admitted at their moment, and a held caller that goes away
freeing its room."""

import asyncio

import pytest

from embedserve.admission.policy import Policy
from embedserve.errors import Overloaded
from embedserve.admission.estimator import Estimator
from embedserve.admission.gate import Caller, Gate

POLICY = Policy(throughput=True, latency=False, max_drain_s=0.5, latency_soft_s=1, latency_hard_s=2, horizon_s=10)


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Seen:
    def __init__(self):
        self.rejections, self.holds = [], 0

    def rejected(self, reason):
        self.rejections.append(reason)

    def held(self):
        self.holds += 1


def gate(queued=600):
    clock = Clock()
    estimator = Estimator(clock=clock)
    estimator.seed_service_rate(1000)  # 1000 tokens/s: the 0.5 s budget is 500 tokens, 0.1 s over
    estimator.enqueued(queued)
    return Gate(estimator, POLICY, Seen()), clock


async def test_a_refused_request_is_booked_and_its_retry_claims_the_room():
    g, clock = gate()
    with pytest.raises(Overloaded) as e:
        await g.admit(key=1, cost=100, caller=Caller())
    assert e.value.retry_after_ms == 100 and g.book.reserved_tokens == 100
    with pytest.raises(Overloaded):  # a newcomer waits behind what is booked
        await g.admit(key=2, cost=100, caller=Caller())
    assert g.book.reserved_tokens == 200
    clock.t += 0.1
    g.estimator.computed(real_tokens=100, busy_s=0.1)  # the device made room
    await g.admit(1, 100, Caller(retry=True))  # on time and first in line: admitted
    assert g.book.reserved_tokens == 100
    assert g.estimator.offered_total == 200  # two requests, two offers, however often they came


async def test_the_same_texts_from_another_caller_are_new_demand_and_claim_nothing():
    """Unmarked, the same texts are another caller: counted, and no booking lets them in."""
    g, clock = gate()
    with pytest.raises(Overloaded):
        await g.admit(1, 100, Caller())
    clock.t += 0.1
    with pytest.raises(Overloaded):
        await g.admit(1, 100, Caller())
    assert g.estimator.offered_total == 200 and g.book.reserved_tokens == 200


async def test_bookings_long_dead_neither_pile_up_nor_push_back_a_refusal():
    """Without HTTP probes nothing but admission reads the book (gRPC probes do not): bookings
    past their grace leave at the next admission, and a refusal's moment counts live ones only
    (dead ones had pushed it back, and piled up without end)."""
    g, clock = gate()
    for key in range(50):  # refused and booked, never back
        with pytest.raises(Overloaded):
            await g.admit(key, 100, Caller())
    assert len(g.book) == 50
    clock.t += 60  # long past every booking's grace
    with pytest.raises(Overloaded) as e:
        await g.admit(1000, 100, Caller())
    assert e.value.retry_after_ms == 100  # the queue ahead alone, as for the first of them
    assert len(g.book) == 1 and g.book.reserved_tokens == 100


async def test_a_retry_back_early_is_told_the_rest_of_its_wait_and_books_nothing_more():
    g, clock = gate()
    with pytest.raises(Overloaded):
        await g.admit(1, 100, Caller())
    clock.t += 0.04
    with pytest.raises(Overloaded) as e:
        await g.admit(1, 100, Caller(retry=True))
    assert e.value.retry_after_ms == 60 and g.book.reserved_tokens == 100


async def test_a_deadline_that_ends_first_books_nothing_and_fails_fast():
    g, _ = gate()
    with pytest.raises(Overloaded) as e:
        await g.admit(1, 100, Caller(deadline_s=0.3, waits=True))
    assert e.value.retry_after_ms == 700  # when it could be done: 0.1 s of wait + the 0.5 s budget + its own 0.1 s
    assert g.book.reserved_tokens == 0 and g.observer.holds == 0


async def test_a_caller_that_waits_is_held_until_its_moment():
    g, clock = gate()
    held = asyncio.ensure_future(g.admit(1, 100, Caller(waits=True)))
    await asyncio.sleep(0)
    assert not held.done() and g.book.reserved_tokens == 100 and g.observer.holds == 1
    await asyncio.wait_for(held, 2)  # the gate sleeps the booked 0.1 s of real time
    assert g.book.reserved_tokens == 0 and g.observer.rejections == [] and g.observer.holds == 1


async def test_a_held_caller_that_goes_away_frees_its_room():
    g, _ = gate()
    held = asyncio.ensure_future(g.admit(1, 100, Caller(waits=True)))
    await asyncio.sleep(0)
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    assert g.book.reserved_tokens == 0 and len(g.book) == 0


async def test_once_the_engine_is_lost_every_held_caller_resumes_at_once():
    """Nothing will make room or reach their moments: they resume now, to meet the engine's
    refusal (UNAVAILABLE) instead of waiting out seconds of booked time on a dead server."""
    g, _ = gate(queued=5_000)  # 4.5 s over the limit: each is held for seconds
    held = [asyncio.ensure_future(g.admit(key, 100, Caller(waits=True))) for key in range(3)]
    await asyncio.sleep(0)
    assert not any(h.done() for h in held) and g.observer.holds == 3
    g.release_all()
    await asyncio.wait_for(asyncio.gather(*held), 1)
    assert g.book.reserved_tokens == 0 and len(g.book) == 0


async def test_past_the_horizon_nobody_is_held():
    g, _ = gate(queued=20_000)  # 20 s of work ahead
    with pytest.raises(Overloaded) as e:
        await g.admit(1, 100, Caller(waits=True))
    assert g.observer.holds == 0 and g.book.reserved_tokens == 0
    assert e.value.retry_after_ms == pytest.approx(19_500 - 10_000, abs=2)  # when booking is possible
    assert not e.value.final  # a burst, as far as anyone knows yet


async def test_sustained_overload_books_nothing_until_demand_falls_clearly_below_capacity():
    g, clock = gate(queued=20_000)
    refusals = await twice_capacity(g, clock, seconds=12, key=100)
    # Past the horizon, and demand over capacity for less than a horizon: a burst, told when
    # booking is possible; for a whole horizon: sustained.
    assert [r.final for r in refusals] == [False] * 11 + [True] and refusals[-1].retry_after_ms == 10_000
    assert g.observer.rejections == ["drain_time"] * 11 + ["sustained"]
    g.observer.rejections.clear()
    g.estimator.dequeued(19_400)  # 0.6 s left: a moment within the horizon again, but demand goes on
    with pytest.raises(Overloaded) as e:
        await g.admit(3, 100, Caller(waits=True))
    assert e.value.final and g.book.reserved_tokens == 0 and g.observer.holds == 0
    assert g.sustained(g.estimator.snapshot())
    clock.t += 30  # the arrival rate decays below the service rate
    assert not g.sustained(g.estimator.snapshot())
    with pytest.raises(Overloaded) as e:  # a burst again: booked
        await g.admit(4, 100, Caller())
    assert e.value.retry_after_ms == 100 and not e.value.final and g.book.reserved_tokens == 100
    assert g.observer.rejections == ["sustained", "drain_time"]


async def test_demand_must_exceed_capacity_without_a_break_for_a_whole_horizon():
    """Six seconds over capacity, a lull, five more: eleven seconds over in all, but not for a
    horizon without a break: a burst past the horizon, not sustained overload."""
    g, clock = gate(queued=20_000)
    await twice_capacity(g, clock, seconds=7, key=200)
    clock.t += 8  # nothing arrives: the average decays below the 1000 tokens/s served
    refusals = await twice_capacity(g, clock, seconds=12, key=300)
    assert [r.final for r in refusals] == [False] * 11 + [True]


async def twice_capacity(g, clock, seconds: int, key: int) -> list[Overloaded]:
    """From the first request on, demand at about twice the 1000 tokens/s served (offers between
    requests), one request a second, each refused. The gate reads demand as each request arrives."""
    refusals = []
    for second in range(seconds):
        with pytest.raises(Overloaded) as e:
            await g.admit(key + second, 100, Caller())
        refusals.append(e.value)
        clock.t += 1
        g.estimator.offered(10_000 if second == 0 else 1900)
    return refusals


async def test_a_held_caller_joins_as_soon_as_the_queue_has_room():
    """Its moment is behind every booking standing when it came, including those of callers that
    never come back; once a batch leaves room it joins then, not at that moment."""
    g, clock = gate()
    with pytest.raises(Overloaded):
        await g.admit(1, 5000, Caller())  # books 5 s of room, and never comes back
    held = asyncio.ensure_future(g.admit(2, 100, Caller(waits=True)))  # its moment: 5.1 s away
    await asyncio.sleep(0)
    g.release_held()
    await asyncio.sleep(0)
    assert not held.done()  # the queue is still over the limit
    g.estimator.computed(real_tokens=200, busy_s=0.2)  # a batch: 400 queued, under the 500 limit
    g.release_held()
    await asyncio.wait_for(held, 1)
    assert g.book.reserved_tokens == 5000 and g.observer.rejections == ["drain_time"]


async def test_callers_woken_by_one_batch_count_until_they_resume():
    """A woken caller joins the queue only on a later loop turn; a second batch meanwhile must
    count it as there, or every batch would wake another queue's worth."""
    g, _ = gate()
    with pytest.raises(Overloaded):
        await g.admit(1, 5000, Caller())  # a booking that never comes back: both below are held
    first = asyncio.ensure_future(g.admit(2, 100, Caller(waits=True)))
    second = asyncio.ensure_future(g.admit(3, 100, Caller(waits=True)))
    await asyncio.sleep(0)
    g.estimator.computed(real_tokens=200, busy_s=0.2)  # 400 queued: 100 tokens of room under 500
    g.release_held()  # wakes the first: its 100 tokens fill the room
    g.release_held()  # the same loop turn (two batches done): the first has not resumed yet
    await asyncio.sleep(0)
    assert first.done() and not second.done()
    g.estimator.enqueued(100)  # the first joined the queue (service.py does this as admit returns)
    g.estimator.computed(real_tokens=100, busy_s=0.1)
    g.release_held()
    await asyncio.wait_for(second, 1)


async def test_a_woken_caller_that_goes_away_leaves_nothing_counted():
    g, _ = gate()
    with pytest.raises(Overloaded):
        await g.admit(1, 5000, Caller())
    held = asyncio.ensure_future(g.admit(2, 100, Caller(waits=True)))
    other = asyncio.ensure_future(g.admit(3, 100, Caller(waits=True)))
    await asyncio.sleep(0)
    g.estimator.computed(real_tokens=200, busy_s=0.2)  # 100 tokens of room
    g.release_held()  # wakes `held`, which is cancelled before it resumes
    held.cancel()
    with pytest.raises(asyncio.CancelledError):
        await held
    g.release_held()  # its 100 tokens never joined: the room is the other's
    await asyncio.wait_for(other, 1)
    assert g.book.reserved_tokens == 5000
