"""Dense rows → CSR, a batch's rows taken and a request's gathered, and CSR through IPC's bytes."""

import numpy as np

from embedserve.model.sparse_rows import SparseRows, to_csr


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


def test_a_requests_rows_gathered_from_its_batches_in_its_own_order():
    """Rows of one request computed in two batches, out of order (a later bucket ran first): the
    request's CSR is its rows in its order, as its dense rows would be."""
    rng = np.random.default_rng(1)
    request = np.where(rng.random((6, 50)) < 0.2, rng.random((6, 50)), 0).astype(np.float32)
    request[4] = 0
    first = np.vstack([np.ones((2, 50), np.float32), request[[1, 3, 5]]])  # another request's rows first
    second = request[[0, 2, 4]]
    pieces = [(np.array([1, 3, 5]), to_csr(first)[slice(2, 5)]), (np.array([0, 2, 4]), to_csr(second)[slice(0, 3)])]
    gathered = SparseRows.gather(pieces, 6, 50)
    assert np.array_equal(gathered.dense(), request)
    assert np.array_equal(gathered.offsets, to_csr(request).offsets)

