"""Direct mode, finding "a prefill-side refusal is only logged": a request a prefill
server took and then refused (its HTTP API answered 400) fails at the submitting
decoder's next probe with the server's reason, and the decoder aborts it - over a real
HTTP server, the real registry and the decoder's real dispatcher."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from messenger_helpers import HOST, register_msg

from sgl_pd.backend.decode.direct import DirectDispatcher, NoPrefillServer, _unless_refused
from sgl_pd.backend.prefill.direct import LocalSubmitter
from sgl_pd.core.wire import AbortReason, SubmitPrefill, decoder_aborted
from sgl_pd.messenger import RegistryClient, RegistryServer

REASON = "The input (9000 tokens) is longer than the model's context length (8192 tokens)."


class _Refusing(BaseHTTPRequestHandler):
    """SGLang's /generate refusing a request it validated."""

    status = 400
    reason = REASON

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = json.dumps({"error": {"message": self.reason}}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _ClientAborted(_Refusing):
    """SGLang's /generate answering for a request whose decoder aborted it mid-transfer,
    as its client went away."""

    status = 500
    reason = f"Prefill transfer failed: {decoder_aborted(AbortReason.CLIENT)}"


@pytest.fixture
def refusing_api() -> Iterator[str]:
    yield from _serve(_Refusing)


@pytest.fixture
def client_aborted_api() -> Iterator[str]:
    yield from _serve(_ClientAborted)


def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer((HOST, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://{HOST}:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(5)


def _submission(room: int, sender: str) -> SubmitPrefill:
    body = json.dumps({"input_ids": [1, 2, 3], "bootstrap_room": room}).encode()
    return SubmitPrefill(request_id=room, sender=sender, request=body)


def test_a_refusal_after_the_submission_fails_the_request_at_the_next_probe(
    refusing_api: str,
) -> None:
    submitter = LocalSubmitter(refusing_api)
    with (
        RegistryServer(
            HOST, 0, submit=submitter.submit, refusals=submitter.refused_for
        ) as registry,
        RegistryClient("prefill rank") as rank,
    ):
        rank.register(registry.address, register_msg(0, 1, instance=1))
        dispatcher = DirectDispatcher(
            registry.address, auth=None, name="decoder 1", probe_interval_s=0.1
        )
        aborted = asyncio.Event()

        async def decode_side() -> AsyncIterator[str]:
            """The decoder's request: waits for KV until it is aborted."""
            await aborted.wait()
            yield "abort"

        async def serve() -> None:
            refused = dispatcher.watch(7)
            assert (
                await dispatcher.submit(registry.address, _submission(7, dispatcher.name)) is None
            )
            with pytest.raises(NoPrefillServer) as raised:
                async for _ in _unless_refused(decode_side(), refused, aborted.set):
                    pass
            assert aborted.is_set()
            assert registry.address in str(raised.value) and "400" in str(raised.value)
            assert "context length" in str(raised.value)
            dispatcher.unwatch(7)

        try:
            asyncio.run(asyncio.wait_for(serve(), 10))
            # another decoder's probes do not see this decoder's refusals
            assert submitter.refused_for("decoder 2") == ()
            assert [r.request_id for r in submitter.refused_for("decoder 1")] == [7]
        finally:
            dispatcher.close()
            submitter.close()


def _refusals_of(submitter: LocalSubmitter, sender: str, count: int) -> list[int]:
    deadline = time.monotonic() + 10
    while len(rooms := [r.request_id for r in submitter.refused_for(sender)]) < count:
        assert time.monotonic() < deadline, "the submitter never recorded the answer"
        time.sleep(0.01)
    return rooms


@pytest.mark.parametrize(
    ("api", "level"),
    [
        ("refusing_api", logging.WARNING),
        # the decoder aborted it itself: a warning on the prefill server would be a false alarm
        ("client_aborted_api", logging.DEBUG),
    ],
)
def test_a_refusal_is_a_warning_unless_its_client_went_away(
    api: str, level: int, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    submitter = LocalSubmitter(request.getfixturevalue(api))
    try:
        with caplog.at_level(logging.DEBUG, logger="sgl_pd.direct"):
            assert submitter.submit(_submission(3, "decoder 1")) is None
            assert _refusals_of(submitter, "decoder 1", 1) == [3]
    finally:
        submitter.close()
    assert [r.levelno for r in caplog.records] == [level]


def test_outputs_pass_through_until_the_request_ends() -> None:
    async def outputs() -> AsyncIterator[int]:
        for i in range(3):
            await asyncio.sleep(0)
            yield i

    async def serve() -> list[int]:
        refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        return [out async for out in _unless_refused(outputs(), refused, lambda: None)]

    assert asyncio.run(serve()) == [0, 1, 2]


def test_submissions_in_flight_are_exported_and_return_to_zero() -> None:
    from prometheus_client import CollectorRegistry

    from sgl_pd.backend.metrics import TableEntries

    registry = CollectorRegistry()
    labels = {"role": "decode", "table": "direct_submissions"}
    # no prefill server answers at this address: the probe rounds run all the same
    dispatcher = DirectDispatcher(
        "127.0.0.1:9",
        auth=None,
        probe_interval_s=0.05,
        tables=TableEntries(True, "decode", registry),
    )

    def exported(value: float) -> None:
        deadline = time.monotonic() + 30
        while registry.get_sample_value("sgl_pd_table_entries", labels) != value:
            assert time.monotonic() < deadline, f"direct_submissions never read {value}"
            time.sleep(0.02)

    async def served() -> None:
        dispatcher.watch(11)
        await asyncio.to_thread(exported, 1)
        dispatcher.unwatch(11)
        await asyncio.to_thread(exported, 0)

    try:
        asyncio.run(served())
    finally:
        dispatcher.close()
