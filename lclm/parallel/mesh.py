"""The (dp, fsdp, tp, sp) device mesh and the one table of logical-axis sharding rules."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lclm.config import MESH_AXES

# Logical axis name -> mesh axes. The only place that decides what is sharded where.
# Parameters: embedding/hidden over fsdp *and* sp (the ring's devices hold different tokens
# but the same weights, so they share the weight shards too: ZeRO-3 over fsdp x sp, as the
# Ring Attention paper runs FSDP over every device), heads and MLP hidden over tp.
# Activations: batch over (dp, fsdp), sequence over sp, heads over tp.
AXIS_RULES: dict[str, tuple[str, ...]] = {
    # parameters
    "layers": (),
    "vocab": ("tp",),
    "embed": ("fsdp", "sp"),
    "heads": ("tp",),
    "kv_heads": ("tp",),
    "head_dim": (),
    "mlp": ("tp",),
    "norm": (),
    # activations
    "batch": ("dp", "fsdp"),
    "seq": ("sp",),
    "act_embed": (),
    "act_heads": ("tp",),
    "act_mlp": ("tp",),
    "act_vocab": ("tp",),
}


def resolve_mesh_shape(
    dp: int = 1, fsdp: int = 1, tp: int = 1, sp: int = 1, device_count: int | None = None
) -> dict[str, int]:
    """Sizes per axis with at most one -1 replaced by the remaining devices."""
    sizes = dict(dp=int(dp), fsdp=int(fsdp), tp=int(tp), sp=int(sp))
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1 or any(s == 0 or s < -1 for s in sizes.values()):
        raise ValueError(f"mesh {sizes}: sizes must be >= 1, with at most one -1 (= the rest)")
    if free:
        if device_count is None:
            raise ValueError("a mesh axis of -1 needs the device count")
        known = math.prod(s for s in sizes.values() if s != -1)
        if device_count % known:
            raise ValueError(f"mesh {sizes}: {device_count} devices are not divisible by {known}")
        sizes[free[0]] = device_count // known
    need = math.prod(sizes.values())
    if device_count is not None and need > device_count:
        raise ValueError(
            f"mesh {sizes} needs {need} devices but only {device_count} exist; "
            "shrink config.mesh.*, use -1 for one axis, or set mesh.fit=True"
        )
    return sizes


def fit_mesh(sizes: Mapping[str, int], device_count: int) -> dict[str, int]:
    """`sizes` shrunk until their product is at most `device_count`: the axes in the order
    dp, fsdp, tp, sp (the sequence split, the point of a long-context mesh, goes last), each
    divided by its smallest prime factor at a time until it is 1 or the mesh fits. A divisor
    of a size divides whatever the size divided (batch, sequence, heads), and the loss does
    not depend on the mesh, so a fitted run trains the same steps; e.g. dp=1 fsdp=2 tp=1 sp=4
    on 8, 4, 2, 1 devices: fsdp=2 sp=4, sp=4, sp=2, all 1."""
    fitted = dict(sizes)
    for axis in MESH_AXES:
        while fitted[axis] > 1 and math.prod(fitted.values()) > device_count:
            fitted[axis] //= next(f for f in range(2, fitted[axis] + 1) if fitted[axis] % f == 0)
    return fitted


def make_mesh(
    dp: int = 1,
    fsdp: int = 1,
    tp: int = 1,
    sp: int = 1,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """A `Mesh` with axes ('dp', 'fsdp', 'tp', 'sp') (Auto axis types: classic GSPMD).

    One size may be -1 (the rest of the devices). Uses the first prod(sizes) devices, ordered
    so that `sp` and `tp` neighbours are closest (`mesh_utils` where it can, else flat).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(dp, fsdp, tp, sp, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    devices = devices[: math.prod(shape)]
    try:
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices=devices)
    except Exception:  # noqa: BLE001  (CPU / odd topologies: a plain row-major grid is right)
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, MESH_AXES)


class AxisSizes(Protocol):
    """What `logical_spec` reads of a mesh: its size per axis name (a `Mesh`, or a stand-in
    that holds only the sizes)."""

    @property
    def shape(self) -> Mapping[str, int]: ...


def logical_spec(
    axes: Sequence[str | None], shape: Sequence[int] | None = None, mesh: AxisSizes | None = None
) -> P:
    """PartitionSpec for logical axis names under `AXIS_RULES`.

    With `shape` and `mesh`, mesh axes that do not divide a dimension are dropped (that
    dimension is replicated instead), e.g. 1 kv head with tp=2, or a tiny demo vocabulary.
    """
    spec = []
    used: set[str] = set()
    for i, name in enumerate(axes):
        mesh_axes = [a for a in (AXIS_RULES[name] if name else ()) if a not in used]
        if shape is not None and mesh is not None:
            kept, size = [], 1
            for a in mesh_axes:
                if shape[i] % (size * mesh.shape[a]) == 0:
                    kept.append(a)
                    size *= mesh.shape[a]
            mesh_axes = kept
        used.update(mesh_axes)
        spec.append(
            tuple(mesh_axes) if len(mesh_axes) > 1 else (mesh_axes[0] if mesh_axes else None)
        )
    return P(*spec)


def logical_sharding(
    mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int] | None = None
) -> NamedSharding:
    """NamedSharding of an array with the given logical axes on `mesh`."""
    return NamedSharding(mesh, logical_spec(axes, shape, mesh))
