"""A request into token rows: the checks, the prompt, tokenization, pre-tokenized input. The same
in one process and in each front end (FRONTENDS > 1), which then hand the rows to the model
process."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from concurrent.futures import Executor
from typing import NamedTuple

import numpy as np

from embedserve.config import CHARS_PER_TOKEN_BOUND
from embedserve.model import activation
from embedserve.model.declared import Head
from embedserve.errors import InvalidInput, NotReady, WrongTask
from embedserve.admission.gate import Caller
from embedserve.batching.infer_decode import decode
from embedserve.model.maxsim import maxsim
from embedserve.model import m3_rows
from embedserve.model.m3_rows import M3Rows
from embedserve.model.sparse_rows import SparseRows
from embedserve.batching import windows
from embedserve.batching.tokenization import TextTokenizer, validate_texts

# Requests with at most this many characters are tokenized on the event loop (~20 us for a
# query, ~200 us at the bound; in the model's process, many in one call: embedserve.batching.intake):
# handing them to a tokenizer thread costs more, since the thread then waits for the GIL the
# busy loop holds (up to the switch interval). Longer ones go to the tokenizer threads, which
# release the GIL while the Rust tokenizer runs.
INLINE_CHARS = 512
# A token-id row (HTTP input) may hold up to this many times the largest bucket's ids: cut at
# max_length (TRUNCATE), as a long text is. The HTTP schema refuses a longer row (422) on its
# length, before validating its ids one by one: a 33 MB body of one row had cost the event loop
# ~0.35 s and ~100 MiB of validation, only for all but its first ids to be cut. Generous: 8,192 ids with the
# default buckets, which is also OpenAI's limit on one input, so clients written for it fit.
ID_ROW_BOUND = 16


class Result(NamedTuple):
    rows: np.ndarray | SparseRows | M3Rows  # [n, dim] float32: embeddings, or logits when the task is classify
    # or rerank ([n, 1]); rerank's scores: [n]; SparseRows from embed_sparse; task bgem3: M3Rows
    tokens: int  # real tokens computed (usage)


@dataclasses.dataclass
class Limits:
    max_texts: int
    max_length: int  # tokens per text: the model's max_seq_length, capped by the largest bucket
    truncate: bool
    long_texts: str = "off"  # LONG_TEXTS: whether a request may have its long texts windowed
    text_tokens: int = 0  # MAX_TOKENS_PER_TEXT for this model: a windowed text's bound (config.text_tokens)
    max_states: int = 0  # token states (embed_all) a request may ask, MAX_REPLY_BYTES's worth as JSON (model_stack)


class Texts(NamedTuple):
    """An Embed request, checked: its texts, how to cut them, its prompt, and its content's key
    (a retry finds the room booked for it by that). A tuple: one per request, on the event loop.
    A Rerank request is one too, with its query: its rows are the (query, text) pairs."""

    texts: list[str]
    truncate: bool
    prompt: str
    key: int
    query: str | None = None
    side: str = ""  # a multi-vector request's: "query" or "document" (embedserve.batching.multivector_tokenization);
    # a BGE-M3 request's outputs beyond dense, "sparse,colbert"; an embed request's "states" (TEI's /embed_all) (embedserve.batching.flagged_tokenization)
    window: bool = False  # long texts embedded whole (embedserve.batching.windows)


def content_key(*parts) -> int:
    """A request's content → a 63-bit key, the same in every process (Python's hash() of str and
    bytes is salted per process: a retry landing on another front end would miss its booking)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        data = part if isinstance(part, (bytes, memoryview)) else str(part).encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return int.from_bytes(h.digest(), "little") >> 1


def texts_request(texts, limits: Limits, head: Head | None, truncate: bool | None, prompt_name: str | None,
                  window: bool = False, outputs: tuple[str, ...] = ()) -> Texts:
    """`outputs`: a bgem3 model's asked outputs (m3_rows.OUTPUTS; dense is every row's)."""
    truncate = limits.truncate if truncate is None else truncate
    texts = validate_texts(texts, limits.max_texts)
    try:
        prompt = head.prompt(prompt_name) if head else ""
    except KeyError as e:
        raise InvalidInput(e.args[0]) from None
    if window:  # read up to MAX_TOKENS_PER_TEXT's characters (windows.rows), keyed apart from a cut request:
        # on each text's first and last characters and its length (64 texts of 131 k characters hashed
        # whole held the loop ~0.18 s on a loaded host; a key only finds a retry's booked room)
        ends = [t[-limits.max_length * CHARS_PER_TOKEN_BOUND:] for t in texts]
        return Texts(texts, truncate, prompt, content_key("window", truncate, prompt, *read(texts, limits), *ends,
                                                          *map(len, texts)), window=True)
    side = ",".join(o for o in outputs if o != "dense")
    return Texts(texts, truncate, prompt, content_key(side, truncate, prompt, *read(texts, limits)), side=side)


