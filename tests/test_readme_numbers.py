"""The planner's numbers that the README and docs/scaling.md quote (memory, and the
context-parallel strategies' bytes and exposed seconds) are what the planner prints now
(measured numbers, XLA's included, are re-measured by hand and dated there)."""

import os
import re

from support import ROOT

from lclm.config import load_config
from lclm.config.run_config import run_config
from lclm.config.stages import stage_configs
from lclm.ops.context_parallel import STRATEGIES
from lclm.plan import aot
from lclm.plan.__main__ import _links
from lclm.plan.memory import estimate, gib
from lclm.plan.strategies import compare


def _planned(config, devices: int, device: str) -> list[str]:
    """The planner's GiB per stage, runs of equal values written once (as the tables do)."""
    runs = stage_configs(config) or [config]
    values = [gib(estimate(c, devices, device).total) for c in runs]
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


def _tpu_table() -> list[tuple[str, str, list[str]]]:
    """(config, slice, planner GiB values) of each row of the README's TPU table."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    rows = re.findall(
        r"^\| `(\w+)` \| (v\w+-\d+)[^|]* \|[^|]*\|[^|]*\| ([\d. /]+) \|", text, re.MULTILINE
    )
    return [(config, slice_, values.split(" / ")) for config, slice_, values in rows]


def test_the_readme_tpu_table_quotes_the_planner():
    rows = _tpu_table()
    assert {config for config, _, _ in rows} == {
        "llama7b_256k",
        "llama13b_512k",
        "llama3b",
        "llama1b",
        "striped_attention_1b",
        "qwen3_8b_256k",
        "mistral_nemo_12b_256k",
    }
    for config, slice_, quoted in rows:
        target = aot.tpu_target(slice_)
        c = load_config(os.path.join(ROOT, "configs", f"{config}.py"))
        assert _planned(c, target.devices, f"tpu-{target.generation}") == quoted, config


def test_the_scaling_doc_quotes_the_planner_for_one_h100():
    with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
        text = " ".join(f.read().split())
    quoted = re.search(
        r"sp=1\) it now says ([\d.]+) / ([\d.]+) / ([\d.]+) GiB at 8K / 32K / "
        r"128K",
        text,
    ).groups()
    c = load_config(os.path.join(ROOT, "configs", "llama1b.py"))
    c.mesh.update(dp=1, fsdp=1, tp=1, sp=1)
    c.model.remat = "attention"  # the policy the sentence quotes (the config ships 'auto')
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
    rows = re.findall(
        r"^\| (32 H100 \(4 x 8\)|v5p-128), sp=(\d+)(?: fsdp=(\d+))? \| (.*) \|$", text, re.MULTILINE
    )
    return ["h100-nvlink" if where.startswith("32") else "tpu-v5p" for where, _, _, _ in rows], rows


def test_the_readme_strategy_table_quotes_the_planner():
    targets, rows = _strategy_rows()
    assert len(rows) == 4
    for device, (_, sp, fsdp, cells) in zip(targets, rows):
        c = load_config(os.path.join(ROOT, "configs", "llama7b_256k.py"))
        c.stages.schedule = ""
        c.data.update(seq_len=262144, batch_size=4)
        sizes = dict(dp=1, fsdp=int(fsdp or 1), tp=1, sp=int(sp))
        flops, fast, slow, per_node, _ = _links(device, 8)
        costs = {x.strategy: x for x in compare(run_config(c), sizes, flops, fast, slow, per_node)}
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


def _scaling_strategy_rows():
    """(device, devices, sp, fsdp, [cells]) of docs/scaling.md's strategy table."""
    with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
        text = f.read()
    rows = re.findall(
        r"^\| (32 H100 \(4 nodes x 8\)|v5p-128 \(64 chips\)) \| sp=(\d+)"
        r"(?:, fsdp=(\d+))?[^|]* \| (.*) \|$",
        text,
        re.MULTILINE,
    )
    return [
        (
            ("h100-nvlink", 32) if where.startswith("32") else ("tpu-v5p", 64),
            int(sp),
            int(fsdp or 1),
            cells.split(" | "),
        )
        for where, sp, fsdp, cells in rows
    ]


