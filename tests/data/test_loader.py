"""The loader: host shares, mixtures, exact resume, layout on the host, global arrays."""

import json

import numpy as np
import pytest
from support import DEMO_CONFIG, DEMO_CORPUS

from lclm.config import load_config
from lclm.config.run_config import run_config
from lclm.data.loader import (
    HostBatches,
    SourceEntry,
    batch_sharding,
    host_block,
    parse_sources,
)
from lclm.data.records import DataError, resolve_files
from lclm.data.stream import DocumentStream, EpochOrders
from lclm.data.synthetic import conversations
from lclm.data.tokenizer import Tokenizer
from lclm.errors import ConfigError
from lclm.ops.layout import from_layout
from lclm.parallel import make_mesh


def _config(tmp_path, layout="striped"):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("\n".join(json.dumps(r) for r in conversations(60, seed=1)) + "\n{oops\n")
    c = load_config(DEMO_CONFIG)
    corpus = DEMO_CORPUS
    c.data.update(path=f"{corpus}@0.7,sharegpt:{chats}@0.3", seq_len=64, batch_size=4)
    c.attention.layout = layout
    return c


def _split(config, mesh, tok, rows, state=None):
    """A loader that builds only `rows` of the batch, as one of several processes would."""
    part = HostBatches(run_config(config), mesh, tok, prefetch=0)
    part.rows = rows
    part.slots = {r: part.slots[r] for r in range(rows.start, rows.stop)}
    if state is not None:
        part.restore(state)
    return part


def _host(batch, layout, sp):
    return {k: from_layout(np.asarray(v), layout, sp) for k, v in batch.items()}


def test_parse_sources():
    assert parse_sources("a.jsonl", "text") == [SourceEntry("text", "a.jsonl", 1.0)]
    assert parse_sources("sharegpt:x.json@0.25, tokenized:/d@2", "text") == [
        SourceEntry("sharegpt", "x.json", 0.25),
        SourceEntry("tokenized", "/d", 2.0),
    ]
    assert parse_sources("hub:user/owt", "text") == [SourceEntry("text", "hub:user/owt", 1.0)]


def test_data_paths_with_commas_at_signs_and_brackets_are_themselves(tmp_path):
    odd = tmp_path / "corpus, v2 @home [1]"
    odd.mkdir()
    (odd / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "b@2.jsonl").write_text('{"text": "y"}\n')
    assert parse_sources(str(odd), "text") == [SourceEntry("text", str(odd), 1.0)]
    assert parse_sources(f"{tmp_path}/b@2.jsonl@0.5", "text") == [
        SourceEntry("text", f"{tmp_path}/b@2.jsonl", 0.5)
    ]
    assert parse_sources(f"{tmp_path}/b@2.jsonl", "text") == [
        SourceEntry("text", f"{tmp_path}/b@2.jsonl", 1.0)
    ]
    assert resolve_files(str(odd)) == [str(odd / "a.jsonl")]
    assert resolve_files(str(odd / "a.jsonl")) == [str(odd / "a.jsonl")]
    with pytest.raises(ConfigError, match="the weight after '@' must be"):
        parse_sources("a.jsonl@0", "text")


def test_two_hosts_read_disjoint_shares_that_cover_the_data():
    docs = list(range(101))
    orders = EpochOrders(len(docs), seed=5)
    seen, epoch2 = [], []
    for shard in (0, 1):
        stream = DocumentStream(docs, orders, shard=shard, num_shards=2)
        n = len(range(shard, 101, 2))
        seen.append([next(stream) for _ in range(n)])
        epoch2.append([next(stream) for _ in range(n)])
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == docs
    # every epoch is a new shuffle, shared the same way
    assert sorted(epoch2[0] + epoch2[1]) == docs and epoch2 != seen


def test_rows_do_not_depend_on_how_processes_split_the_batch(tmp_path):
    """Two simulated hosts (rows 0-1 and 2-3 of a batch of 4) build exactly the rows that one
    host building all 4 rows builds, reading disjoint documents."""
    config = _config(tmp_path)
    config.data.balance = False  # balancing reorders only each process's own rows
    tok = Tokenizer(config.data.tokenizer)
    mesh = make_mesh(fsdp=2, sp=4)
    whole = HostBatches(run_config(config), mesh, tok, prefetch=0)
    want = [whole.next_host_batch() for _ in range(3)]
    halves = []
    for rows in (slice(0, 2), slice(2, 4)):  # what host_block gives each of two processes
        part = _split(config, mesh, tok, rows)
        halves.append([part.next_host_batch() for _ in range(3)])
    for i in range(3):
        for k in want[i]:
            np.testing.assert_array_equal(
                np.concatenate([halves[0][i][k], halves[1][i][k]]), want[i][k]
            )


