"""A decoder refuses a prefiller that may still write after the decoder would free an
ended request's pages (their hang timeouts differ): per request, with the reason, before
any page is asked for."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import msgspec

from sgl_pd.backend.decode.receiver import SglPdKVReceiver
from sgl_pd.backend.metrics import TransferMetrics
from sgl_pd.core.bounds import TimingBounds
from sgl_pd.messenger.peers import PrefillTable

from .pd_fakes import LAYOUT, Rig


def _receiver(prefill_writes_end_s: float, decoder_holds_s: float) -> tuple[SglPdKVReceiver, Any]:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    shard = msgspec.structs.replace(
        rig.prefill_registration, writes_end_within_ms=round(prefill_writes_end_s * 1000)
    )
    asked: list[int] = []
    aborted: list[int] = []
    mgr = SimpleNamespace(
        bounds=TimingBounds(20.0, 120.0, deferred_release_s=decoder_holds_s),
        layout=LAYOUT,
        registration=d.registration,
        decode=SimpleNamespace(request=lambda room, *a, **k: asked.append(room)),
        metrics=TransferMetrics(False, "decode"),
        abort_unrequested=lambda addr, table, room, *a: aborted.append(room),
        expected_prompt=lambda room: None,
    )
    receiver = SglPdKVReceiver(mgr, "prefill:8998", 17)
    receiver._table = PrefillTable("prefill:8998", (shard,))
    return receiver, SimpleNamespace(asked=asked, aborted=aborted, rig=rig)


def test_a_prefiller_that_writes_longer_than_the_decoder_holds_pages_is_refused() -> None:
    receiver, seen = _receiver(prefill_writes_end_s=234.0, decoder_holds_s=120.0)
    receiver.send_metadata([1, 2, 3], aux_index=1)
    assert seen.asked == [] and seen.aborted == [17]
    assert "--pd-hang-timeout" in (receiver._error or "")
    seen.rig.prefill.writers.close()


def test_matching_settings_ask_for_pages() -> None:
    receiver, seen = _receiver(prefill_writes_end_s=54.0, decoder_holds_s=120.0)
    receiver.send_metadata([1, 2, 3], aux_index=1)
    assert seen.asked == [17] and receiver._error is None
    seen.rig.prefill.writers.close()


def test_a_client_abort_is_no_warning_and_a_failure_is(caplog: Any) -> None:
    """A client that went away ends its request in the ordinary way: logged at info, so
    that a healthy decoder's warnings mean something; any other failure warns."""
    import logging

    receiver, seen = _receiver(prefill_writes_end_s=54.0, decoder_holds_s=120.0)
    with caplog.at_level(logging.INFO, logger="sgl_pd.receiver"):
        receiver.abort()
        other, more = _receiver(prefill_writes_end_s=54.0, decoder_holds_s=120.0)
        other.fail_recompute("the prefill server refused it")
    levels = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert levels == [
        (logging.INFO, "request 17: aborted by the decode scheduler"),
        (logging.WARNING, "request 17: the prefill server refused it"),
    ]
    assert seen.aborted == [17]  # the prefill server still hears of it
    seen.rig.prefill.writers.close()
    more.rig.prefill.writers.close()
