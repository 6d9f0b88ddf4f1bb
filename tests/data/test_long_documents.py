"""Long-document engineering per source (data.path options) and mixtures shared in tokens."""

import json
import os
import sysconfig

import numpy as np
import pytest
from support import DEMO_CONFIG, DEMO_CORPUS, DEMO_TOKENIZER

from lclm.config import load_config
from lclm.config.run_config import run_config
from lclm.data.filters import LengthFilter, LengthRules, parse_options
from lclm.data.loader import HostBatches, SourceEntry, parse_sources
from lclm.data.prepare import prepare
from lclm.data.sources import DataError
from lclm.data.stream import DocumentStream, EpochOrders, Mixture
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError
from lclm.parallel import make_mesh


def _docs(lengths) -> list:
    """Documents whose tokens all hold their own index: `[(tokens [n], loss [n])]`."""
    return [(np.full(n, i, np.int32), np.ones(n, np.int8)) for i, n in enumerate(lengths)]


def _stream(lengths, options: str, shard=0, shards=1, seed=3) -> DocumentStream:
    docs = _docs(lengths)
    rules = LengthFilter(docs, parse_options(options, "test"), seed, source=0)
    return DocumentStream(docs, EpochOrders(len(docs), seed), shard, shards, rules)


def _epochs(stream: DocumentStream, epochs: int) -> list[list[int]]:
    """The documents (indices) that `stream` draws in each of its next `epochs` epochs."""
    drawn: list[list[int]] = [[] for _ in range(epochs)]
    while True:
        doc = next(stream)
        if stream.epoch >= epochs:
            return drawn
        drawn[stream.epoch].append(int(doc[0][0]))


def test_entries_take_options_after_a_question_mark(tmp_path):
    assert parse_sources("text:/data/books@0.3?short_below=4k&short_keep=0.1", "text") == [
        SourceEntry("text", "/data/books", 0.3, LengthRules(short_below=4096, short_keep=0.1))
    ]
    code = LengthRules(min_tokens=65536, long_above=131072, long_repeat=2.0)
    assert parse_sources(
        "tokenized:/d/code@0.3?min_tokens=64k&long_above=128k&long_repeat=2,/d/web?min_tokens=512",
        "text",
    ) == [
        SourceEntry("tokenized", "/d/code", 0.3, code),
        SourceEntry("text", "/d/web", 1.0, LengthRules(min_tokens=512)),
    ]
    assert parse_options(code.text(), "x") == code
    # a glob's '?' is part of its path; a local file named so is itself
    assert parse_sources("/d/part-?.jsonl@2", "text") == [SourceEntry("text", "/d/part-?.jsonl", 2)]
    odd = tmp_path / "a?min_tokens=1.jsonl"
    odd.write_text('{"text": "x"}\n')
    assert parse_sources(str(odd), "text") == [SourceEntry("text", str(odd), 1.0)]


@pytest.mark.parametrize(
    "entry, why",
    [
        ("a.jsonl?max_len=1k", "unknown option 'max_len=1k'; the options are min_tokens"),
        ("a.jsonl@0.5?short_keep=0.1", "short_below and short_keep go together"),
        ("a.jsonl?short_below=4k&short_keep=1.5", "short_keep=1.5 must be a probability"),
        ("a.jsonl?long_above=1k&long_repeat=0.5", "long_repeat=0.5 must be a number >= 1"),
        ("a.jsonl?min_tokens=lots", "bad length 'lots'"),
        ("a.jsonl?min_tokens=1k&min_tokens=2k", "min_tokens is given twice"),
    ],
)
def test_bad_options_are_one_line_errors_naming_the_entry(entry, why):
    with pytest.raises(ConfigError, match="config.data.path entry") as e:
        parse_sources(f"b.jsonl,{entry}", "text")
    assert why in str(e.value) and entry in str(e.value) and "\n" not in str(e.value)


def test_min_tokens_drops_shorter_documents():
    lengths = np.random.default_rng(0).integers(1, 200, 300)
    drawn = _epochs(_stream(lengths, "min_tokens=100"), 2)
    for epoch in drawn:
        assert sorted(epoch) == [i for i, n in enumerate(lengths) if n >= 100]


def test_short_keep_keeps_about_that_share_of_short_documents_each_epoch():
    lengths = [10, 500] * 2000
    drawn = _epochs(_stream(lengths, "short_below=100&short_keep=0.1"), 2)
    for epoch in drawn:
        short = [i for i in epoch if lengths[i] < 100]
        assert len(epoch) - len(short) == 2000  # every long one
        assert 0.08 < len(short) / 2000 < 0.12  # 3 standard deviations: 0.0201
    assert set(drawn[0]) != set(drawn[1])  # each epoch keeps others


