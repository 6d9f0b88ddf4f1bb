"""`lclm.models.nnx_llama`, the Flax NNX view's module before the model served every family: an
alias of `lclm.models.nnx_decoder` (`from_params`, `to_params`, ...), with the old
`LlamaModule` (now `DecoderModule`). Importing it warns where they are now; it goes in lclm
0.2.0."""

from __future__ import annotations

import warnings

from lclm.models import nnx_decoder
from lclm.models.nnx_decoder import DecoderModule

warnings.warn(
    "lclm.models.nnx_llama is now lclm.models.nnx_decoder, and LlamaModule is "
    "DecoderModule; the old names will be removed in lclm 0.2.0",
    DeprecationWarning,
    stacklevel=2,
)

LlamaModule = DecoderModule


def __getattr__(name: str):
    return getattr(nnx_decoder, name)
