"""The planner's numbers that the README and docs/scaling.md quote are what the planner
prints now (measured numbers, XLA's included, are re-measured by hand and dated there)."""

import os
import re

from support import ROOT

from lclm import aot
from lclm.config import load_config
from lclm.config.stages import stage_configs
from lclm.plan import _gib, estimate


def _planned(config, devices: int, device: str) -> list[str]:
    """The planner's GiB per stage, runs of equal values written once (as the tables do)."""
    runs = stage_configs(config) if config.stages.schedule else [config]
    values = [_gib(estimate(c, devices, device).total) for c in runs]
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def _tpu_table() -> list[tuple[str, str, list[str]]]:
    """(config, slice, planner GiB values) of each row of the README's TPU table."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    rows = re.findall(r"^\| `(\w+)` \| (v\w+-\d+)[^|]* \|[^|]*\|[^|]*\| ([\d. /]+) \|", text,
                      re.MULTILINE)
    return [(config, slice_, values.split(" / ")) for config, slice_, values in rows]


def test_the_readme_tpu_table_quotes_the_planner():
    rows = _tpu_table()
    assert {config for config, _, _ in rows} == {
        "llama7b_256k", "llama13b_512k", "llama3b", "llama1b", "striped_attention_1b"}
    for config, slice_, quoted in rows:
        target = aot.tpu_target(slice_)
        c = load_config(os.path.join(ROOT, "configs", f"{config}.py"))
        assert _planned(c, target.devices, f"tpu-{target.generation}") == quoted, config


def test_the_scaling_doc_quotes_the_planner_for_one_h100():
    with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
        text = " ".join(f.read().split())
    quoted = re.search(r"sp=1\) it now says ([\d.]+) / ([\d.]+) / ([\d.]+) GiB at 8K / 32K / "
                       r"128K", text).groups()
    c = load_config(os.path.join(ROOT, "configs", "llama1b.py"))
    c.mesh.update(dp=1, fsdp=1, tp=1, sp=1)
    planned = []
    for seq_len in (8192, 32768, 131072):
        c.data.update(seq_len=seq_len, batch_size=1)
        planned.append(f"{estimate(c, 1, 'h100-nvlink').total / 2**30:.1f}")
    assert tuple(planned) == quoted
