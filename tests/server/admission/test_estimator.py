"""The estimator on an injected clock: EMA convergence, idle decay, drain, P95 window."""

import math

import pytest

from embedserve.admission.estimator import CHARS_PER_TOKEN_HORIZON, BusyTimeRate, DecayingRate, Estimator, LatencyWindow


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_arrival_rate_converges_to_a_steady_stream_and_decays_when_idle():
    r = DecayingRate(tau=5.0)
    t = 0.0
    for _ in range(600):  # 60 s of 100 tokens every 0.1 s = 1000 tokens/s
        t += 0.1
        r.add(100, t)
    assert r.read(t) == pytest.approx(1000, rel=0.02)
    assert r.read(t + 5) == pytest.approx(1000 / math.e, rel=0.02)
    assert r.read(t + 60) < 1


def test_arrival_rate_follows_a_step_within_a_few_tau():
    r = DecayingRate(tau=2.0)
    t = 0.0
    for _ in range(200):
        t += 0.05
        r.add(50, t)  # 1000/s
    for _ in range(200):
        t += 0.05
        r.add(150, t)  # 3000/s for 10 s = 5 tau
    assert r.read(t) == pytest.approx(3000, rel=0.03)


def test_service_rate_weighs_batches_by_busy_time_and_forgets_the_seed():
    s = BusyTimeRate(tau=1.0)
    s.seed(10_000, weight_s=1.0)
    assert s.read() == 10_000
    for _ in range(100):  # 5 s of busy time at 4000 tokens/s, in uneven batches
        s.add(400, 0.1)
        s.add(0, 0.0)
    assert s.read() == pytest.approx(4000, rel=0.02)
    big_and_small = BusyTimeRate(tau=100.0)
    big_and_small.add(9000, 1.0)  # 9000/s for a long batch
    big_and_small.add(10, 0.01)  # 1000/s for a tiny one: barely moves the estimate
    assert big_and_small.read() == pytest.approx(9010 / 1.01, rel=1e-3)


def test_p95_over_a_time_window_ages_out():
    w = LatencyWindow(window=10.0, refresh=0.0)
    for i in range(100):
        w.add(0.010 if i < 94 else 1.0, now=i * 0.01)
    assert w.p95(1.0) > 0.5  # 6% slow: P95 lands among them
    assert w.p95(11.5) == 0.0  # all aged out


def test_latency_samples_leave_their_window_though_p95_is_never_read():
    """Admission reads P95 only with the latency strategy on, and gRPC probes never: samples
    leave as new ones come, or they pile up for as long as the server runs."""
    w = LatencyWindow(window=10.0)
    for i in range(10_000):  # 100 s at 100 requests/s
        w.add(0.01, i * 0.01)
    assert len(w) <= 1001


def test_p95_is_cached_between_refreshes():
    w = LatencyWindow(window=10.0, refresh=0.1)
    w.add(0.01, 0.0)
    assert w.p95(0.0) == pytest.approx(0.01)
    w.add(5.0, 0.05)
    assert w.p95(0.05) == pytest.approx(0.01)  # cached
    assert w.p95(0.2) > 1.0


def test_backlog_and_drain_time():
    clock = Clock()
    e = Estimator(clock=clock)
    e.seed_service_rate(2000)
    e.enqueued(1000)
    snap = e.snapshot()
    assert snap.queued_tokens == 1000 and snap.drain_s == pytest.approx(0.5)
    assert e.drain_s() == snap.drain_s  # what every answer carries, read alone
    e.computed(real_tokens=700, busy_s=0.35)
    e.dequeued(300)  # a cancelled request's rows
    snap = e.snapshot()
    assert snap.queued_tokens == 0 and snap.drain_s == 0 and e.drain_s() == 0
    assert snap.service_rate == pytest.approx(2000, rel=1e-6)  # 700 / 0.35 = 2000


