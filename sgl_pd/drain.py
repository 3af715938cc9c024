"""Waits until a server holds no KV transfer any more: a pod's preStop hook, so that
Kubernetes stops it only once its requests' transfers ended (or the wait gave up).

    python -m sgl_pd.drain --url http://10.1.2.3:30000 --timeout 150

Reads the server's /metrics (``--enable-metrics``): drained once ``sgl_pd_rooms`` (requests
holding transfer state on any rank, draining ones included) and SGLang's running and
queued requests are all zero, twice in a row. Exits 0 then, 1 at the timeout; a server
that no longer answers counts as drained (nothing of it can write any more).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import urllib.error
import urllib.request

# the series whose sum must be zero: ours, and SGLang's requests a scheduler still holds
BUSY_SERIES = (
    "sgl_pd_rooms",
    "sgl_pd_writes_in_flight",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
)
POLL_INTERVAL_S = 1.0


def busy(metrics_text: str) -> float:
    """Requests and transfers a /metrics page says are still held (summed over labels)."""
    total = 0.0
    for name in BUSY_SERIES:
        pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+-]+|NaN)$"
        for value in re.findall(pattern, metrics_text, re.M):
            if value != "NaN":
                total += float(value)
    return total


def drain(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    idle_polls = 0
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
                text = response.read().decode()
        except (urllib.error.URLError, OSError):
            return True  # the server is gone: nothing of it writes any more
        idle_polls = idle_polls + 1 if busy(text) == 0 else 0
        if idle_polls >= 2:  # one idle page may fall between a request's two steps
            return True
        time.sleep(POLL_INTERVAL_S)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the server's HTTP address")
    parser.add_argument("--timeout", type=float, default=150.0, help="seconds to wait at most")
    args = parser.parse_args(argv)
    if drain(args.url.rstrip("/"), args.timeout):
        return 0
    print(f"sgl_pd.drain: {args.url} still busy after {args.timeout:g} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
