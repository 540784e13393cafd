"""Multi-vector (ColBERT) models on the device (tokenizer by side, model/token_head.py through the
Encoder) against sentence-transformers 6.2's MultiVectorEncoder on the same directory: per text
the same token count and every token vector within 1e-4, for queries (prefix, expansion with the
mask token, attended or not, "fixed" and "min") and documents (prefix, skiplist), queries and
documents in one padded batch; its own saves and PyLate's format; MaxSim equal to util.maxsim."""

import numpy as np
import pytest
import torch

from embedserve.config import Settings
from embedserve.model.maxsim import maxsim
from embedserve.model.batches import Batch
from embedserve.model.declared import DeclarationError
from embedserve.model.encoder import Encoder, Placement
from embedserve.model.token_rows import TokenRows
from embedserve.prepare import prepare
from tests.server.model.multivector_models import build_colbert, build_pylate

QUERIES = ["what is the capital of France?", "x", "a query long enough to pass the expansion length of twelve tokens, "
           "so that it is cut there (fixed) or kept whole (min)"]
DOCUMENTS = ["Paris, the capital; of France!", "short", "a much longer document about late interaction retrieval: "
             "ColBERT keeps a vector per token, and MaxSim scores them... (punctuation is skipped)"]


def served(path: str, texts: list[str], is_query: list[bool]) -> tuple[TokenRows, object]:
    """The texts through prepare's tokenizer (each by its side) and the Encoder, in ONE padded
    batch (queries and documents together)."""
    settings = Settings(model_path=path)
    m = prepare(settings)
    assert m.task == "multivector"  # TASK=auto
    encoder = Encoder(path, settings, Placement(torch.device("cpu"), torch.float32, False, False), [], m.task, m.head)
    rows = [m.tokenizer.encode([t], prompt=m.head.prompts.get("query" if q else "document", ""), side="query" if q else "document")
            for t, q in zip(texts, is_query)]
    width = max(ids.shape[1] for ids, _ in rows)
    ids = np.full((len(rows), width), m.tokenizer.pad_id, dtype=np.int64)
    for i, (row, _) in enumerate(rows):
        ids[i, : row.shape[1]] = row[0]
    lengths = np.array([int(n[0]) for _, n in rows])
    mask = torch.from_numpy((np.arange(width) < lengths[:, None]).astype(np.int64))
    out = encoder.run(Batch(torch.from_numpy(ids), mask, len(rows), int(lengths.sum()), []))
    return out, encoder


def assert_equal_tokens(got: TokenRows, want: list) -> float:
    worst = 0.0
    for i, w in enumerate(want):
        w = w.numpy() if hasattr(w, "numpy") else np.asarray(w)
        assert got.row(i).shape == w.shape, (i, got.row(i).shape, w.shape)
        worst = max(worst, float(np.abs(got.row(i) - w).max()))
    assert worst <= 1e-4
    return worst


@pytest.mark.parametrize("kind", [{}, {"attend": True}, {"strategy": "min"}, {"prompts": {}},
                                  {"document_length": 16}],
                         ids=["fixed", "attended", "min", "no-prefixes", "document_length"])
def test_token_vectors_match_multi_vector_encoder(tmp_path, model_dir, kind):
    from sentence_transformers import MultiVectorEncoder

    path = build_colbert(tmp_path, model_dir, **kind)
    texts, sides = QUERIES + DOCUMENTS, [True] * len(QUERIES) + [False] * len(DOCUMENTS)
    got, encoder = served(path, texts, sides)
    reference = MultiVectorEncoder(path, device="cpu")
    want = reference.encode_query(QUERIES) + reference.encode_document(DOCUMENTS)
    assert got.dim == encoder.dim == 16
    assert_equal_tokens(got, want)
    # What the sides do, seen in the counts: queries expanded to 12 tokens (fixed: exactly), a
    # document's punctuation left out.
    counts = np.diff(got.offsets)
    if kind.get("strategy") == "min":
        assert counts[1] == 12 and counts[2] > 12
    else:
        assert (counts[:3] == 12).all()


def test_pylate_format_matches_what_multi_vector_encoder_loads(tmp_path, model_dir):
    from sentence_transformers import MultiVectorEncoder

    path = build_pylate(tmp_path, model_dir)
    got, _ = served(path, QUERIES + DOCUMENTS, [True] * len(QUERIES) + [False] * len(DOCUMENTS))
    reference = MultiVectorEncoder(path, device="cpu")
    assert_equal_tokens(got, reference.encode_query(QUERIES) + reference.encode_document(DOCUMENTS))
    m = prepare(Settings(model_path=path))
    ids, _ = m.tokenizer.encode(["hello"], prompt=m.head.prompts["query"], side="query")
    assert int(ids[0, 1]) & 0xFFFFFF == 30522  # "[Q] " read as the one token PyLate added


