""".parquet and .arrow sources are read in place with pyarrow: the same documents as the same
records in JSON lines, with no `datasets` cache written or needed."""

import json
import logging
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support import DEMO_TOKENIZER, ROOT

from lclm.data import records as record_readers
from lclm.data.sources import DataError, open_documents
from lclm.data.stats import SourceStats
from lclm.data.synthetic import conversations
from lclm.data.tokenizer import Tokenizer

TEXTS = [f"Ada counted {i} plus {i % 5} and wrote it down." for i in range(20)]
TEXTS[4], TEXTS[11] = "", None  # malformed: skipped and counted


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEMO_TOKENIZER)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def usable_documents(docs):
    return [
        (t.tolist(), l.tolist())
        for t, l in (d for d in (docs[i] for i in range(len(docs))) if d is not None)
    ]


def write_columnar(directory, table):
    """`table` split over two parquet files of several row groups, and as Arrow IPC in the
    random-access format and in the stream format that `datasets` saves."""
    directory.mkdir()
    half = table.num_rows // 2
    pq.write_table(table.slice(0, half), directory / "a.parquet", row_group_size=3)
    pq.write_table(table.slice(half), directory / "b.parquet", row_group_size=4)
    with pa.ipc.new_file(directory / "file.arrow", table.schema) as w:
        for batch in table.to_batches(max_chunksize=6):
            w.write_batch(batch)
    with pa.ipc.new_stream(directory / "stream.arrow", table.schema) as w:
        w.write_table(table, max_chunksize=5)
    return {
        "parquet": str(directory / "*.parquet"),
        "file": str(directory / "file.arrow"),
        "stream": str(directory / "stream.arrow"),
    }


READ_IN_A_CLEAN_PROCESS = """
import json, sys
from lclm.data.sources import open_documents
from lclm.data.stats import SourceStats
from lclm.data.tokenizer import Tokenizer
stats = SourceStats()
docs = open_documents("text", sys.argv[1], Tokenizer(sys.argv[2]), stats=stats)
ids = [None if d is None else d[0].tolist() for d in (docs[i] for i in range(len(docs)))]
print(json.dumps([ids, stats.skipped, "datasets" in sys.modules]))
"""


def test_parquet_and_arrow_need_no_datasets_cache(tmp_path, tok):
    paths = write_columnar(tmp_path / "files", pa.table({"text": TEXTS, "n": range(20)}))
    stats = SourceStats()
    jsonl = write_jsonl(tmp_path / "same.jsonl", [{"text": t} for t in TEXTS])
    want = [t for t, _ in usable_documents(open_documents("text", jsonl, tok, stats=stats))]
    assert stats.skipped == 2
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o555)  # read-only for a user other than root; empty afterwards in any case
    env = dict(os.environ, HF_DATASETS_CACHE=str(cache), HF_HOME=str(cache))
    for kind, path in paths.items():
        out = subprocess.run(
            [sys.executable, "-c", READ_IN_A_CLEAN_PROCESS, path, DEMO_TOKENIZER],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        ids, skipped, imported_datasets = json.loads(out)
        assert [i for i in ids if i is not None] == want, kind
        assert (skipped, imported_datasets) == (2, False), kind
    assert os.listdir(cache) == []


def test_parquet_conversations_read_as_their_json_lines(tmp_path, tok):
    records = conversations(12, seed=4)
    records[3] = {"conversations": [{"from": "human", "value": "no reply"}]}
    (tmp_path / "c").mkdir()
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "c" / "c.parquet", row_group_size=5)
    jsonl = write_jsonl(tmp_path / "c.jsonl", records)
    stats = SourceStats()
    got = usable_documents(open_documents("sharegpt", str(tmp_path / "c"), tok, stats=stats))
    assert got == usable_documents(open_documents("sharegpt", jsonl, tok))
    assert len(got) == 11 and stats.skipped == 1


def test_parquet_beside_json_lines_is_read_whole(tmp_path, tok):
    (tmp_path / "d").mkdir()
    pq.write_table(pa.table({"text": TEXTS[:6], "n": range(6)}), tmp_path / "d" / "p.parquet")
    write_jsonl(tmp_path / "d" / "q.jsonl", [{"text": "the last one"}])
    stats = SourceStats()
    docs = open_documents("text", str(tmp_path / "d"), tok, stats=stats)
    assert [tok.decode(docs[i][0][1:-1]) for i in range(len(docs))] == [
        *(t for t in TEXTS[:6] if t),
        "the last one",
    ]
    assert stats.examples == [f"{tmp_path}/d/p.parquet row 4: no non-empty string field 'text'"]


def test_row_groups_beyond_the_cache_are_decoded_again_with_one_warning(
    tmp_path, tok, monkeypatch, caplog
):
    path = write_columnar(tmp_path / "files", pa.table({"text": TEXTS}))["parquet"]
    records = record_readers.ColumnarRecords(record_readers.resolve_files(path), ["text"], path)
    assert [r["text"] for r in records] == TEXTS
    monkeypatch.setattr(record_readers, "PARQUET_CACHE_BYTES", 1)  # keeps only the last row group
    records = record_readers.ColumnarRecords(record_readers.resolve_files(path), ["text"], path)
    with caplog.at_level(logging.WARNING, "lclm.data.records"):
        for _ in range(2):
            assert [records[i]["text"] for i in (19, 0, 7, 18, 3)] == [
                TEXTS[i] for i in (19, 0, 7, 18, 3)
            ]
    assert len(records._decoded) == 1
    [warning] = caplog.records
    assert warning.message.endswith("pre-tokenise it with python -m lclm.data.prepare")


@pytest.mark.parametrize("name", ["x.parquet", "x.arrow"])
def test_unreadable_parquet_and_arrow_files_fail_in_one_line(tmp_path, tok, name):
    (tmp_path / name).write_bytes(b"PAR1 not really" * 10)
    with pytest.raises(DataError, match=f"x.{name[2:]} is not a readable") as e:
        open_documents("text", str(tmp_path / name), tok)
    assert "\n" not in str(e.value)
