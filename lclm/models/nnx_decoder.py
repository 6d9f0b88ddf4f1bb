"""A Flax NNX view of the functional decoder (every family): its parameter tree as Params.

`DecoderModule`'s state is `lclm.models.decoder`'s canonical tree (same names, shapes, nesting),
so `to_params` / `from_params` move between the two without copying, and checkpoints,
HuggingFace conversion and the training loop stay shared with the functional path. Calling
the module runs the functional `forward` / `loss_terms` on that tree: one model, two views.

Each Param carries its logical axes (`param_table`'s) as flax's `out_sharding` metadata, so
`nnx.get_partition_spec` under `nnx.logical_axis_rules(flax_axis_rules())` gives lclm's
parameter PartitionSpecs. Flax's rules do not see shapes, though: where a mesh axis does not
divide a dimension (1 kv head with tp=2, an odd vocabulary) lclm replicates that dimension
and flax does not. To place a module exactly as lclm does, shard the tree:
`from_params(c, shard_params(c, to_params(module), mesh))`.

Flax is an optional dependency (`pip install "lclm[nnx]"`): nothing else in lclm imports it.
"""

from __future__ import annotations

import jax

try:
    from flax import nnx
except ImportError:  # one line that names the fix, not a chain of import frames
    raise ImportError("lclm.models.nnx_decoder needs flax: pip install 'lclm[nnx]'") from None

from lclm.models import decoder
from lclm.models.decoder import AttentionConfig, ModelConfig
from lclm.parallel.mesh import AXIS_RULES


def _param(path, entry, value) -> nnx.Param:
    shape, axes = entry
    if tuple(value.shape) != shape:
        raise ValueError(
            f"parameter {jax.tree_util.keystr(path)} has shape "
            f"{tuple(value.shape)}; the config needs {shape}"
        )
    # not eager: the logical names are not mesh axes, and placing the arrays is the caller's
    # (lclm's shard_params, or nnx.get_named_sharding + device_put), not the constructor's
    return nnx.Param(value, out_sharding=axes, eager_sharding=False)


class DecoderModule(nnx.Module):
    """lclm's LLaMA as an NNX module (`config`: its `ModelConfig`, static).

    Its Params mirror the canonical tree: `embed [vocab, dim]`, `layers` (an `nnx.Dict` of
    weights stacked on a leading `[layers]` axis, e.g. `wq [layers, dim, heads, head_dim]`),
    `final_norm [dim]` and, unless embeddings are tied, `lm_head [dim, vocab]`.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        rngs: nnx.Rngs | jax.Array | None = None,
        params: dict | None = None,
    ):
        """Parameters from lclm's `init_params` with `rngs` (an `nnx.Rngs`, of which one
        `params` key is drawn, or a PRNG key), or the given canonical tree `params`."""
        if (rngs is None) == (params is None):
            raise ValueError("DecoderModule takes exactly one of rngs= and params=")
        if params is None:
            key = rngs.params() if isinstance(rngs, nnx.Rngs) else rngs
            params = decoder.init_params(config, key)
        self.config = config
        tree = jax.tree_util.tree_map_with_path(
            _param, decoder.param_table(config), params, is_leaf=decoder.is_param_entry
        )
        for name, value in tree.items():
            setattr(self, name, nnx.Dict(value) if isinstance(value, dict) else value)

    def __call__(
        self,
        tokens,
        positions=None,
        segment_ids=None,
        *,
        mesh=None,
        attention: AttentionConfig = AttentionConfig(),
    ):
        """Float32 logits `[batch, seq, vocab]` for tokens `[batch, seq]`: `decoder.forward`."""
        return decoder.forward(
            self.config,
            to_params(self),
            tokens,
            positions,
            segment_ids,
            mesh=mesh,
            attention=attention,
        )

    def loss_terms(
        self,
        batch,
        *,
        mesh=None,
        attention: AttentionConfig = AttentionConfig(),
        document_mask: bool = True,
    ):
        """(sum of masked token losses, unmasked token count) of a batch of `[batch, seq]`
        arrays, without materialising the logits: `decoder.loss_terms`."""
        return decoder.loss_terms(
            self.config,
            to_params(self),
            batch,
            mesh=mesh,
            attention=attention,
            document_mask=document_mask,
        )


def from_params(config: ModelConfig, params) -> DecoderModule:
    """The module holding a canonical parameter tree (arrays are wrapped, not copied)."""
    return DecoderModule(config, params=params)


def to_params(module: DecoderModule) -> dict:
    """The module's canonical parameter tree of plain arrays (what `decoder.*` functions take)."""
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def flax_axis_rules() -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """lclm's `AXIS_RULES` as flax logical-axis rules, `(logical name, mesh axes)` pairs, for
    `nnx.logical_axis_rules` (read on each call, so edits to `AXIS_RULES` are seen)."""
    # spelled as lclm's logical_spec spells them, so the PartitionSpecs compare equal
    return tuple(
        (name, None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
        for name, axes in AXIS_RULES.items()
    )
