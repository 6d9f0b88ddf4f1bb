"""Validation loss on held-out data: logged every `validation.every` steps and at the end,
over the same batches each time, equal to the loss of the saved parameters on them."""

import json
import os

import jax
import pytest
from support import DEMO_CORPUS, small_train_config

from lclm.checkpoint import read_params
from lclm.config import AttentionConfig, LlamaConfig
from lclm.data.loader import HostBatches
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError
from lclm.models.llama import loss_terms
from lclm.parallel import make_mesh
from lclm.train.loop import train
from lclm.train.state import init_state
from lclm.train.step import make_optimizer

pytestmark = pytest.mark.slow  # trains a model


def test_val_loss_is_the_loss_of_the_saved_parameters_on_the_held_out_batches(tmp_path):
    held_out = tmp_path / "held_out.jsonl"
    with open(DEMO_CORPUS) as f:   # other documents than the training ones start with
        held_out.write_text("".join(list(f)[-40:]))
    mesh_sizes = dict(dp=1, fsdp=2, tp=1, sp=2)
    config = small_train_config(tmp_path / "run", mesh=mesh_sizes,
                                attention=dict(q_chunk=16, kv_chunk=16), train=dict(steps=5))
    config.validation.update(path=str(held_out), every=2, batches=2)
    config.log.every = 5
    records = train(config)
    # steps 2 and 4 are logged for validation, 5 is the last (also validated)
    assert [r["step"] for r in records] == [1, 2, 4, 5]
    assert "val_loss" not in records[0]
    assert all(r["val_loss"] > 0 for r in records[1:])
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(line).get("val_loss") for line in f] == [
            r.get("val_loss") for r in records]

    # the final val_loss is what the final parameters score on the held-out batches
    mesh = make_mesh(**mesh_sizes)
    model = LlamaConfig.from_config(config.model)
    template = init_state(model, make_optimizer(config.train), mesh, seed=0)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            template.params)
    params = read_params(str(tmp_path / "run"), 5, abstract)
    config.data.path = str(held_out)
    reader = HostBatches(config, mesh, Tokenizer(config.data.tokenizer), prefetch=0)
    total = count = 0.0
    for _ in range(2):
        t, c = loss_terms(model, params, next(reader), mesh=mesh,
                          attention=AttentionConfig.from_config(config.attention))
        total, count = total + float(t), count + float(c)
    reader.close()
    assert records[-1]["val_loss"] == pytest.approx(total / count, rel=1e-5)
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "5")


def test_a_validation_file_smaller_than_a_batch_is_refused_naming_the_validation_keys(tmp_path):
    held_out = tmp_path / "held_out.jsonl"
    with open(DEMO_CORPUS) as f:   # 3 documents for the 4 rows of a batch
        held_out.write_text("".join(list(f)[-3:]))
    config = small_train_config(tmp_path / "run", mesh=dict(dp=1, fsdp=2, tp=1, sp=2),
                                attention=dict(q_chunk=16, kv_chunk=16), train=dict(steps=2))
    config.validation.update(path=str(held_out), every=2, batches=2)
    with pytest.raises(ConfigError) as e:
        train(config)
    message = str(e.value)
    assert message.startswith(f"validation.path={str(held_out)!r}: {held_out} has 3 usable "
                              "record(s), fewer than the data.batch_size=4 rows of a validation "
                              "batch"), message
    assert "validation.batches=2" in message and "\n" not in message
    # the fix is more held-out data, not a smaller data.batch_size (another training run)
    assert message.endswith("give validation.path at least 4 held-out records, or set "
                            "validation.path='' to train without validation"), message
