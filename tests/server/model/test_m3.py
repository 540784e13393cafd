"""BGE-M3 (task bgem3) on the model side: the Encoder's one pass against FlagEmbedding's formulas
(tests/server/model/m3_models.reference) on a padded batch, the lexical-weight rule on small
cases, M3Rows through routing, gathering and IPC, and how the task is told from the files."""

import dataclasses
import os

import numpy as np
import pytest
import torch

from embedserve.config import ConfigError, Settings
from embedserve.model import warm_start
from embedserve.batching.flagged_tokenization import FlaggedTokenizer
from embedserve.model.batches import Batch, PackedBatch, PackSpec, layout
from embedserve.model.declared import DeclarationError
from embedserve.model.encoder import Encoder, choose_placement, task_of
from embedserve.model.m3 import lexical_weights
from embedserve.model.m3_rows import COLBERT, FLAGS, SPARSE, M3Rows
from embedserve.model.sparse_rows import SparseRows
from embedserve.model.token_rows import TokenRows
from embedserve.prepare import prepare
from tests.server.model.m3_models import build_m3, reference

TOL = 1e-4
TEXTS = ["the quick brown fox jumps", "Sparse retrieval weighs each token of the text; dense retrieval pools them.",
         "a", "ColBERT keeps one vector per token and scores by late interaction."]


@pytest.fixture(scope="module")
def m3_dir(tmp_path_factory) -> str:
    return build_m3(tmp_path_factory.mktemp("m3"))


def settings(path: str, **extra) -> Settings:
    return dataclasses.replace(Settings(), model_path=path, **extra)


def assert_matches(out: M3Rows, want: dict, rows: int) -> float:
    """Every output of `rows` texts against the reference; → the largest difference seen."""
    worst = float(np.abs(out.dense - want["dense_vecs"]).max())
    for i in range(rows):
        ids, values = out.sparse.row(i)
        got = dict(zip(map(str, ids.tolist()), values.tolist()))
        assert got.keys() == want["lexical_weights"][i].keys(), i
        worst = max([worst, *(abs(got[k] - float(w)) for k, w in want["lexical_weights"][i].items())])
        assert out.colbert.row(i).shape == want["colbert_vecs"][i].shape, i
        worst = max(worst, float(np.abs(out.colbert.row(i) - want["colbert_vecs"][i]).max()))
    assert worst <= TOL
    return worst


def encoder(m3_dir: str, **extra) -> Encoder:
    s = settings(m3_dir, task="bgem3", **extra)
    m = prepare(s)
    assert m.task == "bgem3" and m.head.pooling == ("cls",) and m.head.normalize
    return Encoder(m.model_dir, s, choose_placement(s, False, False), m.exclude_ids, m.task, m.head, m.sep_id)


def token_rows(m3_dir: str, asked=(SPARSE, COLBERT)) -> list[list[int]]:
    """TEXTS tokenized as the server does, each row's first id flagged with the `asked` outputs
    (FlaggedTokenizer, the server's)."""
    from transformers import AutoTokenizer

    tok = FlaggedTokenizer.from_hf(AutoTokenizer.from_pretrained(m3_dir), 512, True, flags="bgem3")
    ids, lengths = tok.encode(TEXTS, side=",".join(asked))
    return [ids[i, :n].tolist() for i, n in enumerate(lengths)]


def padded(rows: list[list[int]], pad: int) -> Batch:
    width = max(map(len, rows)) + 4  # padding on every row, and a dummy row as captured shapes add
    ids = torch.full((len(rows) + 1, width), pad)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1
    mask[-1, 0] = 1
    return Batch(ids, mask, len(rows), sum(map(len, rows)), [])


def test_one_padded_pass_equals_flagembedding_formulas(m3_dir):
    enc = encoder(m3_dir)
    assert enc.dim == 32 and enc.attention == "padded"
    rows = token_rows(m3_dir)
    batch = padded(rows, 1)
    ids, mask = batch.input_ids, batch.attention_mask
    out = enc.run(batch)
    assert isinstance(out, M3Rows) and len(out) == len(TEXTS)
    want = reference(m3_dir, TEXTS)
    assert_matches(out, want, len(TEXTS))
    # ColBERT: every token after CLS, the final </s> included; lexical weights leave specials out
    assert [len(out.colbert.row(i)) for i in range(len(rows))] == [len(r) - 1 for r in rows]
    assert not np.isin(out.sparse.indices, [0, 1, 2, 3]).any()
    assert len(out.sparse.values) > len(TEXTS)  # the check is not vacuous: weights were kept
    # warm start's probe and output check read the three outputs
    assert enc.probe_flags == sum(FLAGS.values())
    probe = warm_start.probe_of(out)
    assert probe["dim"] == 32 + 32 + len(out.sparse.row(0)[1]) and np.isfinite(probe["norm"])
    assert warm_start.output_problem(out, Batch(ids, mask, len(rows), 0, []), enc.dim) is None


def test_a_row_gets_what_it_asked_for_and_nothing_more_is_copied(m3_dir):
    """One batch of rows asking for different outputs (flags on their first ids): each gets its
    asked ones, equal to the reference; a dense-only row, the rest of the batch's outputs aside,
    has no lexical weights and no ColBERT vectors (none copied off the device for it)."""
    enc = encoder(m3_dir)
    want = reference(m3_dir, TEXTS)
    asks = [(), (SPARSE,), (COLBERT,), (SPARSE, COLBERT)]
    rows = [token_rows(m3_dir, asked)[i] for i, asked in enumerate(asks)]
    out = enc.run(padded(rows, 1))
    assert float(np.abs(out.dense - want["dense_vecs"]).max()) <= TOL
    for i, asked in enumerate(asks):
        ids, values = out.sparse.row(i)
        assert (len(ids) > 0) == (SPARSE in asked), i
        if SPARSE in asked:
            assert dict(zip(map(str, ids.tolist()), values.tolist())).keys() == want["lexical_weights"][i].keys()
        assert (len(out.colbert.row(i)) > 0) == (COLBERT in asked), i
        if COLBERT in asked:
            assert float(np.abs(out.colbert.row(i) - want["colbert_vecs"][i]).max()) <= TOL
    dense_only = enc.run(padded(token_rows(m3_dir, ()), 1))
    assert len(dense_only.sparse.values) == 0 and len(dense_only.colbert.vectors) == 0
    assert np.array_equal(dense_only.dense, out.dense) or float(np.abs(dense_only.dense - out.dense).max()) <= 1e-6


