"""The one typed configuration of lclm (JAX-free): `base_config()` and the presets a config
file starts from, the model schema, `load_config` for files. Submodules: `fields` (how a
field declares its type, default, help, names and range), `schema` (every section as a typed
dataclass, presets, single-field checks), `model` (ModelConfig, AttentionConfig), `loading`
(config files and dotted keys), `syntax` (token counts, lengths, stage schedules), `stages`
(the config of every stage of a schedule)."""

import warnings

from lclm.config.loading import load_config
from lclm.config.model import AttentionConfig, ModelConfig
from lclm.config.schema import (
    MESH_AXES,
    MODEL_PRESETS,
    apply_preset,
    base_config,
    mesh_device_count,
)

__all__ = [
    "AttentionConfig",
    "ModelConfig",
    "MESH_AXES",
    "MODEL_PRESETS",
    "apply_preset",
    "base_config",
    "load_config",
    "mesh_device_count",
]


def __getattr__(name: str):
    """`LlamaConfig`, ModelConfig's name before the model served every family: still
    importable until lclm 0.2.0, with a DeprecationWarning naming `ModelConfig`."""
    if name == "LlamaConfig":
        warnings.warn(
            "lclm.config.LlamaConfig is now lclm.config.ModelConfig; the old name "
            "will be removed in lclm 0.2.0",
            DeprecationWarning,
            stacklevel=2,
        )
        return ModelConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
