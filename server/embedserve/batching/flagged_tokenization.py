"""Texts → token rows whose first ids carry what each request asks of its rows (flags: bits above
every vocabulary, cleared on the device before the encoder reads the ids): a BGE-M3 request's
outputs beyond dense (task bgem3, embedserve.model.m3_rows.FLAGS), an embed request's raw token
states (TEI's /embed_all, embedserve.model.states_rows.STATES). The tokenizer is where a
request's rows are made, in the process that read it (the model process, or a front end with
FRONTENDS > 1), so what they ask travels with them through the queues, the batches and IPC as
ids, like a multi-vector row's side, and the worker copies off the device only what each row
asked for."""

from __future__ import annotations


from embedserve.batching.tokenization import TextTokenizer
from embedserve.model import m3_rows, states_rows

# The task's reading of a request's fifth field (Texts.side) as flags.
FLAGS_OF = {"bgem3": m3_rows.flags_of, "embed": states_rows.flags_of}


class FlaggedTokenizer(TextTokenizer):
    def __init__(self, *args, flags: str = "embed", **kwargs):
        super().__init__(*args, **kwargs)
        self._flags_of = FLAGS_OF[flags]
        self.spec = {**self.spec, "flags": flags}  # a front end's from_spec builds this class

    def encode_each(self, requests: list[tuple]) -> list:
        """TextTokenizer.encode_each; a request's fifth field (what it asks: "sparse,colbert",
        "states") put on its rows' first ids (a copy: the rows are views of one array)."""
        out = super().encode_each([r[:4] for r in requests])
        for i, r in enumerate(requests):
            flags = self._flags_of(r[4]) if len(r) > 4 and r[4] else 0
            if flags and not isinstance(out[i], Exception):
                ids, lengths = out[i]
                ids = ids.copy()
                ids[:, 0] |= flags
                out[i] = (ids, lengths)
        return out
