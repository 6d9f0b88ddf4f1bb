"""The planner's numbers that the README and docs/scaling.md quote (memory, and the
context-parallel strategies' bytes and exposed seconds) are what the planner prints now
(measured numbers, XLA's included, are re-measured by hand and dated there)."""

import os
import re

from support import ROOT

from lclm import aot
from lclm.config import load_config
from lclm.config.schema import STRATEGIES
from lclm.config.stages import stage_configs
from lclm.plan import _gib, _links, estimate
from lclm.strategy_plan import compare


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


def _strategy_rows():
    """([device of each row], [(where, sp, fsdp, its cells)]) of the README's strategy
    table."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    rows = re.findall(r"^\| (32 H100 \(4 x 8\)|v5p-128), sp=(\d+)(?: fsdp=(\d+))? \| (.*) \|$",
                      text, re.MULTILINE)
    return ["h100-nvlink" if where.startswith("32") else "tpu-v5p"
            for where, _, _, _ in rows], rows


def test_the_readme_strategy_table_quotes_the_planner():
    targets, rows = _strategy_rows()
    assert len(rows) == 4
    for device, (_, sp, fsdp, cells) in zip(targets, rows):
        c = load_config(os.path.join(ROOT, "configs", "llama7b_256k.py"))
        c.stages.schedule = ""
        c.data.update(seq_len=262144, batch_size=4)
        sizes = dict(dp=1, fsdp=int(fsdp or 1), tp=1, sp=int(sp))
        flops, fast, slow, per_node, _ = _links(device, 8)
        costs = {x.strategy: x for x in compare(c, sizes, flops, fast, slow, per_node)}
        for name, cell in zip(STRATEGIES, cells.split(" | ")):
            if cell.startswith("= Ulysses"):  # the planner's usp row says so, with Ulysses' figures
                assert name == "usp" and costs[name].note.startswith("= ulysses here")
                continue
            cost = costs[name]
            if "cannot run" in cell:
                assert cost.note.endswith("cannot run"), (sp, name)
                continue
            gb = re.search(r"([\d,]+) GB", cell).group(1)
            assert gb == f"{sum(cost.sent.values()) / 1e9:,.0f}", (sp, name, cell)
            seconds = re.search(r"([\d.]+) s\b", cell)
            if "hidden" in cell:
                assert cost.exposed_s == 0, (sp, name)
            else:
                places = len(seconds.group(1).split(".")[1])
                assert seconds.group(1) == f"{cost.exposed_s:.{places}f}", (sp, name, cell)
            if name == "usp":
                assert cell.startswith(cost.split), (sp, cell)
