"""Cross-entropy over the vocabulary, computed blockwise: logits never exist for the whole
sequence (the Blockwise Parallel Transformer paper). The loss is a global token mean: sum of
masked token losses / count."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from lclm.ops.chunking import merge_chunks, split_chunks
from lclm.ops.ffn import weight_grad

_SEQ_AXES = (None, "batch", "seq", None)


def logits_of(h, w_out):
    """h `[..., dim]`, w_out `[dim, vocab]` -> float32 logits `[..., vocab]`."""
    return jnp.einsum("...d,dv->...v", h, w_out, preferred_element_type=jnp.float32)


def losses_of_logits(logits, targets):
    """Float32 negative log-likelihoods `[...]` of `targets [...]` under `logits [..., vocab]`."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return lse - picked


def losses_of_hidden(h, w_out, targets):
    """h `[..., dim]`, w_out `[dim, vocab]`, targets `[...]` -> float32 losses `[...]`."""
    return losses_of_logits(logits_of(h, w_out), targets)


def blockwise_cross_entropy(
    h,
    w_out,
    targets,
    loss_mask,
    *,
    chunk: int,
    n_shards: int = 1,
    constrain=lambda x, axes: x,
    dtype=None,
):
    """Masked cross-entropy sums of `h [batch, seq, dim]` against `targets [batch, seq]`.

    Returns `(loss_sum, token_count)` as float32 scalars over the whole (global) batch; the
    caller divides once, so every unmasked token weighs the same whatever its row or chunk.
    With `dtype` the `[dim, vocab]` weights are cast to it for the matmul (pass the float32
    parameters: their gradient stays float32 end to end); without it they are used as given.

    The weights' gradient is summed over the chunks in float32 (each chunk's contribution is a
    float32 matmul) and returned in the weights' own dtype; a running sum in the compute dtype
    would lose more precision with every chunk.
    """
    mask = loss_mask.astype(jnp.float32)
    static = (chunk, n_shards, constrain, dtype or w_out.dtype, w_out.dtype)
    total = _blockwise_ce(static, h, w_out, targets, mask)
    return total, jnp.sum(mask)


def _chunks(constrain, n_shards, chunk, h, targets, mask):
    hs = constrain(split_chunks(h, n_shards, chunk), _SEQ_AXES + ("act_embed",))
    ts = constrain(split_chunks(targets, n_shards, chunk), _SEQ_AXES)
    ms = constrain(split_chunks(mask, n_shards, chunk), _SEQ_AXES)
    return hs, ts, ms


def _masked_sum(logits, tc, mc):
    return jnp.sum(losses_of_logits(logits, tc) * mc)


def _whole(static, w_out):
    """The `[dim, vocab]` weights in the compute dtype, gathered along `dim` (FSDP's gather;
    `vocab` stays split over `tp`)."""
    return static[2](w_out.astype(static[3]), ("act_embed", "act_vocab"))


def _total(static, h, w, targets, mask):
    chunk, n_shards, constrain = static[:3]

    def body(total, xs):
        hc, tc, mc = xs
        return total + _masked_sum(logits_of(hc, w), tc, mc), None

    chunks = _chunks(constrain, n_shards, chunk, h, targets, mask)
    return lax.scan(body, jnp.zeros((), jnp.float32), chunks)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blockwise_ce(static, h, w_out, targets, mask):
    """static: (chunk, n_shards, constrain, compute dtype, the weights' dtype)."""
    return _total(static, h, _whole(static, w_out), targets, mask)


def _blockwise_ce_fwd(static, h, w_out, targets, mask):
    # residuals: the inputs, with the weights as the forward cast them, and every chunk's
    # logits are recomputed. Casting again in the backward made the SPMD partitioner gather
    # the weights a second time, at the start of the step beside the layers' gathers (on
    # simulated CPU meshes one more collective in flight, see lclm.parallel.devices)
    w = _whole(static, w_out)
    return _total(static, h, w, targets, mask), (h, w, targets, mask)


def _blockwise_ce_bwd(static, res, dtotal):
    chunk, n_shards, constrain, _, w_dtype = static
    h, w, targets, mask = res

    def body(dw, xs):
        hc, tc, mc = xs
        # every chunk's sum enters the total with weight 1: its cotangent is `dtotal`
        logits, logits_vjp = jax.vjp(lambda hc: logits_of(hc, w), hc)
        (dlogits,) = jax.vjp(lambda lg: _masked_sum(lg, tc, mc), logits)[1](dtotal)
        (dhc,) = logits_vjp(dlogits)
        return dw + weight_grad(hc, dlogits), dhc

    hs, ts, ms = _chunks(constrain, n_shards, chunk, h, targets, mask)
    dw, dhs = lax.scan(body, jnp.zeros(w.shape, jnp.float32), (hs, ts, ms))
    dh = merge_chunks(constrain(dhs, _SEQ_AXES + ("act_embed",)))
    return dh, dw.astype(w_dtype), None, None  # targets and mask are data


_blockwise_ce.defvjp(_blockwise_ce_fwd, _blockwise_ce_bwd)
