"""`code:` and `code-heldout:` sources: directories of packages as repository-level documents."""

import os
import sysconfig

import numpy as np
import pytest
from support import DEMO_CONFIG, DEMO_TOKENIZER, real_model_dir

from lclm.config import load_config
from lclm.config.run_config import run_config
from lclm.config.schema import SOURCE_KINDS
from lclm.data import code
from lclm.data.filters import LengthRules
from lclm.data.loader import HostBatches, SourceEntry, parse_sources
from lclm.data.sources import DataError, open_documents
from lclm.data.stats import SourceStats
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError
from lclm.parallel import make_mesh
from lclm.train.startup_checks import check_data


def _write(root, path: str, content: str | bytes) -> None:
    file = root / path
    file.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        file.write_bytes(content)
    else:
        file.write_text(content)


def _tree(tmp_path):
    """A directory of packages: `alpha` (nested files, a binary and a non-UTF-8 .py, a cache,
    an .so, a symlink out of the directory, a file over the size cap), `beta`, a top-level
    module `gamma.py` beside package `gamma`, and what is no package (install metadata, a
    nested site-packages, a directory of binaries only)."""
    root = tmp_path / "lib"
    files = {
        "alpha/__init__.py": "",
        "alpha/core.py": "def core():\n    return 1\n",
        "alpha/sub/deep.py": "X = 2",
        "alpha/README.md": "# Alpha\n",
        "alpha/blob.py": b"\x00\x01binary",
        "alpha/latin.py": b"caf\xe9 = 1\n",
        "alpha/big.py": "x = 1\n" * 400,
        "alpha/__pycache__/core.py": "cached = 1\n",
        "alpha/_speed.so": b"\x7fELF",
        "beta/b.py": "import alpha\n",
        "gamma.py": "G = 3\n",
        "gamma/__init__.py": "from gamma.x import y\n",
        "gamma-1.0.dist-info/METADATA.txt": "Name: gamma\n",
        "site-packages/other/o.py": "o = 0\n",
        "lib-dynload/_x.so": b"\x7fELF",
    }
    for path, content in files.items():
        _write(root, path, content)
    _write(tmp_path, "elsewhere.py", "secret = 1\n")
    os.symlink(tmp_path / "elsewhere.py", root / "alpha" / "outside.py")
    return root


def _heldout(root, name: str) -> bool:
    """Whether package `name` of `root` is in the held-out split."""
    return any(d.name == name for d in code.list_documents(str(root), True, SourceStats()))


def _all(root) -> tuple[dict[str, list[str]], SourceStats]:
    """Every document's text of both splits by package name, and the stats they shared."""
    stats = SourceStats()
    found: dict[str, list[str]] = {}
    for heldout in (False, True):
        records = code.CodeRecords(str(root), heldout, stats)
        for i, doc in enumerate(records.documents):
            record = records[i]
            assert record is not None
            found.setdefault(doc.name, []).append(record["text"])
    return found, stats


def test_packages_hold_their_files_in_path_order_under_their_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(code, "MAX_FILE_BYTES", 1000)
    found, _ = _all(_tree(tmp_path))
    assert sorted(found) == ["alpha", "beta", "gamma"]
    assert found["alpha"] == [
        "# alpha/README.md\n# Alpha\n\n# alpha/__init__.py\n\n"
        "# alpha/core.py\ndef core():\n    return 1\n\n"
        "# alpha/sub/deep.py\nX = 2\n"
    ]
    assert found["beta"] == ["# beta/b.py\nimport alpha\n"]
    # the top-level module is a short document of its own, in its package's split
    assert sorted(found["gamma"]) == [
        "# gamma.py\nG = 3\n",
        "# gamma/__init__.py\nfrom gamma.x import y\n",
    ]


def test_bad_files_are_left_out_and_counted_once(tmp_path, monkeypatch):
    monkeypatch.setattr(code, "MAX_FILE_BYTES", 1000)
    root = _tree(tmp_path)
    stats = SourceStats()
    records = code.CodeRecords(str(root), _heldout(root, "alpha"), stats)
    alpha = next(i for i, d in enumerate(records.documents) if d.name == "alpha")
    first = records[alpha]
    for _ in range(3):  # later epochs read them again
        assert records[alpha] == first
    whys = sorted(e.split(": ")[-1] for e in stats.examples)
    assert stats.skipped == 4 and whys == [
        "a symlink out of the source's directory",
        "binary",
        "invalid UTF-8",
        "over 1000 bytes",
    ]


