"""Long texts' windows (embedserve.batching.windows): the spans, the estimate admission counts,
the pieces a long text is read in, the rows, and the pooling, each against what it promises."""

from __future__ import annotations

import numpy as np
import pytest

from embedserve.batching import windows
from embedserve.batching.tokenization import TextTokenizer
from embedserve.errors import InvalidInput
from tests.conftest import make_text


@pytest.fixture(scope="module")
def tokenizer(model_dir) -> TextTokenizer:
    from transformers import AutoTokenizer

    return TextTokenizer.from_hf(AutoTokenizer.from_pretrained(model_dir), 32, True, lower_case=True)


@pytest.mark.parametrize("room", [1, 2, 3, 4, 7, 30])
def test_spans_cover_every_token_with_the_documented_overlap(room):
    for n in range(1, 200):
        spans = windows.spans(n, room)
        assert len(spans) == windows.windows_of(n, room)
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(0 < stop - start <= room for start, stop in spans)
        overlap = room // windows.OVERLAP
        for (a, b), (c, d) in zip(spans, spans[1:]):
            assert b - c == overlap and b == a + room  # all but the last are full windows
        covered = np.zeros(n, bool)
        for a, b in spans:
            covered[a:b] = True
        assert covered.all()


def test_estimate_is_exact_on_a_known_token_count():
    """Admission's estimate of a text of known tokens equals its rows' tokens."""
    for tokens in (10, 30, 31, 100, 1000):
        for prompt in (0, 3):
            specials, max_length = 2, 32
            room = max_length - specials - prompt
            rows = windows.spans(tokens - prompt, room) if tokens + specials > max_length else [(0, tokens - prompt)]
            want = sum(b - a + specials + prompt for a, b in rows)
            assert windows.estimate(tokens, prompt, specials, max_length) == want, (tokens, prompt)


def test_pieces_split_before_whitespace_and_rejoin():
    rng = np.random.default_rng(0)
    text = make_text(rng, 3000)
    parts = windows.pieces(text, 1000)
    assert "".join(parts) == text and all(len(p) <= 1000 for p in parts) and len(parts) > 1
    assert all(p[0] == " " for p in parts[1:])
    assert windows.pieces("x" * 2500, 1000) == ["x" * 1000, "x" * 1000, "x" * 500]


def test_read_in_pieces_as_read_whole_and_bounded(tokenizer):
    from tokenizers import Tokenizer

    rng = np.random.default_rng(1)
    text = make_text(rng, 40000)  # ~270 k characters: several pieces
    whole = Tokenizer.from_str(tokenizer.spec["tokenizer_json"])
    whole.no_truncation()
    want = whole.encode(text.lower(), add_special_tokens=False).ids
    (got,) = windows.text_ids(tokenizer, [text], len(want) + 10)
    assert got.tolist() == want
    (cut,) = windows.text_ids(tokenizer, [text], 1000)
    assert cut.tolist() == want[:1001]  # one past the bound: enough to know it is over


def test_rows_fit_or_window(tokenizer):
    rng = np.random.default_rng(2)
    short, long = make_text(rng, 5), make_text(rng, 100)
    out = windows.rows(tokenizer, [short, long], "", True, 1000)
    plain, plain_lengths = tokenizer.encode([short], True)
    assert out.ids[0, : out.lengths[0]].tolist() == plain[0, : plain_lengths[0]].tolist()  # the unwindowed row
    (before, after) = tokenizer.around
    body = tokenizer.bare_ids([long])[0]
    spans = windows.spans(len(body), 32 - 2)
    assert out.owners.tolist() == [0] + [1] * len(spans)
    for j, (a, b) in enumerate(spans, start=1):
        assert out.ids[j, : out.lengths[j]].tolist() == before + body[a:b] + after
    # A prompt is in every window.
    prompted = windows.rows(tokenizer, [long], "query: ", True, 1000)
    prompt = tokenizer.bare_ids(["query: "])[0]
    assert all(prompted.ids[j, 1 : 1 + len(prompt)].tolist() == prompt for j in range(len(prompted.lengths)))
    assert prompted.lengths.max() <= 32


def test_rows_bounded_by_max_tokens(tokenizer):
    rng = np.random.default_rng(3)
    text = make_text(rng, 500)
    with pytest.raises(InvalidInput, match="MAX_TOKENS_PER_TEXT"):
        windows.rows(tokenizer, [text], "", False, 100)
    with pytest.raises(InvalidInput, match="MAX_TOKENS_PER_TEXT"):
        windows.rows(tokenizer, ["x" * 1601], "", False, 100)  # over the characters read, before tokenizing
    out = windows.rows(tokenizer, [text], "", True, 100)
    assert int(out.lengths.sum()) - 2 * len(out.lengths) == 100 + (len(out.lengths) - 1) * (30 // windows.OVERLAP)


def test_pool_weighs_vectors_before_normalize_by_tokens():
    rng = np.random.default_rng(4)
    u = rng.standard_normal((5, 8))
    norms = np.linalg.norm(u, axis=1)
    v = (u / norms[:, None]).astype(np.float32)
    lengths = np.array([7, 32, 32, 10, 3])
    owners = np.array([0, 1, 1, 1, 2])
    out = windows.pool(v, norms.astype(np.float32), lengths, owners, 3, normalize=True)
    want = (u[1:4] * lengths[1:4, None]).sum(0) / lengths[1:4].sum()
    assert np.abs(out[1] - want / np.linalg.norm(want)).max() < 1e-6
    assert out[0].tobytes() == v[0].tobytes() and out[2].tobytes() == v[4].tobytes()  # one window: untouched
    raw = windows.pool(u.astype(np.float32), None, lengths, owners, 3, normalize=False)
    assert np.abs(raw[1] - want).max() < 1e-5


def test_check_names_the_setting_and_the_task():
    assert not windows.check("", "window", "embed")
    assert windows.check("window", "window", "embed")
    with pytest.raises(InvalidInput, match="LONG_TEXTS=window"):
        windows.check("window", "off", "embed")
    with pytest.raises(InvalidInput, match="task embed"):
        windows.check("window", "window", "sparse")
    with pytest.raises(InvalidInput, match="'sliding'"):
        windows.check("sliding", "window", "embed")
