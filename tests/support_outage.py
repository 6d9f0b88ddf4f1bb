"""A bucket that can be made unreachable: a TCP proxy in front of the local GCS server
(tests/storage_servers.py) that a test switches off and on. While it is down, new
connections are refused and open ones are cut, as when a machine loses its route to the
storage service; while it is silent, connections are accepted and what is sent is read, but
nothing is ever answered, as behind a stalled proxy or a black-holed route. The server
itself, and what it holds, is untouched."""

from __future__ import annotations

import socket
import threading


class Outage:
    """A proxy on 127.0.0.1 to the GCS server at `target_url`; `env`: the server's variables
    pointed at the proxy (for runs started as processes). `down()`, `silent()` and `up()`
    switch it."""

    def __init__(self, server_env: dict[str, str], target_url: str):
        host, port = target_url.rsplit("//", 1)[1].rsplit(":", 1)
        self.target = (host, int(port))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {k: (self.url if v == target_url else v) for k, v in server_env.items()}
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._silent = threading.Event()
        self.up()

    def up(self) -> None:
        """Answered again (connections made while it was silent are cut)."""
        if self._silent.is_set():  # the connections made meanwhile were never answered
            self._silent.clear()
            self._cut_open()
        if self._listener is not None:
            return
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(128)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def down(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        try:
            listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept
        except OSError:
            pass
        listener.close()
        self._cut_open()

    def silent(self) -> None:
        """From now on nothing reaches the server and nothing comes back, on open connections
        and new ones alike, and nothing is closed: a client waits for as long as it waits."""
        self._silent.set()

    def _cut_open(self) -> None:
        with self._lock:
            for s in self._open:
                _close(s)
            self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by `down`
                return
            if self._silent.is_set():
                with self._lock:
                    self._open.append(client)
                threading.Thread(target=_swallow, args=(client,), daemon=True).start()
                continue
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    _close(client)
                    _close(server)
                    continue
                self._open += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=_pipe, args=(a, b, self._silent), daemon=True).start()


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def _swallow(s: socket.socket) -> None:
    """Read what `s` receives, and drop it, until it is closed."""
    try:
        while s.recv(65536):
            pass
    except OSError:
        pass


def _pipe(a: socket.socket, b: socket.socket, silent: threading.Event) -> None:
    """Copy what `a` receives to `b` until either end closes (dropped while `silent`); then
    both are shut."""
    try:
        while data := a.recv(65536):
            if not silent.is_set():
                b.sendall(data)
    except OSError:
        pass
    finally:
        for s in (a, b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
