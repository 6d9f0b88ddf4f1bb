"""allow_gpu_host_memory: XLA:GPU's pinned host memory cap, set before JAX starts."""

import os

from lclm.parallel import devices
from lclm.parallel.devices import GPU_HOST_MEMORY_LIMIT, allow_gpu_host_memory


def _machine_with(monkeypatch, gib: int) -> None:
    sizes = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": gib * 2**30 // 4096}
    monkeypatch.setattr(devices.os, "sysconf", sizes.__getitem__)


def test_the_cap_is_90_percent_of_the_machine_split_between_its_processes(monkeypatch):
    _machine_with(monkeypatch, 128)
    monkeypatch.delenv(GPU_HOST_MEMORY_LIMIT, raising=False)
    allow_gpu_host_memory()
    assert os.environ[GPU_HOST_MEMORY_LIMIT] == "115"  # 0.9 x 128 GiB, whole GiB
    monkeypatch.delenv(GPU_HOST_MEMORY_LIMIT)
    allow_gpu_host_memory(local_processes=8)
    assert os.environ[GPU_HOST_MEMORY_LIMIT] == "14"  # 0.9 x 128 / 8


def test_a_cap_the_user_set_is_kept(monkeypatch):
    _machine_with(monkeypatch, 128)
    monkeypatch.setenv(GPU_HOST_MEMORY_LIMIT, "7")
    allow_gpu_host_memory()
    assert os.environ[GPU_HOST_MEMORY_LIMIT] == "7"
