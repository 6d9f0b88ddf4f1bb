"""Old commands and names keep working as thin aliases that say where the new ones are:
`python -m lclm.generate` (now `python -m lclm.eval.generate`), `lclm.models.llama` (now
`lclm.models.decoder`), `LlamaConfig` (now `ModelConfig`) and `lclm.models.nnx_llama` (now
`lclm.models.nnx_decoder`); the deprecated names say when they go (lclm 0.2.0)."""

import importlib
import shutil
import subprocess
import sys

import jax
import pytest
from support import DEMO_TOKENIZER, ROOT

from lclm import hf
from lclm.config import ModelConfig
from lclm.eval import generate as new_generate
from lclm.models import decoder
from lclm.models.decoder import init_params

MODEL = ModelConfig(
    vocab_size=512,
    dim=32,
    n_layers=1,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=64,
    dtype="float32",
    init_std=0.5,
)


def _fresh_import(name: str):
    """`name` imported anew (its import-time warning fires again)."""
    _forget(name)
    return importlib.import_module(name)


def _forget(name: str) -> None:
    """The next import of `name` runs it again."""
    sys.modules.pop(name, None)


def test_python_m_lclm_generate_runs_the_new_command_and_says_where_it_is():
    done = subprocess.run(
        [sys.executable, "-m", "lclm.generate", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "usage: python -m lclm.eval.generate" in done.stdout
    assert done.stderr.splitlines()[0] == (
        "note: python -m lclm.generate is now python -m lclm.eval.generate (also "
        "lclm-generate); running it"
    )


@pytest.mark.slow  # compiles decoding
def test_the_generate_alias_continues_a_prompt_as_the_new_command_does(tmp_path, capsys):
    hf.save(str(tmp_path / "hf"), MODEL, init_params(MODEL, jax.random.key(0)))
    shutil.copy(DEMO_TOKENIZER, tmp_path / "hf" / "tokenizer.model")
    argv = [
        "--hf",
        str(tmp_path / "hf"),
        "--prompt",
        "The quick brown fox",
        "--max-new-tokens",
        "4",
    ]
    old = _fresh_import("lclm.generate")
    assert old.main(argv) == 0
    alias = capsys.readouterr()
    assert new_generate.main(argv) == 0
    new = capsys.readouterr()
    assert alias.out == new.out and new.out.strip()
    assert alias.err.startswith("note: python -m lclm.generate is now python -m lclm.eval.generate")
    assert old.continuation is new_generate.continuation  # its names are the new module's


def test_lclm_models_llama_is_the_decoder_with_llama_config():
    _forget("lclm.models.llama")
    with pytest.warns(
        DeprecationWarning, match="now lclm.models.decoder.*removed in lclm 0.2.0"
    ) as warned:
        import lclm.models.llama as llama
    assert warned[0].filename == __file__  # the importer's line, not the import machinery's
    assert llama.forward is decoder.forward and llama.init_params is decoder.init_params
    assert llama.LlamaConfig is ModelConfig
    tokens = jax.numpy.zeros((1, 8), jax.numpy.int32)
    params = llama.init_params(MODEL, jax.random.key(0))
    assert llama.forward(MODEL, params, tokens).shape == (1, 8, MODEL.vocab_size)


def test_llama_config_from_lclm_config_warns_and_is_model_config():
    with pytest.warns(
        DeprecationWarning,
        match="lclm.config.ModelConfig; the old name will be removed in lclm 0.2.0",
    ):
        from lclm.config import LlamaConfig
    assert LlamaConfig is ModelConfig
    with pytest.raises(ImportError):
        from lclm.config import NoSuchName  # noqa: F401


def test_lclm_models_nnx_llama_is_the_nnx_decoder():
    pytest.importorskip("flax", reason="the NNX view needs the optional flax (lclm[nnx])")
    nnx_decoder = importlib.import_module("lclm.models.nnx_decoder")
    with pytest.warns(
        DeprecationWarning, match="now lclm.models.nnx_decoder.*removed in lclm 0.2.0"
    ):
        nnx_llama = _fresh_import("lclm.models.nnx_llama")
    assert nnx_llama.LlamaModule is nnx_decoder.DecoderModule
    assert nnx_llama.from_params is nnx_decoder.from_params
