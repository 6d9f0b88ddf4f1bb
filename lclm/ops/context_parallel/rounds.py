"""What every context-parallel strategy shares: the static settings of one attention over `sp`
(`Settings`, resolved once per call by `settings`), the kernel pass of a call site that runs
some rounds (`setup`), the log-sum-exp merge of partial results, one hop of the ring, and
`on_mesh`, which runs a strategy's body on every device's shards.

A *round* r is one block pair: this device's queries against the K/V block that started on
device me - r. Masks follow from original positions, which each device derives from its ring
index and the layout (`lclm.ops.layout.original_positions`). A kernel that specializes on a
static class of a block pair (`classify`: `lclm.ops.kernels.range_kernel`) is told at each
call site the classes it can meet there, found on the host from the layout, so it compiles
only those (one at sp=1: no switch).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from lclm.ops.kernels import choose_kernel, get_kernel, lowered
from lclm.ops.layout import LAYOUTS, original_positions

SP = "sp"
BATCH_AXES = ("dp", "fsdp")
HEAD_AXIS = "tp"

# Names of the attention's residuals for remat policies (`lclm.models.decoder`'s 'attention'
# policy saves them, so the backward does not run a strategy's forward again).
SAVED_NAMES = ("attention_out", "attention_lse")


def merge_partials(o, lse, o_r, lse_r):
    """Combine two normalised partial attentions by their log-sum-exps (-inf = empty).
    o `[..., dim]` float32, lse `[...]` float32."""
    lse_new = jnp.logaddexp(lse, lse_r)
    safe = jnp.where(jnp.isfinite(lse_new), lse_new, 0.0)
    w, w_r = jnp.exp(lse - safe), jnp.exp(lse_r - safe)
    return o * w[..., None] + o_r * w_r[..., None], lse_new


def send(xs, axis, n):
    """Pass every array in `xs` one step along the ring (device i -> i+1)."""
    perm = [(i, (i + 1) % n) for i in range(n)]
    return tuple(None if x is None else lax.ppermute(x, axis, perm) for x in xs)


def saved(o, lse, dtype):
    """The forward's output (in `dtype`) and float32 log-sum-exp, named for remat policies."""
    return checkpoint_name(o.astype(dtype), SAVED_NAMES[0]), checkpoint_name(lse, SAVED_NAMES[1])


class Settings(NamedTuple):
    """Static (hashable) settings of one attention: a custom VJP's non-differentiable part."""

    axis: str | None
    n: int
    layout: str
    causal: bool
    q_chunk: int
    kv_chunk: int
    impl: str
    platform: str  # of the devices the program is for (the mesh's)
    device_kind: str  # theirs too, e.g. 'TPU v4' (a TPU kernel sizes its tiles by it)
    # whether a kernel's whole-sequence attention (`Kernel.whole`) may serve a ring of one:
    # False where a remat policy keeps the ring's named residuals (`SAVED_NAMES`), which
    # cuDNN's own VJP does not name (it would run its forward again in the backward)
    whole: bool = True
    # whether some row of the (whole, n == 1) sequence is known to hold several documents
    # while tracing (`Kernel.whole`'s fallback for rows of many documents): kernels then skip
    # their one-document shortcut's conditional (`range_kernel.several_documents`)
    several_documents: bool = False


def tile_run(layout: str, n: int, seq_len: int) -> int:
    """Length of the runs of consecutive positions a shard holds, which tiles stay inside:
    the local length, or half of it with zigzag."""
    local = seq_len // n
    return local // 2 if layout == "zigzag" and n > 1 else local


