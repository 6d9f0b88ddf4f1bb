"""The model families lclm reads, trains and writes: one module each, one line here.

`FAMILIES`: `model.family` name -> `Family` (contract.py). `lclm.models.decoder` computes every
family's layer from its options; `lclm.hf` reads and writes each family's config.json and
tensor names by its `model_type`; `lclm.config.MODEL_PRESETS` gathers the families' presets.
A new family is a module defining `FAMILY` and its line in `FAMILIES`.
"""

from lclm.families import llama, mistral, qwen2, qwen3
from lclm.families.contract import Family

FAMILIES: dict[str, Family] = {
    f.name: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY)
}


def get_family(name: str) -> Family:
    """The family `model.family` names (a ValueError naming the choices otherwise)."""
    if name not in FAMILIES:
        raise ValueError(f"model.family={name!r}; use one of {sorted(FAMILIES)}")
    return FAMILIES[name]


def by_model_type(model_type: str) -> Family | None:
    """The family whose config.json says `model_type`, or None."""
    return next((f for f in FAMILIES.values() if f.model_type == model_type), None)


__all__ = ["FAMILIES", "Family", "by_model_type", "get_family"]