def test_maxsim_equals_sentence_transformers(tmp_path, model_dir):
    from sentence_transformers import MultiVectorEncoder
    from sentence_transformers.util import maxsim as reference_maxsim

    path = build_colbert(tmp_path, model_dir)
    reference = MultiVectorEncoder(path, device="cpu")
    q = reference.encode_query(QUERIES[:1])
    d = reference.encode_document(DOCUMENTS)
    want = reference_maxsim(q, d)[0].numpy()
    rows = TokenRows.gather([(np.arange(3), TokenRows(np.concatenate([x.numpy() for x in d]),
                                                      np.cumsum([0, *[len(x) for x in d]])))], 3, 16)
    got = maxsim(q[0].numpy(), rows)
    assert np.abs(got - want).max() <= 1e-4


def test_task_multivector_refuses_a_model_that_declares_none(model_dir):
    with pytest.raises(DeclarationError, match="multi-vector"):
        prepare(Settings(model_path=model_dir, task="multivector"))


def test_a_stanford_colbert_checkpoint_is_refused_by_name(tmp_path, model_dir):
    """Its projection at the root (linear.weight) and settings in artifact.metadata: served as a
    plain BERT it would be mean-pooled noise, so it is refused, saying how to convert it."""
    import json
    import shutil

    shutil.copytree(model_dir, tmp_path / "stanford")
    config = json.loads((tmp_path / "stanford" / "config.json").read_text())
    (tmp_path / "stanford" / "config.json").write_text(json.dumps({**config, "architectures": ["HF_ColBERT"]}))
    (tmp_path / "stanford" / "modules.json").unlink(missing_ok=True)
    with pytest.raises(DeclarationError, match="HF_ColBERT"):
        prepare(Settings(model_path=str(tmp_path / "stanford")))


def test_another_task_refuses_a_multi_vector_model(tmp_path, model_dir):
    path = build_colbert(tmp_path, model_dir)
    with pytest.raises(DeclarationError, match="TASK=multivector"):
        prepare(Settings(model_path=path, task="embed"))


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu.sh runs these)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_token_vectors_replayed_from_cuda_graphs_compute_what_the_eager_cpu_model_does(tmp_path, device):
    """The token head has no host synchronisation: captured in a CUDA graph per static shape
    (float32), replayed on other rows (queries with unattended expansion tokens, documents with
    skiplisted ids, a dummy row of padding), it keeps the eager CPU model's tokens and vectors.
    On CPU: the static-shape path without graphs."""
    import json

    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    from embedserve.model.colbert import EXPANSION, QUERY, Expansion, MultiVector
    from embedserve.model.declared import Head
    from embedserve.model.encoder import choose_placement

    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=300, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(tmp_path)
    dense = tmp_path / "1_Dense"
    dense.mkdir()
    save_file({"linear.weight": torch.randn(16, 32)}, str(dense / "model.safetensors"))
    (dense / "config.json").write_text(json.dumps({"in_features": 32, "out_features": 16, "bias": False,
                                                   "activation_function": "torch.nn.modules.linear.Identity"}))
    mv = MultiVector((dense,), True, {}, Expansion(length=8), None, None, (),
                     # 32 ids, as PyLate's punctuation: torch.isin would sync the host past ~10 (pooling.member)
                     skiplist_ids=(7, 8, *range(200, 230)), expansion_id=9)
    head = Head((), True, (), 64, False, {}, None, multivector=mv)
    settings = Settings.from_env({"DTYPE": "float32", "ATTENTION": "padded", "STATIC_SHAPES": "true"})
    placement = choose_placement(settings, device == "cuda", True)
    assert placement.cuda_graphs == (device == "cuda")
    served = Encoder(str(tmp_path), settings, placement, [], "multivector", head)
    reference = Encoder(str(tmp_path), Settings(), Placement(torch.device("cpu"), torch.float32, False, False), [],
                        "multivector", head)
    rng = torch.Generator().manual_seed(1)
    for _ in range(2):  # the first run captures, the second replays on other rows
        lengths = torch.tensor([8, 31, 12, 0])
        mask = (torch.arange(32) < lengths[:, None]).long()
        ids = torch.randint(5, 12, (4, 32), generator=rng) * mask  # ids 7 and 8 (skiplisted) among them
        ids[0, 5:8] = 9 | EXPANSION  # a query: its last 3 tokens expansion
        ids[0, 0] |= QUERY
        batch = Batch(ids, mask, 3, int(lengths.sum()), [])
        got = served.run(batch)
        want = reference.run(Batch(ids[:3], mask[:3], 3, batch.real_tokens, []))
        assert np.array_equal(got.offsets, want.offsets) and np.abs(got.vectors - want.vectors).max() <= 1e-4
        assert got.offsets[1] == 8  # the query keeps every token, its expansion and skiplisted ids too
        assert got.offsets[2] - got.offsets[1] < 31  # a document's skiplisted ids are out
