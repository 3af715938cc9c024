"""A request retracted by ``pause_generation(mode="retract")`` resumes by having the
prefill server recompute its KV: one decode rank hands SGLang's ``/generate`` body to the
prefill server's registry, with the token the request resumes from at its end when the
decoder samples first tokens (the prefill then computes the KV of exactly the tokens
before it); a hand-off that fails fails the request."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sgl_pd.backend.decode import manager as decode_manager
from sgl_pd.backend.decode.manager import DecodeKVManager
from sgl_pd.config import SglPdConfig
from sgl_pd.errors import SglPdError


class FakeClient:
    submitted: list[tuple[str, dict[str, Any]]] = []  # noqa: RUF012

    def __init__(self, name: str, **kw: Any) -> None:
        pass

    def submit(self, addr: str, msg: Any) -> None:
        if addr == "down:1":
            raise SglPdError("no answer")
        FakeClient.submitted.append((addr, {**json.loads(msg.request), "attempt": msg.attempt}))

    def close(self) -> None:
        pass


class Receiver:
    def __init__(self, room: int, addr: str) -> None:
        self.bootstrap_room, self.bootstrap_addr = room, addr
        self.failed: list[str] = []

    def fail_recompute(self, why: str) -> None:
        self.failed.append(why)


def _manager(monkeypatch: pytest.MonkeyPatch, rank: int, first_token: str) -> DecodeKVManager:
    monkeypatch.setattr(decode_manager, "RegistryClient", FakeClient)
    FakeClient.submitted = []
    mgr = DecodeKVManager.__new__(DecodeKVManager)
    mgr.rank, mgr.auth, mgr.config = rank, None, SglPdConfig(first_token=first_token)
    mgr._expected_prompts, mgr._recompute_tails = decode_manager.OrderedDict(), {}  # type: ignore[assignment]
    mgr._recompute_attempts = decode_manager.OrderedDict()
    mgr._recomputes, mgr._recompute_client = None, None
    return mgr


def _recompute(mgr: DecodeKVManager, receiver: Receiver, resumes_from: int | None) -> None:
    mgr.expect_prompt(receiver.bootstrap_room, 5, resumes_from=resumes_from)
    payload = {"input_ids": [1, 2, 3, 4, 5], "bootstrap_room": receiver.bootstrap_room}
    mgr.submit_prefill_recompute(receiver, payload)
    if mgr._recomputes is not None:
        mgr._recomputes.shutdown(wait=True)
        mgr._recomputes = None


def test_the_leader_hands_the_body_over_with_the_resumed_token_at_its_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mgr = _manager(monkeypatch, rank=0, first_token="decode")
    _recompute(mgr, Receiver(7, "prefill:1"), resumes_from=9)
    assert FakeClient.submitted == [
        ("prefill:1", {"input_ids": [1, 2, 3, 4, 5, 9], "bootstrap_room": 7, "attempt": 1})
    ]


def test_each_recompute_of_a_room_is_a_new_attempt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Retracted twice (even before a new token): the registry hands each over."""
    mgr = _manager(monkeypatch, rank=0, first_token="decode")
    for _ in range(2):
        _recompute(mgr, Receiver(7, "prefill:1"), resumes_from=9)
    assert [body["attempt"] for _, body in FakeClient.submitted] == [1, 2]


def test_with_the_prefill_sampling_first_tokens_the_body_goes_as_sglang_built_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mgr = _manager(monkeypatch, rank=0, first_token="prefill")
    _recompute(mgr, Receiver(7, "prefill:1"), resumes_from=9)
    assert FakeClient.submitted[0][1]["input_ids"] == [1, 2, 3, 4, 5]


def test_other_ranks_hand_nothing_over(monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = _manager(monkeypatch, rank=1, first_token="decode")
    _recompute(mgr, Receiver(7, "prefill:1"), resumes_from=9)
    assert FakeClient.submitted == [] and not mgr._recompute_tails


def test_a_hand_off_that_fails_fails_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = _manager(monkeypatch, rank=0, first_token="decode")
    receiver = Receiver(8, "down:1")
    _recompute(mgr, receiver, resumes_from=9)
    assert receiver.failed and "did not take the request" in receiver.failed[0]
