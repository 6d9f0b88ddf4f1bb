"""Balanced attention work (lclm.data.balance): the exact work count, the row permutation, and
a training step whose loss does not change when the loader balances its rows."""

import jax
import numpy as np
import pytest
from support import small_train_config

from bench.balance import measure, step_segments
from lclm.config.model import AttentionConfig, ModelConfig
from lclm.config.run_config import run_config
from lclm.data.balance import attention_work, balance_permutation, imbalance, one_vs_many
from lclm.data.loader import HostBatches
from lclm.data.tokenizer import Tokenizer
from lclm.ops.layout import original_positions
from lclm.parallel import make_mesh
from lclm.train.step import make_optimizer, make_train_step
from lclm.workdir.state import init_state


def dense_work(segment_ids, layout, n, document_mask):
    """The same count from a dense [seq, seq] mask, query by query."""
    rows, seq = segment_ids.shape
    q = np.arange(seq)
    work = np.zeros((rows, n), np.int64)
    for r in range(rows):
        seen = q[None, :] <= q[:, None]
        if document_mask:
            seen = seen & (segment_ids[r][:, None] == segment_ids[r][None, :])
        keys = seen.sum(axis=1)
        for j in range(n):
            work[r, j] = keys[original_positions(layout, n, j, seq // n)].sum()
    return work


def packed_segments(rng, rows, seq):
    """Random packed rows: documents as runs of increasing ids, from 1 to seq per row."""
    rate = rng.random((rows, 1)) * 0.3
    return 1 + np.cumsum(rng.random((rows, seq)) < rate, axis=1).astype(np.int32)


@pytest.mark.parametrize("layout", ["striped", "contiguous", "zigzag"])
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("document_mask", [True, False])
def test_work_equals_a_dense_count(layout, n, document_mask):
    rng = np.random.default_rng(n)
    for seq in (8, 48, 64):
        segments = packed_segments(rng, 6, seq)
        segments[0] = 1  # one document filling the row
        np.testing.assert_array_equal(
            attention_work(segments, layout, n, document_mask),
            dense_work(segments, layout, n, document_mask),
        )


def skewed_work(rng, rows, n, accum):
    """Rows of a long-document mix: a quarter of one document each, most of many short ones,
    the long ones where they would all be trained in the first micro-batch."""
    segments = packed_segments(rng, rows, 256)
    segments[: rows // 4 * accum : accum] = 1
    return attention_work(segments, "striped", n)


@pytest.mark.parametrize("shards,accum,n", [(4, 1, 1), (2, 2, 2), (1, 4, 4), (4, 2, 2)])
def test_permutation_reorders_rows_and_lowers_the_imbalance(shards, accum, n):
    rng = np.random.default_rng(shards * 10 + accum)
    work = skewed_work(rng, 32, n, accum)
    order = balance_permutation(work, shards, accum)
    assert sorted(order.tolist()) == list(range(32))
    assert imbalance(work[order], shards, accum) < imbalance(work, shards, accum)
    # a function of the rows alone
    np.testing.assert_array_equal(balance_permutation(work.copy(), shards, accum), order)


def test_balanced_rows_are_the_same_rows_in_another_order():
    rng = np.random.default_rng(0)
    segments = packed_segments(rng, 8, 64)
    batch = dict(segment_ids=segments, tokens=rng.integers(0, 100, (8, 64)))
    order = balance_permutation(attention_work(segments, "striped", 2), 2, 2)
    moved = {k: v[order] for k, v in batch.items()}
    for r in range(8):  # each row intact, found where the permutation put it
        for k in batch:
            np.testing.assert_array_equal(moved[k][r], batch[k][order[r]])
    assert sorted(map(bytes, moved["tokens"])) == sorted(map(bytes, batch["tokens"]))


def test_planner_bound_of_one_document_against_many():
    assert one_vs_many(65536, "striped", 1) == pytest.approx((64, 1), rel=2e-3)
    rows, within = one_vs_many(4096, "contiguous", 4)
    assert within == pytest.approx(7 / 4, rel=1e-3)  # the last of 4 blocks: 7/16 of 1


def test_benchmark_measures_the_loaders_order_against_the_balanced_one():
    lengths = np.array([5000, 40, 300, 70, 2000, 90, 20, 600] * 4)
    steps = step_segments(lengths, 512, 8, 4)
    assert [s.shape for s in steps] == [(8, 512)] * 4
    before, after, step_before, step_after = measure(steps, "striped", 4, 2, 2)
    assert 1 <= after < before and 1 <= step_after < step_before < before


def test_uneven_bins_are_refused():
    with pytest.raises(ValueError, match="do not split evenly"):
        balance_permutation(np.ones((6, 1), np.int64), 2, 2)


def test_balancing_leaves_the_loss_of_a_step_unchanged(tmp_path):
    """The loader's batch with data.balance on and off, same documents: one train step on 8
    devices (fsdp 4 x sp 2, 2 micro-batches) gives the same loss and gradient norm."""
    config = small_train_config(
        tmp_path,
        mesh=dict(dp=1, fsdp=4, tp=1, sp=2),
        attention=dict(layout="striped", q_chunk=16, kv_chunk=16),
        train=dict(grad_accum=2),
    )
    config.data.update(batch_size=8, seq_len=128)
    mesh = make_mesh(fsdp=4, sp=2)
    model = ModelConfig.from_config(config.model)
    optimizer = make_optimizer(run_config(config).train)
    state = init_state(model, optimizer, mesh, seed=3)
    step = jax.jit(
        make_train_step(
            model,
            AttentionConfig.from_config(config.attention),
            run_config(config).train,
            mesh,
            optimizer,
        )
    )
    tokenizer = Tokenizer(config.data.tokenizer)
    results = {}
    for balance in (False, True):
        config.data.balance = balance
        loader = HostBatches(run_config(config), mesh, tokenizer, prefetch=0)
        batch = next(loader)
        loader.close()
        results[balance] = (jax.device_get(batch["tokens"]), step(state, batch)[1])
    (plain, m0), (balanced, m1) = results[False], results[True]
    assert not np.array_equal(plain, balanced)  # rows moved...
    assert sorted(map(bytes, plain)) == sorted(map(bytes, balanced))  # ...but only moved
    assert float(m1["tokens"]) == float(m0["tokens"])
    assert float(m1["loss"]) == pytest.approx(float(m0["loss"]), rel=1e-6)
    assert float(m1["grad_norm"]) == pytest.approx(float(m0["grad_norm"]), rel=1e-5)
