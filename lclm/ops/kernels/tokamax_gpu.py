"""tokamax's Mosaic GPU flash attention (Hopper) as lclm's kernel: `impl='tokamax_gpu'`.

tokamax (openxla/tokamax) takes masks as per-query key ranges plus a causal flag, returns the
softmax statistics (m, l) as residuals, and its VJP op takes residuals back: fed
(m = the *global* log-sum-exp, l = 1) and the global output it computes exactly the ring's
per-round gradients (P = exp(s - lse), delta from the global o and do). `range_kernel` turns
the two calls into lclm's block-pair kernel (round classes, shifted strict rounds, packed
documents as k_start).

The classes used are tokamax's private modules (`tokamax._src.ops.attention`), read from the
0.0.17 release: the version is pinned in the `[cuda]` and `[gpu-aot]` extras and this
adapter is to be checked on every upgrade (`python -m bench.correctness` on the GPU). tokamax
needs Python >= 3.12, and its Mosaic GPU kernels run on Hopper (sm90) and Blackwell GPUs
only. Precision: the forward's output comes back in the input dtype (bf16); the ring merges
rounds in float32.
"""

from __future__ import annotations

import functools
import importlib.util

import jax.numpy as jnp

from lclm.ops.kernels import target_device
from lclm.ops.kernels.range_kernel import range_kernel

INSTALL = (
    "pip install 'lclm[cuda]' on Python >= 3.12 (tokamax; 'lclm[gpu-aot]' to compile for "
    "GPUs without one)"
)


def available() -> bool:
    """Whether tokamax can be imported here (it is never imported just to find out)."""
    return importlib.util.find_spec("tokamax") is not None


def hopper_or_newer() -> bool:
    """Whether the device kernels are built for (`kernels.target_device`: the mesh's in an
    ahead-of-time compile, else the first local one) is an NVIDIA GPU of compute capability
    >= 9.0 (described GPUs of `jax.experimental.topologies` carry it too)."""
    capability = getattr(target_device(), "compute_capability", "0")
    try:
        return float(capability) >= 9.0
    except ValueError:  # a ROCm 'gfx...' name
        return False


def limits(
    *,
    head_dim: int,
    q_chunk: int,
    kv_chunk: int,
    block: int,
    platform: str | None = None,
    dtype: str | None = None,
) -> str | None:
    """Why this kernel cannot serve the shapes (`contract.Kernel.limits`): a Hopper or newer
    GPU with tokamax installed, the head dims checked on a GPU, 16-bit compute. tokamax
    picks its own tiles (chunks and block are not its concern)."""
    del q_chunk, kv_chunk, block
    if platform not in ("gpu", None):
        return "it runs on NVIDIA Hopper/Blackwell GPUs only (tokamax's Mosaic GPU kernel)"
    if head_dim not in (64, 128):  # bench.correctness's; others are unmeasured (tokamax pads)
        return f"its head dim {head_dim} must be 64 or 128 (the ones checked on a GPU yet)"
    if not available():
        return f"tokamax is not installed: {INSTALL}"
    if dtype not in (None, "bfloat16", "float16"):
        return f"it computes in bfloat16/float16, not {dtype}"
    if platform == "gpu" and not hopper_or_newer():
        return "its kernels need a Hopper (sm90) or newer GPU"
    return None


@functools.cache
def _ops():
    """(forward op, VJP op, Mask class), imported on first use."""
    try:
        from tokamax._src.ops.attention.pallas_mosaic_gpu import Mask, PallasMosaicGpuFlashAttention
        from tokamax._src.ops.attention.pallas_mosaic_gpu_vjp import (
            PallasMosaicGpuFlashAttentionVjp,
        )
    except ImportError as e:
        raise ValueError(f"attention.impl='tokamax_gpu' needs tokamax: {INSTALL}") from e
    return PallasMosaicGpuFlashAttention(), PallasMosaicGpuFlashAttentionVjp(), Mask


def _mask(mask_class, causal: bool, start, end):
    """tokamax's Mask; ranges `[b, tq]` gain a heads axis of 1 (the same for every head).

    Never per head: with GQA tokamax's sm90 dK/dV kernel indexes per-head ranges wrongly;
    a heads axis of 1 is read as the same row for every head.
    """
    return mask_class(is_causal=causal, k_start=_one_head(start), k_end=_one_head(end))


def _one_head(x):
    """Per-row key ranges `[b, tq]` -> `[b, 1, tq]` (None stays None)."""
    if x is None:
        return None
    if x.ndim != 2:
        raise ValueError(f"key ranges must be per row [batch, tq], not {x.shape}")
    return x[:, None, :]


def attend(q, k, v, causal, start, end):
    """(o `[b, tq, h, d]` in q's dtype, lse `[b, tq, h]` float32; -inf where nothing is seen)."""
    forward, _, mask_class = _ops()
    o, (m, l) = forward(q, k, v, mask=_mask(mask_class, causal, start, end), return_residuals=True)
    seen = l > 0
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
    return o, lse.transpose(0, 2, 1)


def attend_vjp(q, k, v, o, lse, do, causal, start, end):
    """(dq, dk, dv) of one block pair from the global o and (finite) lse `[b, tq, h]`."""
    forward, vjp, mask_class = _ops()
    mask = _mask(mask_class, causal, start, end)
    kwargs = dict(forward.bind(q, k, v, mask=mask, return_residuals=True).kwargs)
    kwargs.pop("return_residuals")
    lse = lse.transpose(0, 2, 1)  # [b, h, tq], as the residuals are
    grads = vjp((lse, jnp.ones_like(lse)), o.astype(q.dtype), do.astype(q.dtype), q, k, v, **kwargs)
    return grads["q"], grads["k"], grads["v"]


# tokamax's dK/dV kernel reloads and applies k_start on every tile (its sm90 source): in
# LLaMA-3.2-1B's 32K step on an H200 its backward took 611 ms with a one-document row's
# k_start (all 0) passed, against 505 for 16 layers of the same causal call without k_start
# (bench/results/gpu-lease-h200). The suspected cause, not yet timed on a GPU: calls whose
# starts are all 0 run without them, at one host sync per call for the lax.cond
KERNEL = range_kernel(attend, attend_vjp, limits, skip_zero_starts=True)
