"""Per-query key ranges equal the dense mask in every ring round of every layout."""

import jax.numpy as jnp
import numpy as np
import pytest

from lclm.ops.kernels.key_ranges import key_ranges, ranges_mask
from lclm.ops.layout import LAYOUTS, original_positions, to_layout


def _segments(rng, b, t):
    """Packed documents of random lengths, ids non-decreasing along the row (original order)."""
    return np.cumsum(rng.random((b, t)) < 0.15, axis=1).astype(np.int32)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 4, 8])
@pytest.mark.parametrize("segments", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_ranges_equal_the_dense_mask_in_every_round(layout, n, segments, causal):
    t, b = 64, 3
    rng = np.random.default_rng(n + 10 * segments)
    seg = to_layout(_segments(rng, b, t), layout, n) if segments else None
    local = t // n
    shard = lambda x, d: None if x is None else x[:, d * local : (d + 1) * local]
    for device in range(n):
        for source in range(n):  # every block pair some ring round computes
            q_pos = original_positions(layout, n, device, local)
            k_pos = original_positions(layout, n, source, local)
            q_seg, k_seg = shard(seg, device), shard(seg, source)
            want = np.ones((1, local, local), bool)
            if causal:
                want = want & (q_pos[:, None] >= k_pos[None, :])[None]
            if segments:
                want = want & (q_seg[:, :, None] == k_seg[:, None, :])
            start, end = key_ranges(
                jnp.asarray(q_pos),
                jnp.asarray(k_pos),
                None if seg is None else jnp.asarray(q_seg),
                None if seg is None else jnp.asarray(k_seg),
                causal=causal,
            )
            got = np.asarray(ranges_mask(start, end, local))
            shape = (max(got.shape[0], want.shape[0]), local, local)
            np.testing.assert_array_equal(
                np.broadcast_to(got, shape),
                np.broadcast_to(want, shape),
                err_msg=f"device {device}, source {source}",
            )
            assert (np.asarray(end) >= np.asarray(start)).all()


def test_a_strict_round_gives_the_first_query_nothing():
    n, local = 4, 8
    q_pos = original_positions("striped", n, 1, local)  # a later device's keys: k > j
    k_pos = original_positions("striped", n, 3, local)
    start, end = key_ranges(jnp.asarray(q_pos), jnp.asarray(k_pos))
    np.testing.assert_array_equal(np.asarray(end - start)[0], np.arange(local))
