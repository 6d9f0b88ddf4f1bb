"""`lclm.models.llama`, the decoder's module before it served every model family: an alias of
`lclm.models.decoder` (its functions: `forward`, `init_params`, `loss_terms`, ...), with the
old `LlamaConfig` (now `lclm.config.ModelConfig`). Importing it warns where they are now; it
goes in lclm 0.2.0."""

from __future__ import annotations

import warnings

from lclm.config.model import ModelConfig
from lclm.models import decoder

# the importer's line (warnings skips the import machinery's frames), so a script sees it
warnings.warn(
    "lclm.models.llama is now lclm.models.decoder, and LlamaConfig is "
    "lclm.config.ModelConfig; the old names will be removed in lclm 0.2.0",
    DeprecationWarning,
    stacklevel=2,
)

LlamaConfig = ModelConfig


def __getattr__(name: str):
    return getattr(decoder, name)
