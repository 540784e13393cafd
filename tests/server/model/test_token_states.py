"""Raw token states (TEI's /embed_all) on the model side: an embed batch's rows flagged STATES on
their first id (the server's FlaggedTokenizer) get their tokens' last hidden states, equal to
transformers' own, padded and packed; the other rows get their pooled vectors only and nothing
is copied for them; a batch no row of which asked answers a plain array, as before. A request
takes its own side of a mixed batch."""

import asyncio

import numpy as np
import torch

from embedserve.batching.flagged_tokenization import FlaggedTokenizer
from embedserve.batching.queues import PendingRequest
from embedserve.model.batches import Batch, PackedBatch, PackSpec, layout
from embedserve.model.states_rows import STATES, StatesRows
from tests.server.model.test_varlen import encoder, tiny

TOL = 1e-4
TEXTS = [[5, 17, 9, 30, 2], [5, 44, 2], [5, 8, 8, 61, 70, 12, 2]]


def reference(path: str, rows: list[list[int]]) -> list[np.ndarray]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path).eval()
    with torch.inference_mode():
        return [model(input_ids=torch.tensor([r])).last_hidden_state[0].numpy() for r in rows]


def padded(rows: list[list[int]], asks: list[bool]) -> Batch:
    ids = torch.ones((len(rows) + 1, max(map(len, rows)) + 2), dtype=torch.int64)  # a dummy row, as captured shapes add
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
        ids[i, 0] |= STATES if asks[i] else 0
    mask[-1, 0] = 1
    return Batch(ids, mask, len(rows), sum(map(len, rows)), [])


def packed(rows: list[list[int]], asks: list[bool]) -> PackedBatch:
    lengths = np.array(list(map(len, rows)))
    cu, positions, segments, size = layout(lengths, PackSpec(max_len=16, max_rows=8, ladder=(32,)))
    stream = np.ones(size, dtype=np.int64)
    stream[: lengths.sum()] = np.concatenate([[r[0] | (STATES if a else 0), *r[1:]] for r, a in zip(rows, asks)])
    return PackedBatch(torch.from_numpy(stream), torch.from_numpy(positions), torch.from_numpy(segments),
                       torch.from_numpy(cu), 16, len(rows), int(lengths.sum()), [])


def test_asking_rows_get_their_token_states_padded_and_packed(tmp_path):
    path = tiny(tmp_path, "bert")
    want = reference(path, TEXTS)
    asks = [True, False, True]
    for attention, make in (("padded", padded), ("packed", packed)):
        enc = encoder(path, attention)
        assert enc.attention == attention and enc.states_dim == 32
        plain = enc.run(make(TEXTS, [False] * 3))
        assert isinstance(plain, np.ndarray)  # no row asked: the embed answer as it always was
        out = enc.run(make(TEXTS, asks))
        assert isinstance(out, StatesRows) and np.allclose(out.dense, plain, atol=1e-6), attention
        for i, asked in enumerate(asks):
            got = out.states.row(i)
            if asked:
                assert got.shape == want[i].shape and float(np.abs(got - want[i]).max()) <= TOL, (attention, i)
            else:
                assert len(got) == 0, (attention, i)


def test_a_request_takes_its_own_side_of_a_mixed_batch(tmp_path):
    path = tiny(tmp_path, "bert")
    enc = encoder(path, "padded")
    out = enc.run(padded(TEXTS, [True, False, True]))
    loop = asyncio.new_event_loop()
    try:
        dense, states = (PendingRequest(1, enc.dim, loop.create_future()) for _ in range(2))
        states.states = True
        dense.deliver(np.array([0]), out[1:2])
        states.deliver(np.array([0]), out[0:1])
        assert isinstance(dense.future.result(), np.ndarray) and dense.future.result().shape == (1, enc.dim)
        assert states.future.result().row(0).shape == (len(TEXTS[0]), 32)
    finally:
        loop.close()


def test_the_tokenizer_flags_what_a_request_asks(model_dir):
    from transformers import AutoTokenizer

    tok = FlaggedTokenizer.from_hf(AutoTokenizer.from_pretrained(model_dir), 128, True, flags="embed")
    (plain, n), (flagged, m) = tok.encode_each([(["a text"], True, ""), (["a text"], True, "", None, "states")])
    assert np.array_equal(n, m) and np.array_equal(plain[:, 1:], flagged[:, 1:])
    assert flagged[0, 0] == plain[0, 0] | STATES and plain[0, 0] < tok.vocab_size
