"""Dense rows → CSR, and CSR through IPC's bytes."""

import numpy as np

from embedserve.batching.sparse import SparseRows, to_csr


def test_csr_keeps_every_non_zero_in_row_order_and_survives_the_bytes():
    rng = np.random.default_rng(0)
    dense = np.where(rng.random((5, 40)) < 0.1, rng.random((5, 40)), 0).astype(np.float32)
    dense[2] = 0  # a row with no weight at all
    csr = to_csr(dense)
    assert csr.shape == (5, 40) and csr.offsets[0] == 0 and csr.offsets[-1] == np.count_nonzero(dense)
    back = SparseRows.from_bytes(csr.to_bytes(), 5, len(csr.values), 40)
    for i in range(5):
        indices, values = back.row(i)
        assert indices.dtype == np.int32 and values.dtype == np.float32
        assert np.array_equal(indices, np.flatnonzero(dense[i])) and np.array_equal(values, dense[i][indices])
    assert len(back.row(2)[0]) == 0


async def test_a_large_request_is_sparsified_off_the_loop_to_the_same_rows():
    from concurrent.futures import ThreadPoolExecutor

    from embedserve.batching.sparse import INLINE_VALUES, sparsify

    rng = np.random.default_rng(1)
    dense = np.where(rng.random((8, INLINE_VALUES // 4)) < 0.01, 1.0, 0).astype(np.float32)
    assert dense.size > INLINE_VALUES
    with ThreadPoolExecutor(1) as pool:
        off, on = await sparsify(dense, pool), to_csr(dense)
    assert all(np.array_equal(getattr(off, f), getattr(on, f)) for f in ("indices", "values", "offsets"))