def pairs_request(query, texts, limits: Limits, truncate: bool | None, head: Head | None = None) -> Texts:
    """A Rerank request, checked: the query and the texts it is paired with. A cross-encoder's
    default prompt goes before the query (the first text of each pair), as CrossEncoder puts it."""
    truncate = limits.truncate if truncate is None else truncate
    if not isinstance(query, str) or not query or query.isspace():
        raise InvalidInput("query is empty or whitespace only")
    texts = validate_texts(texts, limits.max_texts)
    query = (head.prompt(None) if head else "") + query
    return Texts(texts, truncate, "", content_key("rerank", truncate, *read([query, *texts], limits)), query)


def multivector_request(texts, limits: Limits, head: Head | None, truncate: bool | None, is_query: bool) -> Texts:
    """A multi-vector (ColBERT) model's texts of one side (embedserve.batching.multivector_tokenization
    reads `side`). The side's prompt as MultiVectorEncoder.encode_query / encode_document pick it:
    the model's "query" or "document" prompt (its prefix), else none, never the default prompt."""
    truncate = limits.truncate if truncate is None else truncate
    texts = validate_texts(texts, limits.max_texts)
    side = "query" if is_query else "document"
    prompt = (head.prompts if head else {}).get(side) or ""
    return Texts(texts, truncate, prompt, content_key(side, truncate, prompt, *read(texts, limits)), side=side)


def read(texts: list[str], limits: Limits) -> list[str]:
    """What the tokenizer reads of each text: its first max_length × CHARS_PER_TOKEN_BOUND
    characters (tokenization cuts the rest). A request's key is taken over these: hashing a
    25 MB text whole held the event loop ~55 ms for characters no row depends on."""
    most = limits.max_length * CHARS_PER_TOKEN_BOUND
    return [t if len(t) <= most else t[:most] for t in texts]


def chars(r: Texts) -> int:
    """A request's characters, a pair's query counted once per text (each pair is a row)."""
    return sum(map(len, r.texts)) + len(r.query or "") * len(r.texts)


async def tokenize(tokenizer: TextTokenizer, executor: Executor | None, r: Texts) -> tuple[np.ndarray, np.ndarray]:
    if chars(r) <= INLINE_CHARS:  # a thread hop costs more than the work
        return tokenizer.encode(r.texts, r.truncate, r.prompt, r.query, r.side)
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(executor, tokenizer.encode, r.texts, r.truncate, r.prompt, r.query, r.side)


