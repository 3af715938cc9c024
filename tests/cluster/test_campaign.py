"""Judging a fault campaign's tokens against the monolithic server's: a departure at a
near tie is allowed, any other departure is wrong."""

from __future__ import annotations

from sgl_pd.cluster.campaign import NEAR_TIE_NATS, Expected

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
