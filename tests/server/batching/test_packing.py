"""Packed rows end to end on CPU, across the stages (the layout itself: model/test_batches.py): the
assembly of queued rows into a stream, the packed encoder against the padded one
on the packaged model (every pooling mode, EXCLUDE_TOKENS), the engine routing packed results to
their requests, and the warm-up's token budget. On CPU the packed encoder runs the reference
attention (SDPA row by row), registered with transformers exactly as the CUDA kernels are, so
everything but the kernel is the code a GPU runs. The CUDA tests compare the kernels with the
padded model on every stream size of the ladder (bench/gpu.sh runs them)."""

import asyncio

import numpy as np
import pytest
import torch

from embedserve.model.shapes import token_ladder
from embedserve.config import Settings
from embedserve.model.declared import POOLING_MODES, Head
from embedserve.model.encoder import Encoder, choose_placement
from embedserve.batching.engine import Engine
from embedserve.admission.estimator import Estimator
from embedserve.batching.packing import assemble_packed
from embedserve.model.batches import Batch, PackedBatch, PackSpec, padded_rows, random_packed
from embedserve.batching.queues import Chunk, PendingRequest, QueuedRow
from embedserve.model.worker import WarmupPlan, warm_up

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (bench/gpu.sh runs these)")
ALL_MODES = Head(POOLING_MODES, True, (), 256, False, {}, None)  # every mode at once, concatenated


async def test_assembly_keeps_each_rows_tokens_and_routes_its_output_row():
    loop = asyncio.get_running_loop()
    a, b = PendingRequest(3, 1, loop.create_future()), PendingRequest(1, 1, loop.create_future())
    ids_a = np.array([[101, 7, 8, 102], [101, 9, 102, 0], [101, 102, 0, 0]], dtype=np.int32)
    chunk_a = Chunk(a, ids_a, np.array([4, 3, 2]), np.array([0, 1, 2]))
    chunk_b = Chunk(b, np.array([[101, 5, 6, 7, 102]], dtype=np.int32), np.array([5]), np.array([0]))
    taken = [QueuedRow(chunk_a, 2, 2, 0.0), QueuedRow(chunk_b, 0, 5, 0.0), QueuedRow(chunk_a, 0, 4, 0.0)]
    batch = assemble_packed(taken, pad_id=0, spec=PackSpec(8, 4, (16, 32)))
    assert batch.rows == 3 and batch.real_tokens == 11 and batch.padded_tokens == 16
    assert batch.input_ids.tolist()[:11] == [101, 102, 101, 7, 8, 102, 101, 5, 6, 7, 102]
    assert batch.cu_seqlens.tolist()[:4] == [0, 2, 6, 11] and batch.max_len == 8  # pinned
    routes = [(r is a, p.tolist(), s) for r, p, s in batch.routes]
    assert routes == [(True, [2, 0], slice(0, 2)), (False, [0], slice(2, 3))]


def packaged(model_dir, env, head=ALL_MODES, exclude=(101, 102)) -> Encoder:
    settings = Settings.from_env(env)
    return Encoder(model_dir, settings, choose_placement(settings, False, False), list(exclude), "embed", head)


@pytest.fixture(scope="module")
def encoders(model_dir):
    """The packaged model, packed (reference attention) and padded, every pooling mode at once
    and [CLS]/[SEP] left out of the mean modes."""
    return packaged(model_dir, {"ATTENTION": "packed"}), packaged(model_dir, {})


def as_padded(batch: PackedBatch) -> Batch:
    """The packed batch's real rows, padded (the padded path's own layout)."""
    return Batch(*padded_rows(batch), batch.rows, batch.real_tokens, [])