def make_settings(
    n, layout, causal, q_chunk, kv_chunk, impl, q, device, axis=SP, whole=True
) -> Settings:
    """Check the layout and resolve `impl` ('auto' included) for global queries `q` split
    over a ring of `n` (`axis`) on devices like `device`; `whole`: `Settings.whole`."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; use one of {LAYOUTS}")
    impl = choose_kernel(
        impl,
        head_dim=q.shape[-1],
        q_chunk=q_chunk,
        kv_chunk=kv_chunk,
        block=tile_run(layout, n, q.shape[1]),
        platform=device.platform,
        dtype=jnp.dtype(q.dtype).name,
    )
    return Settings(
        axis,
        n,
        layout,
        bool(causal),
        int(q_chunk),
        int(kv_chunk),
        impl,
        device.platform,
        device.device_kind,
        bool(whole),
    )


def setup(s: Settings, q, which: str):
    """(`rounds -> kernel pass` for the call site that runs those rounds, this device's
    query positions, `r -> the key positions of round r`). `which`: 'forward' or 'backward'."""
    kernel = get_kernel(s.impl)
    lowered(f"{kernel.passes or s.impl} (ring)")
    # a zigzag shard is two runs of consecutive positions: tiles stay inside one, so that
    # every tile is entirely visible or entirely hidden in all but the diagonal blocks
    run = tile_run(s.layout, s.n, q.shape[1] * s.n)
    block = functools.partial(
        getattr(kernel, which),
        causal=s.causal,
        q_chunk=min(s.q_chunk, run),
        kv_chunk=min(s.kv_chunk, run),
        **({"platform": s.platform, "device_kind": s.device_kind} if kernel.takes_platform else {}),
    )
    me = lax.axis_index(s.axis) if s.n > 1 else 0
    q_pos = original_positions(s.layout, s.n, me, q.shape[1], xp=jnp)
    # in round r this device holds the K/V block that started on device me - r
    k_pos = lambda r: original_positions(s.layout, s.n, (me - r) % s.n, q.shape[1], xp=jnp)
    return functools.partial(_site, block, kernel, s, q.shape[1]), q_pos, k_pos


def _site(block, kernel, s: Settings, local: int, rounds: range):
    """The kernel pass of the call site that runs `rounds`. A kernel that specializes on a
    static property of a block pair's positions (`classify`, as `range_kernel`'s round
    classes) gets the values it takes there (`classes=`): traced positions (they depend on
    `lax.axis_index` and the scanned round) would leave it a conditional over all of them."""
    classify = getattr(kernel, "classify", None)
    if classify is None:
        return block
    return functools.partial(
        block, classes=_site_classes(classify, s.layout, s.n, local, s.causal, rounds)
    )


@functools.cache
def _site_classes(
    classify, layout: str, n: int, local: int, causal: bool, rounds: range
) -> frozenset:
    """`classify` of every block pair some device meets in `rounds`, on the host (numpy)."""
    pos = lambda device: original_positions(layout, n, device, local)
    return frozenset(classify(pos(j), pos((j - r) % n), causal) for r in rounds for j in range(n))


def passing_sites(s: Settings, local: int) -> list[range]:
    """The call sites of the rounds before the last (those that pass K/V on), each a range of
    rounds run by one kernel pass: all of them in one scan, or the diagonal round (0: every
    device's own block) on its own where its mask class is met in no other of them, so that
    a kernel that specializes on classes (`classify`) compiles the scanned rounds' switch
    without it (contiguous: full or hidden; zigzag: the two halves). Striped meets the
    diagonal's class (causal) in the other rounds too: one site, as without `classify`."""
    if s.n == 1:
        return []
    together = [range(0, s.n - 1)]
    classify = getattr(get_kernel(s.impl), "classify", None)
    if classify is None:
        return together
    classes = lambda rounds: _site_classes(classify, s.layout, s.n, local, s.causal, rounds)
    if classes(range(0, 1)) <= classes(range(1, s.n - 1)):
        return together
    return [r for r in (range(0, 1), range(1, s.n - 1)) if len(r)]


def kv_repeats(q_heads: int, kv_heads: int, tp: int, axis: str = "tp") -> int:
    """How often to repeat K/V heads so that they split evenly over `tp` devices (MQA/GQA
    with tp; Ulysses splits heads over `sp` the same way: `axis` names it in the message)."""
    if q_heads % tp:
        raise ValueError(f"{q_heads} query heads are not divisible by {axis}={tp}")
    rep = tp // math.gcd(kv_heads, tp)
    if (q_heads // kv_heads) % rep:
        raise ValueError(
            f"{kv_heads} kv heads cannot be split over {axis}={tp} with {q_heads} heads"
        )
    return rep


def on_mesh(body, mesh, q, k, v, segment_ids, seq_axes=SP):
    """`body(q, k, v, seg)` on every device's shards of global arrays (shapes as
    `ring_attention`'s): batch over (`dp`, `fsdp`), sequence over `seq_axes` (`sp`), heads
    over `tp`, K/V heads repeated first where there are fewer than tp (each tp shard then
    holds its own copy); seg is None without segment ids. Returns the global
    `[batch, seq, heads, dim]`."""
    rep = kv_repeats(q.shape[2], k.shape[2], mesh.shape[HEAD_AXIS])
    if rep > 1:
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    x_spec = P(BATCH_AXES, seq_axes, HEAD_AXIS, None)
    if segment_ids is None:
        fn = lambda q, k, v: body(q, k, v, None)
        in_specs, args = (x_spec,) * 3, (q, k, v)
    else:
        fn = body
        in_specs = (x_spec,) * 3 + (P(BATCH_AXES, seq_axes),)
        args = (q, k, v, segment_ids.astype(jnp.int32))
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=x_spec, check_vma=False)(*args)
