"""cuDNN's fused flash attention where one device holds the whole sequence, tokamax's kernel in
ring rounds: `impl='cudnn_gpu'`, what `attention.impl='auto'` picks first on Hopper GPUs.

Without a ring (sp=1, and inside Ulysses' all-to-alls) there are no per-round statistics to
merge, so the fastest single-device attention serves as it is, with its own VJP
(`Kernel.whole`). On an H200 cuDNN's causal fwd+bwd at 32K took 36.1 ms (head dim 64) and
28.1 ms (128); tokamax's backward alone runs at 0.87 / 0.93 of the speed of cuDNN's
(bench/results/gpu-lease-h200). Packed documents go to cuDNN as per-row document offsets
and lengths (its packed layout, through jax's private `jax._src.cudnn.fused_attention_stablehlo`,
which takes them; `jax.nn.dot_product_attention` does not): checked there against float32
dense attention with 4 documents per row (errors <= 6e-3 in bf16, as plain causal).

Which call a step makes is decided per step from the segment ids (a `lax.switch` in every
layer's forward and backward, its index read on the host): every row one document -> plain
causal; at most `MAX_DOCUMENTS` -> packed; more -> the ring with tokamax's kernel (always
exact; cuDNN's packed call needs a static document count, and keeps softmax statistics of
`[batch x MAX_DOCUMENTS, heads, seq]` float32 per layer for its backward, which is why the
bound is not larger). Differentiating the switch keeps every branch's residuals, those
statistics included, whichever branch runs: with remat='none' the step holds more than
tokamax_gpu's (bench/results/gpu-lease-h200).

In a ring (sp > 1) the block-pair passes are tokamax's (`tokamax_gpu`), unchanged. Under
ahead-of-time compilation for a described GPU (`lclm.plan.aot`), jax's cuDNN checks would read
the local GPU, which is absent (and reject the packed layout as pre-Hopper): within
`checks_for` they read the described one's compute capability, so the switch compiled there
is the one a real GPU runs. The residuals are cuDNN's own, not the ring's named ones: under
remat='attention' and 'offload', which keep those, the model asks for the ring
(`rounds.Settings.whole`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import jax
import jax.numpy as jnp
from jax import lax

from lclm.ops.kernels import lowered, target_device, tokamax_gpu

# Documents per row that go to cuDNN's packed call; rows with more fall back to the ring
MAX_DOCUMENTS = 32


def _document_starts(segment_ids):
    """bool `[b, t]`: where a document (a run of equal ids) begins in each row."""
    return jnp.concatenate(
        [jnp.ones((segment_ids.shape[0], 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
        axis=1,
    )


def document_offsets(segment_ids, max_documents: int):
    """cuDNN's packed-layout arguments from segment ids `[b, t]` (each id one contiguous run):
    (lengths `[b, max_documents]`, offsets `[b, max_documents + 1]`) int32, the documents'
    lengths and first positions in order, -1 past a row's last document. Rows with more
    documents are cut (callers check `document_count` first)."""
    t = segment_ids.shape[1]

    def row(first_row):
        starts = jnp.nonzero(first_row, size=max_documents + 1, fill_value=t)[0]
        n = jnp.sum(first_row)
        index = jnp.arange(max_documents + 1)
        listed = index < jnp.minimum(n, max_documents)  # the last offset slot is always -1
        ends = jnp.concatenate([starts[1:], jnp.array([t])])
        lengths = jnp.where(listed, ends - starts, -1)
        return (
            lengths[:max_documents].astype(jnp.int32),
            jnp.where(listed, starts, -1).astype(jnp.int32),
        )

    return jax.vmap(row)(_document_starts(segment_ids))


def document_count(segment_ids):
    """The most documents (runs of equal ids) in any row of `[b, t]` ids: int32 scalar."""
    return jnp.max(jnp.sum(_document_starts(segment_ids), axis=1)).astype(jnp.int32)


def call_index(segment_ids):
    """Which call `whole` makes for `[b, t]` segment ids: 0 plain causal (every row one
    document), 1 packed (at most `MAX_DOCUMENTS`), 2 the ring (more). int32 scalar."""
    count = document_count(segment_ids)
    return jnp.where(count == 1, 0, jnp.where(count <= MAX_DOCUMENTS, 1, 2)).astype(jnp.int32)


@functools.cache
def _fused():
    """jax's cuDNN attention module, imported on first use."""
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


# The described GPU that jax's cuDNN checks read within `checks_for`
_DESCRIBED: contextvars.ContextVar = contextvars.ContextVar("lclm_cudnn_described", default=None)


def _version(capability: str) -> tuple[int, ...]:
    return tuple(int(x) for x in capability.split("."))


@contextlib.contextmanager
def checks_for(device):
    """Within: jax's cuDNN checks (head dim, packed layout: Hopper or newer) read the compute
    capability of `device`, a described GPU of an ahead-of-time compile, not a local GPU's.
    They run whenever jax traces cuDNN's forward rule, which under a gradient of scanned
    layers is after `whole` has returned: hence a context around the whole lowering."""
    fa = _fused()
    own = fa.check_compute_capability, fa.is_cuda_compute_capability_equal
    have = _version(device.compute_capability)
    fa.check_compute_capability = lambda capability: have >= _version(capability)
    fa.is_cuda_compute_capability_equal = lambda capability: have == _version(capability)
    token = _DESCRIBED.set(device)
    try:
        yield
    finally:
        _DESCRIBED.reset(token)
        fa.check_compute_capability, fa.is_cuda_compute_capability_equal = own


def _on_gpu() -> bool:
    """Whether the program is built for a GPU jax's cuDNN checks can read: one of this
    process, or the described one of `checks_for`."""
    device = target_device()
    return device.platform in ("gpu", "cuda") and (
        device in jax.local_devices() or device is _DESCRIBED.get()
    )


def _causal(q, k, v):
    fa = _fused()
    return fa.dot_product_attention(
        q, k, v, scale=q.shape[-1] ** -0.5, mask_type=fa.MaskType.CAUSAL
    )


def _packed(q, k, v, segment_ids):
    fa = _fused()
    lengths, offsets = document_offsets(segment_ids, MAX_DOCUMENTS)
    return fa.dot_product_attention(
        q,
        k,
        v,
        q_seqlen=lengths,
        kv_seqlen=lengths,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=q.shape[-1] ** -0.5,
        mask_type=fa.MaskType.PADDING_CAUSAL,
    )


def whole(q, k, v, segment_ids, *, causal: bool, fallback):
    """Causal attention of one device's whole sequence in original order, differentiable.

    q `[b, t, h, d]`, k/v `[b, t, kv_heads, d]`, segment_ids `[b, t]` or None; returns
    `[b, t, h, d]` in q's dtype. `fallback(several_documents=False)`: the ring's result, used
    where cuDNN does not serve (non-causal, no GPU to check against, rows of more than
    `MAX_DOCUMENTS` documents: there with `several_documents`)."""
    if not causal or not _on_gpu():
        return fallback()
    lowered("cudnn_gpu")
    if segment_ids is None:
        return _causal(q, k, v)
    return lax.switch(
        call_index(segment_ids),
        [
            lambda: _causal(q, k, v),
            lambda: _packed(q, k, v, segment_ids),
            # rows of more than MAX_DOCUMENTS documents: the ring's one-document shortcut
            # (a conditional around a second kernel call) cannot serve them
            lambda: fallback(several_documents=True),
        ],
    )


KERNEL = tokamax_gpu.KERNEL._replace(whole=whole, passes="tokamax_gpu")
