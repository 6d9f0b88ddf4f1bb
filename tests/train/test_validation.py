"""Validation loss on held-out data: logged every `validation.every` steps and at the end,
over the same batches each time, equal to the loss of the saved parameters on them, at the
run's length and at each of `validation.lengths` (val_loss@LEN)."""

import json
import os

import jax
import pytest
from support import DEMO_CORPUS, small_train_config

from lclm.config import AttentionConfig, ModelConfig, base_config
from lclm.config.run_config import run_config
from lclm.config.stages import stage_configs, validation_lengths
from lclm.data.loader import HostBatches
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError
from lclm.models.decoder import loss_terms
from lclm.parallel import make_mesh
from lclm.train.loop import train
from lclm.train.startup_checks import validate
from lclm.train.step import make_optimizer
from lclm.workdir.checkpoint import read_params
from lclm.workdir.state import init_state

pytestmark = pytest.mark.slow  # trains a model


def test_val_loss_is_the_loss_of_the_saved_parameters_on_the_held_out_batches(tmp_path):
    held_out = tmp_path / "held_out.jsonl"
    with open(DEMO_CORPUS) as f:  # other documents than the training ones start with
        held_out.write_text("".join(list(f)[-40:]))
    mesh_sizes = dict(dp=1, fsdp=2, tp=1, sp=2)
    config = small_train_config(
        tmp_path / "run",
        mesh=mesh_sizes,
        attention=dict(q_chunk=16, kv_chunk=16),
        train=dict(steps=5),
    )
    # 32 and 128 tokens besides the run's 64: shorter and longer than trained
    config.validation.update(path=str(held_out), every=2, batches=2, lengths="32,128")
    config.log.every = 5
    records = train(config)
    # steps 2 and 4 are logged for validation, 5 is the last (also validated)
    assert [r["step"] for r in records] == [1, 2, 4, 5]
    assert "val_loss" not in records[0]
    assert all(r["val_loss"] > 0 for r in records[1:])
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(line).get("val_loss") for line in f] == [
            r.get("val_loss") for r in records
        ]

    # the final val_loss is what the final parameters score on the held-out batches
    mesh = make_mesh(**mesh_sizes)
    model = ModelConfig.from_config(config.model)
    template = init_state(model, make_optimizer(run_config(config).train), mesh, seed=0)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template.params
    )
    params = read_params(str(tmp_path / "run"), 5, abstract)
    config.data.path = str(held_out)
    expected = {}
    for length in (32, 64, 128):
        config.data.seq_len = length
        reader = HostBatches(run_config(config), mesh, Tokenizer(config.data.tokenizer), prefetch=0)
        total = count = 0.0
        for _ in range(2):
            batch = next(reader)
            assert batch["tokens"].shape == (4, length)
            t, c = loss_terms(
                model,
                params,
                batch,
                mesh=mesh,
                attention=AttentionConfig.from_config(config.attention),
            )
            total, count = total + float(t), count + float(c)
        reader.close()
        expected[length] = total / count
    assert records[-1]["val_loss"] == pytest.approx(expected[64], rel=1e-5)
    for length, loss in expected.items():
        assert records[-1][f"val_loss@{length}"] == pytest.approx(loss, rel=1e-5), length
    assert len(set(expected.values())) == 3  # three lengths, three different losses
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "5")


def test_validation_lengths_resolve_per_stage_and_a_length_the_mesh_cannot_split_is_refused(
    tmp_path,
):
    config = base_config()
    config.workdir = str(tmp_path / "run")
    config.stages.schedule = "128:1e4:5, 256:1e5:5, 512:1e6:5"
    config.validation.lengths = "stages, 1k"
    # each stage validates at its own length and every earlier one's (forgetting shows)
    assert [
        validation_lengths(c.data.seq_len, c.validation.lengths) for c in stage_configs(config)
    ] == [[128, 1024], [128, 256, 1024], [128, 256, 512, 1024]]
    config.stages.schedule = ""
    config.data.seq_len = 64
    # 'stages' outside a schedule: its own
    assert validation_lengths(64, config.validation.lengths) == [64, 1024]
    config.validation.lengths = "2x"
    with pytest.raises(ConfigError, match=r"^validation.lengths='2x': bad length '2x'"):
        validation_lengths(64, config.validation.lengths)

    config = small_train_config(
        tmp_path / "run2",
        mesh=dict(dp=1, fsdp=2, tp=1, sp=2),
        attention=dict(q_chunk=16, kv_chunk=16),
    )
    config.validation.update(path=DEMO_CORPUS, lengths="192")
    validate(config, 4)  # 192 splits over sp=2 into feed-forward chunks of 32
    config.validation.lengths = "33"
    with pytest.raises(ConfigError) as e:
        validate(config, 4)
    message = str(e.value)
    assert message.startswith(
        "validation.lengths='33', length 33: data.seq_len=33 is not divisible by mesh.sp=2"
    ), message
    assert "\n" not in message


def test_a_validation_file_smaller_than_a_batch_is_refused_naming_the_validation_keys(tmp_path):
    held_out = tmp_path / "held_out.jsonl"
    with open(DEMO_CORPUS) as f:  # 3 documents for the 4 rows of a batch
        held_out.write_text("".join(list(f)[-3:]))
    config = small_train_config(
        tmp_path / "run",
        mesh=dict(dp=1, fsdp=2, tp=1, sp=2),
        attention=dict(q_chunk=16, kv_chunk=16),
        train=dict(steps=2),
    )
    config.validation.update(path=str(held_out), every=2, batches=2)
    with pytest.raises(ConfigError) as e:
        train(config)
    message = str(e.value)
    assert message.startswith(
        f"validation.path={str(held_out)!r}: {held_out} has 3 usable "
        "record(s), fewer than the data.batch_size=4 rows of a validation "
        "batch"
    ), message
    assert "validation.batches=2" in message and "\n" not in message
    # the fix is more held-out data, not a smaller data.batch_size (another training run)
    assert message.endswith(
        "give validation.path at least 4 held-out records, or set "
        "validation.path='' to train without validation"
    ), message
