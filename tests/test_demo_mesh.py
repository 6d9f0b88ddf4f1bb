"""The quick start's demo runs as it is on 1, 2, 4 or 8 devices (mesh.fit), with the same
losses: the mesh it picks for each device count, and its first steps on one device against
the 8 simulated CPU devices of the README's command."""

import json
import os
import subprocess
import sys

import pytest
from support import DEMO_CONFIG, ROOT

from lclm.config import load_config
from lclm.errors import ConfigError
from lclm.parallel.mesh import fit_mesh, resolve_mesh_shape
from lclm.train.startup_checks import checked, validate

DEMO_MESH = dict(dp=1, fsdp=2, tp=1, sp=4)


@pytest.mark.parametrize(
    "devices,sizes",
    [
        (1, dict(dp=1, fsdp=1, tp=1, sp=1)),
        (2, dict(dp=1, fsdp=1, tp=1, sp=2)),
        (3, dict(dp=1, fsdp=1, tp=1, sp=2)),
        (4, dict(dp=1, fsdp=1, tp=1, sp=4)),
        (8, DEMO_MESH),
        (16, DEMO_MESH),  # a larger machine: the first 8 devices, as any smaller mesh
    ],
)
def test_the_demo_mesh_fits_the_devices(devices, sizes):
    assert resolve_mesh_shape(**fit_mesh(DEMO_MESH, devices), device_count=devices) == sizes
    config = load_config(DEMO_CONFIG)
    assert validate(config, devices) == sizes
    # config.json records the mesh the run used (the checked config's): generate and the
    # evaluations read it
    resolved, _, mesh = checked(config, devices)
    assert mesh == sizes and {a: resolved.mesh[a] for a in sizes} == sizes


def test_fit_shrinks_outer_axes_first():
    assert fit_mesh(dict(dp=2, fsdp=2, tp=2, sp=8), 8) == dict(dp=1, fsdp=1, tp=1, sp=8)
    assert fit_mesh(dict(dp=1, fsdp=1, tp=2, sp=8), 4) == dict(dp=1, fsdp=1, tp=1, sp=4)
    assert fit_mesh(dict(dp=1, fsdp=3, tp=1, sp=6), 4) == dict(dp=1, fsdp=1, tp=1, sp=3)


def test_without_fit_a_large_mesh_is_refused_naming_fit():
    config = load_config(DEMO_CONFIG)
    config.mesh.fit = False
    with pytest.raises(ConfigError, match="needs 8 devices but only 1 exist.*mesh.fit=True"):
        validate(config, 1)


def _demo_losses(tmp_path, name: str, xla_flags: str | None) -> tuple[list[float], dict]:
    """Losses of the demo's first 3 steps run by the README's command (shortened) in a
    process whose CPU shows the devices `xla_flags` asks for (None: what the demo asks for),
    and the mesh its config.json records."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    workdir = tmp_path / name
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train.py"),
            "--config",
            DEMO_CONFIG,
            f"--config.workdir={workdir}",
            "--config.train.steps=3",
            "--config.log.every=1",
            "--config.log.progress=false",
            "--config.validation.path=",
        ],
        env=env,
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=600,
    )
    records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    mesh = json.load(open(workdir / "config.json"))["mesh"]
    return [r["loss"] for r in records if "loss" in r], mesh


@pytest.mark.slow
def test_the_demo_trains_the_same_on_one_device_as_on_eight(tmp_path):
    one, one_mesh = _demo_losses(tmp_path, "one", "--xla_force_host_platform_device_count=1")
    eight, eight_mesh = _demo_losses(tmp_path, "eight", None)
    assert {a: one_mesh[a] for a in DEMO_MESH} == dict(dp=1, fsdp=1, tp=1, sp=1)
    assert {a: eight_mesh[a] for a in DEMO_MESH} == DEMO_MESH
    assert len(one) == len(eight) == 3
    assert one == pytest.approx(eight, rel=1e-5)
