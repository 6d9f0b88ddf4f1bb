"""Data source kinds are one registry (`lclm.data.sources.KINDS`): data.source's choices are
its names, and the loader, the start-up check, prepare and the messages that list kinds ask
it instead of choosing by name."""

import json
import re

import pytest
from support import DEMO_CONFIG, DEMO_TOKENIZER

from lclm.config import load_config
from lclm.config.schema import SOURCE_KINDS
from lclm.data.kind import DIRECTORY, FILES, OPTIONS, Kind
from lclm.data.loader import parse_sources
from lclm.data.prepare import main as prepare_main
from lclm.data.prepare import prepare
from lclm.data.sources import KINDS, open_documents
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError
from lclm.train.startup_checks import check_data


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEMO_TOKENIZER)


def test_the_registry_holds_the_schemas_names():
    assert tuple(KINDS) == SOURCE_KINDS


def test_an_unknown_kind_is_one_line_naming_every_kind(tmp_path, tok):
    with pytest.raises(ValueError) as e:
        open_documents("csv", str(tmp_path), tok)
    # every kind, written out: a kind left out of the registry fails here too
    assert str(e.value) == (
        "unknown data source 'csv'; use one of text, sharegpt, tokenized, "
        "line_retrieval, ruler, code, code-heldout"
    )


def test_every_kind_is_a_prefix_of_data_path():
    for name in KINDS:
        assert parse_sources(f"{name}:x@2", "text")[0][:3] == (name, "x", 2.0)
    # not a kind: part of the path
    assert parse_sources("csv:x", "text")[0][:2] == ("text", "csv:x")


def test_the_start_up_check_asks_what_a_kinds_path_is(tmp_path):
    config = load_config(DEMO_CONFIG)
    # options are not looked up as files (ruler's were, and so training on it failed)
    for name in (n for n, k in KINDS.items() if k.path == OPTIONS):
        config.data.path = f"{name}:tokens=256;seed=0"
        check_data(config)
    (tmp_path / "f.jsonl").write_text("{}\n")
    for name, kind in KINDS.items():
        if kind.path == DIRECTORY:
            config.data.path = f"{name}:{tmp_path}/f.jsonl"
            with pytest.raises(
                ConfigError, match=re.escape(f"not a local directory; point it at {kind.path_help}")
            ):
                check_data(config)
        if kind.path == FILES:
            config.data.path = f"{name}:{tmp_path}/f.jsonl"
            check_data(config)
            config.data.path = f"{name}:{tmp_path}/missing.jsonl"
            with pytest.raises(ConfigError, match="no data at"):
                check_data(config)


def test_prepare_takes_the_kinds_the_registry_says_and_they_read_its_output(tmp_path, capsys, tok):
    preparable = [name for name, kind in KINDS.items() if kind.prepare]
    assert preparable == ["text", "sharegpt", "code", "code-heldout"]
    with pytest.raises(SystemExit):
        prepare_main(
            [
                "--source",
                "ruler",
                "--input",
                "x",
                "--tokenizer",
                DEMO_TOKENIZER,
                "--out",
                str(tmp_path / "out"),
            ]
        )
    err = capsys.readouterr().err
    # argparse quotes the choices on some Python versions and not on others
    assert "invalid choice: 'ruler'" in err
    assert all(name in err.split("choose from", 1)[1] for name in preparable)
    corpus = tmp_path / "a.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3)))
    prepare("text", str(corpus), DEMO_TOKENIZER, str(tmp_path / "out"))
    for name in ("tokenized", *preparable):  # a prepared directory reads as one under each
        docs = open_documents(name, str(tmp_path / "out"), tok)
        assert type(docs).__name__ == "TokenizedDocuments" and len(docs) == 3


def test_a_kind_says_what_its_path_is():
    with pytest.raises(ValueError, match="path='url'"):
        Kind("web", lambda path, tokenizer, reading: [], "url")
    with pytest.raises(ValueError, match="path_help"):
        Kind("repos", lambda path, tokenizer, reading: [], DIRECTORY)
