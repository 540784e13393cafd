"""The tokenization stage (embedserve.batching.intake) with the engine, the stand-in model of test_engine
(a row → (sum of its ids, its length)) and the packaged model's real tokenizer: requests admitted
while no batch can be formed are tokenized together, in one call, when one can; each still gets
its own rows, its own error and its place in the backlog; and waiting there never delays a
batch the decision would form."""

import asyncio

import numpy as np
import pytest
from transformers import AutoTokenizer

from embedserve.errors import DeviceUnresponsive, InvalidInput
from embedserve.batching.intake import Intake
from embedserve.batching.shaping import Limits, Texts, texts_request, tokenize
from embedserve.batching.tokenization import TextTokenizer
from embedserve.model.worker import Watchdog
from tests.server.batching.test_engine import BUCKETS, RowSums, started_engine

MAX_LENGTH = BUCKETS[-1]


class Counting(TextTokenizer):
    """The real tokenizer, recording how many requests each call of encode_each carried."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def encode_each(self, requests):
        self.calls.append(len(requests))
        return super().encode_each(requests)


@pytest.fixture(scope="module")
def hf(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture
def tokenizer(hf):
    return Counting.from_hf(hf, MAX_LENGTH, truncate=True)


def request(texts, truncate=True, prompt=""):
    return Texts(list(texts), truncate, prompt, 0)


def expected(tokenizer, texts, prompt=""):
    ids, lengths = tokenizer.encode(texts, True, prompt)
    return np.array([[ids[i, :n].sum(), n] for i, n in enumerate(lengths)], np.float32)


async def until(check, timeout=10):
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.001)


async def turns(n=5):
    """Let the event loop run a few turns (callbacks scheduled now run)."""
    for _ in range(n):
        await asyncio.sleep(0)


async def busy_engine(runner, tokenizer, **kwargs):
    """An engine whose worker is blocked on a first batch (lookahead 0: no batch can be formed)."""
    engine = await started_engine(runner, vocab_size=tokenizer.vocab_size, **kwargs)
    intake = Intake(tokenizer, engine, engine.estimator)
    runner.gate.clear()
    first = intake.put(request(["the first request"]), 5)
    await until(lambda: engine.in_worker == 1)
    tokenizer.calls.clear()
    return engine, intake, first


async def test_requests_admitted_while_the_worker_is_busy_are_tokenized_in_one_call(tokenizer):
    """No batch can be formed (lookahead 0, the worker on its first batch): the requests admitted
    meanwhile are tokenized together, in one call, while the worker is still busy (off the path
    between two batches), then computed when it is free."""
    runner = RowSums()
    engine, intake, first = await busy_engine(runner, tokenizer, lookahead=0, caps={4: 64, 8: 64, 16: 64})
    texts = [[f"query number {i}"] if i % 3 else [f"query {i}", "a second text of it"] for i in range(20)]
    waiting = [intake.put(request(t), 7 * len(t)) for t in texts]
    # counted in the backlog by their estimates until their rows are queued
    # (the first request's rows count until computed)
    assert engine.estimator.snapshot().queued_tokens == sum(7 * len(t) for t in texts) + first.tokens
    await until(lambda: tokenizer.calls)
    assert tokenizer.calls == [20] and engine.in_worker == 1 and not runner.batches
    assert engine.estimator.snapshot().queued_tokens == sum(r.tokens for r in (first, *waiting))
    runner.gate.set()
    results = await asyncio.gather(first.future, *(r.future for r in waiting))
    assert tokenizer.calls == [20]
    for t, r, out in zip(texts, waiting, results[1:]):
        np.testing.assert_array_equal(out, expected(tokenizer, t))
        assert r.tokens == int(expected(tokenizer, t)[:, 1].sum())
    await until(lambda: engine.in_worker == 0)
    assert engine.estimator.snapshot().queued_tokens == 0
    await engine.stop()


async def test_each_request_gets_its_own_error_and_a_cancelled_one_never_runs(tokenizer):
    runner = RowSums()
    engine, intake, first = await busy_engine(runner, tokenizer, lookahead=0, caps={4: 64, 8: 64, 16: 64})
    long_text = " ".join(["word"] * 40)  # > MAX_LENGTH tokens
    good = intake.put(request(["fine", "also fine"]), 6)
    too_many_tokens = intake.put(request(["short", long_text], truncate=False), 50)
    too_many_chars = intake.put(request(["x" * (tokenizer.max_chars + 1)], truncate=False), 16)
    cut = intake.put(request([long_text]), 16)
    cancelled = intake.put(request(["never computed"]), 5)
    cancelled.future.cancel()
    engine.drop(cancelled)
    runner.gate.set()
    await first.future
    np.testing.assert_array_equal(await good.future, expected(tokenizer, ["fine", "also fine"]))
    with pytest.raises(InvalidInput, match=r"texts\[1\] is longer than 16 tokens"):
        await too_many_tokens.future
    with pytest.raises(InvalidInput, match=r"texts\[0\] has \d+ characters"):
        await too_many_chars.future
    assert (await cut.future)[0, 1] == MAX_LENGTH
    await until(lambda: engine.in_worker == 0)
    assert sum(rows for rows, _ in runner.batches) == 1 + 2 + 1  # first, good, cut: no other row ran
    assert engine.estimator.snapshot().queued_tokens == 0
    await engine.stop()


async def test_arrivals_that_fill_a_bucket_form_its_batch_before_the_deadline(tokenizer):
    """The worker can take more (lookahead 2) but is not idle, so rows wait for their bucket to
    fill or their deadline (a minute here). The first arrival is looked at (its deadline must be
    set); the two after it cannot fill the bucket and wait, untokenized; the one that can makes
    the batcher look, tokenize the three together and form the batch."""
    runner = RowSums()
    engine, intake, first = await busy_engine(runner, tokenizer, lookahead=2, deadline_s=60.0,
                                              caps={4: 4, 8: 64, 16: 64})
    assert tokenizer.encode(["hi"], True)[1].tolist() == [3]  # bucket 4
    tokenizer.calls.clear()
    shorts = [intake.put(request(["hi"]), 3)]
    await turns()
    assert tokenizer.calls == [1]
    shorts += [intake.put(request(["hi"]), 3) for _ in range(2)]
    await turns()
    assert tokenizer.calls == [1] and engine.in_worker == 1 and len(intake.waiting) == 2
    shorts.append(intake.put(request(["hi"]), 3))
    await until(lambda: engine.in_worker == 2)
    assert tokenizer.calls == [1, 3]
    runner.gate.set()
    await asyncio.gather(first.future, *(r.future for r in shorts))
    await engine.stop()


async def test_a_row_tokenized_late_is_as_old_as_its_admission(tokenizer):
    """A row waiting to be tokenized until the deadline ahead (an older row's) is queued with
    its admission time: it is stale at that look too, and drained, not held for a deadline of
    its own counted from the look."""
    now = [0.0]
    runner = RowSums()
    engine, intake, first = await busy_engine(runner, tokenizer, lookahead=2, deadline_s=0.05,
                                              caps={4: 64, 8: 64, 16: 64}, clock=lambda: now[0])
    older = intake.put(request(["hi"]), 3)  # bucket 4: looked at, its deadline set (0.05)
    await turns()
    now[0] = 0.04
    later = intake.put(request(["a longer query here"]), 6)  # bucket 8: waits for that look
    await turns()
    assert len(intake.waiting) == 1 and engine.in_worker == 1
    now[0] = 0.2  # both stale when the deadline's look comes (in 50 ms of real time)
    await until(lambda: engine.in_worker == 3)
    runner.gate.set()
    await asyncio.gather(first.future, older.future, later.future)
    await engine.stop()


async def test_a_hung_device_fails_the_requests_waiting_to_be_tokenized(tokenizer):
    """They wait (the worker is full, and they would be tokenized only in a minute) when the
    watchdog finds the device hung: they fail with the rest, and later ones at once."""
    runner = RowSums()
    failing = []
    engine, intake, first = await busy_engine(runner, tokenizer, lookahead=0, caps={4: 64, 8: 64, 16: 64},
                                              watchdog=Watchdog(multiple=1, floor_s=0.2), on_failing=failing.append,
                                              feed_delay_s=60.0)
    waiting = [intake.put(request([f"text {i}"]), 4) for i in range(5)]
    for r in (first, *waiting):
        with pytest.raises(DeviceUnresponsive):
            await asyncio.wait_for(r.future, 10)
    assert failing == [True] and intake.waiting == [] and tokenizer.calls == [5]
    with pytest.raises(DeviceUnresponsive):
        intake.put(request(["after the hang"]), 4)
    runner.gate.set()
    await until(lambda: engine.in_worker == 0)
    assert engine.estimator.snapshot().queued_tokens == 0
    await engine.stop()


async def test_texts_the_tokenizer_cannot_read_fail_only_their_request(tokenizer):
    """Validation refuses lone surrogates before admission; should such a text reach the
    tokenizer anyway, the call for everyone fails: each request is then tokenized alone, the bad
    one fails with a clear error, the others are computed, and the batcher goes on."""
    runner = RowSums()
    engine, intake, first = await busy_engine(runner, tokenizer, lookahead=0, caps={4: 64, 8: 64, 16: 64},
                                              feed_delay_s=60.0)
    good = [intake.put(request([f"good text {i}"]), 5) for i in range(3)]
    bad = intake.put(request(["bad \ud800 text"]), 5)
    runner.gate.set()
    with pytest.raises(InvalidInput, match="the tokenizer could not read these texts"):
        await bad.future
    for r, i in zip(good, range(3)):
        np.testing.assert_array_equal(await r.future, expected(tokenizer, [f"good text {i}"]))
    await first.future
    later = intake.put(request(["still serving"]), 5)
    np.testing.assert_array_equal(await later.future, expected(tokenizer, ["still serving"]))
    assert engine.ready
    await until(lambda: engine.in_worker == 0)
    assert engine.estimator.snapshot().queued_tokens == 0
    await engine.stop()


async def test_a_text_the_tokenizer_cannot_read_is_invalid_input_off_the_intake_too(tokenizer):
    """Requests over INLINE_CHARS, and every request on a front end (FRONTENDS > 1), are tokenized
    by shaping.tokenize on a tokenizer thread, not here: the tokenizer's TypeError was a 500."""
    for text in ("bad \ud800 text", "\udfff a long text" * 50):
        r = texts_request([text], Limits(8, MAX_LENGTH, True), None, None, None)
        with pytest.raises(InvalidInput, match="the tokenizer could not read these texts"):
            await tokenize(tokenizer, None, r)


def test_chars_per_token_is_sampled_text_by_text(tokenizer):
    """A text crafted to read as one token counts the 16 characters one token may show (summed
    with the others before the ratio was held to that, it outweighed them: 256 characters read,
    here, for one token beside 11 for 2); a text cut at max_length is left out (its tokens are
    its first part's, its characters the whole's). The prompt is part of every text."""
    texts = ["hello world", "a" + " " * 4095, "word " * 100]
    _, lengths = tokenizer.encode(texts, True, "")
    assert tokenizer.sample(texts, "", lengths) == (11 + 16, 2 + 1)
    _, lengths = tokenizer.encode(texts[:1], True, "query: ")
    assert tokenizer.sample(texts[:1], "query: ", lengths) == (7 + 11, int(lengths[0]) - tokenizer.specials)


def test_encode_each_is_encode_per_request(hf):
    tok = TextTokenizer.from_hf(hf, MAX_LENGTH, truncate=True)
    long_text = " ".join(["word"] * 40)
    requests = [(["one text"], True, ""), (["two", "texts here"], True, "query: "), ([long_text], True, ""),
                (["short", long_text], False, ""), (["fits"], False, "passage: "), (["x" * 300], False, "")]
    for (texts, truncate, prompt), got in zip(requests, tok.encode_each(requests)):
        try:
            want = tok.encode(texts, truncate, prompt)
        except InvalidInput as e:
            assert isinstance(got, InvalidInput) and str(got) == str(e)
            continue
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
        assert got[0].dtype == np.int32 and got[1].dtype == np.int64
