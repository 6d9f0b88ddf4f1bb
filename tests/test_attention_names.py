"""`attention.strategy` and `attention.impl` are schema choices (`lclm.config.model`), known
before JAX starts; the registries hold exactly those names, and a wrong one is one line at
start naming them."""

import pytest
from support import DEMO_CONFIG

from lclm.config import load_config
from lclm.config.model import KERNEL_NAMES, STRATEGY_NAMES, AttentionConfig
from lclm.config.schema import check_fields
from lclm.errors import ConfigError
from lclm.ops.context_parallel import STRATEGIES
from lclm.ops.kernels import KERNELS


def test_the_registries_hold_the_schemas_names():
    assert tuple(STRATEGIES) == STRATEGY_NAMES
    assert tuple(KERNELS) == KERNEL_NAMES


@pytest.mark.parametrize("key, wrong", [("strategy", "mesh"), ("impl", "cudnn")])
def test_a_wrong_name_is_one_line_naming_the_choices(key, wrong):
    config = load_config(DEMO_CONFIG, {f"attention.{key}": wrong})
    with pytest.raises(ConfigError) as e:
        check_fields(config)
    choices = dict(strategy=STRATEGY_NAMES, impl=("auto", *KERNEL_NAMES))[key]
    assert str(e.value) == f"attention.{key}={wrong!r}; use one of {choices}"
    field = AttentionConfig.__dataclass_fields__[key]
    assert field.metadata["choices"] == choices
