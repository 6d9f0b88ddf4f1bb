"""Soak: the loader over skewed document lengths, two sources and many readers, for thousands
of batches; and the data state stays small and exact with very long documents."""

import json

import numpy as np
from support import DEMO_CONFIG, DEMO_CORPUS

from lclm.config import load_config
from lclm.config.run_config import run_config
from lclm.data.loader import HostBatches
from lclm.data.stream import DocumentStream, EpochOrders, epoch_order
from lclm.data.synthetic import conversations
from lclm.data.tokenizer import Tokenizer
from lclm.ops.layout import from_layout
from lclm.parallel import make_mesh

CORPUS = DEMO_CORPUS


def _corpus_texts(n):
    with open(CORPUS) as f:
        return [json.loads(line)["text"] for _, line in zip(range(n), f)]


def _config(path, seq_len, batch_size):
    c = load_config(DEMO_CONFIG)
    c.data.update(path=path, seq_len=seq_len, batch_size=batch_size)
    return c


def _check_rows(batch, seq_len):
    """Every row is full and in original order a continuous token stream."""
    host = {k: from_layout(v, "striped", 4) for k, v in batch.items()}
    assert all(v.shape == (len(host["tokens"]), seq_len) for v in host.values())
    np.testing.assert_array_equal(host["tokens"][:, 1:], host["targets"][:, :-1])
    seg = host["segment_ids"]
    assert (seg[:, 0] == 1).all() and (np.diff(seg, axis=1) >= 0).all()


def test_readers_any_number_of_epochs_apart_share_one_source():
    """A reader far ahead does not take away the epoch order that a slow one still reads."""
    orders = EpochOrders(10, seed=3)
    fast, slow = (
        DocumentStream(list(range(10)), orders, 0, 2),
        DocumentStream(list(range(10)), orders, 1, 2),
    )
    for _ in range(5 * 7):  # 7 epochs of 5 documents
        next(fast)
    got = [next(slow) for _ in range(10)]
    assert got == [int(d) for e in (0, 1) for d in epoch_order(10, 3, e)[1::2]]
    assert len(orders._cache) <= orders.keep


def test_soak_skewed_lengths_two_sources_many_readers(tmp_path):
    """64 readers over documents of 1 to ~700 characters (which drives readers epochs
    apart) and conversations, 2000 batches: no crash, full rows, malformed lines counted
    once, a small state, and a resume from mid-way continues identically."""
    texts = _corpus_texts(100)
    texts = [t if i % 3 == 0 else t[: 1 + i % 7] for i, t in enumerate(texts)]  # 2/3 tiny
    lines = [json.dumps({"text": t}) for t in texts] + ["{broken", '{"text": ""}']
    (tmp_path / "skew.jsonl").write_text("\n".join(lines) + "\n")
    chats = [json.dumps(r) for r in conversations(80, seed=2)] + ['{"conversations": 1}']
    (tmp_path / "chats.jsonl").write_text("\n".join(chats) + "\n")
    seq_len, batch_size = 32, 64
    config = _config(
        f"{tmp_path}/skew.jsonl@0.8,sharegpt:{tmp_path}/chats.jsonl@0.2", seq_len, batch_size
    )
    tok, mesh = Tokenizer(config.data.tokenizer), make_mesh(fsdp=2, sp=4)
    loader = HostBatches(run_config(config), mesh, tok, prefetch=0)
    mid, spread = None, 0
    for i in range(2000):
        batch = loader.next_host_batch()
        if i % 97 == 0:
            _check_rows(batch, seq_len)
            epochs = [s.mixture.streams[0].epoch for s in loader.slots.values()]
            spread = max(spread, max(epochs) - min(epochs))
        if i == 1000:
            mid = json.loads(json.dumps(loader._snapshot()))
            after_mid = [loader.next_host_batch() for _ in range(20)]
    assert spread >= 10  # readers were many epochs apart
    assert loader.stats.skipped == 3  # two text lines, one conversation: once each
    assert len(json.dumps(mid)) < 300 * batch_size
    resumed = HostBatches(run_config(config), mesh, tok, state=mid, prefetch=0)
    for want in after_mid:
        got = resumed.next_host_batch()
        for k in want:
            np.testing.assert_array_equal(got[k], want[k])


def test_state_stays_small_with_very_long_documents(tmp_path):
    """Documents of ~37k tokens pending in every slot: the JSON state is a few hundred bytes
    per slot (it held every pending token before) and resuming from it is exact."""
    texts = _corpus_texts(160)
    long_docs = [" ".join(texts[i::8]) * 12 for i in range(8)]  # ~100 KB each
    (tmp_path / "long.jsonl").write_text(
        "\n".join(json.dumps({"text": t}) for t in long_docs) + "\n"
    )
    config = _config(str(tmp_path / "long.jsonl"), 64, 4)
    tok, mesh = Tokenizer(config.data.tokenizer), make_mesh(fsdp=2, sp=4)
    loader = HostBatches(run_config(config), mesh, tok, prefetch=0)
    for _ in range(5):
        loader.next_host_batch()
    state = json.loads(json.dumps(loader._snapshot()))
    assert len(json.dumps(state)) < 300 * len(state["slots"])
    assert all(
        s["packer"]["documents"] == 1 and s["packer"]["consumed"] > 0
        for s in state["slots"].values()
    )  # a long document is pending everywhere
    want = [loader.next_host_batch() for _ in range(3)]
    resumed = HostBatches(run_config(config), mesh, tok, state=state, prefetch=0)
    for w in want:
        got = resumed.next_host_batch()
        for k in w:
            np.testing.assert_array_equal(got[k], w[k])
