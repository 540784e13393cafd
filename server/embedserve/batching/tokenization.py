"""Texts → right-padded int32 token ids and lengths, with the model's fast tokenizer, prepared as
sentence-transformers prepares them: the prompt put before each text, lower-cased when the model
declares do_lower_case, cut at its max_seq_length. A rerank request's (query, text) pairs are
encoded as pairs (the tokenizer's pair template: [CLS] query [SEP] text [SEP] for BERT), cut
longest first at the same length, as CrossEncoder has its tokenizer cut them.

Short requests are encoded on the event loop (in the model's process many at once,
`encode_each`: embedserve.batching.intake), longer ones on the tokenizer threads (the Rust tokenizer
releases the GIL there).
"""

from __future__ import annotations

import json

import numpy as np
from tokenizers import Tokenizer, normalizers

# CHARS_PER_TOKEN_BOUND (kept with the settings whose sizes follow from it): a text is cut at this
# many characters per token of max_length before it is tokenized: the tokenizer reads a whole text
# before truncating, and a 4 MiB text would hold a tokenizer thread for seconds. Generous (English
# runs 4-5 characters per token, code and URLs less): only texts whose first max_length tokens span
# more than this are tokenized differently, and those are cut either way.
from embedserve.config import CHARS_PER_TOKEN_BOUND
from embedserve.errors import InvalidInput
from embedserve.batching.prompted_pairs import Pieces, PromptedPairs

# Characters per token a text may show: from a symbol or CJK character split into byte tokens, to
# the bound at which texts are cut before tokenizing anyway.
CHARS_PER_TOKEN_RANGE = (0.25, float(CHARS_PER_TOKEN_BOUND))
# Characters the Rust tokenizer is handed at once. It reads a whole text before truncating it and
# keeps every token (~140 bytes each, the overflow pieces included) until the call returns: 512
# texts of 4,096 "!" were 2.1 M tokens, +272 MiB, in one call; in calls of this many characters
# a request holds ~10 MiB of them at a time (bytes of a character's UTF-8: up to 4 tokens).
GROUP_CHARS = 65536


def _lowercasing(tok: Tokenizer) -> None:
    """Lower-case before the model's own normalizer, unless that already does (as
    sentence-transformers does for do_lower_case)."""
    current = json.loads(tok.to_str()).get("normalizer")
    if current and ("Lowercase" in json.dumps(current) or current.get("lowercase")):
        return
    tok.normalizer = normalizers.Sequence([normalizers.Lowercase(), tok.normalizer]) if tok.normalizer else normalizers.Lowercase()


