"""The planner's memory model asks the attention strategy what it holds (`Strategy.buffers`)
and reads one table of what each remat policy keeps (`lclm.config.model.REMAT`)."""

import os

import pytest
from support import ROOT

from lclm.config import load_config
from lclm.config.model import REMAT, REMAT_POLICIES
from lclm.config.run_config import run_config
from lclm.models import decoder
from lclm.ops.context_parallel import STRATEGIES, strategy_of
from lclm.ops.context_parallel.contract import Step
from lclm.plan.memory import estimate
from lclm.plan.strategies import attention_step


def _seven_b(strategy: str, ulysses: int = 1):
    c = load_config(os.path.join(ROOT, "configs", "llama7b_256k.py"))
    c.stages.schedule = ""
    c.train.grad_accum = 1
    c.data.update(seq_len=262144, batch_size=4)
    c.mesh.update(dp=1, fsdp=4, tp=1, sp=8)
    c.attention.update(strategy=strategy, ulysses=ulysses)
    return c


@pytest.mark.parametrize("strategy, ulysses", [(s, 1) for s in STRATEGIES] + [("usp", 4)])
def test_the_planner_charges_what_the_strategy_states(strategy, ulysses):
    c = _seven_b(strategy, ulysses)
    plan = estimate(c, 32, "tpu-v4")
    step = attention_step(
        run_config(c), plan.mesh, flops=0.0, fast_gbs=0.0, slow_gbs=0.0, devices_per_node=8
    )
    assert plan.ring == pytest.approx(strategy_of(c.attention).buffers(step))


def test_all_gather_and_ulysses_are_not_charged_the_rings_buffers():
    ring, gathered, ulysses = (
        estimate(_seven_b(s), 32, "tpu-v4") for s in ("ring", "all_gather", "ulysses")
    )
    # all_gather holds the whole sequence's K/V and their float32 gradient: n = 8 blocks
    # against the ring's one in flight and one travelling dK/dV
    assert gathered.ring == pytest.approx(ring.ring * 8 * (1 + 4 / 2) / (2 + 4 / 2))
    assert ulysses.ring != ring.ring
    assert gathered.total - gathered.ring == pytest.approx(ring.total - ring.ring)


def test_one_table_says_what_each_remat_policy_keeps():
    assert REMAT_POLICIES == tuple(REMAT)
    # the decoder gives every policy that recomputes anything its JAX policy
    assert set(decoder._REMAT) == {n for n, r in REMAT.items() if not r.everything}
    step = lambda remat: Step(
        n=2,
        q=1,
        kv=1,
        kv_heads=1,
        heads=1,
        pair_flops=1,
        dtype_bytes=2,
        per_step=1,
        remat=remat,
        flops=1,
        fast_gbs=1,
        slow_gbs=1,
        devices_per_node=8,
    )
    assert {n for n in REMAT if step(n).recompute} == {"full", "dots", "dots_no_batch"}
