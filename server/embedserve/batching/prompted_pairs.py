"""An LLM reranker's (query, text) pairs → token rows of its chat-template prompt
(embedserve.model.llm_prompt.Pieces), as sentence-transformers 6.2 tokenizes and cuts them:

- the rendered string is tokenized whole with add_special_tokens=False (apply_chat_template's
  call: the template writes its own special tokens, e.g. <|im_start|>); tokenizing the pieces
  apart would differ, byte-level BPE merging across the texts' edges;
- a row is cut at max_length from the tokenizer's truncation side (right by default:
  truncation="longest_first" on one sequence), and a row that reached max_length gets the
  template's tail written back over its last tokens (Transformer._restore_chat_template_suffix):
  an LLM reranker reads the logits at the last position, which must be the template's own end
  (e.g. "<|im_start|>assistant\\n"), not a cut document. The tail is the longest common token
  suffix of two renders with the fillers "0" and "1 2 3 4" as the pair's texts, derived as
  sentence-transformers derives it (Transformer._chat_template_suffix_ids).

In the model's process and in front ends (the Rust tokenizer only).
"""

from __future__ import annotations

from tokenizers import Tokenizer

from embedserve.errors import InvalidInput
from embedserve.model.llm_prompt import Pieces

# sentence-transformers' fillers for the template's tail (Transformer._chat_template_suffix_ids).
TAIL_FILLERS = ("0", "1 2 3 4")


class PromptedPairs:
    """Pieces → token rows with our (Rust) tokenizer: in the model's process and in front ends."""

    def __init__(self, pieces: Pieces, tok: Tokenizer, max_length: int):
        """`tok`: the model's tokenizer with no truncation and no padding (lower-casing as the
        model declares)."""
        self.pieces, self._tok, self.max_length = pieces, tok, max_length
        # The rows are cut in the Rust tokenizer, as transformers has it cut them (truncation on
        # one sequence, from the truncation side): only max_length (+ 1: with truncation off, to
        # see a row is longer) ids per row come back as Python ints, under the GIL. 512 pairs of
        # a long query and text read whole were 8 M ints, a 0.3 s stall of the event loop.
        self._cutting, self._checking = (self._truncating(tok, n, pieces.truncation_side)
                                         for n in (max_length, max_length + 1))
        first, second = (self._ids(pieces.render(f, f)) for f in TAIL_FILLERS)
        self.tail = _common_tail(first, second)
        # The prompt's own tokens, a pair's "specials" in admission's estimate.
        self.overhead = len(self._ids(pieces.render("", "")))

    @staticmethod
    def _truncating(tok: Tokenizer, limit: int, side: str) -> Tokenizer:
        out = Tokenizer.from_str(tok.to_str())
        out.enable_truncation(limit, direction=side)
        return out

    def _ids(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def rows(self, query: str, texts: list[str], truncate: bool, groups) -> list[list[int]]:
        """(query, text) pairs → their ids, cut at max_length (the tail restored) or, with
        truncation off, at max_length + 1 (only their being longer matters: the caller refuses
        them). `groups`: the runs in which the Rust tokenizer reads them."""
        tok = self._cutting if truncate else self._checking
        try:
            strings = [self.pieces.render(query, t) for t in texts]
            encoded = [e.ids for g in groups(strings) for e in tok.encode_batch_fast(g, add_special_tokens=False)]
        except (TypeError, ValueError) as e:  # a lone surrogate: the Rust tokenizer's refusal
            raise InvalidInput(f"the tokenizer could not read these texts: {e}") from None
        top = self.max_length if truncate else self.max_length + 1
        return [cut(ids, top, self.pieces.truncation_side, self.tail if truncate else ()) for ids in encoded]


def cut(ids: list[int], top: int, side: str, tail) -> list[int]:
    """One row cut to `top` tokens from `side`; a row that reaches `top` then ends with `tail`
    (as many of its tokens as fit), as sentence-transformers restores it on every row whose
    length reached max_length, cut or not. Pure."""
    if len(ids) > top:
        ids = ids[len(ids) - top:] if side == "left" else ids[:top]
    if len(ids) >= top and tail:
        keep = min(len(tail), len(ids))
        ids = ids[: len(ids) - keep] + list(tail[len(tail) - keep:])
    return ids


def _common_tail(first: list[int], second: list[int]) -> tuple[int, ...]:
    """The longest common token suffix of two renders; none when they never differ (no variable
    content: sentence-transformers does not trust the run then). Pure."""
    count = 0
    for a, b in zip(reversed(first), reversed(second)):
        if a != b:
            break
        count += 1
    return tuple(first[len(first) - count:]) if 0 < count < min(len(first), len(second)) else ()
