"""An OpenAI-compatible judge for the tests, on loopback in a thread of the test process: every chat completion it
is asked for answers with one scripted reply, and what it was asked is kept."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Judge:
    url: str
    asked: list[str] = field(default_factory=list)


@contextmanager
def scripted_judge(reply: str):
    """Yields the judge (its /v1 URL and the user turns it was sent) while it serves."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            asked.append(body["messages"][-1]["content"])
            out = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}],
                              "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield Judge(f"http://127.0.0.1:{server.server_address[1]}/v1", asked)
    finally:
        server.shutdown()
        server.server_close()
