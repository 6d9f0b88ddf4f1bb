"""Where a run's first state comes from (lclm.train.first_weights.origin): the workdir's own
checkpoint before any configured source, a resume the config may not make refused before the
model is initialised. A checkpoint of a tiny model is written directly (no training)."""

import pytest
from support import save_initial_checkpoint, small_train_config

from lclm.config.model import ModelConfig
from lclm.config.run_config import run_config
from lclm.config.secrets import public_config
from lclm.errors import ConfigError
from lclm.train.first_weights import (
    FRESH,
    HUGGINGFACE,
    OTHER_RUN,
    RESUME,
    Origin,
    origin,
)
from lclm.workdir.checkpoint import Checkpoints, ShapeMismatch


def _config(workdir, **model):
    config = small_train_config(workdir, mesh=dict(fsdp=1, sp=1), attention={})
    config.model.update(model)
    return config


def _origin(config):
    checkpoints = Checkpoints(config.workdir, keep=3)
    try:
        return origin(
            run_config(config),
            checkpoints,
            public_config(config),
            ModelConfig.from_config(config.model),
        )
    finally:
        checkpoints.close()


@pytest.fixture(scope="module")
def saved_at_3(tmp_path_factory):
    """A workdir with one checkpoint, step 3, of the small config's model."""
    config = _config(tmp_path_factory.mktemp("run"))
    save_initial_checkpoint(config, step=3)
    return config.workdir


def test_without_a_checkpoint_the_config_names_the_source(tmp_path):
    assert _origin(_config(tmp_path)) == Origin(FRESH)
    assert _origin(_config(tmp_path, init_from_hf="/models/llama")) == Origin(HUGGINGFACE)
    assert _origin(_config(tmp_path, init_from_checkpoint="/runs/a")) == Origin(OTHER_RUN)


def test_the_workdirs_own_checkpoint_comes_before_a_configured_source(saved_at_3):
    assert _origin(_config(saved_at_3)) == Origin(RESUME, 3, restart_data=False)
    assert _origin(_config(saved_at_3, init_from_hf="/models/llama")) == Origin(RESUME, 3)


def test_a_resume_the_config_may_not_make_is_refused_before_the_model_is_built(saved_at_3):
    config = _config(saved_at_3)
    config.data.seq_len = 32
    with pytest.raises(ConfigError, match="data.seq_len 64 -> 32"):
        _origin(config)
    config.checkpoint.allow_changed = "data.seq_len"  # allowed: the data order restarts
    assert _origin(config) == Origin(RESUME, 3, restart_data=True)

    wider = _config(saved_at_3, dim=96, ffn_dim=192)
    wider.checkpoint.allow_changed = "model.dim,model.ffn_dim"
    with pytest.raises(ShapeMismatch, match="the model expects"):
        _origin(wider)