def test_padding_shows_as_lower_capacity_in_one_unit():
    """Batches that are half padding: capacity is the real tokens per busy second, so offered
    real tokens over it is the busy fraction (no second unit to convert between)."""
    clock = Clock()
    e = Estimator(clock=clock, service_tau_s=1.0)
    e.seed_service_rate(4000)  # warm-up: full rows, 4000 tokens/s
    busy = 0.0
    for _ in range(200):  # 40 s: every 0.2 s a batch of 200 real tokens padded to 400 (0.1 s busy)
        clock.t += 0.2
        e.enqueued(200)
        e.offered(200)
        e.computed(real_tokens=200, busy_s=0.1)
        busy += 0.1
    snap = e.snapshot()
    assert snap.service_rate == pytest.approx(2000, rel=0.01)  # half of the padded rate
    assert snap.queued_tokens == 0
    assert snap.arrival_rate / snap.service_rate == pytest.approx(busy / 40, rel=0.05)  # 0.5


def test_chars_per_token_is_learned():
    e = Estimator()
    e.learn_chars_per_token(600, 100)
    assert e.chars_per_token == pytest.approx(6.0)  # the prior is forgotten at the first sample
    for _ in range(200):
        e.learn_chars_per_token(500, 100)
    assert e.chars_per_token == pytest.approx(5.0, rel=0.01)


def test_a_stream_of_crafted_texts_moves_chars_per_token_by_their_tokens_only():
    """One request in two crafted to read 16 characters per token (its one token, as the tokenizer
    samples it: 4,096 spaces held to 16 characters), the other ordinary text (250 characters, 55
    tokens): weighed by tokens, the estimate stays at ordinary text's. One equal sample per request,
    it had been pulled to ~10, and the offered load of ordinary text under-counted by half."""
    e = Estimator()
    for _ in range(20):
        e.learn_chars_per_token(250, 55)
    for _ in range(200):
        e.learn_chars_per_token(16, 1)
        e.learn_chars_per_token(250, 55)
    assert e.chars_per_token == pytest.approx(266 / 56, rel=0.01)  # ordinary: 4.55


def test_chars_per_token_follows_a_change_of_traffic_within_its_horizon():
    e = Estimator()
    for _ in range(1000):  # 100,000 tokens of English-like text
        e.learn_chars_per_token(450, 100)
    for _ in range(int(3 * CHARS_PER_TOKEN_HORIZON / 100)):  # three horizons of CJK-like text
        e.learn_chars_per_token(120, 100)
    assert e.chars_per_token == pytest.approx(1.2 + 3.3 * math.exp(-3), rel=0.01)


def test_a_models_drain_counts_the_device_time_other_models_queued():
    """Several models on one device (MODELS): admission weighs the others' queued device time in
    this model's tokens, and the answer's drain says it; the model's own queue stays its own."""
    from embedserve.admission.policy import Policy, decide

    others = [0.0]
    e = Estimator(clock=lambda: 0.0, elsewhere=lambda: (others[0], 0.0))
    e.seed_service_rate(1000.0)
    e.enqueued(100)
    assert e.snapshot().drain_s == pytest.approx(0.1) and e.queued_s() == pytest.approx(0.1)
    others[0] = 0.3
    snap = e.snapshot()
    assert snap.queued_tokens == 100 and snap.backlog_tokens == pytest.approx(400)
    assert snap.drain_s == pytest.approx(0.4) and e.drain_s() == pytest.approx(0.4)
    assert e.queued_s() == pytest.approx(0.1)  # what the other models count of this one
    policy = Policy(throughput=True, latency=False, max_drain_s=0.35, latency_soft_s=1, latency_hard_s=2)
    assert not decide(snap, 10, policy, 0.5).admit  # 0.4 s ahead of it, all models' work, over 0.35
    others[0] = 0.2
    assert decide(e.snapshot(), 10, policy, 0.5).admit
    # The others' demand takes 60% of the device: this model's capacity beside them is 40% of its rate.
    e.elsewhere = lambda: (0.0, 0.6)
    assert e.snapshot().capacity_rate == pytest.approx(400)