def test_single_process_block_is_the_whole_batch():
    mesh = make_mesh(fsdp=2, sp=4)
    assert host_block(batch_sharding(mesh), (8, 64)) == (slice(0, 8), slice(0, 64))


@pytest.mark.parametrize("layout", ["striped", "contiguous", "zigzag"])
def test_resume_yields_exactly_the_following_batches(tmp_path, layout):
    config = _config(tmp_path, layout)
    tok = Tokenizer(config.data.tokenizer)
    mesh = make_mesh(fsdp=2, sp=4)
    loader = HostBatches(run_config(config), mesh, tok)
    batches = [_host(next(loader), layout, 4) for _ in range(6)]
    loader.close()
    first = HostBatches(run_config(config), mesh, tok)
    for _ in range(3):
        next(first)
    state = json.loads(json.dumps(first.state()))  # it must survive JSON
    first.close()
    resumed = HostBatches(run_config(config), mesh, tok, state=state)
    for want in batches[3:]:
        got = _host(next(resumed), layout, 4)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])
    resumed.close()
    assert loader.stats.skipped >= 1  # the broken chat line was counted, not fatal


def test_batches_are_global_arrays_in_layout_order_with_both_sources(tmp_path):
    config = _config(tmp_path)
    tok = Tokenizer(config.data.tokenizer)
    mesh = make_mesh(fsdp=2, sp=4)
    loader = HostBatches(run_config(config), mesh, tok)
    batch = next(loader)
    assert batch["tokens"].shape == (4, 64)
    assert batch["tokens"].sharding.is_equivalent_to(batch_sharding(mesh), 2)
    seen_chat = False
    for _ in range(10):
        host = _host(next(loader), "striped", 4)
        np.testing.assert_array_equal(host["tokens"][:, 1:], host["targets"][:, :-1])
        # chat rows have untrained (prompt) tokens inside a document, text rows do not
        inside = host["segment_ids"][:, 1:] == host["segment_ids"][:, :-1]
        seen_chat |= bool(((host["loss_mask"][:, :-1] == 0) & inside).any())
    loader.close()
    assert seen_chat


def test_state_saved_by_two_processes_resumes_on_one(tmp_path):
    config = _config(tmp_path)
    config.data.balance = False  # balancing reorders only each process's own rows
    tok = Tokenizer(config.data.tokenizer)
    mesh = make_mesh(fsdp=2, sp=4)
    whole = HostBatches(run_config(config), mesh, tok, prefetch=0)
    want = [whole.next_host_batch() for _ in range(7)][4:]
    states = []
    for rows in (slice(0, 2), slice(2, 4)):
        part = _split(config, mesh, tok, rows)
        for _ in range(4):
            part.next_host_batch()
        states.append(json.loads(json.dumps(part._snapshot())))
    resumed = HostBatches(run_config(config), mesh, tok, state=states, prefetch=0)
    halves = [_split(config, mesh, tok, rows, states) for rows in (slice(0, 1), slice(1, 4))]
    for w in want:
        got = resumed.next_host_batch()
        split = [h.next_host_batch() for h in halves]
        for k in w:
            np.testing.assert_array_equal(got[k], w[k])
            np.testing.assert_array_equal(np.concatenate([s[k] for s in split]), w[k])


def test_source_smaller_than_the_batch_fails_at_start(tmp_path):
    config = _config(tmp_path)
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3)))
    config.data.path = f"{small},{config.data.path}"
    with pytest.raises(DataError, match=f"{small} has 3 usable records but needs at least 4"):
        HostBatches(run_config(config), make_mesh(fsdp=2, sp=4), Tokenizer(config.data.tokenizer))


def test_old_data_state_with_pending_tokens_fails_in_one_line(tmp_path):
    config = _config(tmp_path)
    tok = Tokenizer(config.data.tokenizer)
    mesh = make_mesh(fsdp=2, sp=4)
    state = HostBatches(run_config(config), mesh, tok, prefetch=0)._snapshot()
    for slot in state["slots"].values():  # what lclm saved before states were positions
        slot["packer"] = dict(tokens=[1, 5], loss=[0, 1], doc=[0, 0], pos=[0, 1], next_doc=1)
    with pytest.raises(DataError, match="saved by an older lclm") as e:
        HostBatches(run_config(config), mesh, tok, state=state, prefetch=0)
    assert "\n" not in str(e.value)
