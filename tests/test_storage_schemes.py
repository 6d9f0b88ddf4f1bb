"""The table of object stores (lclm.storage.SCHEMES) answers every choice lclm makes by a
path's scheme: the messages that name the schemes, the client it imports and sets up, the
conditional writes of the workdir lease, whether Orbax keeps checkpoints there and the bound
of tensorstore's retries. No server is started: what is checked is the table against the code
and packages that use it."""

import logging
import os
import tomllib
import types

import pytest
import tensorstore as ts
from fsspec.registry import known_implementations
from orbax.checkpoint._src.serialization import tensorstore_utils
from support import ROOT, write_text

from lclm import storage
from lclm.errors import StartupError
from lclm.workdir import checkpoint

ENTRIES = list(storage.SCHEMES.values())


def test_the_messages_name_the_table_s_schemes():
    assert [s.name for s in ENTRIES] == ["gs", "s3"]
    # the wording of before the table, made from it
    assert storage.client_problem("hdfs://x/y") == (
        "uses hdfs://, which lclm does not read or write; use gs://, s3:// or a local or "
        "mounted path"
    )
    assert checkpoint.path_problem("s3://b/run") == (
        "is on s3://, where Orbax (0.12, lclm's checkpoint writer) cannot keep checkpoints: it "
        "writes arrays to gs:// or a file path; use a gs:// workdir, or mount the bucket (e.g. "
        "mountpoint-s3) and give its path"
    )
    assert storage.listing(lambda s: s.put_if is not None) == "gs:// or s3://"


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda s: s.name)
def test_each_entry_agrees_with_the_code_that_uses_it(entry):
    # fsspec makes the filesystem of the scheme with the client the table imports and sets up
    assert known_implementations[entry.name]["class"].split(".")[0] == entry.client
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["cloud"]
    assert any(r.startswith(f"{entry.package}>=") for r in extra), extra
    assert storage.client_problem(f"{entry.name}://b/x") is None  # installed here
    assert (checkpoint.path_problem(f"{entry.name}://b/run") is None) == entry.checkpoints
    if entry.checkpoints:
        # a run's workdir there is leased with conditional writes (lclm.workdir.object_lock)
        assert entry.put_if is not None
        # a resource tensorstore knows (an unknown one is refused), put into Orbax's contexts
        assert entry.tensorstore_retries is not None
        ts.Context(ts.Context.Spec({entry.tensorstore_retries: {"max_retries": 1}}))
        checkpoint._prepare_orbax()
        for context in (
            tensorstore_utils._BASE_TS_CONTEXT,
            tensorstore_utils._DEFAULT_OCDBT_TS_CONTEXT,
        ):
            assert context[entry.tensorstore_retries] == checkpoint._TENSORSTORE_RETRIES
        for name in (entry.client, *entry.loggers):
            assert any(
                isinstance(f, storage.OneLineStorageErrors) for f in logging.getLogger(name).filters
            ), name
    else:
        assert entry.mount in checkpoint.path_problem(f"{entry.name}://b/run")


def test_gcsfs_is_bounded_where_it_is_set_up():
    from gcsfs.core import GCSFileSystem

    assert storage.client_problem("gs://b/x") is None
    assert GCSFileSystem._request._lclm_tries == storage.GCS_TRIES


def test_a_scheme_is_one_entry(monkeypatch):
    """fsspec's in-memory store added as one entry (no conditional writes, no checkpoints):
    read and written, and named in every message that lists schemes."""
    memory = storage.Scheme(
        "memory",
        client="fsspec",
        package="fsspec",
        version=lambda info: storage.Version("", 0.0),
        put_if=None,
        mount="a FUSE driver",
    )
    monkeypatch.setattr(
        storage, "SCHEMES", types.MappingProxyType({**storage.SCHEMES, "memory": memory})
    )
    path = "memory://lclm-test-bucket/run/config.json"
    write_text(path, "{}\n")
    try:
        assert storage.read_text(path) == "{}\n"
        assert storage.listdir("memory://lclm-test-bucket/run") == ["config.json"]
    finally:
        storage.remove_tree("memory://lclm-test-bucket")
    assert storage.client_problem("hdfs://x/y").endswith(
        "use gs://, s3://, memory:// or a local or mounted path"
    )
    with pytest.raises(StartupError, match=r"conditional writes need gs:// or s3://$"):
        storage.create(path, b"")
    assert "(e.g. a FUSE driver)" in checkpoint.path_problem("memory://b/run")