def test_a_package_of_only_bad_files_is_a_malformed_record(tmp_path):
    _write(tmp_path, "pkg/a.py", b"\xff\xfe")
    records = code.CodeRecords(str(tmp_path), _heldout(tmp_path, "pkg"), SourceStats())
    assert len(records) == 1 and records[0] is None


def test_a_large_package_continues_in_documents_cut_between_files(tmp_path, monkeypatch):
    monkeypatch.setattr(code, "MAX_DOCUMENT_BYTES", 250)
    for k in range(10):
        _write(tmp_path, f"pkg/m{k}.py", f"# {k}\n" + "x" * 96 + "\n")  # 102 bytes each
    documents = code.CodeRecords(str(tmp_path), _heldout(tmp_path, "pkg"), SourceStats()).documents
    assert [len(d.files) for d in documents] == [2, 2, 2, 2, 2]
    assert [f for d in documents for f in d.files] == [f"pkg/m{k}.py" for k in range(10)]


def test_a_module_beside_its_package_is_on_its_side_and_bands_hold_out_at_most_half(tmp_path):
    names = [f"pkg{k:03d}" for k in range(200)]
    for name in names:
        _write(tmp_path, f"{name}/__init__.py", f"NAME = {name!r}\n")
        _write(tmp_path, f"{name}.py", "")
    tok = Tokenizer(DEMO_TOKENIZER)
    train = open_documents("code", str(tmp_path), tok).records.documents
    heldout = open_documents("code-heldout", str(tmp_path), tok).records.documents
    train_names, heldout_names = {d.name for d in train}, {d.name for d in heldout}
    assert not train_names & heldout_names and train_names | heldout_names == set(names)
    assert len(heldout_names) == code.HELDOUT_BANDS[-1][1]  # all 200 in the shortest band
    assert len(train) + len(heldout) == 400  # each package and its top-level module
    # three packages in a band: one held out, so that training keeps the band too
    small = _tree(tmp_path / "small")
    assert [_heldout(small, n) for n in ("alpha", "beta", "gamma")].count(True) == 1


def _sized_tree(root) -> dict[str, int]:
    """Packages of chosen sizes, of files of up to 16 KiB of zeros (sparse: the split reads
    only sizes): in each band of HELDOUT_BANDS, twice its count and one more, spread
    over the band (the longest band up to PART_BYTES[0]); and `big`, three rounds of
    PART_BYTES's cuts, 3.6 MiB. {path relative to root: bytes}."""
    bounds = [least for least, _ in code.HELDOUT_BANDS]
    uppers = [code.PART_BYTES[0]] + bounds[:-1]
    sizes = {
        f"band{b}_{j}": least + (upper - least) * (2 * j + 1) // (4 * count + 2)
        for b, ((least, count), upper) in enumerate(zip(code.HELDOUT_BANDS, uppers))
        for j in range(2 * count + 1)
    }
    sizes["big"] = 3 * sum(code.PART_BYTES)
    files = {}
    for name, size in sizes.items():
        for k, start in enumerate(range(0, size, 16 << 10)):
            files[f"{name}/m{k:03d}.py"] = min(16 << 10, size - start)
    for path, size in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        with open(root / path, "wb") as f:
            f.truncate(size)
    return files


