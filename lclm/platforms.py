"""JAX's platforms on this machine, chosen where JAX would otherwise start libtpu for nothing.

With libtpu installed (lclm's [test] extra brings it for ahead-of-time TPU compiles) and no TPU
attached, JAX's default platform search initialises the TPU runtime anyway, which prints
libtpu's complaints about the missing TPU before every command and takes libtpu's machine-wide
lock, so that a second such process (`plan --compile` among them) fails. There, when nothing
but the CPU is left for JAX to use, `keep_jax_off_an_absent_tpu` sets `JAX_PLATFORMS=cpu`; the
same where JAX's CUDA plugin is installed ([gpu-aot], for compiling for described GPUs) and no
GPU is attached, where the plugin would print its failed CUDA check before every command. An
explicit `JAX_PLATFORMS` (even empty) is kept, and machines with a TPU, a GPU or another PJRT
plugin are left to JAX.

Every CLI calls it through `lclm.cli.run_cli`, before JAX starts its backends (JAX reads its
platforms then, not at import); importing lclm chooses nothing. No JAX here: the probe reads
device nodes, sysfs and the installed packages.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pkgutil
import re
import sys
from importlib.machinery import ModuleSpec

# What jax._src.hardware_utils takes for a TPU chip on the PCI bus (Google's vendor id; the
# device ids of v3 to TPU7x). Not imported from there: that would import JAX.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})
# The device nodes through which JAX finds an NVIDIA GPU (hardware_utils) or an AMD one (KFD)
_NVIDIA_DEVICE_NODES = ("/dev/nvidia0", "/dev/nvidiactl")
_GPU_DEVICE_NODES = (*_NVIDIA_DEVICE_NODES, "/dev/dxg", "/dev/kfd")


def tpu_attached() -> bool:
    """Whether this machine has a TPU: the device nodes libtpu opens (/dev/accel0... on v2-v4
    and v5e, VFIO groups on v5p and later) or a TPU chip on the PCI bus."""
    # a TPU of a generation newer than the PCI ids above still shows its device nodes; a
    # false "yes" only leaves JAX's own platform search in place
    if glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() != _GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor), "device")) as f:
                if f.read().strip() in _TPU_PCI_DEVICES:
                    return True
        except OSError:
            continue
    return False


def _other_accelerator() -> bool:
    """Whether JAX might start a platform other than the CPU and the TPU here: a GPU's device
    nodes, or a PJRT plugin it would load (CUDA's aside: without an NVIDIA device it fails
    its CUDA check and JAX goes on without it, so naming only the CPU loses nothing)."""
    if any(os.path.exists(p) for p in _GPU_DEVICE_NODES):
        return True
    if os.environ.get("PJRT_NAMES_AND_LIBRARY_PATHS"):
        return True
    # Plugins live in the jax_plugins namespace package (CUDA's and ROCm's among them).
    # JAX also loads plugins named only by a jax_plugins entry point; not looked for: reading
    # every package's entry points would add 70 ms to each command, jax-free ones included.
    try:
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        return True  # unreadable: leave the choice to JAX
    return any(not re.fullmatch(r"xla_cuda\d*", name) for name in _jax_plugins(spec))


def _jax_plugins(spec: ModuleSpec | None) -> list[str]:
    """The module names of the jax_plugins namespace package (`spec`: its spec, or None)."""
    return (
        [m.name for m in pkgutil.iter_modules(list(spec.submodule_search_locations or []))]
        if spec
        else []
    )


def nvidia_gpu_attached() -> bool:
    """Whether this machine shows an NVIDIA GPU's device nodes (those JAX's CUDA plugin opens)."""
    return any(os.path.exists(p) for p in _NVIDIA_DEVICE_NODES)


def cuda_plugin() -> str | None:
    """The module of JAX's installed CUDA plugin (jax_plugins.xla_cuda12 or _cuda13: the [cuda]
    or [gpu-aot] extra), or None. Without a GPU, JAX's platform search makes it print a cuInit
    failure before every command; compiling for described GPUs (`plan --compile h100:8`) needs
    it and the CPU platform only."""
    try:
        spec = importlib.util.find_spec("jax_plugins")
    except (ImportError, ValueError):
        return None
    for name in sorted(_jax_plugins(spec), reverse=True):  # the newest CUDA first
        if re.fullmatch(r"xla_cuda\d*", name):
            try:  # a plugin blocked in sys.modules (set to None) is not there
                if importlib.util.find_spec(f"jax_plugins.{name}") is not None:
                    return f"jax_plugins.{name}"
            except (ImportError, ValueError):
                continue
    return None


def keep_jax_off_an_absent_tpu() -> None:
    """Set `JAX_PLATFORMS=cpu` (and JAX's config, if JAX is already imported) where libtpu or
    JAX's CUDA plugin is installed, no TPU is attached and JAX has nothing but the CPU to
    use; otherwise nothing. Call it before JAX starts its backends."""
    if "JAX_PLATFORMS" in os.environ or "JAX_FORCE_TPU_INIT" in os.environ:
        return
    if not (
        os.environ.get("TPU_LIBRARY_PATH") or importlib.util.find_spec("libtpu") or cuda_plugin()
    ):
        return  # without libtpu or the CUDA plugin JAX's own search is silent and lock-free
    if tpu_attached() or _other_accelerator():
        return
    jax = sys.modules.get("jax")
    if jax is not None and hasattr(jax, "config"):
        if jax.config.jax_platforms is not None:
            return  # chosen in code before this call: the caller's
        jax.config.update("jax_platforms", "cpu")  # no effect once its backends have started
    # read by JAX when it is imported; child processes (bench's isolated parts) inherit the
    # choice, which holds for them too: the same machine
    os.environ["JAX_PLATFORMS"] = "cpu"
