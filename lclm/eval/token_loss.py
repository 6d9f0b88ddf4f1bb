"""Per-token losses of a batch with training's forward: the model's layers under the
attention's context-parallel strategy on the mesh (`decoder.hidden_states`, as `loss_terms`
runs them), then the output projection and cross-entropy of `lclm.ops.loss` chunk by chunk
of each device's shard (`split_chunks` with `loss_chunk`), as `blockwise_cross_entropy`
walks them: full-sequence logits never exist. Training sums these losses; here each is
kept, float32, in the batch's (layout) order.

Shapes: B rows, T tokens, D model width, V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax import lax

from lclm.config import AttentionConfig, ModelConfig
from lclm.data.loader import batch_sharding
from lclm.models import decoder
from lclm.ops.chunking import merge_chunks, split_chunks
from lclm.ops.context_parallel import layout_shards
from lclm.ops.layout import batch_to_layout, from_layout
from lclm.ops.loss import losses_of_hidden
from lclm.parallel.mesh import logical_sharding

_CHUNKED = (None, "batch", "seq", None)  # [chunks, B, sp shards, chunk]: as the loss splits


def token_losses(c: ModelConfig, a: AttentionConfig, mesh, params, batch: dict):
    """Float32 losses `[B, T]` of predicting `targets` (in the batch's order).

    batch: `[B, T]` arrays `tokens`, `targets`, `positions`, `segment_ids` in the mesh's
    layout order. The output weights are cast to the compute dtype and the logits
    accumulate in float32, as in training's `blockwise_cross_entropy`.
    """
    constrain = (
        (lambda x, axes: x)
        if mesh is None
        else (
            lambda x, axes: lax.with_sharding_constraint(x, logical_sharding(mesh, axes, x.shape))
        )
    )
    h = decoder.hidden_states(
        c, params, batch["tokens"], batch["positions"], batch["segment_ids"], mesh=mesh, attention=a
    )
    # FSDP gathers the weights along D; V stays split over tp, as in training's loss
    w = constrain(decoder.output_weights(c, params), ("act_embed", "act_vocab"))
    n_shards = 1 if mesh is None else mesh.shape["sp"]
    hs = constrain(split_chunks(h, n_shards, c.loss_chunk), _CHUNKED + ("act_embed",))
    ts = constrain(split_chunks(batch["targets"], n_shards, c.loss_chunk), _CHUNKED)
    # one chunk's logits [B, sp, chunk, V] alive at a time
    losses = lax.map(lambda x: losses_of_hidden(x[0], w, x[1]), (hs, ts))
    return merge_chunks(constrain(losses, _CHUNKED))


@functools.lru_cache(maxsize=8)
def _jitted(c: ModelConfig, a: AttentionConfig, mesh):
    return jax.jit(functools.partial(token_losses, c, a, mesh))


def losses_in_order(c: ModelConfig, a: AttentionConfig, mesh, params, rows: dict) -> np.ndarray:
    """Float32 losses `[B, T]` in ORIGINAL token order of rows given in original order
    (numpy `[B, T]` tokens, targets, positions, segment_ids; T must suit the mesh: see
    `decode.padded_length`). The rows are put into the attention's layout for the mesh's
    ring, run, and the losses put back: what the mesh and strategy change is only the
    order in which the devices hold the tokens."""
    ring = 1 if mesh is None else layout_shards(a, mesh.shape["sp"])  # the layout's shards
    layout = a.layout if mesh is not None else "contiguous"
    batch = {k: np.asarray(v, np.int32) for k, v in batch_to_layout(rows, layout, ring).items()}
    if mesh is not None:
        batch = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in batch.items()}
    losses = np.asarray(jax.device_get(_jitted(c, a, mesh)(params, batch)), np.float32)
    return from_layout(losses, layout, ring, axis=1)
