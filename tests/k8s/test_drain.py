"""The preStop drain: busy while any rank holds a transfer or SGLang holds a request,
done when the server is idle twice in a row or no longer answers."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from sgl_pd import drain

PAGE = """# HELP sgl_pd_rooms x
sgl_pd_rooms{role="prefill"} %d
sgl_pd_writes_in_flight{role="prefill"} 0.0
sglang:num_running_reqs{model_name="m",engine_type="unified"} %d
sglang:num_queue_reqs{model_name="m"} 0.0
sgl_pd_rooms_created 1.7e9
"""


def test_busy_sums_held_requests_and_ignores_other_series() -> None:
    assert drain.busy(PAGE % (0, 0)) == 0
    assert drain.busy(PAGE % (2, 1)) == 3


def test_drain_waits_until_idle_and_a_gone_server_counts_as_drained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pages = [PAGE % (1, 0), PAGE % (0, 0), PAGE % (0, 0)]
    served: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (pages.pop(0) if pages else PAGE % (0, 0)).encode()
            served.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(drain, "POLL_INTERVAL_S", 0.01)
    try:
        assert drain.drain(f"http://127.0.0.1:{server.server_port}", timeout_s=5)
        assert served == ["/metrics"] * 3
    finally:
        server.shutdown()
        server.server_close()
    assert drain.drain(f"http://127.0.0.1:{server.server_port}", timeout_s=1)  # gone
