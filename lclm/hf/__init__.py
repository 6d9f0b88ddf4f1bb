"""HuggingFace model directories of every family lclm knows (config.json, safetensors weights,
tokenizer) in and out.

`config` translates config.json to and from ModelConfig, `weights` reads and writes the
safetensors (`load`, `save`), `tokenizer` puts the training tokenizer into an export. A
directory may be on gs:// or s3://: it is read from a local copy (`local_copy`) and exported
to a local folder that is then uploaded (`exporting`). Only JSON, safetensors and
SentencePiece model protos are read: nothing is unpickled or executed.
"""

from lclm.hf.config import (
    SCALING_FIELDS,
    SOURCE_FIELDS,
    config_from_hf,
    config_to_hf,
    model_fields,
    read_config,
    rope_to_hf,
)
from lclm.hf.directories import local_copy
from lclm.hf.errors import HFFormatError
from lclm.hf.tokenizer import TOKENIZER_FILES, save_tokenizer, sentencepiece_to_hf
from lclm.hf.weights import exporting, hf_shapes, load, save

__all__ = [
    "HFFormatError",
    "SCALING_FIELDS",
    "SOURCE_FIELDS",
    "TOKENIZER_FILES",
    "config_from_hf",
    "config_to_hf",
    "exporting",
    "hf_shapes",
    "load",
    "local_copy",
    "model_fields",
    "read_config",
    "rope_to_hf",
    "save",
    "save_tokenizer",
    "sentencepiece_to_hf",
]
