"""One hardware table: the MFU's peak, the planner's devices and the compiler's targets read
the same figures (lclm/hardware.py)."""

from lclm import hardware
from lclm.plan import aot
from lclm.plan.memory import DEVICES


def test_the_mfu_peak_is_the_longest_matching_device_kind():
    assert hardware.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert hardware.peak_flops("TPU v5 lite") == 197e12  # not v5p's, whose prefix is "TPU v5"
    assert hardware.peak_flops("TPU v5") == 459e12
    assert hardware.peak_flops("cpu") is None


def test_planner_and_compiler_targets_come_from_the_table():
    h100 = hardware.BY_NAME["h100"]
    assert DEVICES["h100-nvlink"] == (h100.peak_flops, 450, h100.hbm_gib)
    assert DEVICES["h100-ib"][1] == 50 and "tpu-v6e" not in DEVICES  # v6e: no link figures
    v5p = aot.target("v5p-128")
    assert (v5p.devices, v5p.hbm_bytes) == (64, hardware.TPUS["v5p"].hbm_gib * 2**30)
    assert aot.target("v4-64").planner_device == "tpu-v4" in DEVICES
    assert aot.target("h200:8").planner_device == "h200-nvlink" in DEVICES
