"""Attention kernels, one module each, and the registry `attention.impl` names them in.

`contract` says what a kernel is; `blockwise` (pure JAX, any platform), `pallas_gpu`,
`pallas_tpu`, `tokamax_gpu` (through `range_kernel`) and `cudnn_gpu` (cuDNN without a ring,
tokamax's passes in one) are the kernels; `reference` is the
dense attention they are tested against. Each kernel's module states its own limits
(`Kernel.limits`); this registry only knows names, module paths and the order in which
`attention.impl='auto'` tries them on each platform.

A fused kernel's module is imported the first time its name is asked for (`get_kernel`,
`choose_kernel`), so a run loads only the backends it may use: 'auto' asks its candidates
in order and stops at the first that serves, which keeps GPU code off TPUs and tokamax (the
package) unimported unless 'tokamax_gpu' is named or picked on a GPU.

`recording` lists what the programs lowered within it call, as the code that lowers the
kernels notes it (`lowered`), for ahead-of-time compiles to name (`lclm.plan.aot`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib

from lclm.ops.kernels import blockwise
from lclm.ops.kernels.contract import Kernel

# name -> Kernel, or the module whose `KERNEL` it is (imported on first use)
KERNELS: dict[str, Kernel | str] = {
    "blockwise": blockwise.KERNEL,
    "cudnn_gpu": "lclm.ops.kernels.cudnn_gpu",
    "pallas_gpu": "lclm.ops.kernels.pallas_gpu",
    "pallas_tpu": "lclm.ops.kernels.pallas_tpu",
    "tokamax_gpu": "lclm.ops.kernels.tokamax_gpu",
}
# what `attention.impl='auto'` tries on each platform, fastest first: the first kernel whose
# limits allow the shapes is used. A kernel runs compiled only on its own platform; elsewhere
# (pallas_* on CPU) it is interpreted, which is for tests, never picked. Every list ends with
# blockwise, which serves any shape.
AUTO = {
    "gpu": ("cudnn_gpu", "tokamax_gpu", "pallas_gpu", "blockwise"),
    "tpu": ("pallas_tpu", "blockwise"),
    "cpu": ("blockwise",),
}


# The device programs are being built for, where that is not the host's own (`compiling_for`)
_TARGET: contextvars.ContextVar = contextvars.ContextVar("lclm_kernel_target", default=None)


@contextlib.contextmanager
def compiling_for(device):
    """Within: kernels are chosen and lowered for `device` (a JAX device of the mesh, possibly a
    described one of `jax.experimental.topologies`), not for the host's first device.
    `lclm.plan.aot` sets it around the lowering of an ahead-of-time compile."""
    token = _TARGET.set(device)
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_device():
    """The device kernels are built for: `compiling_for`'s, else this process's first."""
    device = _TARGET.get()
    if device is None:
        import jax

        device = jax.devices()[0]
    return device


@dataclasses.dataclass
class Lowered:
    """The attention kernels of the programs lowered within `recording`: `kernels` in order of
    first use, each named by the registry name and the part it serves ('tokamax_gpu (ring)': a
    ring's block-pair passes, of however many rounds; 'cudnn_gpu': one device's whole
    sequence in one call), and `passed_over`: the kernels `attention.impl='auto'` tried
    before the one it chose, with why each could not serve (its `Kernel.limits`)."""

    kernels: list[str] = dataclasses.field(default_factory=list)
    passed_over: dict[str, str] = dataclasses.field(default_factory=dict)


_RECORD: contextvars.ContextVar = contextvars.ContextVar("lclm_kernel_record", default=None)


@contextlib.contextmanager
def recording():
    """Within: the `Lowered` yielded gathers the kernels the programs traced call."""
    record = Lowered()
    token = _RECORD.set(record)
    try:
        yield record
    finally:
        _RECORD.reset(token)


def lowered(name: str) -> None:
    """Note, where `recording`, that the program being traced calls the kernel `name`."""
    record = _RECORD.get()
    if record is not None and name not in record.kernels:
        record.kernels.append(name)


def platform_family(platform: str) -> str:
    """jax's platform name -> the key of `AUTO` ('cuda'/'rocm' are GPUs)."""
    return "gpu" if platform in ("gpu", "cuda", "rocm") else platform


def get_kernel(impl: str) -> Kernel:
    """The kernel registered under a kernel name (see `choose_kernel` for 'auto')."""
    try:
        entry = KERNELS[impl]
    except KeyError:
        raise ValueError(
            f"attention impl {impl!r} is not available; use one of {sorted(KERNELS)}"
        ) from None
    return importlib.import_module(entry).KERNEL if isinstance(entry, str) else entry


def choose_kernel(
    impl: str,
    *,
    head_dim: int,
    q_chunk: int,
    kv_chunk: int,
    block: int,
    platform: str,
    dtype: str | None = None,
    device=None,
) -> str:
    """The kernel name `attention.impl` means here: 'auto' -> the first of `AUTO[platform]`
    that can serve the shapes (`Kernel.limits`); an explicit name that cannot -> ValueError
    (one line). `block`: the run of consecutive local positions tiles stay inside. `device`:
    one of the mesh's devices, whose generation the limits check (default: `target_device()`)."""
    if device is not None:
        with compiling_for(device):
            return choose_kernel(
                impl,
                head_dim=head_dim,
                q_chunk=q_chunk,
                kv_chunk=kv_chunk,
                block=block,
                platform=platform,
                dtype=dtype,
            )
    platform = platform_family(platform)
    shapes = dict(
        head_dim=head_dim,
        q_chunk=q_chunk,
        kv_chunk=kv_chunk,
        block=block,
        platform=platform,
        dtype=dtype,
    )
    if impl == "auto":
        record = _RECORD.get()

        def serves(name: str) -> bool:
            why = get_kernel(name).limits(**shapes)
            if why is not None and record is not None:
                record.passed_over.setdefault(name, why)
            return why is None

        return next(name for name in AUTO.get(platform, ("blockwise",)) if serves(name))
    why = get_kernel(impl).limits(**shapes)
    if why is not None:
        raise ValueError(
            f"attention.impl={impl!r} cannot run here: {why} "
            "(attention.impl='auto' picks a kernel that can)"
        )
    return impl