@pytest.mark.parametrize("repeat", [2, 2.5])
def test_long_documents_repeat_spread_out_never_back_to_back(repeat):
    lengths = [2000 if i % 4 == 0 else 10 for i in range(1600)]
    for shard in range(2):  # two readers, each of every other document
        drawn = _epochs(_stream(lengths, f"long_above=1k&long_repeat={repeat}", shard, 2), 3)
        flat = sum(drawn, [])
        assert all(a != b for a, b in zip(flat, flat[1:]))
        for epoch in drawn:
            counts = np.bincount(epoch, minlength=len(lengths))
            mine = counts > 0  # this reader's share of the epoch
            long = counts[mine & (np.asarray(lengths) > 1024)]
            assert (counts[mine & (np.asarray(lengths) < 1024)] == 1).all()
            assert set(long) <= {int(repeat), int(np.ceil(repeat))}
            assert abs(long.mean() - repeat) < 0.1
            where: dict[int, list[int]] = {}
            for k, i in enumerate(epoch):  # copies lie about an epoch / copies apart
                where.setdefault(i, []).append(k)
            gaps = [b - a for ks in where.values() for a, b in zip(ks, ks[1:])]
            assert min(gaps) > len(epoch) / (2 * repeat)


def test_a_single_long_document_is_still_drawn_when_nothing_else_is_left():
    stream = _stream([2000], "long_above=1k&long_repeat=3")
    assert [int(next(stream)[0][0]) for _ in range(3)] == [0, 0, 0]


def test_options_that_leave_a_row_nothing_fail_in_one_line():
    stream = _stream([10, 20, 30], "min_tokens=1k")
    with pytest.raises(DataError, match=r"options \?min_tokens=1k leave out every document"):
        next(stream)


def test_stream_resumes_exactly_in_the_middle():
    lengths = np.random.default_rng(1).integers(1, 3000, 500)
    options = "min_tokens=20&short_below=1k&short_keep=0.3&long_above=2k&long_repeat=2.5"
    stream = _stream(lengths, options)
    for _ in range(180):
        next(stream)
    state = json.loads(json.dumps(stream.state()))
    want = [int(next(stream)[0][0]) for _ in range(400)]
    resumed = _stream(lengths, options)
    resumed.restore(state)
    assert [int(next(resumed)[0][0]) for _ in range(400)] == want


def test_mixture_by_tokens_tracks_token_shares_and_documents_is_unchanged():
    def mixture(unit):
        streams = [
            DocumentStream(_docs([1000] * 50), EpochOrders(50, 1)),
            DocumentStream(_docs([10] * 50), EpochOrders(50, 2)),
        ]
        return Mixture(streams, [0.5, 0.5], seed=7, stream_id=3, unit=unit)

    by_tokens = mixture("tokens")
    tokens = np.zeros(2)
    for _ in range(600):
        doc = next(by_tokens)
        tokens[int(len(doc[0]) == 10)] += len(doc[0])
    assert abs(tokens[0] / tokens.sum() - 0.5) < 1000 / tokens.sum()
    assert by_tokens.state()["tokens"] == tokens.tolist()
    # documents: the choice of draw n is uniform(seed, reader, n) against the weights
    by_documents = mixture("documents")
    lengths = [len(next(by_documents)[0]) for _ in range(200)]
    want = [1000 if np.random.default_rng([7, 3, n]).random() < 0.5 else 10 for n in range(200)]
    assert lengths == want
    assert set(by_documents.state()) == {"count", "streams"}
    with pytest.raises(DataError, match="set data.mixture_unit=documents to resume it") as e:
        mixture("tokens").restore(by_documents.state())
    assert "\n" not in str(e.value)


def _config(path: str, unit="tokens", seq_len=64, batch_size=4):
    c = load_config(DEMO_CONFIG)
    c.data.update(
        path=path, seq_len=seq_len, batch_size=batch_size, mixture_unit=unit, balance=False
    )
    return c


def test_loader_with_options_resumes_exactly(tmp_path):
    path = (
        f"{DEMO_CORPUS}@0.6?min_tokens=60&long_above=120&long_repeat=1.5,"
        f"{DEMO_CORPUS}@0.4?short_below=100&short_keep=0.2"
    )
    config = _config(path)
    tok = Tokenizer(config.data.tokenizer)
    mesh = make_mesh(fsdp=2, sp=4)
    loader = HostBatches(run_config(config), mesh, tok, prefetch=0)
    want = [loader.next_host_batch() for _ in range(8)][5:]
    first = HostBatches(run_config(config), mesh, tok, prefetch=0)
    for _ in range(5):
        first.next_host_batch()
    state = json.loads(json.dumps(first._snapshot()))
    resumed = HostBatches(run_config(config), mesh, tok, state=state, prefetch=0)
    for w in want:
        got = resumed.next_host_batch()
        for k in w:
            np.testing.assert_array_equal(got[k], w[k])
    config.data.mixture_unit = "documents"
    with pytest.raises(DataError, match="set data.mixture_unit=tokens"):
        HostBatches(run_config(config), mesh, tok, state=state, prefetch=0)


