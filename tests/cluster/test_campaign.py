"""Judging a fault campaign's tokens against the monolithic server's: a departure at a
near tie is allowed, any other departure is wrong. A kill meant to land mid-request is
tried again, sooner, while the request finishes first."""

from __future__ import annotations

import json

import pytest
import requests

from sgl_pd.cluster import campaign
from sgl_pd.cluster.campaign import NEAR_TIE_NATS, Expected, KillResult

CLEAR = 5.0  # nats between the top two candidates: no doubt
TIE = NEAR_TIE_NATS / 10


def test_equal_tokens_are_ok() -> None:
    assert Expected((1, 2, 3), (CLEAR,) * 3).judge([1, 2, 3]) == "ok"


def test_a_departure_at_a_near_tie_is_allowed_whatever_follows() -> None:
    expected = Expected((19, 224, 21), (TIE, CLEAR, CLEAR))
    assert expected.judge([23, 7, 7]) == "near_tie"


def test_a_departure_at_a_clear_step_is_wrong_even_after_a_tie_elsewhere() -> None:
    expected = Expected((19, 224, 21), (TIE, CLEAR, CLEAR))
    assert expected.judge([19, 225, 21]) == "wrong_tokens"


def test_a_truncated_answer_is_wrong() -> None:
    assert Expected((1, 2, 3), (CLEAR,) * 3).judge([1, 2]) == "wrong_tokens"


def _answer(status: int, finish: str) -> requests.Response:
    response = requests.Response()
    response.status_code = status
    response._content = json.dumps({"meta_info": {"finish_reason": {"type": finish}}}).encode()
    return response


def test_a_request_served_whole_did_not_see_the_kill() -> None:
    assert KillResult(_answer(200, "length"), 0.1).completed
    assert not KillResult(_answer(200, "abort"), 0.1).completed
    assert not KillResult(_answer(500, "length"), 0.1).completed
    assert not KillResult(None, 0.1).completed


def test_a_kill_is_tried_again_sooner_while_the_request_finishes_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each retry restarts the victim and sends a fresh prompt, sooner; the first kill
    that lands mid-request is returned, and a kill that never does fails loudly."""
    calls: list[tuple[list[int], str, float]] = []
    outcomes = [_answer(200, "length"), _answer(200, "length"), None]

    def kill(url: str, victim: object, ids: list[int], rid: str, after_s: float) -> KillResult:
        calls.append((ids, rid, after_s))
        return KillResult(outcomes[len(calls) - 1], 0.5)

    restarts: list[int] = []
    monkeypatch.setattr(campaign, "kill_mid_transfer", kill)
    result = campaign.kill_during_request(
        "http://r",
        object(),
        lambda n: [n],
        "k",
        lambda: restarts.append(1),  # type: ignore[arg-type]
    )
    assert result.response is None and len(restarts) == 2
    assert calls == [([0], "k-0", 1.0), ([1], "k-1", 0.5), ([2], "k-2", 0.25)]

    outcomes[:] = [_answer(200, "stop")] * 3
    calls.clear()
    with pytest.raises(AssertionError, match="finished before its kill"):
        campaign.kill_during_request(
            "http://r",
            object(),
            lambda n: [n],
            "k",
            lambda: None,  # type: ignore[arg-type]
        )


def test_a_request_that_ended_on_its_own_before_the_kill_is_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request an injected write failure ended before the kill answers with an error,
    as a killed one does: `ended_early` tells them apart, and the kill is tried again."""
    calls: list[str] = []

    def kill(url: str, victim: object, ids: list[int], rid: str, after_s: float) -> KillResult:
        calls.append(rid)
        return KillResult(_answer(500, "abort"), 0.5)

    monkeypatch.setattr(campaign, "kill_mid_transfer", kill)
    result = campaign.kill_during_request(
        "http://r", object(), lambda n: [n], "k", lambda: None,  # type: ignore[arg-type]
        ended_early=lambda rid: rid == "k-0",
    )  # fmt: skip
    assert calls == ["k-0", "k-1"] and not result.completed
