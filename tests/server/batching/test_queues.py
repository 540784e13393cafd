import asyncio
import time

import numpy as np
import torch

from embedserve.batching.queues import BucketQueues, Chunk, PendingRequest, QueuedRow, assemble

PAD = 0
LOOP = asyncio.new_event_loop()  # only makes the requests' futures; never run


def chunk(rows: list[list[int]], positions: list[int]) -> Chunk:
    width = max(map(len, rows))
    ids = np.full((len(rows), width), 7, dtype=np.int32)  # 7: junk past each row's end
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    request = PendingRequest(len(rows), 2, LOOP.create_future())
    return Chunk(request, ids, np.array([len(r) for r in rows]), np.array(positions))


def queued(c: Chunk, index: int) -> QueuedRow:
    return QueuedRow(c, index, int(c.lengths[index]), 0.0)


def test_assemble_copies_rows_masks_padding_and_routes_each_chunk():
    a = chunk([[11, 12, 13], [21], [31, 32]], positions=[0, 2, 5])
    b = chunk([[41, 42, 43, 44]], positions=[1])
    taken = [queued(a, 0), queued(b, 0), queued(a, 2)]
    batch = assemble(taken, PAD, pad_to=6, batch_to=8)
    assert batch.input_ids.shape == batch.attention_mask.shape == (8, 6)
    assert batch.input_ids.dtype == batch.attention_mask.dtype == torch.int64
    # rows of one chunk are adjacent; junk past a row's end and dummy rows are the pad id
    assert batch.input_ids[:3].tolist() == [[11, 12, 13, 0, 0, 0], [31, 32, 0, 0, 0, 0], [41, 42, 43, 44, 0, 0]]
    assert batch.attention_mask[:3].sum(1).tolist() == [3, 2, 4]
    assert (batch.input_ids[3:] == PAD).all()
    assert batch.attention_mask[3:].tolist() == [[1, 0, 0, 0, 0, 0]] * 5  # dummy rows: one token each
    assert (batch.rows, batch.real_tokens, batch.padded_tokens) == (3, 9, 48)
    (ra, pa, sa), (rb, pb, sb) = batch.routes
    assert (ra, pa.tolist(), sa) == (a.request, [0, 5], slice(0, 2))
    assert (rb, pb.tolist(), sb) == (b.request, [1], slice(2, 3))


def test_assemble_without_a_fixed_shape_pads_to_the_longest_row_only():
    a = chunk([[1, 2], [3, 4, 5]], positions=[0, 1])
    batch = assemble([queued(a, 0), queued(a, 1)], PAD, pad_to=None, batch_to=None)
    assert batch.input_ids.tolist() == [[1, 2, 0], [3, 4, 5]]
    assert batch.attention_mask.tolist() == [[1, 1, 0], [1, 1, 1]]


def test_a_bucket_queue_never_goes_back_in_time():
    """Rows stamped earlier than the last one queued (admitted, then tokenized later with others)
    take its time: the drain reads a queue's first row as its oldest."""
    queues = BucketQueues([16])
    for now in (1.0, 3.0, 2.0, 5.0):
        queues.add(16, chunk([[1, 2]], positions=[0]), now)
    assert [r.enqueued for r in queues.rows[16]] == [1.0, 3.0, 3.0, 5.0]


def test_a_mass_cancellation_on_a_deep_queue_costs_each_request_its_own_rows_only():
    """Each cancelled request scanned every bucket's whole queue: quadratic under mass
    cancellation on a deep (GPU) queue, ~15 s here for these 20,000. Its rows leave the count at once
    and the queue at the next look, never to reach a batch."""
    queues = BucketQueues([16, 32])
    requests = []
    for i in range(20_000):  # alternate buckets: 3-token and 20-token rows
        c = chunk([[1, 2, 3]] if i % 2 else [[4] * 20], positions=[0])
        queues.add(16 if i % 2 else 32, c, float(i))
        requests.append(c.request)
    kept = {requests[100], requests[10_001]}  # one of each bucket, deep in the queue
    t0 = time.perf_counter()
    freed = sum(queues.drop(r) for r in requests if r not in kept)
    elapsed = time.perf_counter() - t0
    assert freed == 9999 * 20 + 9999 * 3 and queues.queued_tokens == 23
    assert queues.drop(requests[0]) == 0  # dropped twice: nothing more
    assert [(v.rows, v.oldest) for v in queues.views({16: 8, 32: 8})] == [(1, 10_001.0), (1, 100.0)]
    assert [r.chunk.request for r in queues.take(32, [0]) + queues.take(16, [0])] == [requests[100], requests[10_001]]
    assert queues.queued_tokens == 0
    assert elapsed < 1.0, f"{elapsed:.2f} s to drop 19,998 requests"


def test_rows_delivered_at_once_are_the_result_as_they_are_and_in_pieces_land_in_place():
    whole = PendingRequest(2, 3, LOOP.create_future())
    out = np.arange(6, dtype=np.float32).reshape(2, 3)
    whole.deliver(np.array([0, 1]), out)
    assert whole.future.result() is out  # no copy
    parts = PendingRequest(3, 2, LOOP.create_future())
    parts.deliver(np.array([2]), np.array([[5.0, 6.0]], np.float32))
    assert not parts.future.done()
    parts.deliver(np.array([0, 1]), np.array([[1.0, 2.0], [3.0, 4.0]], np.float32))
    assert parts.future.result().tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