@pytest.mark.parametrize("ladder", [None, (256, 320, 384, 448, 512, 640)], ids=["exact", "static"])
def test_the_packed_encoder_computes_what_the_padded_one_does(encoders, ladder):
    """Rows of random lengths, laid out as the ladder sizes lay them (tail rows, empty rows):
    every pooling mode, Normalize, EXCLUDE_TOKENS, within float32 rounding."""
    packed, padded = encoders
    assert (packed.attention, padded.attention) == ("packed", "padded")
    rng = np.random.default_rng(0)
    spec = PackSpec(max_len=256, max_rows=16, ladder=ladder)
    for tokens in (250, 300, 640):
        batch = random_packed(tokens, spec, packed.model.config.vocab_size, rng)
        got, want = packed.run(batch), padded.run(as_padded(batch))
        assert got.shape == want.shape == (batch.rows, packed.dim) and packed.dim == 384 * len(POOLING_MODES)
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_each_layout_refuses_the_others_batches(encoders):
    packed, padded = encoders
    batch = random_packed(64, PackSpec(32, 4, None), 30000, np.random.default_rng(0))
    with pytest.raises(TypeError, match="PackedBatch for an encoder of padded rows"):
        padded.run(batch)
    with pytest.raises(TypeError, match="Batch for an encoder of packed rows"):
        packed.run(as_padded(batch))


class SteadyDevice:
    """A stand-in packed runner whose clock runs `launch + tokens / rate` per batch: a device
    that pays per launch, so bigger streams pay up to a point. Records each stream size."""

    attention = "packed"
    dim = 1

    def __init__(self, launch_s=0.002, rate=1e6):
        self.launch_s, self.rate, self.now, self.sizes = launch_s, rate, 0.0, []

    def run(self, batch: PackedBatch):
        self.sizes.append(batch.padded_tokens)
        self.now += self.launch_s + batch.padded_tokens / self.rate
        return np.zeros((batch.rows, 1), np.float32)

    def memory(self):
        return {}


def test_the_warm_up_captures_every_stream_size_and_picks_the_budget_where_bigger_stops_paying():
    device = SteadyDevice()
    plan = WarmupPlan((16, 64, 256), 512, 32768, True, None, 0, 1000)
    result = warm_up(device, plan, clock=lambda: device.now)
    # T / (2 ms + T / 1M) tok/s: best at 32768 (942k), 20480 the smallest size within 5% (911k)
    assert result.token_budget == 20480 and result.packing.ladder == token_ladder(32768)
    assert set(device.sizes) == set(token_ladder(32768))  # every size captured before serving
    assert result.largest_batch_s == pytest.approx(0.002 + 20480 / 1e6)
    fixed = warm_up(device := SteadyDevice(), WarmupPlan((16, 64), 512, 1000, True, {16: 4}, 0, 1000),
                    clock=lambda: device.now)
    assert fixed.token_budget == 1000 and set(device.sizes) == set(token_ladder(1000))


def test_the_budget_holds_the_longest_row_even_where_smaller_streams_run_as_fast():
    """A constant-rate device makes every size "within 5% of the best": the budget is still the
    smallest size that holds a row of the largest bucket (a smaller one would starve such rows)."""
    device = SteadyDevice(launch_s=0.0)
    result = warm_up(device, WarmupPlan((16, 64, 256), 512, 32768, True, None, 0, 1000), clock=lambda: device.now)
    assert result.token_budget == 256


async def test_the_engine_packs_rows_of_every_bucket_and_routes_each_result_home(model_dir, encoders):
    """The whole packed pipeline on CPU: requests of random lengths arrive together, batches mix
    buckets up to the token budget, streams are padded to the ladder, and every request gets the
    vectors the padded encoder computes for its own rows."""
    packed, padded = encoders
    tok = packed.model.config.vocab_size
    buckets = (16, 64, 256)
    plan = WarmupPlan(buckets, 32, 512, True, {16: 1}, 0, tok)
    batches = []
    engine = Engine(plan, lambda: packed, Estimator(), deadline_s=0.01, worker_queue_size=4, lookahead=0,
                    on_batch=lambda batch, busy: batches.append(batch))
    await engine.start()
    assert engine.attention == "packed" and engine.warmup.token_budget == 512
    rng = np.random.default_rng(1)
    requests = []
    for _ in range(40):
        lengths = rng.integers(2, 200, int(rng.integers(1, 4)))
        ids = np.zeros((len(lengths), lengths.max()), np.int32)
        for i, n in enumerate(lengths):
            ids[i, :n] = rng.integers(1000, tok, n)
        requests.append((ids, lengths))
    results = await asyncio.gather(*(engine.submit(ids, lengths).future for ids, lengths in requests))
    for (ids, lengths), got in zip(requests, results):
        mask = (np.arange(ids.shape[1]) < lengths[:, None]).astype(np.int64)
        want = padded.run(Batch(torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask), len(lengths),
                                int(lengths.sum()), []))
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert all(isinstance(b, PackedBatch) and b.real_tokens <= 512 for b in batches)
    assert {b.padded_tokens for b in batches} <= set(token_ladder(512))
    assert any(len({int(np.searchsorted(buckets, n)) for n in np.diff(b.cu_seqlens.numpy()[: b.rows + 1])}) > 1
               for b in batches), "no batch mixed buckets"
    assert engine.estimator.snapshot().queued_tokens == 0
    await engine.stop()