def test_every_size_band_has_heldout_units_and_the_splits_partition_the_files(tmp_path):
    files = _sized_tree(tmp_path / "lib")
    train, heldout = (
        code.list_documents(str(tmp_path / "lib"), h, SourceStats()) for h in (False, True)
    )
    train_files = [f for d in train for f in d.files]
    heldout_files = [f for d in heldout for f in d.files]
    # no file on both sides or twice on one (held-out parts are disjoint), none missing
    assert sorted(train_files + heldout_files) == sorted(files)
    sizes = [sum(files[f] for f in d.files) for d in heldout]
    bands = [
        next(i for i, (least, _) in enumerate(code.HELDOUT_BANDS) if size >= least)
        for size in sizes
    ]
    assert [bands.count(b) for b in range(len(code.HELDOUT_BANDS))] == [
        count for _, count in code.HELDOUT_BANDS
    ]
    assert max(sizes) <= code.PART_BYTES[0]
    # big's parts are cut at 704, 352 and 176 KiB in turn; held-out ones are among them
    cuts = np.cumsum([0] + [code.PART_BYTES[k % 3] // (16 << 10) for k in range(9)])
    parts = [tuple(f"big/m{k:03d}.py" for k in range(a, b)) for a, b in zip(cuts, cuts[1:])]
    assert all(d.files in parts for d in heldout if d.name == "big")
    # the same listing elsewhere, and again, splits the same way
    _sized_tree(tmp_path / "copy")
    assert code.list_documents(str(tmp_path / "copy"), True, SourceStats()) == heldout
    assert code.list_documents(str(tmp_path / "lib"), False, SourceStats()) == train


def test_documents_are_deterministic_text_documents(tmp_path):
    root = str(_tree(tmp_path))
    tok = Tokenizer(DEMO_TOKENIZER)
    first, again = (open_documents("code", root, tok) for _ in range(2))
    for i in range(len(first)):
        tokens, loss = first[i]
        assert tokens.dtype == np.int32 and loss.dtype == np.int8
        assert tokens[0] == tok.bos_id and tokens[-1] == tok.eos_id and loss[0] == 0
        assert loss[1:].all()
        np.testing.assert_array_equal(tokens, again[i][0])


def test_kinds_are_parsed_checked_and_listed(tmp_path):
    root = str(_tree(tmp_path))
    assert parse_sources(f"code:{root}@0.7,code-heldout:{root}?min_tokens=64k", "text") == [
        SourceEntry("code", root, 0.7),
        SourceEntry("code-heldout", root, 1.0, LengthRules(min_tokens=65536)),
    ]
    with pytest.raises(ValueError, match="code, code-heldout") as e:
        open_documents("csv", root, Tokenizer(DEMO_TOKENIZER))
    assert all(k in str(e.value) for k in SOURCE_KINDS)
    config = load_config(DEMO_CONFIG)
    config.data.path = f"code:{root}/gamma.py"
    with pytest.raises(ConfigError, match="not a local directory"):
        check_data(config)
    with pytest.raises(DataError, match="holds no package"):
        open_documents("code", f"{root}/lib-dynload", Tokenizer(DEMO_TOKENIZER))


def test_the_standard_library_gives_rows_and_documents_of_64k_tokens(monkeypatch):
    """The real stdlib through the loader; documents cut at 384 KiB keep it fast (a document
    is tokenised whole when drawn) and still hold 64K+ tokens."""
    monkeypatch.setattr(code, "MAX_DOCUMENT_BYTES", 384 << 10)
    config = load_config(DEMO_CONFIG)
    config.data.update(
        path=f"code:{sysconfig.get_paths()['stdlib']}", seq_len=4096, batch_size=2, balance=False
    )
    loader = HostBatches(
        run_config(config), make_mesh(fsdp=2, sp=4), Tokenizer(DEMO_TOKENIZER), prefetch=0
    )
    batch = loader.next_host_batch()
    assert batch["tokens"].shape == (2, 4096) and batch["loss_mask"].sum() > 0
    (source,) = loader.statistics(sample=24)["sources"]
    assert source["kind"] == "code" and source["estimated"]
    assert source["buckets"]["64-256K"]["documents"] > 0
    assert source["buckets"]["<4K"]["documents"] > 0  # the single-file modules


def test_the_standard_library_holds_out_documents_for_every_length_evaluated():
    """SmolLM2's tokenizer on code-heldout:STDLIB: 16 documents over 2K, 8K and 32K tokens,
    8 over 64K and 4 over 128K (evaluation at L reads L + 1), about a fifth of the bytes."""
    stdlib = sysconfig.get_paths()["stdlib"]
    docs = open_documents("code-heldout", stdlib, Tokenizer(real_model_dir()))
    tokens = np.array([len(docs[i][0]) for i in range(len(docs))])
    counts = [int((tokens > n).sum()) for n in (2048, 8192, 32768, 65536, 131072)]
    assert all(c >= need for c, need in zip(counts, (16, 16, 16, 8, 4), strict=True)), counts
    sizes = {False: 0, True: 0}
    for heldout in sizes:
        for d in code.list_documents(stdlib, heldout, SourceStats()):
            sizes[heldout] += sum(os.path.getsize(os.path.join(stdlib, f)) for f in d.files)
    assert sizes[True] < 0.25 * (sizes[True] + sizes[False])
