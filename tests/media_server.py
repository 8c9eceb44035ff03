"""A local HTTP server (127.0.0.1, in a thread) that records every request it receives, for tests of which image
URLs the front end fetches. Reach it as ``127.0.0.1`` or as ``localhost`` to test host allow-lists."""

from __future__ import annotations

import http.server
import io
import threading
import time

from quire.core.testing.multimodal_checkpoints import sample_image as make_image


def png_bytes(width: int = 20, height: int = 12, seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    make_image(width, height, seed).save(buffer, format="PNG")
    return buffer.getvalue()


class RecordingServer:
    """Routes: ``/image.png`` (a PNG), ``/missing`` (404), ``/big`` (declares 8 MiB), ``/endless`` (streams
    without a length until the client stops reading), ``/slow`` (answers after ``slow_seconds``),
    ``/redirect?to=URL`` (302 to URL). ``requests`` lists the paths received, in order."""

    def __init__(self, slow_seconds: float = 3.0):
        self.requests: list[str] = []
        self.image = png_bytes()
        self.slow_seconds = slow_seconds
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the http.server hook's name
                recorder.requests.append(self.path)
                try:
                    recorder.answer(self)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped reading (over its size or time limit)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def answer(self, handler) -> None:
        path = handler.path
        if path == "/image.png":
            self._send(handler, 200, self.image, {"Content-Type": "image/png"})
        elif path == "/big":
            handler.send_response(200)
            handler.send_header("Content-Length", str(8 * 2**20))
            handler.end_headers()
            for _ in range(128):
                handler.wfile.write(b"\0" * 65536)
        elif path == "/endless":
            handler.send_response(200)  # no length: the body ends when the connection closes
            handler.end_headers()
            for _ in range(1024):
                handler.wfile.write(b"\0" * 65536)
        elif path == "/slow":
            time.sleep(self.slow_seconds)
            self._send(handler, 200, self.image, {"Content-Type": "image/png"})
        elif path.startswith("/redirect?to="):
            self._send(handler, 302, b"", {"Location": path[len("/redirect?to="):]})
        else:
            self._send(handler, 404, b"not found", {})

    @staticmethod
    def _send(handler, status: int, body: bytes, headers: dict[str, str]) -> None:
        handler.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(body)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)
