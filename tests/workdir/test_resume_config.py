"""A resume under a changed config: layout fields change freely, the schedule changes with a
warning, model and data-order fields are refused in one line unless allowed (then logged,
and a data-order change restarts the data order)."""

import json
import logging
import os
import shutil

import pytest
import sentencepiece as spm
from support import DEMO_TOKENIZER, small_train_config

from lclm.config.schema import base_config
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError
from lclm.train.loop import train
from lclm.workdir import resume


def _keys(node, prefix=""):
    for k, v in node.items():
        if hasattr(v, "items"):
            yield from _keys(v, prefix + k + ".")
        else:
            yield prefix + k


def test_every_config_key_has_one_class():
    assert sorted(resume.CLASSES) == sorted(_keys(base_config()))


def _saved(**changes):
    config = base_config()
    for key, value in changes.items():
        *sections, name = key.split(".")
        node = config
        for section in sections:
            node = node[section]
        node[name] = value
    return dict(config.to_dict(), identity=dict(tokenizer="aaaa"))


def test_changes_are_classed_logged_or_refused(caplog):
    old = _saved()
    free = _saved(**{"mesh.sp": 4, "attention.layout": "zigzag"})
    with caplog.at_level(logging.INFO):
        assert resume.check_resume(old, free, set(), step=7) is False
    assert "mesh.sp 4 (the checkpoint's run used 1)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert resume.check_resume(old, _saved(**{"train.steps": 2000}), set(), 7) is False
    assert "the new value applies from step 8 on" in caplog.text

    changed = _saved(**{"data.batch_size": 16, "model.rope_theta": 5e5})
    with pytest.raises(ConfigError) as e:
        resume.check_resume(old, changed, set(), 7)
    message = str(e.value)
    assert "\n" not in message
    assert "data.batch_size 8 -> 16" in message
    assert "model.rope_theta 10000.0 -> 500000.0" in message
    assert "--config.checkpoint.allow_changed=data.batch_size,model.rope_theta" in message
    # allowed: logged; the data-order change restarts the data order, the model one does not
    assert resume.check_resume(old, changed, {"data.batch_size", "model.rope_theta"}, 7)
    theta = _saved(**{"model.rope_theta": 5e5})
    assert resume.check_resume(old, theta, {"model.rope_theta"}, 7) is False


def test_the_tokenizer_is_compared_by_what_it_does_not_by_its_path(tmp_path):
    moved = tmp_path / "moved.model"
    shutil.copy(DEMO_TOKENIZER, moved)
    demo = resume.tokenizer_fingerprint(Tokenizer(DEMO_TOKENIZER))
    assert resume.tokenizer_fingerprint(Tokenizer(str(moved))) == demo
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"line {i} of another corpus, with other words" for i in range(200)))
    spm.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(tmp_path / "other"), vocab_size=50, minloglevel=2
    )
    other = resume.tokenizer_fingerprint(Tokenizer(str(tmp_path / "other.model")))
    assert other != demo

    def config(path, fp):
        c = _saved(**{"data.tokenizer": path})
        c["identity"]["tokenizer"] = fp
        return c

    assert resume.changes(config(DEMO_TOKENIZER, demo), config(str(moved), demo)) == {}
    with pytest.raises(ConfigError, match="data.tokenizer"):
        resume.check_resume(config(DEMO_TOKENIZER, demo), config(str(moved), other), set(), 3)


def test_a_refused_resume_moves_nothing_and_an_allowed_one_restarts_the_data(tmp_path, caplog):
    workdir = tmp_path / "run"
    mesh = dict(dp=1, fsdp=2, tp=1, sp=2)
    attention = dict(q_chunk=16, kv_chunk=16)
    train(small_train_config(workdir, mesh=mesh, attention=attention, train=dict(steps=2)))
    metrics = (workdir / "metrics.jsonl").read_text()

    bigger = small_train_config(workdir, mesh=mesh, attention=attention, train=dict(steps=4))
    bigger.data.batch_size = 8
    with pytest.raises(
        ConfigError,
        match=r"^the checkpoint \(step 2\) was written with another "
        r"config: data.batch_size 4 -> 8; ",
    ):
        train(bigger)
    assert sorted(os.listdir(workdir / "checkpoints")) == ["2"]
    assert not (workdir / "checkpoints_damaged").exists()
    assert (workdir / "metrics.jsonl").read_text() == metrics

    # allowed, on another mesh (free): steps 3-4 train with a data order that starts afresh
    bigger.checkpoint.allow_changed = "data.batch_size"
    bigger.mesh.update(fsdp=4, sp=1)
    with caplog.at_level(logging.INFO):
        records = train(bigger)
    assert [r["step"] for r in records] == [3, 4]
    assert (
        "resuming with data.batch_size 8 (was 4), allowed by checkpoint.allow_changed; "
        "the data order restarts from its beginning" in caplog.text
    )
    assert "resuming with mesh.fsdp 4 (the checkpoint's run used 2)" in caplog.text
    saved = json.loads((workdir / "config.json").read_text())
    assert saved["data"]["batch_size"] == 8 and len(saved["identity"]["tokenizer"]) == 16