def test_packed_rows_equal_the_reference(m3_dir):
    """ATTENTION=packed (the reference varlen attention on CPU): one stream of rows, a padding
    tail and empty rows as served, every output equal to FlagEmbedding's formulas."""
    enc = encoder(m3_dir, attention="packed")
    assert enc.attention == "packed", enc.declined
    rows = token_rows(m3_dir)
    lengths = np.array(list(map(len, rows)))
    spec = PackSpec(max_len=64, max_rows=8, ladder=(256,))
    cu, positions, segments, size = layout(lengths, spec)
    stream = np.full(size, 1, dtype=np.int64)
    stream[: lengths.sum()] = np.concatenate(rows)
    batch = PackedBatch(torch.from_numpy(stream), torch.from_numpy(positions), torch.from_numpy(segments),
                        torch.from_numpy(cu), spec.max_len, len(rows), int(lengths.sum()), [])
    out = enc.run(batch)
    assert_matches(out, reference(m3_dir, TEXTS), len(TEXTS))
    assert [len(out.colbert.row(i)) for i in range(len(rows))] == [n - 1 for n in lengths]


def test_lexical_weights_keep_each_ids_largest_positive_weight_and_leave_specials_out():
    ids = np.array([[0, 7, 9, 7, 2, 1], [0, 5, 3, 2, 1, 1]])
    weights = np.array([[0.9, 0.2, 0.0, 0.6, 0.8, 0.7], [0.5, 0.3, 0.4, 0.1, 0.9, 0.9]], dtype=np.float32)
    mask = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    rows = lexical_weights(ids, weights, mask, np.array([0, 1, 2, 3]), 10)
    assert rows.offsets.tolist() == [0, 1, 2]
    assert rows.row(0)[0].tolist() == [7] and rows.row(0)[1].tolist() == pytest.approx([0.6])  # max; 9 weighs 0
    assert rows.row(1)[0].tolist() == [5] and rows.row(1)[1].tolist() == pytest.approx([0.3])  # unk (3) out
    empty = lexical_weights(ids[:, :0], weights[:, :0], mask[:, :0], np.array([0]), 10)
    assert empty.offsets.tolist() == [0, 0, 0]


def _m3(rows: int, seed: int) -> M3Rows:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, rows)
    colbert = TokenRows(rng.standard_normal((int(counts.sum()), 3)).astype(np.float32),
                        np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
    dense = rng.standard_normal((rows, 5)).astype(np.float32)
    sparse = SparseRows(np.arange(rows, dtype=np.int32), np.ones(rows, np.float32), np.arange(rows + 1), 50)
    return M3Rows(dense, sparse, colbert)


def test_rows_route_gather_and_cross_ipc_unchanged():
    a, b = _m3(3, 0), _m3(2, 1)
    whole = M3Rows.gather([(np.array([0, 2, 4]), a), (np.array([1, 3]), b.take(slice(0, 2)))], 5, 5)
    order = [(a, 0), (b, 0), (a, 1), (b, 1), (a, 2)]
    for i, (src, j) in enumerate(order):
        assert np.array_equal(whole.dense[i], src.dense[j])
        assert np.array_equal(whole.colbert.row(i), src.colbert.row(j))
        assert np.array_equal(whole.sparse.row(i)[0], src.sparse.row(j)[0])
    header, data = whole.take(slice(1, 4)).wire()
    back = M3Rows.from_wire(header, data)
    part = whole[1:4]
    assert np.array_equal(back.dense, part.dense) and np.array_equal(back.colbert.vectors, part.colbert.vectors)
    assert np.array_equal(back.colbert.offsets, part.colbert.offsets)
    assert np.array_equal(back.sparse.indices, part.sparse.indices) and back.sparse.dim == 50


def test_the_head_files_make_the_task(m3_dir, tmp_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(m3_dir)
    assert task_of(config, "bgem3", m3=True) == "bgem3"
    # TASK=auto reads the head files: dense for embeddings clients at an embedder's cost.
    assert task_of(config, "auto", m3=True) == "bgem3" and prepare(settings(m3_dir)).task == "bgem3"
    # LONG_TEXTS=window asks for an embedder's windows: TASK=auto keeps it one
    assert prepare(settings(m3_dir, long_texts="window")).task == "embed"
    assert task_of(config, "auto") == "embed"
    assert task_of(config, "embed", m3=True) == "embed"  # TASK=embed serves its dense vectors the old way
    plain = tmp_path / "plain"
    plain.mkdir()
    for name in os.listdir(m3_dir):
        if not name.endswith(".pt"):
            os.link(os.path.join(m3_dir, name), plain / name)
    assert prepare(settings(str(plain))).task == "embed"
    with pytest.raises(DeclarationError, match="sparse_linear.pt and colbert_linear.pt"):
        prepare(settings(str(plain), task="bgem3"))
    with pytest.raises((ConfigError, DeclarationError)):
        prepare(settings(m3_dir, task="rerank"))
