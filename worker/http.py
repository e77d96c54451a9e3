"""The worker's HTTP endpoints: /metrics, /healthz, /readyz.

Served from a small WSGI server on its own thread, so a scrape never waits on
the event loop or the engine.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args):
        pass  # scrapes every few seconds would flood the log


class _ThreadingServer(WSGIServer):
    daemon_threads = True


class HealthServer:
    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 health: Callable[[], tuple[bool, dict]], ready: Callable[[], tuple[bool, dict]]) -> None:
        metrics_app = make_wsgi_app(registry)

        def app(environ, start_response):
            path = environ.get("PATH_INFO", "/")
            if path == "/metrics":
                return metrics_app(environ, start_response)
            if path in ("/healthz", "/readyz"):
                ok, detail = (health if path == "/healthz" else ready)()
                body = json.dumps({"ok": ok, **detail}).encode()
                start_response("200 OK" if ok else "503 Service Unavailable",
                               [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
                return [body]
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found: try /metrics, /healthz or /readyz\n"]

        self._server = make_server(host, port, app, server_class=_ThreadingServer, handler_class=_QuietHandler)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