def test_an_unknown_allowed_key_fails_at_start(tmp_path):
    config = small_train_config(
        tmp_path / "run",
        mesh=dict(dp=1, fsdp=1, tp=1, sp=1),
        attention=dict(q_chunk=16, kv_chunk=16),
    )
    config.checkpoint.allow_changed = "data.batch_sise"
    with pytest.raises(ConfigError, match="batch_sise"):
        train(config)
    assert not (tmp_path / "run").exists()


def _converted(**changes):
    """The config `lclm.convert --to-checkpoint` saves with step 0: the defaults, the source's
    model fields and a record of the conversion."""
    saved = _saved(**changes)
    saved["identity"].update(converted_from="/models/llama-hf")
    return saved


def test_a_converted_checkpoint_compares_only_what_its_weights_fix(caplog):
    saved = _converted(**{"model.dim": 128, "model.rope_scaling": "none"})
    # the run's own data, sequence length, schedule, mesh, RoPE theta and param dtype
    run = _saved(
        **{
            "model.dim": 128,
            "data.path": "corpus.jsonl",
            "data.seq_len": 512,
            "data.tokenizer": "elsewhere/tokenizer.model",
            "seed": 3,
            "train.steps": 50,
            "mesh.sp": 4,
            "model.rope_theta": 5e5,
            "model.param_dtype": "bfloat16",
            "model.rope_scaling": "auto",
        }
    )
    with caplog.at_level(logging.INFO):
        assert resume.check_resume(saved, run, set(), 0) is True  # the data order starts anew
    assert "with model.rope_theta 500000.0 (theirs: 10000.0)" in caplog.text
    assert "rope_scaling" not in caplog.text  # 'auto' is no scaling here, as in the source
    assert "data.seq_len" not in caplog.text and "mesh.sp" not in caplog.text

    # another shape, or another tokenizer (by content): one line naming each
    other = _saved(**{"model.dim": 64, "model.n_kv_heads": 4})
    other["identity"]["tokenizer"] = "bbbb"
    with pytest.raises(ConfigError) as e:
        resume.check_resume(saved, other, set(), 0)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(
        "the checkpoint (step 0) holds the weights converted from "
        "/models/llama-hf, which the config does not describe: model.dim "
        "128 -> 64; model.n_kv_heads 2 -> 4; data.tokenizer "
    )
    assert "(aaaa)' -> " in message and "(bbbb)'" in message
    # a tokenizer of the same content at another path is the same tokenizer
    same = _saved(**{"model.dim": 128, "data.tokenizer": "moved/tokenizer.model"})
    assert resume.check_resume(saved, same, set(), 0) is True
    # with the tokenizer's change allowed, only the shapes are refused
    with pytest.raises(
        ConfigError,
        match=r"describe: model.dim 128 -> 64; model.n_kv_heads "
        r"2 -> 4; set these",
    ):
        resume.check_resume(saved, other, {"data.tokenizer"}, 0)


def test_auto_rope_scaling_does_not_drop_the_converted_weights_scaling():
    saved = _converted(**{"model.rope_scaling": "llama3", "model.rope_factor": 32.0})
    with pytest.raises(
        ConfigError,
        match="model.rope_scaling 'llama3' -> 'auto "
        r"\(none without init_from_hf\)'",
    ):
        resume.check_resume(saved, _saved(**{"model.rope_scaling": "auto"}), set(), 0)
    # a scaling named by the run applies over the weights, as with model.init_from_hf
    named = _saved(**{"model.rope_scaling": "llama3", "model.rope_factor": 8.0})
    assert resume.check_resume(saved, named, set(), 0) is True
    dropped = _saved(**{"model.rope_scaling": "none"})
    assert resume.check_resume(saved, dropped, set(), 0) is True


def test_head_dim_is_compared_as_the_weights_have_it():
    """model.head_dim 0 means dim / n_heads: a config with 0 describes weights whose head_dim
    is that (converted weights state it resolved; older checkpoints lack it), and a head_dim
    apart from it (Mistral-NeMo, Qwen3) is a change of the weights' shape."""

    def config(**model):
        c = base_config().to_dict()
        c["model"].update({"dim": 64, "n_heads": 4, **model})
        return c

    assert resume.changes(config(head_dim=16), config(head_dim=0)) == {}
    old = config()
    del old["model"]["head_dim"]
    assert resume.changes(old, config()) == {}
    assert resume.changes(config(head_dim=24), config(head_dim=0)) == {"model.head_dim": (24, 16)}
    # a default head_dim follows dim, which is compared (and reported) itself
    assert set(resume.changes(config(), config(dim=128))) == {"model.dim"}
