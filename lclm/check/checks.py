"""The three pre-flight checks of one stage (`setup.Run`), each one `Result` line:

1. `length_check`: the first step's loss at the target length L against a short length S
   on the same rows: a long-context run with broken positions (RoPE theta or scaling,
   positions not reset, masks) starts near ln(V) at L while S is fine.
2. `strategy_check`: loss and gradient norm under the configured mesh and strategy against
   one device (sp=1) on the same batch.
3. `document_check`: changing one packed document's tokens leaves every other document's
   per-token losses unchanged (`data.document_mask`).

All losses are training's own: `loss_terms` (the train step's loss, the mean over target
tokens) and `token_losses` (its per-token form), on batches laid out as the loader lays them.
Shapes: B rows, L tokens, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lclm.check.setup import MIN_SHORT, Run
from lclm.data.loader import batch_sharding
from lclm.eval.token_loss import token_losses
from lclm.models.decoder import loss_terms
from lclm.ops.context_parallel import layout_shards
from lclm.ops.layout import batch_to_layout, from_layout
from lclm.parallel.mesh import make_mesh
from lclm.train.step import jit_eval_loss
from lclm.workdir.state import param_shardings

NEAR_UNIFORM = 1.0  # nats below ln(V) that count as "near ln(V)": next to nothing learnt
LONG_MARGIN = 0.5  # nats the long loss may exceed the short one by (it has more context)
# relative tolerances of check 2 (loss, gradient norm) and absolute per-token loss change of
# check 3, by compute dtype: float32 strategies agree to ~1e-6, bfloat16 ones to ~1e-3
STRATEGY_TOLERANCE = {"float32": (2e-4, 2e-3), "bfloat16": (1e-2, 5e-2)}
LEAK_TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-3}
PIECES = 4  # documents a one-document row is cut into for check 3


@dataclasses.dataclass
class Result:
    ok: bool
    text: str

    def line(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.text}"


def _on_mesh(run: Run, mesh, rows: dict) -> dict:
    """`[B, T]` rows in original order -> the batch training feeds `mesh`: in the layout of
    its ring, sharded as the loader shards it."""
    shards = layout_shards(run.sections.attention, mesh.shape["sp"])
    laid = batch_to_layout(rows, run.sections.attention.layout, shards)
    return {
        k: jax.device_put(np.asarray(v, np.int32), batch_sharding(mesh)) for k, v in laid.items()
    }


def mean_loss(run: Run, rows: dict) -> float:
    """The train step's loss (no update) of `rows` on the run's mesh and strategy."""
    fn = jit_eval_loss(
        run.model,
        run.sections.attention,
        run.mesh,
        param_shardings(run.model, run.mesh),
        document_mask=run.sections.data.document_mask,
    )
    total, count = jax.device_get(fn(run.params, _on_mesh(run, run.mesh, rows)))
    return float(total) / max(float(count), 1.0)


def loss_and_grad_norm(run: Run, mesh, params) -> tuple[float, float]:
    """(loss, global gradient norm) of the run's rows on `mesh` (`params` placed on it)."""
    terms = functools.partial(
        loss_terms,
        run.model,
        mesh=mesh,
        attention=run.sections.attention,
        document_mask=run.sections.data.document_mask,
    )

    def mean(p, batch):
        total, count = terms(p, batch)
        return total / jnp.maximum(count, 1.0)

    def both(p, batch):
        loss, grads = jax.value_and_grad(mean)(p, batch)
        return loss, optax.tree_utils.tree_norm(grads)

    loss, norm = jax.device_get(jax.jit(both)(params, _on_mesh(run, mesh, run.rows)))
    return float(loss), float(norm)


def losses_by_token(run: Run, rows: dict) -> np.ndarray:
    """Float32 per-token losses `[B, L]` in original order, on the run's mesh and strategy."""
    mesh = run.mesh
    fn = jax.jit(functools.partial(token_losses, run.model, run.sections.attention, mesh))
    losses = np.asarray(jax.device_get(fn(run.params, _on_mesh(run, mesh, rows))), np.float32)
    a = run.sections.attention
    return from_layout(losses, a.layout, layout_shards(a, mesh.shape["sp"]), axis=1)


def judge_lengths(long: float, short: float, ln_v: float) -> tuple[bool, str]:
    """(passed, what to conclude) of the loss at the target length against the short one."""
    near = lambda x: x > ln_v - NEAR_UNIFORM
    if not (math.isfinite(long) and math.isfinite(short)):
        return False, (
            "a loss is not finite: check model.dtype, model.rope_theta and the initial weights"
        )
    if near(long) and not near(short):
        return False, (
            f"the long loss is within {NEAR_UNIFORM:g} of ln V while the short one "
            "is not: positions break at long lengths; check model.rope_theta, "
            "model.rope_scaling, data.reset_positions and the attention masks"
        )
    if long > short + LONG_MARGIN:
        return False, (
            f"the long loss exceeds the short one by {long - short:.3f} > "
            f"{LONG_MARGIN:g}: the model loses its way at long positions; check "
            "model.rope_theta, model.rope_scaling, data.reset_positions"
        )
    if near(short):
        return True, (
            "both near ln V: the weights are untrained, so this says little; set "
            "model.init_from_hf or init_from_checkpoint"
        )
    return True, f"the long loss is not near ln V and at most {LONG_MARGIN:g} above the short"


