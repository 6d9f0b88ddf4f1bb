"""lclm.storage against local GCS and S3 servers: plain and conditional writes, listing,
ranged reads, and the one-line error of a scheme without its client."""

import pytest
from support import write_text

from lclm import storage
from lclm.errors import StartupError


@pytest.fixture(params=["gcs", "s3"])
def bucket(request):
    return request.getfixturevalue(request.param).bucket()


def test_write_read_list_remove(bucket):
    path = storage.join(bucket, "run", "config.json")
    assert not storage.exists(path) and storage.listdir(storage.join(bucket, "run")) == []
    write_text(path, "{}\n")
    storage.write_bytes(storage.join(bucket, "run", "checkpoints", "5", "x"), b"abc")
    assert storage.read_text(path) == "{}\n"
    assert storage.listdir(storage.join(bucket, "run")) == ["checkpoints", "config.json"]
    assert storage.isdir(storage.join(bucket, "run", "checkpoints"))
    assert storage.isfile(path) and not storage.isfile(storage.join(bucket, "run", "checkpoints"))
    storage.remove(path)
    storage.remove(path)  # already gone: nothing
    assert storage.listdir(storage.join(bucket, "run")) == ["checkpoints"]
    storage.remove_tree(storage.join(bucket, "run"))
    assert not storage.isdir(storage.join(bucket, "run"))


def test_ranged_reads(bucket):
    path = storage.join(bucket, "tokens.bin")
    storage.write_bytes(path, bytes(range(256)) * 1000)
    with storage.open_file(path) as f:
        f.seek(256 * 500 + 10)
        assert f.read(3) == bytes([10, 11, 12])


def test_conditional_writes(bucket):
    path = storage.join(bucket, "run", "lock")
    first = storage.create(path, b"a")
    assert first is not None
    assert storage.create(path, b"b") is None  # exists: refused
    second = storage.replace_if(path, b"c", first)
    assert second is not None and second != first
    assert storage.replace_if(path, b"d", first) is None  # stale version: refused
    data, version = storage.stat(path)
    assert data == b"c" and version == second
    assert storage.stat(storage.join(bucket, "run", "nothing")) is None


def test_unknown_scheme_and_missing_client(monkeypatch):
    with pytest.raises(StartupError, match="does not read or write"):
        storage.filesystem("hdfs://x/y")
    import builtins

    real = builtins.__import__

    def no_gcsfs(name, *args, **kwargs):
        if name == "gcsfs":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gcsfs)
    with pytest.raises(StartupError, match=r"needs the gcsfs package: pip install 'lclm\[cloud\]'"):
        storage.filesystem("gs://b/x")


def test_a_save_that_timed_out_on_the_store_says_so_in_the_stores_words():
    """A request the store left unanswered reaches a save's stop line in the words of whichever
    client waited: Orbax's "ChainedFuture completed 0/1 futures but timed out after 9.98
    seconds" (CI, stop 79), aiohttp's "Timeout on reading data from socket" (here, the next
    run). Each is told as the store's timeout."""
    import concurrent.futures

    from orbax.checkpoint._src.futures.future import ChainedFuture

    from lclm.storage import REQUEST_SECONDS
    from lclm.workdir.checkpoint import first_line

    unanswered = concurrent.futures.Future()
    unanswered.set_exception(TimeoutError(f"no answer from the store within {REQUEST_SECONDS} s"))
    with pytest.raises(TimeoutError) as orbax_error:
        ChainedFuture([unanswered], cb=lambda: None).result(timeout=60)
    assert "ChainedFuture" in str(orbax_error.value)
    assert first_line(orbax_error.value) == f"no answer from the store within {REQUEST_SECONDS} s"
    assert first_line(TimeoutError()) == f"no answer from the store within {REQUEST_SECONDS} s"
    import aiohttp  # gcsfs's client: its own words for a socket that stays silent

    silent = aiohttp.ServerTimeoutError("Timeout on reading data from socket")
    assert first_line(silent) == f"no answer from the store within {REQUEST_SECONDS} s"
    assert first_line(ValueError("a\nb")) == "a"
