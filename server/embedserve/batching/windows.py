"""Long texts embedded whole (LONG_TEXTS=window, a request's long_text "window"): a text over the
model's max length is split into windows of that length, each window a row like any other (its
own special tokens, the prompt, bucketed and batched with every other row), and the windows'
vectors pooled back into one per text.

The rule (docs/api.md, "Long texts"), which the tests re-derive on their own:
- The text is tokenized with the prompt before it and no special token, read up to
  MAX_TOKENS_PER_TEXT tokens (past it: cut, or refused with truncate false). A text whose
  tokens, special tokens included, fit the max length is one row, the very row it is without
  windowing.
- A longer one: its tokens after the prompt's are laid out in windows of `room` = max length −
  the special tokens − the prompt's tokens, each overlapping the one before by a quarter of
  `room` (OVERLAP): windows start at 0, stride, 2 × stride, ... (stride = room − room // 4)
  until one reaches the end, the last one shorter. Each window is [specials before] prompt
  window [specials after]: the prompt is in every window, since a declared prompt (a query's or
  a document's instruction) conditions every vector the model makes of the text.
- Pooling: the windows' vectors before the model's Normalize, weighted by each window's tokens
  (its row's length, special tokens and prompt included: the tokens the model read), averaged,
  then normalized where the model normalizes. The model reports each row's norm before
  Normalize (model.pooling.Pooler, `norms`), so u = v × |u| here; a runner that reports none
  (the simulated device) has its vectors pooled as they are. A text of one window keeps its row
  as computed, bit for bit.

Usage counts every window's tokens (the rows computed), and admission estimates them
(`estimate`). Tokenizing reads a text in pieces of at most GROUP_CHARS characters cut before a
whitespace, and stops once it holds more than the text's bound: memory and time follow
MAX_TOKENS_PER_TEXT, not the text's length. Pure functions, but `tokenize`, which hands the
work to a tokenizer thread."""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import Executor
from typing import NamedTuple

import numpy as np

from embedserve.config import CHARS_PER_TOKEN_BOUND
from embedserve.errors import InvalidInput
from embedserve.batching.tokenization import GROUP_CHARS, TextTokenizer, unreadable

WINDOW = "window"
OVERLAP = 4  # consecutive windows share a quarter of a window's text tokens
INLINE_ROWS = 256  # windows pooled on the event loop (~1 ms); more on a thread (service)


class Windows(NamedTuple):
    """A windowed request's rows: ids [rows, width] int32 right-padded, lengths [rows], and the
    text each row belongs to (owners, ascending: a text's windows are consecutive rows)."""

    ids: np.ndarray
    lengths: np.ndarray
    owners: np.ndarray


def spans(n: int, room: int) -> list[tuple[int, int]]:
    """n tokens → the windows' [start, stop), at most `room` tokens each, overlapping by
    room // OVERLAP. Pure."""
    if room < 1:
        raise ValueError("a window holds at least one token")
    if n <= room:
        return [(0, n)]
    stride = room - room // OVERLAP
    return [(start, min(start + room, n)) for start in range(0, n - room + stride, stride)]


def windows_of(n: int, room: int) -> int:
    """How many windows `spans` makes of n tokens (without making them). Pure."""
    if n <= room:
        return 1
    stride = room - room // OVERLAP
    return 1 + math.ceil((n - room) / stride)


