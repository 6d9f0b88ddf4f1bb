"""allow_gpu_host_memory: XLA:GPU's pinned host memory cap, set before JAX starts."""

import os

from lclm.parallel.devices import GPU_HOST_MEMORY_LIMIT, HOST_MEMORY_SHARE, allow_gpu_host_memory


def _machine_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30


def test_the_cap_is_a_share_of_this_machine_split_between_its_processes(monkeypatch):
    monkeypatch.delenv(GPU_HOST_MEMORY_LIMIT, raising=False)
    allow_gpu_host_memory()
    one = int(os.environ[GPU_HOST_MEMORY_LIMIT])
    assert one == int(_machine_gib() * HOST_MEMORY_SHARE)
    monkeypatch.delenv(GPU_HOST_MEMORY_LIMIT)
    allow_gpu_host_memory(local_processes=4)
    assert int(os.environ[GPU_HOST_MEMORY_LIMIT]) == int(_machine_gib() * HOST_MEMORY_SHARE / 4)


def test_a_cap_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv(GPU_HOST_MEMORY_LIMIT, "7")
    allow_gpu_host_memory()
    assert os.environ[GPU_HOST_MEMORY_LIMIT] == "7"