def length_check(run: Run) -> Result:
    """Check 1: the first step's loss at L and at S on the same rows (their first S tokens).
    Rows at L always have a trained target (the packer skips windows with none); their
    first S tokens may not (a chat's long prompt), and a loss over no target is no loss."""
    length, short = run.sections.data.seq_len, run.short
    long_loss = mean_loss(run, run.rows)
    short_rows = {k: v[:, :short] for k, v in run.rows.items()}
    if not short_rows["loss_mask"].any():
        return Result(
            False,
            f"loss at {length} tokens {long_loss:.4f}; the first {short} "
            "tokens of the rows have no trained target (every target masked, "
            "as a chat's prompt is), so there is no short loss to compare: "
            "raise --length where it caps the target (the short length is "
            f"about 1/8 of it, at least {MIN_SHORT}) or check on data whose "
            f"rows do not start with {short} untrained tokens",
        )
    short_loss = mean_loss(run, short_rows)
    ln_v = math.log(run.model.vocab_size)
    ok, why = judge_lengths(long_loss, short_loss, ln_v)
    return Result(
        ok,
        f"loss at {length} tokens {long_loss:.4f}, at {short} {short_loss:.4f} "
        f"(ln V = {ln_v:.4f}): {why}",
    )


def strategy_check(run: Run) -> Result:
    """Check 2: loss and gradient norm on the run's mesh against one device (sp=1)."""
    a, sizes = run.sections.attention, dict(run.mesh.shape)
    what = f"{a.strategy} strategy, {a.layout} layout, mesh " + " ".join(
        f"{k}={v}" for k, v in sizes.items()
    )
    if run.mesh.size == 1:
        return Result(True, f"{what}: one device, nothing to compare against sp=1")
    loss, norm = loss_and_grad_norm(run, run.mesh, run.params)
    one = make_mesh(devices=jax.devices()[:1])
    ref_loss, ref_norm = loss_and_grad_norm(
        run, one, jax.device_put(run.params, param_shardings(run.model, one))
    )
    loss_tol, norm_tol = STRATEGY_TOLERANCE[run.model.dtype]
    loss_err = abs(loss - ref_loss) / max(abs(ref_loss), 1e-6)
    norm_err = abs(norm - ref_norm) / max(abs(ref_norm), 1e-6)
    ok = loss_err <= loss_tol and norm_err <= norm_tol
    fix = (
        ""
        if ok
        else (
            "; the strategy or layout computes another attention than one device "
            "does: try attention.strategy='all_gather' and report the bug"
        )
    )
    return Result(
        ok,
        f"{what} vs one device (sp=1): loss {loss:.6f} vs {ref_loss:.6f} "
        f"(relative {loss_err:.1e}, tolerance {loss_tol:g}), grad norm {norm:.6f} "
        f"vs {ref_norm:.6f} (relative {norm_err:.1e}, tolerance {norm_tol:g})"
        f"{fix}",
    )


def packed_row(rows: dict) -> tuple[int, dict, str]:
    """(the row with the most documents, `rows` with that row's documents, in words). A
    row of one document is cut into `PIECES` documents (segment ids only): a document
    mask must keep them apart as well."""
    segments = rows["segment_ids"]
    counts = [len(np.unique(s)) for s in segments]
    i = int(np.argmax(counts))
    if counts[i] >= 2:
        return i, rows, f"row {i}'s {counts[i]} packed documents"
    rows = {k: v.copy() for k, v in rows.items()}
    length = segments.shape[1]
    rows["segment_ids"][i] = 1 + np.arange(length) * PIECES // length
    return i, rows, f"row {i} (one document) cut into {PIECES} documents"


def document_check(run: Run) -> Result:
    """Check 3: new tokens in one packed document change no other document's token losses."""
    a, sp = run.sections.attention, run.mesh.shape["sp"]
    what = f"document mask ({a.strategy} strategy, {a.layout} layout, sp={sp})"
    if not run.sections.data.document_mask:
        return Result(
            True,
            f"{what.split(' (')[0]}: off (data.document_mask=False): packed "
            "documents attend to each other by design (separators only)",
        )
    i, rows, words = packed_row(run.rows)
    segments = rows["segment_ids"][i]
    doc = segments[0]  # the first document: every later one could see it through a leak
    changed = {k: v.copy() for k, v in rows.items()}
    inside = segments == doc
    noise = np.random.default_rng(0).integers(0, run.model.vocab_size, int(inside.sum()))
    changed["tokens"][i, inside] = noise
    before, after = losses_by_token(run, rows), losses_by_token(run, changed)
    change = float(np.max(np.abs(before[i, ~inside] - after[i, ~inside])))
    tol = LEAK_TOLERANCE[run.model.dtype]
    ok = change <= tol
    verdict = (
        "unchanged"
        if ok
        else "CHANGED: tokens attend across document boundaries; "
        "check that segment ids reach the attention (data.document_mask, the kernel's "
        "and strategy's masks)"
    )
    return Result(
        ok,
        f"{what}: new tokens in the first of {words} ({int(inside.sum())} "
        f"tokens): the other {int((~inside).sum())} token losses {verdict} "
        f"(max change {change:.1e}, tolerance {tol:g})",
    )


CHECKS = (length_check, strategy_check, document_check)