def estimate(tokens: float, prompt_tokens: float, specials: int, max_length: int) -> float:
    """The tokens a text of `tokens` (its prompt's included, no special token) is computed as:
    one row, or its windows' rows (overlaps and each window's specials and prompt counted). What
    admission counts before tokenizing. Pure."""
    if tokens + specials <= max_length:
        return tokens + specials
    room = max(1, int(max_length - specials - prompt_tokens))
    body = max(0.0, tokens - prompt_tokens)
    k = windows_of(math.ceil(body), room)
    return body + (k - 1) * (room // OVERLAP) + k * (specials + prompt_tokens)


def pieces(text: str, size: int = GROUP_CHARS) -> list[str]:
    """A text in pieces of at most `size` characters, each but the first starting at a whitespace
    (where the tokenizer's pre-tokenizers split anyway: BERT's, SentencePiece's metaspace and
    byte-level BPE read " word" alike whether it opens a piece or follows one); a run with no
    whitespace is cut where it must. Pure."""
    out, start = [], 0
    while len(text) - start > size:
        cut = max(text.rfind(" ", start + 1, start + size), text.rfind("\n", start + 1, start + size))
        cut = cut if cut > start else start + size
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def text_ids(tokenizer: TextTokenizer, texts: list[str], most: int) -> list[np.ndarray]:
    """Texts (the prompt already before each) → their ids with no special token, at most
    `most` + 1 each (one past: whether a text is over the bound is what matters beyond it). Read
    in pieces (`pieces`), GROUP_CHARS characters per call of the Rust tokenizer, the pieces of
    a text that already holds more than `most` tokens skipped."""
    chunks: list[list[np.ndarray]] = [[] for _ in texts]
    held = [0] * len(texts)
    queue = [(i, p) for i, t in enumerate(texts) for p in pieces(t)]
    at = 0
    while at < len(queue):
        group, size = [], 0
        while at < len(queue) and (not group or size + len(queue[at][1]) <= GROUP_CHARS):
            i, piece = queue[at]
            at += 1
            if held[i] <= most:
                group.append((i, piece))
                size += len(piece)
        if not group:
            continue
        try:
            encoded = tokenizer.bare_ids([p for _, p in group])
        except (TypeError, ValueError) as e:  # a str the Rust tokenizer cannot read (a lone surrogate)
            raise unreadable(e) from None
        for (i, _), ids in zip(group, encoded):
            if held[i] <= most:
                chunks[i].append(np.asarray(ids[: most + 1 - held[i]], dtype=np.int32))
                held[i] += len(chunks[i][-1])
    return [np.concatenate(c) if c else np.zeros(0, np.int32) for c in chunks]


def rows(tokenizer: TextTokenizer, texts: list[str], prompt: str, truncate: bool, most: int) -> Windows:
    """A windowed request's texts → its rows (the module's rule). `most`: MAX_TOKENS_PER_TEXT for
    this model (at least its max length)."""
    max_chars = most * CHARS_PER_TOKEN_BOUND
    for i, t in enumerate(texts):
        if len(t) > max_chars and not truncate:
            raise InvalidInput(f"texts[{i}] has {len(t)} characters, more than {max_chars} (MAX_TOKENS_PER_TEXT={most} "
                               f"× {CHARS_PER_TOKEN_BOUND}), and truncation is off")
    before, after = tokenizer.around
    specials = len(before) + len(after)
    prompt_ids = np.asarray(tokenizer.bare_ids([prompt])[0] if prompt else [], dtype=np.int32)
    room = tokenizer.max_length - specials - len(prompt_ids)
    if room < 1:
        raise InvalidInput(f"the prompt takes {len(prompt_ids)} tokens: no room for a window of text within the "
                           f"max length {tokenizer.max_length}")
    joint = text_ids(tokenizer, [prompt + t[:max_chars] for t in texts], most)
    head, tail = np.asarray(before, np.int32), np.asarray(after, np.int32)
    out, owners = [], []
    for i, ids in enumerate(joint):
        if len(ids) > most:
            if not truncate:
                raise InvalidInput(f"texts[{i}] is longer than {most} tokens (MAX_TOKENS_PER_TEXT) and truncation is off")
            ids = ids[:most]
        if len(ids) + specials <= tokenizer.max_length:  # the row it is unwindowed
            out.append(np.concatenate([head, ids, tail]))
            owners.append(i)
            continue
        # The prompt alone before each window; one that merges with the text's first token (no
        # tokenizer here does) stays in the first window only, as part of the text.
        p = len(prompt_ids) if np.array_equal(ids[: len(prompt_ids)], prompt_ids) else 0
        body, lead = ids[p:], prompt_ids[:p]
        for start, stop in spans(len(body), tokenizer.max_length - specials - p):
            out.append(np.concatenate([head, lead, body[start:stop], tail]))
            owners.append(i)
    lengths = np.fromiter(map(len, out), np.int64, len(out))
    padded = np.full((len(out), int(lengths.max())), tokenizer.pad_id, dtype=np.int32)
    for j, row in enumerate(out):
        padded[j, : len(row)] = row
    return Windows(padded, lengths, np.asarray(owners, dtype=np.int64))


async def tokenize(tokenizer: TextTokenizer, executor: Executor | None, texts: list[str], prompt: str, truncate: bool,
                   most: int) -> Windows:
    """`rows` on a tokenizer thread (a windowed text may be MAX_TOKENS_PER_TEXT long)."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, rows, tokenizer, texts, prompt, truncate, most)


def pool(vectors: np.ndarray, norms: np.ndarray | None, lengths: np.ndarray, owners: np.ndarray, texts: int,
         normalize: bool) -> np.ndarray:
    """A windowed request's rows → one vector per text (the module's rule): [texts, dim] float32.
    `norms`: each row's norm before Normalize (None: the vectors are pooled as they are)."""
    counts = np.bincount(owners, minlength=texts)
    out = np.empty((texts, vectors.shape[1]), dtype=np.float32)
    single = counts[owners] == 1
    out[owners[single]] = vectors[single]  # one window: its row, untouched
    many = ~single
    if many.any():
        weights = lengths[many].astype(np.float64)
        if norms is not None and normalize:
            weights = weights * norms[many]
        u = vectors[many] * weights[:, None]  # float64
        # A text's windows are consecutive rows: one segment sum per text (np.add.at was ~0.4 s
        # for 22 k windows of 384 on the event loop).
        mine = owners[many]
        starts = np.flatnonzero(np.r_[True, mine[1:] != mine[:-1]])
        whose = mine[starts]
        pooled = np.add.reduceat(u, starts, axis=0) / np.add.reduceat(lengths[many].astype(np.float64), starts)[:, None]
        if normalize:
            pooled /= np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
        out[whose] = pooled
    return out


def check(long_text: str, allowed: str, task: str) -> bool:
    """A request's long_text → whether its texts are windowed; what no server does is named."""
    if long_text in ("", None):
        return False
    if long_text != WINDOW:
        raise InvalidInput(f"long_text {long_text!r}: use \"window\" (or leave it empty: the server's way)")
    if allowed != WINDOW:
        raise InvalidInput("long_text \"window\" needs a server with LONG_TEXTS=window (this one cuts long texts, "
                           "or refuses them with truncate false)")
    if task != "embed":
        raise InvalidInput(f"long_text \"window\" embeds dense vectors (task embed); this server's task is {task}")
    return True
