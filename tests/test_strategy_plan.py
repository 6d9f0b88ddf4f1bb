"""The planner's comparison of context-parallel strategies (lclm/plan/strategies.py): bytes by
hand for a small case, how they scale with the ring, and the ranking on a 4 x 8 GPU cluster."""

import os

import pytest
from support import ROOT

from lclm.config import load_config
from lclm.config.run_config import run_config
from lclm.ops.context_parallel import STRATEGIES
from lclm.plan.__main__ import main
from lclm.plan.memory import DEVICES
from lclm.plan.strategies import compare

H100 = DEVICES["h100-nvlink"][0]


def _seven_b(seq_len=262144, batch=1, **model):
    c = load_config(os.path.join(ROOT, "configs", "llama7b_256k.py"))
    c.stages.schedule = ""
    c.data.update(seq_len=seq_len, batch_size=batch)
    c.model.update(model)
    return c


def _by_name(costs):
    return {c.strategy: c for c in costs}


def _mesh(sp, fsdp=1):
    return dict(dp=1, fsdp=fsdp, tp=1, sp=sp)


def test_ring_bytes_by_hand():
    c = _seven_b(seq_len=4096, remat="attention")
    ring = _by_name(compare(run_config(c), _mesh(2), H100, 450, 50, 8))["ring"]
    kv = 1 * 2048 * 32 * 128 * 2 * 2  # one device's K and V of a layer, bfloat16
    # forward: 1 hop; backward: K/V 1 hop, float32 dK/dV 2 hops (home)
    assert ring.sent == {"in a node": (2 * 1 + 2 * 4 / 2) * kv * 32}


@pytest.mark.parametrize("remat, again", [("none", 0), ("attention", 1), ("full", 1)])
def test_all_gather_and_ulysses_bytes_by_hand(remat, again):
    c = _seven_b(seq_len=4096, remat=remat, n_kv_heads=2)
    costs = _by_name(compare(run_config(c), _mesh(4), H100, 450, 50, 8))
    t = 4096 // 4
    kv = 1 * t * 2 * 128 * 2 * 2  # one device's K and V of a layer: 2 KV heads, bfloat16
    q = 1 * t * 32 * 128 * 2
    # gathered forward, again backward (and again under a forward-recomputing remat),
    # float32 dK/dV reduce-scattered: each a (n - 1)/n share of n blocks
    full = 1 if remat == "full" else 0
    assert costs["all_gather"].sent == {"in a node": (2 + full + 4 / 2) * 3 * kv * 32}
    # 2 KV heads over 4 devices: each repeated twice (kv_repeats); q, k, v in and o out,
    # do in and dq, dk, dv out, and q, k, v in again where the backward re-runs the forward
    kv2 = 2 * kv
    moved = 2 * (2 * q + kv2) + again * (q + kv2)
    assert costs["ulysses"].sent == {"in a node": pytest.approx(moved * 3 / 4 * 32)}
    assert costs["ulysses"].note == "KV heads replicated x2"


def test_ulysses_bytes_fall_with_the_degree_while_the_ring_sends_the_sequence():
    c = _seven_b()
    at8, at32 = (_by_name(compare(run_config(c), _mesh(n), H100, 450, 450, 64)) for n in (8, 32))
    ring8, ring32 = (sum(x["ring"].sent.values()) for x in (at8, at32))
    ulysses8, ulysses32 = (sum(x["ulysses"].sent.values()) for x in (at8, at32))
    assert ring32 == pytest.approx(ring8, rel=0.1)  # about the whole sequence's K/V
    assert ulysses32 < ulysses8 / 3.5 and ulysses8 < ring8 / 5


def test_on_four_nodes_of_eight_usp_keeps_the_all_to_all_inside_the_nodes():
    costs = _by_name(compare(run_config(_seven_b()), _mesh(32), H100, 450, 50, 8))
    assert sorted(costs) == sorted(STRATEGIES)  # the planner compares every named one
    usp = costs["usp"]
    assert usp.split == "ulysses 8 x ring 4" and usp.note == "attention.ulysses=8"
    between = {name: c.sent.get("between nodes", 0.0) for name, c in costs.items()}
    # plain ulysses sends least between nodes, but its all-to-alls wait on InfiniBand; usp's
    # ring hops there hide behind the block pairs' compute
    assert between["ulysses"] < between["usp"] < between["all_gather"] < between["ring"]
    exposed = [costs[name].exposed_s for name in ("usp", "ulysses", "ring", "all_gather")]
    assert exposed == sorted(exposed) and exposed[0] < exposed[1] / 5


def test_usp_is_listed_where_it_equals_ulysses_or_the_ring():
    """Every strategy is ranked: usp with its ulysses group the whole ring is Ulysses, with
    no heads to split over it is the ring; its row says which, with that one's figures."""
    whole = _by_name(compare(run_config(_seven_b()), _mesh(8), H100, 450, 50, 8))
    assert sorted(whole) == sorted(STRATEGIES)
    assert whole["usp"].split == "ulysses 8 x ring 1"
    assert whole["usp"].note.startswith("= ulysses here (attention.ulysses=8)")
    assert (whole["usp"].sent, whole["usp"].exposed_s) == (
        whole["ulysses"].sent,
        whole["ulysses"].exposed_s,
    )
    one = _by_name(compare(run_config(_seven_b()), _mesh(1), H100, 450, 50, 8))
    assert one["usp"].note.startswith("= ring here") and one["usp"].sent == one["ring"].sent


def test_ulysses_limits_gqa_replication_and_heads():
    costs = _by_name(compare(run_config(_seven_b(n_kv_heads=8)), _mesh(16), H100, 450, 50, 64))
    assert costs["ulysses"].note == "KV heads replicated x2"
    costs = _by_name(compare(run_config(_seven_b()), _mesh(64), H100, 450, 450, 64))
    assert costs["ulysses"].note.endswith("cannot run")
    costs = _by_name(compare(run_config(_seven_b()), _mesh(24), H100, 450, 450, 64))  # 32 heads
    assert costs["ulysses"].note.endswith("cannot run")


def test_the_cli_ranks_the_strategies(capsys):
    assert (
        main(
            [
                "--config",
                os.path.join(ROOT, "configs", "llama7b_256k.py"),
                "--devices",
                "32",
                "--device",
                "h100-nvlink",
                "--strategies",
                "--config.stages.schedule=256k:1e7:150:32",
            ]
        )
        == 0
    )
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0][2:] for r in rows[2:]] == ["usp", "ulysses", "ring", "all_gather"]
    assert main(["--config", os.path.join(ROOT, "configs", "demo.py"), "--strategies"]) == 2
    assert "pass --device" in capsys.readouterr().err
