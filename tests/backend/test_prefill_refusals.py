"""A request the prefill server refuses at its door reaches its decoder at once: the
decode ranks that asked, and those that ask later, hear the prefill server's reason as
a bad request instead of waiting their transfer timeout for KV no prefill will write."""

from __future__ import annotations

from types import SimpleNamespace

from sgl_pd.backend import refusals
from sgl_pd.config import BACKEND_NAME
from sgl_pd.core.states import DecodeState, PrefillState

from .pd_fakes import Rig, wait_state


def test_decoders_that_asked_before_the_refusal_hear_it() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 31, [0, 1, 2], slot=1, kv_tokens=3)
    rig.prefill.refuse(31, "logprob_start_len=9 is higher than the number of input tokens")
    wait_state(d, 31, DecodeState.FAILED)
    error = d.messenger.poll(31)[1] or ""
    assert "bad_request" in error and "logprob_start_len=9" in error
    rig.prefill.writers.close()


def test_decoders_that_ask_after_the_refusal_hear_it() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.prefill.refuse(32, "input_embeds is provided while disable_radix_cache is False")
    rig.request(d, 32, [0, 1], slot=2)
    wait_state(d, 32, DecodeState.FAILED)
    assert "bad_request" in (d.messenger.poll(32)[1] or "")
    rig.prefill.writers.close()


def test_a_request_sglang_holds_is_not_refused_behind_its_back() -> None:
    """Its sender exists: SGLang's own abort path ends it, and reports to the decoder."""
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 33, [0, 1], slot=3)
    rig.prefill.track(33)
    rig.prefill.refuse(33, "late")
    assert rig.prefill.state(33)[0] is not PrefillState.FAILED
    rig.prefill_all(33, [5, 6])
    wait_state(d, 33, DecodeState.COMPLETE)
    rig.prefill.writers.close()


def test_the_schedulers_refusal_hook_names_the_room_and_the_reason() -> None:
    refused: list[tuple[int, str]] = []
    manager = SimpleNamespace(prefill=SimpleNamespace(refuse=lambda r, w: refused.append((r, w))))
    scheduler = SimpleNamespace(
        disaggregation_mode=SimpleNamespace(value="prefill"),
        transfer_backend=SimpleNamespace(value=BACKEND_NAME),
        disagg_prefill_bootstrap_queue=SimpleNamespace(kv_manager=manager),
    )
    req = SimpleNamespace(
        bootstrap_room=77, bootstrap_host="10.0.0.2", finished_reason=None,
        to_finish=SimpleNamespace(message="too long"),
    )  # fmt: skip
    refusals.before_retire_unadmitted_request(scheduler, req)
    health_check = SimpleNamespace(**{**vars(req), "bootstrap_host": "2.2.2.2"})
    refusals.before_retire_unadmitted_request(scheduler, health_check)
    assert refused == [(77, "the prefill server refused the request: too long")]
    # the HTTP process's notice of a room it refused, through SGLang's abort channel
    notice = SimpleNamespace(rid=f"{refusals.REFUSED_ROOM_RID}78", abort_message="embeds")
    refusals.around_abort_request(lambda *a: "sglang's", scheduler, notice)
    assert refused[-1] == (78, "the prefill server refused the request: embeds")
    other = SimpleNamespace(rid="abc", abort_message=None)
    assert refusals.around_abort_request(lambda *a: "sglang's", scheduler, other) == "sglang's"


def test_the_client_gets_the_prefill_servers_reason_as_a_bad_request() -> None:
    from http import HTTPStatus

    ended: list[tuple[str, object]] = []
    message = (
        "Decode transfer failed for request rank=0 with exception KV of request 5 from"
        " h:1 did not arrive: prefill reports bad_request: the prefill server refused the"
        " request: input_embeds is provided while disable_radix_cache is False"
    )
    refusals.around_decode_prepare_abort(
        lambda req, msg, status_code=None: ended.append((msg, status_code)),
        object(), message, status_code=HTTPStatus.INTERNAL_SERVER_ERROR,
    )  # fmt: skip
    assert ended == [
        (
            "the prefill server refused the request: input_embeds is provided while"
            " disable_radix_cache is False",
            HTTPStatus.BAD_REQUEST,
        )
    ]
