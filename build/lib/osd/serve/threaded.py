"""An app served by uvicorn on a thread, on a free loopback port: for benchmarks that are their own HTTP front
(bench/scale.py) and for the tests' live servers."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager


@contextmanager
def serve_in_thread(app, ready_timeout: float = 20.0, graceful_seconds: int = 10, log_level: str = "warning"):
    """Run `app` under uvicorn on a thread (lifespan included); yield its base URL; shut down gracefully."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on",
                                           timeout_graceful_shutdown=graceful_seconds))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + ready_timeout
    while not server.started:  # a readiness poll, not a sleep that correctness depends on
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