def test_statistics_count_pre_tokenised_sources_exactly_and_sample_others(tmp_path):
    prepared = str(tmp_path / "prepared")
    prepare("text", DEMO_CORPUS, DEMO_TOKENIZER, prepared)
    config = _config(f"tokenized:{prepared}@3?min_tokens=120,{DEMO_CORPUS}@1", "documents")
    loader = HostBatches(
        run_config(config), make_mesh(fsdp=2, sp=4), Tokenizer(DEMO_TOKENIZER), prefetch=0
    )
    exact, sampled = loader.statistics(sample=500)["sources"]
    lengths = np.array([len(loader.sources[0].docs[i][0]) for i in range(3000)])
    assert not exact["estimated"] and exact["options"] == "min_tokens=120"
    assert (exact["documents"], exact["tokens"]) == (
        (lengths >= 120).sum(),
        lengths[lengths >= 120].sum(),
    )
    assert exact["buckets"]["<4K"]["tokens"] == exact["tokens"]
    assert sampled["estimated"] and sampled["measured"] == 500
    assert abs(sampled["tokens"] / lengths.sum() - 1) < 0.05
    # shared by documents: weight x mean tokens per document
    means = [exact["tokens"] / exact["documents"], lengths.mean()]
    assert exact["share"] == pytest.approx(3 * means[0] / (3 * means[0] + means[1]), rel=0.02)
    json.dumps(loader.statistics())


def _stdlib_sources(tmp_path) -> dict[str, str]:
    """Three .jsonl sources of real code from the standard library: `packages`, one document
    per directory (its .py files in path order, each under its path; 8-64 KB each),
    `modules`, single files (1-48 KB), `small`, single files under 3 KB. Each document
    starts with its source's name."""
    root = sysconfig.get_paths()["stdlib"]
    packages, files = [], []
    for directory, dirs, names in sorted(os.walk(root)):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "__pycache__"))
        paths = [os.path.join(directory, n) for n in sorted(names) if n.endswith(".py")]
        sizes = [os.path.getsize(p) for p in paths]
        files += zip(paths, sizes)
        if 8 << 10 <= sum(sizes) <= 64 << 10:
            packages.append(paths)

    def read(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            return f"# {os.path.relpath(path, root)}\n{f.read()}"

    chosen = {
        "packages": packages[::2],
        "modules": [[p] for p, n in files if 1 << 10 <= n <= 48 << 10][::6],
        "small": [[p] for p, n in files if n < 3 << 10][::4],
    }
    written = {}
    for name, documents in chosen.items():
        written[name] = str(tmp_path / f"{name}.jsonl")
        with open(written[name], "w") as f:
            for paths in documents:
                f.write(json.dumps({"text": f"#{name}\n" + "\n".join(map(read, paths))}) + "\n")
    return written


def _token_shares(loader: HostBatches, tok, rows: int, names) -> np.ndarray:
    """The share of each source (`names` `[k]`) of the tokens in the next `rows` rows of
    every slot: a document starts where positions restart, with its source's name."""
    tokens = np.zeros(len(names))
    for slot in loader.slots.values():
        got = [slot.next_row() for _ in range(rows)]  # a slot's rows continue its documents
        ids, positions = (np.concatenate([r[k] for r in got]) for k in ("tokens", "positions"))
        starts = np.flatnonzero(positions == 0)
        assert starts[0] == 0  # a fresh loader: its rows start with a document
        for a, b in zip(starts, [*starts[1:], len(ids)]):
            head = tok.decode(ids[a : a + 12].tolist()).lstrip()
            tokens[next(k for k, n in enumerate(names) if head.startswith(f"#{n}"))] += b - a
    return tokens / tokens.sum()


def test_a_length_filter_keeps_each_sources_token_share_on_real_code(tmp_path):
    """Code of very different lengths: whole package directories, single files and short
    files, one source keeping only 10% of its documents under 4K tokens; the rows still hold
    each source's weight of the tokens."""
    src = _stdlib_sources(tmp_path)
    weights = {"packages": 0.5, "modules": 0.3, "small": 0.2}
    path = (
        f"{src['packages']}@0.5,{src['modules']}@0.3?short_below=4k&short_keep=0.1,"
        f"{src['small']}@0.2"
    )
    config = _config(path, seq_len=8192, batch_size=2)
    tok = Tokenizer(DEMO_TOKENIZER)
    loader = HostBatches(run_config(config), make_mesh(fsdp=2, sp=4), tok, prefetch=0)
    shares = _token_shares(loader, tok, 48, list(weights))
    np.testing.assert_allclose(shares, list(weights.values()), atol=0.03)
    stats = loader.statistics(sample=150)
    found = {s["path"]: s for s in stats["sources"]}
    assert [found[src[n]]["share"] for n in weights] == pytest.approx(list(weights.values()))
    modules = found[src["modules"]]
    assert modules["options"] == "short_below=4k&short_keep=0.1"
    assert sum(b["tokens"] for b in modules["buckets"].values()) == pytest.approx(
        modules["tokens"], abs=len(modules["buckets"])
    )
    assert modules["documents"] < 0.75 * modules["source_documents"]  # short ones left out


def test_max_tokens_keeps_only_the_short_documents():
    rules = parse_options("max_tokens=8", "test")
    lengths = np.array([1, 8, 9, 100])
    f = LengthFilter([None] * 4, rules, seed=0, source=0)
    assert f.keep(np.arange(4), lengths, epoch=0, copy=0).tolist() == [True, True, False, False]
    assert rules.text() == "max_tokens=8"
