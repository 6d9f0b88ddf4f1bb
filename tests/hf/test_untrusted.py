"""Malformed or hostile HuggingFace directories: `hf.load` and `python -m lclm.convert` refuse
each with one line naming the file and the tensor (or config field) at fault; a safetensors
file whose header safetensors itself rejects is named as damaged, with safetensors' reason."""

import json
import os
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from lclm import hf
from lclm.config import ModelConfig
from lclm.convert import main
from lclm.models.decoder import init_params

TINY = ModelConfig(
    vocab_size=11,
    dim=8,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    ffn_dim=12,
    dtype="float32",
    param_dtype="float32",
)
EMBED, NORM = "model.embed_tokens.weight", "model.layers.0.input_layernorm.weight"
K_PROJ, GATE = "model.layers.1.self_attn.k_proj.weight", "model.layers.1.mlp.gate_proj.weight"
# lclm's words for a file safetensors refuses to open (its reason follows, worded by version)
DAMAGED = "truncated, damaged or not a safetensors file"


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    """A good single-file directory and a good sharded one (with an index)."""
    root = tmp_path_factory.mktemp("good")
    params = init_params(TINY, jax.random.key(0))
    hf.save(str(root / "single"), TINY, params)
    hf.save(str(root / "sharded"), TINY, params, max_shard_bytes=1500)
    return root


@pytest.fixture
def single(originals, tmp_path):
    return str(shutil.copytree(originals / "single", tmp_path / "hf"))


@pytest.fixture
def sharded(originals, tmp_path):
    return str(shutil.copytree(originals / "sharded", tmp_path / "hf_sharded"))


