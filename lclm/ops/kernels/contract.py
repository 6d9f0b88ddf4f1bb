"""What an attention kernel is in lclm, and the tile-visibility test every kernel shares.

A *kernel* computes attention between one block of queries and one block of keys/values
(one ring round) and is defined by two functions:

- `forward(q, k, v, q_pos, k_pos, q_seg, k_seg, *, causal, q_chunk, kv_chunk) -> (o, lse)`
- `backward(q, k, v, o, lse, do, q_pos, k_pos, q_seg, k_seg, *, causal, q_chunk, kv_chunk)
   -> (dq, dk, dv)`, where `o` and `lse` are the *global* output and log-sum-exp (over all
   rounds), so per-block gradients add up exactly (FlashAttention-2 style recomputation).

Shapes: q, o, do `[batch, tq, heads, dim]`; k, v `[batch, tk, kv_heads, dim]` with
`heads % kv_heads == 0` (GQA: K/V are never repeated in memory); lse `[batch, tq, heads]`
float32; q_pos `[tq]`, k_pos `[tk]` int32 original token positions (masking follows from
them, so any layout works); q_seg `[batch, tq]`, k_seg `[batch, tk]` int32 segment ids or
None (ids never decrease along the original order, as packing gives them: the blockwise and
Pallas kernels would serve any ids, the range-based ones of `range_kernel` need this). A
query sees a key when `q_pos >= k_pos` (if causal) and their segment ids are equal. Returned
`o`, `dq`, `dk`, `dv` are float32; statistics are always float32. Rows with nothing visible
give o = 0, lse = -inf and zero gradients.

Each kernel also says where it cannot run (`Kernel.limits`), so that `attention.impl='auto'`
(`lclm.ops.kernels`) can pick one without trying it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

F32 = jnp.float32


def serves_any(
    *,
    head_dim: int,
    q_chunk: int,
    kv_chunk: int,
    block: int,
    platform: str | None = None,
    dtype: str | None = None,
) -> None:
    """`Kernel.limits` of a kernel that serves every shape on every platform."""
    del head_dim, q_chunk, kv_chunk, block, platform, dtype


class Kernel(NamedTuple):
    """A block-pair attention kernel (see the module docstring for the contract).

    `limits(*, head_dim, q_chunk, kv_chunk, block, platform=None, dtype=None) -> str | None`:
    why the kernel cannot serve these shapes on `platform` (None: it can). `block` is the run
    of consecutive local positions tiles stay inside (the local length; half of it with
    zigzag); `platform` is a family ('cpu', 'gpu', 'tpu'), None to check only what holds on
    every platform; `dtype` is the compute dtype's name (None: not checked). Availability
    (the platform, an optional package, the GPU generation) is part of it.

    `takes_platform`: its passes take `platform=` and `device_kind=`, those of the devices
    the program is compiled for (a mesh's, which need not be JAX's default backend: ahead-of-
    time compilation for a TPU on a CPU machine); they compile for their own platform (sized
    for the device kind where that matters) and run interpreted on others.

    `compute_dtype_rounds`: its backward is handed o and do, and returns a round's dq, dk, dv,
    in the compute dtype, upcast to float32 per round; those copies live beside the ring's
    float32 ones (the memory planner, `lclm.plan`, counts them).

    `whole`: optional, attention of one device's whole sequence where the ring has one
    member, with its own VJP: `whole(q, k, v, segment_ids, *, causal, fallback) -> o` in q's
    dtype (original order; `fallback(several_documents=False)` gives the ring's result where it
    cannot serve, `several_documents` where some row is known to hold more than one).

    `passes`: the registry name of the kernel whose block-pair passes these are, where they
    are another kernel's (cudnn_gpu's are tokamax_gpu's): what a compile names as the ring's
    kernel (`lclm.ops.kernels.recording`)."""

    forward: Callable
    backward: Callable
    limits: Callable[..., str | None] = serves_any
    takes_platform: bool = False
    compute_dtype_rounds: bool = False
    whole: Callable | None = None
    passes: str | None = None


def tile_visible(q_pos, k_pos, q_seg, k_seg, causal: bool):
    """Whether any (query, key) pair of a tile may be visible. Scalar bool.

    A necessary condition only (a True tile can still be partly masked): used to skip work.
    q_pos `[qc]`, k_pos `[kc]`, q_seg `[batch, qc]` / k_seg `[batch, kc]` or None.
    """
    visible = jnp.bool_(True)
    if causal:
        visible = jnp.max(q_pos) >= jnp.min(k_pos)
    if q_seg is not None:
        overlap = (jnp.min(q_seg) <= jnp.max(k_seg)) & (jnp.min(k_seg) <= jnp.max(q_seg))
        visible = visible & overlap
    return visible


def visible_tiles(q_pos, k_pos, q_seg, k_seg, causal: bool, q_chunk: int, kv_chunk: int):
    """`tile_visible` of every (query chunk, key chunk) pair at once: bool `[nq, nk]`.

    q_pos `[tq]`, k_pos `[tk]`; q_seg `[batch, tq]` / k_seg `[batch, tk]` or None.
    """
    pair = lambda qp, kp, qs, ks: tile_visible(qp, kp, qs, ks, causal)
    per_query_chunk = jax.vmap(jax.vmap(pair, (None, 0, None, 1)), (0, None, 1, None))
    return per_query_chunk(
        q_pos.reshape(-1, q_chunk),
        k_pos.reshape(-1, kv_chunk),
        _seg_tiles(q_seg, q_chunk),
        _seg_tiles(k_seg, kv_chunk),
    )


def _seg_tiles(seg, size: int):
    """Segment ids `[batch, t]` -> `[batch, t / size, size]` (None stays None)."""
    return None if seg is None else seg.reshape(seg.shape[0], -1, size)