class TextTokenizer:
    def __init__(self, tokenizer_json: str, pad_id: int, vocab_size: int, max_length: int, truncate: bool,
                 lower_case: bool = False, pair_prompt: dict | None = None):
        """`tokenizer_json`: the model's Rust tokenizer, serialized (a front end gets it from the
        model process: no model files, no transformers, no torch there). `pair_prompt`: an LLM
        reranker's chat-template pieces (embedserve.batching.prompted_pairs.Pieces as a dict):
        its pairs are rows of that prompt instead of the tokenizer's pair encoding."""
        # Private copies with our settings instead of the model repo's: no padding; one cuts at
        # max_length, the other one past it, to detect over-long input.
        def copy(limit: int) -> Tokenizer:
            tok = Tokenizer.from_str(tokenizer_json)
            tok.no_padding()
            tok.enable_truncation(limit)
            if lower_case:
                _lowercasing(tok)
            return tok

        self._cutting, self._checking = copy(max_length), copy(max_length + 1)
        # A pair's sides, each read alone with no special token (pair_rows).
        self._bare = copy(max_length)
        self._bare.no_truncation()
        self._whole: Tokenizer | None = None  # no truncation: /tokenize with truncate off, made when first asked
        self._copy = copy
        self.max_length = max_length
        self.max_chars = max_length * CHARS_PER_TOKEN_BOUND
        self.truncate = truncate
        # Tokens the model adds to every text ([CLS] and [SEP] for BERT): a text's token count
        # is its characters' share plus these.
        self.specials = len(self._cutting.encode("").ids)
        try:  # [CLS] [SEP] [SEP] for BERT; a post-processor with no pair template refuses pairs
            self._template = pair_template(self._cutting)
            self.pair_specials = sum(map(len, self._template))
        except Exception:  # noqa: BLE001 - such a model never reranks (rerank needs a pair encoding)
            self._template, self.pair_specials = None, 2 * self.specials
        self._prompted = PromptedPairs(Pieces(**pair_prompt), self._bare, max_length) if pair_prompt else None
        if self._prompted is not None:  # a pair's own tokens are the prompt's
            self.pair_specials = self._prompted.overhead
        self.pad_id, self.vocab_size = pad_id, vocab_size
        self.spec = {"tokenizer_json": tokenizer_json, "pad_id": pad_id, "vocab_size": vocab_size,
                     "max_length": max_length, "lower_case": lower_case, "pair_prompt": pair_prompt}

    @classmethod
    def from_hf(cls, hf_tokenizer, max_length: int, truncate: bool, lower_case: bool = False,
                pair_prompt: dict | None = None, **extra) -> "TextTokenizer":
        pad = hf_tokenizer.pad_token_id
        return cls(hf_tokenizer.backend_tokenizer.to_str(), int(pad if pad is not None else 0), len(hf_tokenizer),
                   max_length, truncate, lower_case, pair_prompt, **extra)

    def bare_ids(self, texts: list[str]) -> list[list[int]]:
        """Texts → their ids with no special token and no cut (long texts' windows:
        embedserve.batching.windows, which reads a text in bounded pieces)."""
        return [e.ids for e in self._bare.encode_batch_fast(texts, add_special_tokens=False)]

    @property
    def around(self) -> tuple[list[int], list[int]]:
        """The special ids the post-processor puts before and after one text ([CLS] / [SEP] for BERT)."""
        empty, first = self._cutting.encode("").ids, self._cutting.encode("a").ids
        i = next((k for k, (x, y) in enumerate(zip(empty, first)) if x != y), len(empty))
        return empty[:i], empty[i:]

    def encode_pairs(self, query: str, texts: list[str], truncate: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(query, text) pairs → what `encode` returns, one row per text: the Rust tokenizer's pair
        encoding, cut longest first at max_length (CrossEncoder's `truncation="longest_first"`),
        or refused when truncation is off."""
        return self.encode(texts, truncate, "", query)

    def encode(self, texts: list[str], truncate: bool | None = None, prompt: str = "",
               query: str | None = None, side: str = "") -> tuple[np.ndarray, np.ndarray]:
        """→ ids [n, longest] int32 (pad id after each row), lengths [n], the prompt's tokens
        included. Over-long texts are cut (truncate, default TRUNCATE) or refused, and texts the
        tokenizer cannot read (a lone surrogate: JSON may carry one) are an InvalidInput too."""
        try:
            (result,) = self.encode_each([(texts, self.truncate if truncate is None else truncate, prompt, query, side)])
        except (TypeError, ValueError) as e:  # the Rust tokenizer's refusal of a str it cannot read
            raise unreadable(e) from None
        if isinstance(result, InvalidInput):
            raise result
        return result

    def encode_each(self, requests: list[tuple]) -> list[tuple[np.ndarray, np.ndarray] | InvalidInput]:
        """Many requests' (texts, truncate, prompt[, query]) in one call of the Rust tokenizer per
        truncation setting (GROUP_CHARS at a time): → per request, what `encode` returns (views of
        one array), or the InvalidInput it would raise. One text at a time, a tokenizer between
        requests runs with its tables out of the CPU's caches: ~40 us for a short query inside a
        busy server, ~12 us in a loop. A request with a query (not None) is rerank's: its texts are
        encoded as (query, text) pairs (pair_rows). A fifth field, a multi-vector request's side,
        is read by embedserve.batching.multivector_tokenization (here: none)."""
        out: list = [None] * len(requests)
        for truncate in (True, False):
            singles, owners = [], []  # owners: (request, its pairs' rows or None, its texts)
            for i, (request_texts, cut, prompt, *query) in enumerate(requests):
                if bool(cut) is not truncate:
                    continue
                try:
                    prepared = self._prepared(request_texts, truncate, prompt)
                    if query and query[0] is not None:
                        (q,) = self._prepared([query[0]], truncate, "", "query")
                        rows = (self._prompted.rows(q, prepared, truncate, groups) if self._prompted is not None
                                else self.pair_rows(q, prepared, truncate))
                        owners.append((i, rows, len(prepared)))
                        continue
                except InvalidInput as e:
                    out[i] = e
                    continue
                owners.append((i, None, len(prepared)))
                singles += prepared
            if not owners:
                continue
            tok = self._cutting if truncate else self._checking
            encoded = iter([e.ids for group in groups(singles) for e in tok.encode_batch_fast(group)])  # fast: no offsets
            rows = [r for _, pairs, n in owners for r in (pairs if pairs is not None else (next(encoded) for _ in range(n)))]
            lens = list(map(len, rows))
            ids, lengths = self._padded(rows, lens)
            start = 0
            for i, pairs, n in owners:
                mine = lens[start : start + n]
                too_long = None if truncate else next((j for j, k in enumerate(mine) if k > self.max_length), None)
                if too_long is None:
                    out[i] = ids[start : start + n, : max(mine)], lengths[start : start + n]
                else:
                    what = f"texts[{too_long}]" if pairs is None else f"the pair (query, texts[{too_long}])"
                    out[i] = InvalidInput(f"{what} is longer than {self.max_length} tokens (the model's "
                                          "max_seq_length, capped by the largest bucket) and truncation is off")
                start += n
        return out

    def pair_rows(self, query: str, texts: list[str], truncate: bool) -> list[list[int]]:
        """(query, text) pairs → their ids, as the tokenizer's own pair encoding gives them: each
        side read alone, cut longest first (longest_first: the Rust tokenizer's rule) to
        max_length with the pair template's special tokens around them; the query read once. With
        truncation off, rows are cut one past max_length (only their being longer matters).
        The tokenizer's own pair encoding split each over-long side into pieces and paired every
        piece of one side with every piece of the other: a query and a text of 4,096 "!" made
        1,024 encodings of 256 tokens, and 512 such pairs took 22 GB."""
        if self._template is None:
            raise InvalidInput("this model's tokenizer has no template for pairs: it cannot rerank")
        lengths, firsts = [], []
        for group in groups([query, *texts]):
            for e in self._bare.encode_batch_fast(group, add_special_tokens=False):
                ids = e.ids
                lengths.append(len(ids))
                firsts.append(ids[: self.max_length])
        before, between, after = self._template
        budget = self.max_length - self.pair_specials
        rows = []
        for n, ids in zip(lengths[1:], firsts[1:]):
            k1, k2 = longest_first(lengths[0], n, budget) if truncate else (self.max_length, self.max_length)
            rows.append((before + firsts[0][:k1] + between + ids[:k2] + after)[: self.max_length + 1])
        return rows

    def tokens(self, texts: list[str], prompt: str = "", add_special_tokens: bool = True,
               truncate: bool | None = None) -> list[list[tuple[int, str, bool, int | None, int | None]]]:
        """What the model reads of each text (HTTP /tokenize): per text, its tokens as (id, text,
        special, start, stop), start and stop character offsets into prompt + text (None for a
        special token, whose text is the token itself). Cut at max_length as embedding cuts
        (truncate, default TRUNCATE); not cut with truncate off, where embedding would refuse."""
        cut = self.truncate if truncate is None else truncate
        prepared = self._prepared(list(texts), cut, prompt)
        if cut:
            tok = self._cutting
        else:
            if self._whole is None:
                self._whole = self._copy(self.max_length)
                self._whole.no_truncation()
            tok = self._whole
        try:
            encodings = tok.encode_batch(prepared, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError) as e:
            raise unreadable(e) from None
        out = []
        for text, e in zip(prepared, encodings):
            out.append([(i, token, True, None, None) if special else (i, text[start:stop], False, start, stop)
                        for i, token, special, (start, stop) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets)])
        return out

    def decode(self, rows: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """Token ids → text (HTTP /decode); an id outside the vocabulary is named."""
        for i, row in enumerate(rows):
            bad = next((t for t in row if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidInput(f"ids[{i}] holds {bad}, outside the vocabulary [0, {self.vocab_size})")
        return self._cutting.decode_batch(rows, skip_special_tokens=skip_special_tokens)

    def sample(self, texts: list[str], prompt: str, lengths: np.ndarray, query: str | None = None) -> tuple[float, int]:
        """What characters per token is learned on (Estimator.learn_chars_per_token), from a
        tokenized request: its texts' characters and tokens (the prompt's included, the specials
        not), text by text. A text cut at max_length is left out: its tokens are its first part's,
        its characters the whole. Each text's characters are held to what CHARS_PER_TOKEN_RANGE
        allows for its tokens: 4,096 spaces read as one token count as 16 characters, for one
        token (summed over a request or several before being held, that text outweighed the rest).
        A pair's characters are its query's and its text's, its specials the pair template's."""
        low, high = CHARS_PER_TOKEN_RANGE
        chars, tokens = 0.0, 0
        before = len(prompt) + (0 if query is None else min(len(query), self.max_chars))
        specials = self.specials if query is None else self.pair_specials
        for text, n in zip(texts, lengths.tolist()):
            own = n - specials
            if own > 0 and n < self.max_length:
                chars += min(max(before + min(len(text), self.max_chars), low * own), high * own)
                tokens += own
        return chars, tokens

    def _prepared(self, texts: list[str], truncate: bool, prompt: str, field: str = "texts") -> list[str]:
        """The texts the Rust tokenizer reads: cut at max_chars (or refused), the prompt before each."""
        for i, t in enumerate(texts):
            if len(t) > self.max_chars:
                if not truncate:
                    name = f"{field}[{i}]" if field == "texts" else field
                    raise InvalidInput(f"{name} has {len(t)} characters, more than {self.max_chars} "
                                       f"({self.max_length} tokens × {CHARS_PER_TOKEN_BOUND}), and truncation is off")
                texts = [s[: self.max_chars] for s in texts]
                break
        return [prompt + t for t in texts] if prompt else texts

    def _padded(self, rows: list[list[int]], lens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Id lists (of lengths `lens`) → right-padded int32 ids and int64 lengths: padded as
        lists, then one conversion (fewer numpy calls than a masked fill: ~15 us against ~28
        for six queries with cold caches)."""
        width, pad = max(lens), [self.pad_id]
        ids = np.array([r + pad * (width - n) if n < width else r for r, n in zip(rows, lens)], dtype=np.int32)
        return ids, np.array(lens, dtype=np.int64)


def longest_first(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """Tokens kept of a pair's sides of n1 and n2 tokens within `budget`, as the Rust tokenizer's
    LongestFirst truncation keeps them (tests/server/batching: against it on every length up to
    30): both halves of the budget when both are long (the longer the odd one), else the short
    side whole and the rest to the long one. Pure."""
    if n1 + n2 <= budget:
        return n1, n2
    swap = n1 > n2
    short, long = (n2, n1) if swap else (n1, n2)
    long = short if short > budget else max(short, budget - short)
    if short + long > budget:
        short = budget // 2
        long = short + budget % 2
    k1, k2 = (long, short) if swap else (short, long)
    return min(k1, n1), min(k2, n2)


def pair_template(tok: Tokenizer) -> tuple[list[int], list[int], list[int]]:
    """The special ids a tokenizer's post-processor puts before, between and after a pair's two
    sides ([CLS] / [SEP] / [SEP] for BERT; <s> / </s></s> / </s> for RoBERTa), found where the
    sides of a probe pair land among them."""
    empty = tok.encode("", "").ids
    first = tok.encode("a", "").ids
    second = tok.encode("", "a").ids
    i = next((k for k, (x, y) in enumerate(zip(empty, first)) if x != y), len(empty))
    j = next((k for k, (x, y) in enumerate(zip(empty, second)) if x != y), len(empty))
    return empty[:i], empty[i:j], empty[j:]


def groups(texts: list) -> list[list]:
    """`texts` (strings, or pairs of them) in runs of at most GROUP_CHARS characters (one longer
    text: a run of its own)."""
    out, run, size = [], [], 0
    for t in texts:
        n = len(t) if isinstance(t, str) else len(t[0]) + len(t[1])
        if run and size + n > GROUP_CHARS:
            out.append(run)
            run, size = [], 0
        run.append(t)
        size += n
    if run:
        out.append(run)
    return out


def unreadable(error: Exception) -> InvalidInput:
    return InvalidInput(f"the tokenizer could not read these texts: {error}")


def vocab_ids(hf_tokenizer, tokens: tuple[str, ...]) -> list[int]:
    """EXCLUDE_TOKENS strings → ids; a token the vocabulary lacks is a start-up error."""
    vocab = hf_tokenizer.get_vocab()
    missing = [t for t in tokens if t not in vocab]
    if missing:
        raise ValueError(f"EXCLUDE_TOKENS: not in the model's vocabulary: {', '.join(missing)} "
                         f"(tokens are strings of its vocabulary, e.g. {hf_tokenizer.cls_token!r})")
    return [vocab[t] for t in tokens]


def validate_texts(texts, max_texts: int) -> list[str]:
    """The checks of an Embed request that need no tokenizer."""
    if len(texts) == 0:
        raise InvalidInput("texts is empty: send at least one text")
    if len(texts) > max_texts:
        raise InvalidInput(f"{len(texts)} texts exceed MAX_TEXTS_PER_REQUEST={max_texts}")
    for i, t in enumerate(texts):
        if not t or t.isspace():
            raise InvalidInput(f"texts[{i}] is empty or whitespace only")
    return list(texts)