def _split(path):
    """(header dict, data bytes) of a safetensors file."""
    raw = Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write(path, header, data, claimed=None):
    """A safetensors file from raw parts; `claimed` lies about the header length."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    length = len(body) if claimed is None else claimed
    Path(path).write_bytes(length.to_bytes(8, "little") + body + data)


def _edit_header(d, edit):
    path = os.path.join(d, "model.safetensors")
    header, data = _split(path)
    edit(header)
    _write(path, header, data)


def _edit_tensors(d, edit, file="model.safetensors"):
    """Rewrite one file of `d` as a valid safetensors file with `edit`ed tensors."""
    path = os.path.join(d, file)
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _edit_json(d, file, edit):
    path = Path(d, file)
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _shard_of(d, name):
    return json.loads(Path(d, "model.safetensors.index.json").read_text())["weight_map"][name]


# --- single-file directories: each case breaks `d` and returns what the message must name ---


def header_longer_than_file(d):
    path = Path(d, "model.safetensors")
    raw = path.read_bytes()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw[8:])
    return "model.safetensors", DAMAGED


def absurd_header_length(d):
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:  # a sparse 300 MB file whose header claims 200 MB
        f.write((200 << 20).to_bytes(8, "little"))
        f.truncate(300 << 20)
    return "model.safetensors", DAMAGED


def truncated_file(d):
    path = Path(d, "model.safetensors")
    path.write_bytes(path.read_bytes()[:-16])
    return "model.safetensors", DAMAGED


def offsets_past_the_end(d):
    size = len(_split(os.path.join(d, "model.safetensors"))[1])

    def edit(header):
        header[NORM]["data_offsets"] = [o + size for o in header[NORM]["data_offsets"]]

    _edit_header(d, edit)
    return "model.safetensors", DAMAGED


def offsets_disagree_with_shape(d):
    def edit(header):
        header[EMBED]["shape"] = [TINY.vocab_size + 1, TINY.dim]

    _edit_header(d, edit)
    return "model.safetensors", DAMAGED


def overlapping_tensors(d):
    other = NORM.replace("input", "post_attention")

    def edit(header):
        header[other]["data_offsets"] = header[NORM]["data_offsets"]

    _edit_header(d, edit)
    return "model.safetensors", DAMAGED


def unknown_dtype(d):
    def edit(header):
        header[NORM]["dtype"] = "Q7"

    _edit_header(d, edit)
    return "model.safetensors", DAMAGED


def header_not_json(d):
    path = os.path.join(d, "model.safetensors")
    _write(path, b"{'not': json}", _split(path)[1])
    return "model.safetensors", DAMAGED


def header_not_an_object(d):
    path = os.path.join(d, "model.safetensors")
    _write(path, b"[1, 2, 3]", _split(path)[1])
    return "model.safetensors", DAMAGED


def metadata_safetensors_rejects(d):
    def edit(header):
        header["__metadata__"] = {"format": 1}

    _edit_header(d, edit)
    return "model.safetensors", DAMAGED


def tensor_name_with_a_line_break(d):  # safetensors' reason quotes the name as it is
    def edit(header):
        first = min(
            (n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"][0]
        )
        entry = header.pop(first)
        entry["data_offsets"][0] += 1
        header["x\nerror: a forged line"] = entry

    _edit_header(d, edit)
    return "model.safetensors", DAMAGED


def embedding_one_row_too_many(d):
    def edit(tensors):
        tensors[EMBED] = np.zeros((TINY.vocab_size + 1, TINY.dim), np.float32)

    _edit_tensors(d, edit)
    return "model.safetensors", EMBED


def transposed_k_proj(d):
    def edit(tensors):
        tensors[K_PROJ] = np.ascontiguousarray(tensors[K_PROJ].T)

    _edit_tensors(d, edit)
    return "model.safetensors", K_PROJ


def transposed_gate_proj(d):
    def edit(tensors):
        tensors[GATE] = np.ascontiguousarray(tensors[GATE].T)

    _edit_tensors(d, edit)
    return "model.safetensors", GATE


def integer_weights(d):
    def edit(tensors):
        tensors[NORM] = np.ones(TINY.dim, np.int32)

    _edit_tensors(d, edit)
    return "model.safetensors", NORM


def bool_weights(d):
    def edit(tensors):
        tensors["lm_head.weight"] = tensors["lm_head.weight"] > 0

    _edit_tensors(d, edit)
    return "model.safetensors", "lm_head.weight"


def missing_tensor(d):
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_tensors(d, lambda tensors: tensors.pop(name))
    return os.path.basename(d), name


def config_not_json(d):
    Path(d, "config.json").write_text('{"hidden_size": 8,')
    return "config.json", "not valid JSON"


def config_lacks_a_field(d):
    _edit_json(d, "config.json", lambda c: c.pop("hidden_size"))
    return "config.json", "hidden_size"


def config_field_of_the_wrong_type(d):
    _edit_json(d, "config.json", lambda c: c.update(num_attention_heads="2"))
    return "config.json", "num_attention_heads"


def config_with_biases(d):
    _edit_json(d, "config.json", lambda c: c.update(attention_bias=True))
    return "config.json", "attention_bias"


# --- what lclm cannot compute as config.json asks is refused, never dropped ---


def config_of_another_architecture(d):
    _edit_json(
        d, "config.json", lambda c: c.update(architectures=["LlamaForSequenceClassification"])
    )
    return "config.json", "architectures", "LlamaForSequenceClassification"


def config_with_gelu(d):
    _edit_json(d, "config.json", lambda c: c.update(hidden_act="gelu"))
    return "config.json", "hidden_act", "gelu"


def config_with_a_sliding_window(d):
    _edit_json(d, "config.json", lambda c: c.update(sliding_window=4096))
    return "config.json", "sliding_window", "4096"


def config_using_a_sliding_window(d):
    _edit_json(d, "config.json", lambda c: c.update(use_sliding_window=True))
    return "config.json", "use_sliding_window"


def config_with_a_yarn_truncate_not_a_bool(d):  # transformers 4's layout
    _edit_json(
        d,
        "config.json",
        lambda c: c.update(
            rope_scaling={
                "rope_type": "yarn",
                "factor": 4.0,
                "truncate": "yes",
                "original_max_position_embeddings": 2048,
            }
        ),
    )
    return "config.json", "rope_scaling.truncate", "yes"


def config_with_dynamic_rope(d):  # transformers 5's layout, with the legacy "type" key
    _edit_json(
        d,
        "config.json",
        lambda c: c.update(
            rope_parameters={"type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        ),
    )
    return "config.json", "rope_parameters.rope_type", "dynamic"


def config_with_llama3_rope_lacking_a_factor(d):
    _edit_json(
        d,
        "config.json",
        lambda c: c.update(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "rope_theta": 1e4,
            }
        ),
    )
    return "config.json", "rope_parameters.low_freq_factor"


def config_with_llama3_high_below_low(d):
    _edit_json(
        d,
        "config.json",
        lambda c: c.update(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
            }
        ),
    )
    return "config.json", "rope_scaling.high_freq_factor"


def config_with_a_negative_rope_factor(d):
    _edit_json(
        d, "config.json", lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": -2.0})
    )
    return "config.json", "rope_scaling.factor", "-2.0"


def config_with_two_thetas(d):
    _edit_json(
        d,
        "config.json",
        lambda c: c.update(
            rope_theta=10000.0, rope_parameters={"rope_type": "default", "rope_theta": 500000.0}
        ),
    )
    return "config.json", "rope_theta=10000.0", "rope_parameters.rope_theta=500000.0"


def config_with_partial_rotary(d):
    _edit_json(d, "config.json", lambda c: c.update(partial_rotary_factor=0.5))
    return "config.json", "partial_rotary_factor"


def config_with_bad_token_ids(d):
    _edit_json(d, "config.json", lambda c: c.update(eos_token_id=[2, "3"]))
    return "config.json", "eos_token_id"


# --- sharded directories: the index may name only .safetensors files inside the directory ---


def index_names_a_pickle(d):
    Path(d, "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")  # a pickle of 1
    _edit_json(
        d,
        "model.safetensors.index.json",
        lambda i: i["weight_map"].update({EMBED: "pytorch_model.bin"}),
    )
    return "model.safetensors.index.json", EMBED


def index_escapes_the_directory(d):
    shutil.copy(os.path.join(d, _shard_of(d, EMBED)), os.path.join(d, "..", "x.safetensors"))
    _edit_json(
        d,
        "model.safetensors.index.json",
        lambda i: i["weight_map"].update({EMBED: "../x.safetensors"}),
    )
    return "model.safetensors.index.json", EMBED


def index_names_an_absolute_path(d):
    outside = os.path.abspath(os.path.join(d, "..", "x.safetensors"))
    shutil.copy(os.path.join(d, _shard_of(d, EMBED)), outside)
    _edit_json(
        d, "model.safetensors.index.json", lambda i: i["weight_map"].update({EMBED: outside})
    )
    return "model.safetensors.index.json", EMBED


def index_names_a_missing_shard(d):
    _edit_json(
        d,
        "model.safetensors.index.json",
        lambda i: i["weight_map"].update({EMBED: "model-00009-of-00009.safetensors"}),
    )
    return "model.safetensors.index.json", EMBED


def index_not_json(d):
    Path(d, "model.safetensors.index.json").write_text("weight_map: {}")
    return "model.safetensors.index.json", "weight_map"


def tensor_in_two_shards(d):
    first = _shard_of(d, EMBED)
    other = next(f for f in sorted(os.listdir(d)) if f.endswith(".safetensors") and f != first)
    copy = load_file(os.path.join(d, first))[EMBED]
    _edit_tensors(d, lambda tensors: tensors.update({EMBED: copy}), file=other)
    return ".safetensors", EMBED


SINGLE = [
    header_longer_than_file,
    absurd_header_length,
    truncated_file,
    offsets_past_the_end,
    offsets_disagree_with_shape,
    overlapping_tensors,
    unknown_dtype,
    header_not_json,
    header_not_an_object,
    metadata_safetensors_rejects,
    tensor_name_with_a_line_break,
    embedding_one_row_too_many,
    transposed_k_proj,
    transposed_gate_proj,
    integer_weights,
    bool_weights,
    missing_tensor,
    config_not_json,
    config_lacks_a_field,
    config_field_of_the_wrong_type,
    config_with_biases,
]
REFUSED = [
    config_of_another_architecture,
    config_with_gelu,
    config_with_a_sliding_window,
    config_using_a_sliding_window,
    config_with_a_yarn_truncate_not_a_bool,
    config_with_dynamic_rope,
    config_with_llama3_rope_lacking_a_factor,
    config_with_llama3_high_below_low,
    config_with_a_negative_rope_factor,
    config_with_two_thetas,
    config_with_partial_rotary,
    config_with_bad_token_ids,
]
SHARDED = [
    index_names_a_pickle,
    index_escapes_the_directory,
    index_names_an_absolute_path,
    index_names_a_missing_shard,
    index_not_json,
    tensor_in_two_shards,
]


def _refused_everywhere(d, names, tmp_path, capsys):
    with pytest.raises(ValueError) as e:
        hf.load(d)
    message = str(e.value)
    assert "\n" not in message and all(n in message for n in names), message
    work = tmp_path / "work"
    assert main(["--from-hf", d, "--to-checkpoint", str(work)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert all(n in err for n in names), err
    assert not work.exists()


@pytest.mark.parametrize("case", SINGLE, ids=lambda f: f.__name__)
def test_a_broken_single_file_directory_is_refused_in_one_line(single, case, tmp_path, capsys):
    _refused_everywhere(single, case(single), tmp_path, capsys)


@pytest.mark.parametrize("case", REFUSED, ids=lambda f: f.__name__)
def test_a_config_lclm_cannot_honour_is_refused_naming_the_field(single, case, tmp_path, capsys):
    _refused_everywhere(single, case(single), tmp_path, capsys)
    with pytest.raises(hf.HFFormatError):
        hf.load(single)


@pytest.mark.parametrize("case", SHARDED, ids=lambda f: f.__name__)
def test_a_broken_sharded_directory_is_refused_in_one_line(sharded, case, tmp_path, capsys):
    _refused_everywhere(sharded, case(sharded), tmp_path, capsys)


def test_good_directories_load_exactly(single, sharded, tmp_path):
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    want = init_params(TINY, jax.random.key(0))
    for d in (single, sharded):
        c, params = hf.load(d)
        assert c == TINY
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    bf16 = ModelConfig(**{**vars(TINY), "dtype": "bfloat16", "param_dtype": "bfloat16"})
    hf.save(str(tmp_path / "bf16"), bf16, want)
    c, params = hf.load(str(tmp_path / "bf16"))
    assert c == bf16 and params["embed"].dtype == jax.numpy.bfloat16
