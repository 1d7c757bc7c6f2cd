"""LoopbackServer: an ASGI app served by uvicorn on a thread at 127.0.0.1 (tests, the serving bench)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class LoopbackServer:
    """`with LoopbackServer(app) as server: server.url` -- a free port picked by the OS, the server
    up before the block starts, shut down (the app's lifespan end included) when it leaves."""

    def __init__(self, app, *, startup_timeout_s: float = 60.0) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        name="loopback-uvicorn", daemon=True)
        self._startup_timeout_s = startup_timeout_s

    def __enter__(self) -> "LoopbackServer":
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the loopback server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()
