"""Prefill server, direct mode: requests that decoders submit to this server's registry
go to its own HTTP API (/generate), the path a router's request takes, so the scheduler,
D16 and the KV streaming treat them exactly like router requests.

Runs in the HTTP front-end process beside the registry: the registry thread calls
`submit` (never blocks), one asyncio thread posts the requests to 127.0.0.1.

A request this server took and then could not serve (its API answered an error, or the
post failed) is remembered for `REFUSAL_MEMORY_S`: the submitting decoder probes the
registry every second, reads its refusals in the answer (`refused_for`), and fails the
request with the reason - its client and its pages do not wait for a transfer timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import deque
from typing import Any

from sgl_pd.core.wire import (
    MAX_REFUSED_PER_REPLY,
    AbortReason,
    ErrorCode,
    RefusedSubmission,
    SubmitPrefill,
    decoder_aborted,
)
from sgl_pd.log_limits import LogLimiter

logger = logging.getLogger("sgl_pd.direct")

MAX_IN_FLIGHT = 1024  # submitted requests not yet answered by the local server
POST_TIMEOUT_S = 3600.0  # a prefill's answer comes once its KV is sent: long prompts, queues
# seconds a refusal stays in probe answers: decoders probe every second, so several times
REFUSAL_MEMORY_S = 30.0
MAX_REFUSALS = 4096  # remembered at once, whoever submitted them
# what the API answers for a request its decoder aborted because the client went away
_CLIENT_ABORT = decoder_aborted(AbortReason.CLIENT)


class LocalSubmitter:
    """Posts submitted requests to this server's /generate; refuses what cannot be served."""

    def __init__(self, base_url: str, *, api_key: str | None = None) -> None:
        self._url = base_url.rstrip("/") + "/generate"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._in_flight = 0  # under _lock
        # (when, submitter, refusal), oldest first; under _lock
        self._refused: deque[tuple[float, str, RefusedSubmission]] = deque(maxlen=MAX_REFUSALS)
        self._lock = threading.Lock()
        self._log = LogLimiter(logger)
        self._session: Any = None  # one aiohttp session, made and used on the loop thread
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="sgl-pd-direct-submit", daemon=True
        )
        self._thread.start()

    def submit(self, msg: SubmitPrefill) -> tuple[ErrorCode, str] | None:
        """Queues the request; None when queued, else (code, why)."""
        try:
            body = json.loads(msg.request)
        except ValueError as e:
            return ErrorCode.BAD_REQUEST, f"request {msg.request_id} is not JSON: {e}"
        if not isinstance(body, dict) or body.get("bootstrap_room") != msg.request_id:
            return ErrorCode.BAD_REQUEST, "a submitted request is a JSON object of its own room"
        with self._lock:
            if self._in_flight >= MAX_IN_FLIGHT:
                return ErrorCode.OVERLOADED, f"{self._in_flight} submitted requests in flight"
            self._in_flight += 1
        asyncio.run_coroutine_threadsafe(self._post(msg.request_id, msg.sender, body), self._loop)
        return None

    async def _post(self, room: int, sender: str, body: dict[str, Any]) -> None:
        import aiohttp

        try:
            if self._session is None:
                # as many connections as requests may be in flight: none waits for another
                self._session = aiohttp.ClientSession(
                    timeout=aiohttp.ClientTimeout(total=POST_TIMEOUT_S),
                    connector=aiohttp.TCPConnector(limit=MAX_IN_FLIGHT),
                )
            async with self._session.post(self._url, json=body, headers=self._headers) as resp:
                if resp.status >= 400:
                    text = (await resp.text())[:300]
                    self._refuse(room, sender, f"it answered {resp.status}: {text}")
                else:
                    await resp.read()
        except Exception as e:
            self._refuse(room, sender, f"it could not take the request: {e}")
        finally:
            with self._lock:
                self._in_flight -= 1

    def _refuse(self, room: int, sender: str, why: str) -> None:
        if _CLIENT_ABORT in why:  # its client went away: the decoder knows, nothing is wrong
            logger.debug("direct request %d from %s ended: %s", room, sender, why)
        else:
            self._log.warning("refused", "direct request %d from %s: %s", room, sender, why)
        with self._lock:
            self._refused.append(
                (time.monotonic(), sender, RefusedSubmission(request_id=room, message=why[:1000]))
            )

    def refused_for(self, sender: str) -> tuple[RefusedSubmission, ...]:
        """The recent refusals of requests `sender` submitted, newest first (registry
        thread: answers to the submitter's probes)."""
        horizon = time.monotonic() - REFUSAL_MEMORY_S
        with self._lock:
            while self._refused and self._refused[0][0] < horizon:
                self._refused.popleft()
            mine = [r for _, who, r in reversed(self._refused) if who == sender]
        return tuple(mine[:MAX_REFUSED_PER_REPLY])

    def close(self) -> None:
        if self._session is not None:
            closing = asyncio.run_coroutine_threadsafe(self._session.close(), self._loop)
            with contextlib.suppress(TimeoutError):
                closing.result(timeout=2.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2.0)
