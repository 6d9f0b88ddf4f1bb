"""Data on object storage, against the local GCS and S3 servers: sources, tokenizers and
prepared directories read from gs:// and s3:// give the documents the same files give
locally; prepare writes to a bucket; a missing object is one clear error; prepared data is
read with ranged requests, not whole objects."""

import json
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import DEMO_CONFIG, DEMO_TOKENIZER

from lclm import storage
from lclm.config import load_config
from lclm.config.run_config import run_config
from lclm.data.loader import HostBatches
from lclm.data.prepare import OUTPUTS, main
from lclm.data.prepared import TOKENIZED_META, TokenizedDocuments
from lclm.data.sources import open_documents
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError
from lclm.parallel import make_mesh
from lclm.train.startup_checks import check_data

TEXTS = [f"Ada counted {i} plus {i % 7} and wrote it down." for i in range(40)]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEMO_TOKENIZER)


def documents(docs) -> list:
    return [(t.tolist(), l.tolist()) for t, l in (docs[i] for i in range(len(docs)))]


@pytest.fixture
def corpus(tmp_path):
    """A local folder of two .jsonl files, a .parquet file of several row groups and an
    .arrow file."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    for k, part in enumerate((TEXTS[:15], TEXTS[15:25])):
        (folder / f"part{k}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in part)
        )
    pq.write_table(pa.table({"text": TEXTS[25:33]}), folder / "more.parquet", row_group_size=3)
    with pa.OSFile(str(folder / "rest.arrow"), "wb") as sink:
        table = pa.table({"text": TEXTS[33:]})
        with pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    return folder


def uploaded(server, local) -> str:
    """`local` (a folder) copied into a new bucket of `server`; its URL."""
    remote = storage.join(server.bucket(), "corpus")
    storage.upload(str(local), remote)
    return remote


@pytest.mark.parametrize("name", ["part0.jsonl", "more.parquet", "rest.arrow", "*.jsonl", ""])
def test_sources_read_from_gcs_equal_the_local_files(gcs, corpus, tok, name):
    remote = uploaded(gcs, corpus)
    local = str(corpus / name) if name else str(corpus)
    from_bucket = open_documents("text", storage.join(remote, name) if name else remote, tok)
    assert documents(from_bucket) == documents(open_documents("text", local, tok))
    assert len(from_bucket) == {
        "part0.jsonl": 15,
        "more.parquet": 8,
        "rest.arrow": 7,
        "*.jsonl": 25,
    }.get(name, len(TEXTS))


def prepare_cli(*args: str) -> None:
    assert main(["--source", "text", *args]) == 0


def test_prepare_to_gcs_reads_back_as_prepared_locally(gcs, corpus, tok, tmp_path):
    remote = uploaded(gcs, corpus)
    tokenizer = storage.join(storage.dirname(remote), "tokenizer.model")
    storage.upload(DEMO_TOKENIZER, tokenizer)
    out = storage.join(storage.dirname(remote), "prepared")
    prepare_cli("--input", remote, "--tokenizer", tokenizer, "--out", out)
    prepare_cli(
        "--input", str(corpus), "--tokenizer", DEMO_TOKENIZER, "--out", str(tmp_path / "prepared")
    )
    assert storage.listdir(out) == sorted(OUTPUTS)  # nothing left over (the write probe)
    from_bucket = open_documents("text", out, Tokenizer(tokenizer))  # found to be prepared
    assert isinstance(from_bucket, TokenizedDocuments)
    local = TokenizedDocuments(str(tmp_path / "prepared"))
    assert documents(from_bucket) == documents(local)
    meta = json.loads(storage.read_text(storage.join(out, TOKENIZED_META)))
    assert meta["tokenizer"] == tokenizer


def test_s3_source_and_prepared_data(s3, corpus, tok, tmp_path):
    remote = uploaded(s3, corpus)
    out = storage.join(storage.dirname(remote), "prepared")
    prepare_cli(
        "--input", storage.join(remote, "*.jsonl"), "--tokenizer", DEMO_TOKENIZER, "--out", out
    )
    expected = documents(open_documents("text", str(corpus / "*.jsonl"), tok))
    assert documents(open_documents("text", storage.join(remote, "*.jsonl"), tok)) == expected
    assert documents(open_documents("tokenized", out, tok)) == expected


def test_missing_objects_are_one_clear_error(gcs, tok):
    bucket = gcs.bucket()
    with pytest.raises(FileNotFoundError, match=f"^no data files at '{bucket}/none.jsonl'"):
        open_documents("text", f"{bucket}/none.jsonl", tok)
    with pytest.raises(FileNotFoundError, match="is not a pre-tokenised directory"):
        open_documents("tokenized", f"{bucket}/none", tok)
    with pytest.raises(FileNotFoundError, match=f"^tokenizer '{bucket}/t.model' not found"):
        Tokenizer(f"{bucket}/t.model")
    config = types.SimpleNamespace(
        data=types.SimpleNamespace(path=f"{bucket}/none.jsonl@2", source="text"),
        validation=types.SimpleNamespace(path=""),
    )
    with pytest.raises(ConfigError, match=f"^config.data.path: no data at '{bucket}/none.jsonl'"):
        check_data(config)


def test_prepared_data_is_read_with_ranged_requests(gcs, tok, tmp_path, monkeypatch):
    out = storage.join(gcs.bucket(), "prepared")
    corpus = tmp_path / "a.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    prepare_cli("--input", str(corpus), "--tokenizer", DEMO_TOKENIZER, "--out", out)
    docs = TokenizedDocuments(out)
    fs, fetched = docs.tokens.fs, []
    cat_ranges = fs.cat_ranges

    def counted(paths, starts, ends, **kwargs):
        data = cat_ranges(paths, starts, ends, **kwargs)
        fetched.append([(p.rsplit("/", 1)[-1], len(d)) for p, d in zip(paths, data)])
        return data

    monkeypatch.setattr(fs, "cat_ranges", counted)
    tokens, loss = docs[7]
    assert (tokens.tolist(), loss.tolist()) == documents(open_documents("text", str(corpus), tok))[
        7
    ]
    # only document 7's bytes (a fortieth of the token file), both arrays in one round trip
    assert fetched == [[("tokens.bin", 4 * len(tokens)), ("loss.bin", len(tokens))]]


def _batches(data_path: str, n: int) -> list:
    config = load_config(DEMO_CONFIG)
    config.data.update(path=data_path, seq_len=32, batch_size=4)
    check_data(config)  # every source found (a prefix, a glob: looked up in the bucket)
    loader = HostBatches(
        run_config(config), make_mesh(fsdp=2, sp=2), Tokenizer(DEMO_TOKENIZER), prefetch=0
    )
    return [loader.next_host_batch() for _ in range(n)]


def test_a_mixture_on_gcs_gives_the_batches_of_the_local_files(gcs, corpus, tmp_path):
    remote = uploaded(gcs, corpus)
    prepared = storage.join(storage.dirname(remote), "prepared")
    prepare_cli("--input", str(corpus), "--tokenizer", DEMO_TOKENIZER, "--out", prepared)
    storage.download(prepared, str(tmp_path / "prepared"))
    mixture = "tokenized:{}@0.4,{}@0.6"
    local = _batches(mixture.format(tmp_path / "prepared", corpus / "*.jsonl"), 3)
    from_bucket = _batches(mixture.format(prepared, storage.join(remote, "*.jsonl")), 3)
    for a, b in zip(local, from_bucket):
        assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_hf_tokenizer_directory_on_s3_is_the_local_one(s3, hf_dir):
    remote = storage.join(s3.bucket(), "tok")
    storage.upload(str(hf_dir), remote)
    local, from_bucket = Tokenizer(str(hf_dir)), Tokenizer(remote)
    assert type(from_bucket) is type(local)
    assert (from_bucket.bos_id, from_bucket.eos_id, from_bucket.pad_id, from_bucket.add_bos) == (
        local.bos_id,
        local.eos_id,
        local.pad_id,
        local.add_bos,
    )
    assert from_bucket.encode(TEXTS[3]) == local.encode(TEXTS[3])