def id_lists(rows: list[list[int]], limits: Limits, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Token id lists (HTTP input) → right-padded int32 ids and lengths, every check named. Rows
    are counted and cut at max_length (or refused) before any array is made: padded to its
    longest row as sent, one row of 200,000 ids beside 511 short ones held 1.1 GB at its peak."""
    if not rows or len(rows) > limits.max_texts:
        raise InvalidInput(f"send 1 to {limits.max_texts} token lists, got {len(rows)}")
    counts = [len(r) for r in rows]
    if 0 in counts:
        raise InvalidInput("token lists must not be empty")
    if max(counts) > limits.max_length:
        if not limits.truncate:
            row = next(i for i, n in enumerate(counts) if n > limits.max_length)
            raise InvalidInput(_too_long(row, counts[row], limits.max_length))
        rows = [r[: limits.max_length] for r in rows]
    lengths = np.array([len(r) for r in rows], dtype=np.int64)
    ids = np.zeros((len(rows), int(lengths.max())), dtype=np.int64)  # checked before narrowing
    bad = f"token ids must be in [0, {vocab_size}) (the model's vocabulary)"
    try:
        for i, r in enumerate(rows):
            ids[i, : len(r)] = r
    except OverflowError:
        raise InvalidInput(bad) from None
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise InvalidInput(bad)
    return ids.astype(np.int32), lengths


def _too_long(row: int, tokens: int, top: int) -> str:
    return (f"row {row} has {tokens} tokens, more than {top} (the model's max_seq_length, capped by the "
            "largest bucket), and TRUNCATE is off")


def cut(ids: np.ndarray, lengths: np.ndarray, limits: Limits) -> tuple[np.ndarray, np.ndarray]:
    """Pre-tokenized rows cut at max_length (or refused, TRUNCATE off)."""
    top = limits.max_length
    if ids.shape[1] <= top:
        return ids, lengths
    if not limits.truncate and (lengths > top).any():
        row = int(np.flatnonzero(lengths > top)[0])
        raise InvalidInput(_too_long(row, int(lengths[row]), top))
    return ids[:, :top], np.minimum(lengths, top)


# What to call instead, by the task a server does.
_USE = {"classify": "POST /classify", "rerank": "Rerank, POST /rerank or /v1/rerank", "embed": "Embed or /v1/embeddings",
        "sparse": "EmbedSparse or POST /embed_sparse",
        "multivector": "EmbedMultiVector or POST /embed_multivector (and Rerank, POST /rerank or /v1/rerank: MaxSim)",
        "bgem3": "Embed (its outputs), /embed, /v1/embeddings or /embed_sparse"}
# Tasks a server serves besides its own: a multi-vector model reranks (MaxSim); a BGE-M3 server's
# one pass also answers the embed and sparse tasks' calls (embedserve.model.m3).
_ALSO = {"multivector": ("rerank",), "bgem3": ("embed", "sparse")}


def require_task(served: str, task: str) -> None:
    if task != served and task not in _ALSO.get(served, ()):
        raise WrongTask(f"this server's model does {served} (TASK={served}), not {task}: use {_USE.get(served, served)}")


class InFlight:
    """The requests inside, for a graceful stop: refused once draining, waited for until none is
    left. `refusal()` says why a request may not come in now (None: it may)."""

    def __init__(self):
        self.draining = False
        self.in_flight = 0  # admitted requests not yet answered: what a graceful stop waits for
        self._idle = asyncio.Event()
        self._idle.set()

    def refusal(self) -> Exception | None:
        return NotReady("server is shutting down") if self.draining else None

    @property
    def ready(self) -> bool:
        return self.refusal() is None

    async def drained(self) -> None:
        """Returns once no admitted request is left unanswered (new ones are refused while
        draining, so this only waits for the ones already inside)."""
        await self._idle.wait()

    def _tracked(self) -> "InFlight":
        """`with self._tracked():` around a request inside (refused while draining)."""
        return self

    def __enter__(self) -> None:
        if (error := self.refusal()) is not None:
            raise error
        self.in_flight += 1
        self._idle.clear()

    def __exit__(self, *exc) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()


class PreTokenized(InFlight):
    """The pre-tokenized entry points, the same in one process and in a front end: rows decoded
    and checked here, then `_rows` (admit and compute, or send to the model process)."""

    tokenizer: TextTokenizer
    limits: Limits
    activation: str = ""  # rerank: the cross-encoder's (embedserve.model.activation)
    head: Head | None = None  # prompts, normalize, truncate_dim (None: the simulated device's tests)
    task: str = "embed"

    async def rerank(self, query: str, texts, caller: Caller = Caller(), truncate: bool | None = None,
                     raw_scores: bool = False) -> Result:
        """(query, text) pairs → one score per text, in order: the model's logit, through its
        activation unless `raw_scores`. The pairs are rows like any others (admitted in real tokens,
        bucketed, batched, possibly over several batches)."""
        if self.task == "multivector":  # late interaction: MaxSim of the two sides' token vectors
            with self._tracked():
                return await self._maxsim(query, texts, caller, truncate)
        with self._tracked():
            out = await self._texts(pairs_request(query, texts, self.limits, truncate, self.head), caller)
        # The activation sees each pair's row ([n, 1]), as CrossEncoder applies it: a declared
        # Softmax over the request's pairs instead would rank them against each other.
        scores = out.rows if raw_scores else activation.apply(self.activation, out.rows)
        return Result(scores[:, 0], out.tokens)

    async def infer(self, input_ids: bytes, attention_mask: bytes, shape, caller: Caller = Caller()) -> Result:
        """Pre-tokenized rows (int32 LE bytes, right-padded) → one output row per row."""
        with self._tracked():
            ids, lengths = decode(input_ids, attention_mask, shape, self.tokenizer.vocab_size, self.limits.max_texts)
            return await self._rows(ids, lengths, content_key(input_ids, attention_mask, *shape), caller)

    async def infer_ids(self, rows: list[list[int]], caller: Caller = Caller(), outputs: tuple[str, ...] = ()) -> Result:
        """Token id lists (HTTP input) → the same path as Infer. `outputs`: a bgem3 model's, put
        on the rows' first ids here, once the ids are checked against the vocabulary (a client's
        ids never carry flags of their own: embedserve.batching.flagged_tokenization)."""
        with self._tracked():
            ids, lengths = id_lists(rows, self.limits, self.tokenizer.vocab_size)
            side = ",".join(o for o in outputs if o != "dense")
            key = content_key(side, np.ascontiguousarray(ids).tobytes(), np.ascontiguousarray(lengths).tobytes(), *ids.shape)
            if side and self.task == "bgem3" and ids.size:
                ids = np.array(ids)  # its own copy: the flags go on it
                ids[:, 0] |= m3_rows.flags_of(side)
            return await self._rows(ids, lengths, key, caller)

    async def _rows(self, ids: np.ndarray, lengths: np.ndarray, key: int, caller: Caller) -> Result:
        raise NotImplementedError

    async def embed_sparse(self, texts, caller: Caller = Caller(), truncate: bool | None = None,
                           prompt_name: str | None = None, long_text: str = "") -> Result:
        """SPLADE (task sparse): Embed's path (checks, prompt, admission and usage in real tokens,
        batching), each text's row as SparseRows: made sparse per batch on the model worker
        (embedserve.model.sparse_rows says why), gathered so, and sent so over IPC."""
        result = await self.embed_texts(texts, caller, truncate, prompt_name, long_text,  # "window": refused (task)
                                        outputs=("sparse",) if self.task == "bgem3" else ())
        return result._replace(rows=result.rows.sparse) if isinstance(result.rows, M3Rows) else result

    async def embed_all(self, texts, caller: Caller = Caller(), truncate: bool | None = None,
                        prompt_name: str | None = None) -> Result:
        """TEI's /embed_all (task embed): per text, every token's last hidden state (special
        tokens included, before pooling), as TokenRows: Embed's path (admission, tokenization
        with the others or on a tokenizer thread), the states bounded by their real tokens once
        tokenized, before the model runs (EmbeddingService.states_fit)."""
        if self.task != "embed":  # not require_task: bgem3 answers embed's calls, not this one
            raise WrongTask(f"this server's model does {self.task} (TASK={self.task}): token states (/embed_all) are "
                            f"an embed model's; use {_USE.get(self.task, self.task)}")
        with self._tracked():
            return await self._texts(texts_request(texts, self.limits, self.head, truncate, prompt_name,
                                                   outputs=("states",)), caller)

    async def embed_multivector(self, texts, is_query: bool, caller: Caller = Caller(),
                                truncate: bool | None = None) -> Result:
        """A multi-vector model's token vectors (task multivector): queries or documents, each
        text's as embedserve.model.token_rows.TokenRows (prefix and expansion by side at
        tokenization, embedserve.batching.multivector_tokenization)."""
        with self._tracked():
            return await self._texts(multivector_request(texts, self.limits, self.head, truncate, is_query), caller)

    async def _maxsim(self, query: str, texts, caller: Caller, truncate: bool | None) -> Result:
        """Rerank on a multi-vector model: the query's token vectors and the texts' (as documents;
        two requests, computed together) → MaxSim scores in text order; usage counts both."""
        if not isinstance(query, str) or not query or query.isspace():
            raise InvalidInput("query is empty or whitespace only")
        documents = multivector_request(texts, self.limits, self.head, truncate, False)
        asked = asyncio.ensure_future(self._texts(multivector_request([query], self.limits, self.head, truncate, True),
                                                  caller))
        asked.add_done_callback(lambda f: f.cancelled() or f.exception())  # read when the documents fail first
        try:
            docs = await self._texts(documents, caller)
        except BaseException:
            asked.cancel()
            raise
        try:
            q = await asked
        except InvalidInput as e:  # the query's own refusal, named as the field it came in
            raise InvalidInput(str(e).replace("texts[0]", "query")) from None
        return Result(maxsim(q.rows.row(0), docs.rows), q.tokens + docs.tokens)

    async def embed_texts(self, texts, caller: Caller = Caller(), truncate: bool | None = None,
                          prompt_name: str | None = None, long_text: str = "", outputs: tuple[str, ...] = ()) -> Result:
        """Texts → one output row per text, in order. `truncate` overrides TRUNCATE;
        `prompt_name` picks one of the model's declared prompts (default: its default prompt);
        `long_text` "window": long texts embedded whole (embedserve.batching.windows); `outputs`:
        a bgem3 model's (transports.m3_reply.wanted), computed for this request's rows only."""
        with self._tracked():
            window = windows.check(long_text, self.limits.long_texts, self.task)
            return await self._texts(texts_request(texts, self.limits, self.head, truncate, prompt_name, window,
                                                   outputs), caller)

    async def _texts(self, r: Texts, caller: Caller) -> Result:
        """A checked request of texts (or pairs) → its rows, computed (inside `_tracked`)."""
        raise NotImplementedError