def test_the_scaling_doc_strategy_table_quotes_the_planner():
    """Bytes per link, exposed seconds and GiB per device of every cell, as `plan
    --strategies --config.stages.schedule=256k:1e7:150:SP --config.mesh.fsdp=F` prints
    them for configs/llama7b_256k.py."""
    rows = _scaling_strategy_rows()
    assert len(rows) == 4
    for (device, devices), sp, fsdp, cells in rows:
        c = load_config(os.path.join(ROOT, "configs", "llama7b_256k.py"))
        c.stages.schedule, c.mesh.fsdp = f"256k:1e7:150:{sp}", fsdp
        stage = stage_configs(c)[0]
        plan = estimate(stage, devices, device)
        flops, fast, slow, per_node, _ = _links(device, 8)
        costs = {
            x.strategy: x
            for x in compare(run_config(stage), plan.mesh, flops, fast, slow, per_node)
        }
        assert len(cells) == len(STRATEGIES)
        for name, cell in zip(STRATEGIES, cells):
            cost, where = costs[name], (device, sp, name, cell)
            if cell == "(= Ulysses)":
                assert name == "usp" and cost.note.startswith("= ulysses here"), where
                continue
            if cell.startswith("cannot run"):
                assert cost.note.endswith("cannot run"), where
                continue
            if ": " in cell:  # usp names its split
                split, cell = cell.split(": ", 1)
                assert split == cost.split, where
            inside, between = (cost.sent.get(k, 0.0) / 1e9 for k in ("in a node", "between nodes"))
            both = re.match(r"([\d,]+) GB between \+ ([\d,]+) in,", cell)
            if both:
                assert both.groups() == (f"{between:,.0f}", f"{inside:,.0f}"), where
            else:
                assert re.match(r"([\d,]+) GB", cell).group(1) == f"{inside + between:,.0f}", where
            seconds = re.search(r", ([\d.]+) s\b", cell)
            if "hidden" in cell:
                assert cost.exposed_s == 0, where
            else:
                places = len(seconds.group(1).split(".")[1])
                assert seconds.group(1) == f"{cost.exposed_s:.{places}f}", where
            memory = (plan.total - plan.ring + cost.memory) / 2**30
            assert re.search(r"([\d.]+) GiB$", cell).group(1) == f"{memory:.1f}", where


def test_the_scaling_doc_compile_table_names_the_recipe_meshes_and_plans():
    """The meshes docs/scaling.md says the v4-64 strategy compiles ran are the stages', and
    the per-strategy GiB it quotes beside the compiled ones are the planner's (256K)."""
    with open(os.path.join(ROOT, "docs", "scaling.md")) as f:
        text = " ".join(f.read().split())
    said = re.search(
        r"the recipe's meshes: sp=(\d+) x fsdp=(\d+) at 32K, sp=(\d+) x fsdp=(\d+) "
        r"from 128K",
        text,
    ).groups()
    c = load_config(os.path.join(ROOT, "configs", "llama7b_256k.py"))
    target = aot.tpu_target("v4-64")
    meshes = {}
    for stage in stage_configs(c):
        plan = estimate(stage, target.devices, "tpu-v4")
        meshes.setdefault(stage.data.seq_len, (plan.mesh["sp"], plan.mesh["fsdp"]))
    lengths = sorted(meshes)
    assert lengths[0] == 32768 and lengths[1] == 131072
    assert said == tuple(str(x) for x in (*meshes[32768], *meshes[131072]))
    assert all(meshes[n] == meshes[131072] for n in lengths[1:])
    quoted = re.search(
        r"at 256K: ring ([\d.]+), all-gather ([\d.]+), Ulysses ([\d.]+) GiB "
        r"planned",
        text,
    ).groups()
    last = stage_configs(c)[-1]
    plan = estimate(last, target.devices, "tpu-v4")
    flops, fast, slow, per_node, _ = _links("tpu-v4", 8)
    costs = {
        x.strategy: x for x in compare(run_config(last), plan.mesh, flops, fast, slow, per_node)
    }
    assert quoted == tuple(
        f"{(plan.total - plan.ring + costs[s].memory) / 2**30:.1f}"
        for s in ("ring", "all_gather", "ulysses")
    )