def cuda_encoder(tiny_dir, dtype, attention, compile_):
    settings = Settings.from_env({"DTYPE": dtype, "ATTENTION": attention, "COMPILE": compile_})
    return Encoder(tiny_dir, settings, choose_placement(settings, True, True), [101], "embed", ALL_MODES)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-bert")
    BertModel(BertConfig(vocab_size=3000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=512)).save_pretrained(path)
    return str(path)


@cuda
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_packed_graphs_compute_what_the_padded_model_does_at_every_stream_size(tiny_dir, dtype):
    """FlashAttention-2 (bf16) / the memory-efficient kernel (fp32) replayed in CUDA graphs, one
    per ladder size, against the padded eager model on fresh random rows at each size; then
    every size once more, so a replay reads no stale static input. A host synchronisation
    inside the forward would have failed its capture (capture_error_mode thread_local).
    fp32: within 1e-5. bf16: within 1e-3, or within bf16's own rounding where that is larger
    (the padded bf16 model's distance from fp32 on the same rows: two kernels summing in another
    order differ by rounding, not by more; on CPU the tiny model's gap is ~1e-3 against ~2e-3)."""
    packed = cuda_encoder(tiny_dir, dtype, "packed", "graphs")
    padded = cuda_encoder(tiny_dir, dtype, "padded", "false")
    truth = cuda_encoder(tiny_dir, "float32", "padded", "false")
    assert packed.attention == "packed" and packed.placement.cuda_graphs
    # The server's defaults: the longest bucket 512 pinned, MAX_BATCH_SIZE 512 rows,
    # MAX_TOKENS_PER_BATCH 32768 (37 stream sizes), as its warm-up captures them.
    spec = PackSpec.for_plan(512, 512, 32768, True)
    assert spec.ladder == token_ladder(32768) and len(spec.ladder) == 37
    rng = np.random.default_rng(0)
    worst = []
    for _ in range(2):
        for below, size in zip((0, *spec.ladder), spec.ladder):
            batch = random_packed(int(rng.integers(below + 1, size + 1)), spec, 3000, rng)
            assert batch.padded_tokens == size
            rows = as_padded(batch)
            got, want = packed.run(batch), padded.run(rows)
            allowed = 1e-5 if dtype == "float32" else max(1e-3, float(np.abs(want - truth.run(rows)).max()))
            worst.append(float(np.abs(got - want).max()) / allowed)
    assert max(worst) <= 1.0, f"packed vs padded, worst at {max(worst):.2f}x the tolerance"
    assert packed._forward.shapes == [(size,) for size in spec.ladder]


@cuda
def test_cuda_eager_packed_rows_agree_with_padded_rows(tiny_dir):
    """Without graphs the kernel gets the batch's own longest row, not the pin."""
    packed = cuda_encoder(tiny_dir, "bfloat16", "packed", "false")
    padded = cuda_encoder(tiny_dir, "bfloat16", "padded", "false")
    truth = cuda_encoder(tiny_dir, "float32", "padded", "false")
    spec = PackSpec(max_len=256, max_rows=64, ladder=None)
    rng = np.random.default_rng(1)
    for tokens in (7, 300, 3000):
        batch = random_packed(tokens, spec, 3000, rng)
        rows = as_padded(batch)
        want = padded.run(rows)
        allowed = max(1e-3, float(np.abs(want - truth.run(rows)).max()))
        np.testing.assert_allclose(packed.run(batch), want, atol=allowed)
