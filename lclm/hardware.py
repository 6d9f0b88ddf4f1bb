"""The accelerators lclm knows, in one table: the planner (memory, strategy ranking), the MFU
of the metrics and the ahead-of-time compiler (TPU slices, GPU targets) all read it.

Figures are per JAX device (a GPU; a TPU chip, whose TensorCores a megacore chip presents as
one device), from the vendors' datasheets: dense bf16 peak FLOP/s, HBM, and the one-way link
bandwidth of the planner's ranking of context-parallel strategies. What XLA is told when
compiling for a described GPU (its memory too) is the target file in lclm/targets/.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str  # the generation as `--compile` spells it: 'h100', 'v4'
    platform: str  # 'gpu' or 'tpu'
    device_kinds: tuple[str, ...]  # prefixes of JAX's `Device.device_kind`
    peak_flops: float  # dense bf16 FLOP/s per device
    hbm_gib: float  # per device
    # one-way GB/s per link kind: GPUs 'nvlink' (in a node) and 'ib' (between nodes), TPUs
    # 'ici'; a chip without figures has no planner device
    links: tuple[tuple[str, float], ...] = ()
    gpu_target: str | None = None  # GPUs: the GpuTargetConfigProto file in lclm/targets/
    # TPUs: TensorCores per chip (slice names count them: v4-64 is 32 chips), libtpu's chip
    # config, and the torus's dimensions
    tpu_cores: int = 1
    tpu_chip_config: str | None = None
    tpu_torus_dims: int = 0


CHIPS = (
    Chip(
        "a100",
        "gpu",
        ("NVIDIA A100",),
        312e12,
        80,
        (("nvlink", 300), ("ib", 12.5)),
        gpu_target="a100.txtpb",
    ),
    Chip(
        "h100",
        "gpu",
        ("NVIDIA H100",),
        989e12,
        80,
        (("nvlink", 450), ("ib", 50)),
        gpu_target="h100.txtpb",
    ),
    Chip("h200", "gpu", ("NVIDIA H200",), 989e12, 141, (("nvlink", 450),), gpu_target="h200.txtpb"),
    Chip(
        "v4",
        "tpu",
        ("TPU v4",),
        275e12,
        32,
        (("ici", 268),),
        tpu_cores=2,
        tpu_chip_config="megacore",
        tpu_torus_dims=3,
    ),
    Chip(
        "v5p",
        "tpu",
        ("TPU v5p", "TPU v5"),
        459e12,
        95,
        (("ici", 600),),
        tpu_cores=2,
        tpu_chip_config="megacore",
        tpu_torus_dims=3,
    ),
    Chip("v5e", "tpu", ("TPU v5 lite", "TPU v5e"), 197e12, 16, (("ici", 186),), tpu_torus_dims=2),
    Chip("v6e", "tpu", ("TPU v6 lite", "TPU v6e"), 918e12, 32, tpu_torus_dims=2),
)
BY_NAME = {c.name: c for c in CHIPS}
TPUS = {c.name: c for c in CHIPS if c.platform == "tpu"}
GPUS = {c.name: c for c in CHIPS if c.platform == "gpu"}


def peak_flops(device_kind: str) -> float | None:
    """Peak FLOP/s of one device by its JAX `device_kind`, or None when unknown (a CPU): MFU
    is then not reported. The longest matching prefix wins ('TPU v5 lite' before 'TPU v5')."""
    found = [
        (len(p), c.peak_flops) for c in CHIPS for p in c.device_kinds if device_kind.startswith(p)
    ]
    return max(found)[1] if found else None


def planner_device(chip: Chip, link: str | None = None) -> str:
    """The planner's name of a chip on a link: 'h100-nvlink', 'a100-ib', 'tpu-v4'."""
    if chip.platform == "tpu":
        return f"tpu-{chip.name}"
    return f"{chip.name}-{link or chip.links[0][0]}"


def planner_devices() -> dict[str, tuple[float, float, float]]:
    """Planner device name -> (peak FLOP/s, one-way link GB/s, HBM GiB), for every chip with
    link figures."""
    return {
        planner_device(c, link): (c.peak_flops, gbs, c.hbm_gib)
        for c in CHIPS
        for link, gbs in c.links
    }
