"""The static shapes the model runs (embedserve.model.shapes): ladders, caps, stream sizes. Pure."""

import pytest

from embedserve.model.shapes import (bucket_row_limit, choose_cap, fit_length, ladder_size, length_ladder,
                                     packed_slots, served_shapes, sweep_should_stop, token_ladder)


@pytest.mark.parametrize("rows, size", [(1, 8), (8, 8), (9, 16), (100, 128), (512, 512)])
def test_ladder_size(rows, size):
    assert ladder_size(rows) == size


def test_length_ladder_adds_the_midpoint_below_each_bucket():
    assert length_ladder((16, 32, 64, 128, 256, 512)) == (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert length_ladder((4, 5, 16)) == (2, 4, 5, 10, 16)  # no midpoint between 4 and 5


@pytest.mark.parametrize("longest, length", [(1, 8), (8, 8), (9, 16), (17, 24), (25, 32), (100, 128), (500, 512)])
def test_fit_length_is_the_smallest_static_length_that_holds_the_batch(longest, length):
    assert fit_length(longest, length_ladder((16, 32, 64, 128, 256, 512))) == length


def test_ladder_size_rejects_more_than_largest():
    with pytest.raises(ValueError, match="exceed"):
        ladder_size(513)


@pytest.mark.parametrize(
    "bucket, max_batch, max_tokens, static, limit",
    [
        (16, 512, 32768, False, 512),
        (512, 512, 32768, False, 64),
        (512, 512, 32768, True, 64),
        (256, 512, 30000, False, 117),
        (256, 512, 30000, True, 96),  # rounded down to a captured size
        (512, 512, 100, False, 1),  # a single row always fits
    ],
)
def test_bucket_row_limit(bucket, max_batch, max_tokens, static, limit):
    assert bucket_row_limit(bucket, max_batch, max_tokens, static) == limit


@pytest.mark.parametrize(
    "sweep, cap",
    [
        ([(1, 1000), (2, 1900), (4, 3000), (8, 3100), (16, 2000)], 4),  # 3000 >= 0.95 × 3100
        ([(1, 1000), (2, 1900), (4, 2500), (8, 3100)], 8),
        ([(8, 100), (16, 400), (32, 800), (64, 1600)], 64),  # GPU-like: keeps growing
        ([(1, 500)], 1),
    ],
)
def test_choose_cap_is_smallest_batch_near_the_best(sweep, cap):
    assert choose_cap(sweep) == cap


def test_sweep_stops_once_throughput_clearly_falls():
    assert not sweep_should_stop([(1, 100), (2, 180), (4, 170)])
    assert sweep_should_stop([(1, 100), (2, 180), (4, 140)])


def test_token_ladder_steps_by_quarters_of_each_power_of_two_up_to_the_budget():
    ladder = token_ladder(32768)
    assert ladder[:9] == (64, 80, 96, 112, 128, 160, 192, 224, 256)
    assert ladder[-1] == 32768 and len(ladder) == 37
    assert max(b / a for a, b in zip(ladder, ladder[1:])) <= 1.25  # a stream pads at most a fifth
    assert token_ladder(1000)[-3:] == (768, 896, 1000)  # the budget itself is the top
    assert token_ladder(40) == (40,)


def test_packed_slots_hold_the_real_rows_and_the_tail_in_rows_no_longer_than_the_pin():
    assert packed_slots(32768, 512, 512) == 512 + 64
    assert packed_slots(64, 512, 512) == 64 + 1  # no more rows than tokens
    assert packed_slots(1000, 8, 256) == 8 + 4


def test_served_shapes_are_each_bucket_at_its_cap_or_every_captured_shape():
    assert served_shapes((16, 32), {16: 8, 32: 16}, False) == [(16, 8), (32, 16)]
    assert served_shapes((16, 32), {16: 8, 32: 16}, True) == [(8, 8), (16, 8), (24, 8), (24, 16), (32, 8), (32, 16)]
