"""D16's two hooks: the prefill server's copy of a request loses its last prompt token and
every grammar; the decode server marks the request for the pinned SGLang patch. A
one-token prompt, SGLang's own health checks and other backends are left alone."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest

from sgl_pd.backend import first_token
from sgl_pd.config import BACKEND_NAME

OURS = SimpleNamespace(value=BACKEND_NAME)
PREFILL = SimpleNamespace(value="prefill")


@pytest.fixture(autouse=True)
def decoder_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(first_token._Process, "decode_first", True)


def _recv(ids: list[int], host: str = "10.0.0.1", rid: str = "r1") -> SimpleNamespace:
    sampling = SimpleNamespace(json_schema='{"type": "object"}', regex=None, ebnf=None,
                               structural_tag=None, temperature=0.7)  # fmt: skip
    return SimpleNamespace(
        rid=rid, input_ids=array("q", ids), sampling_params=sampling, bootstrap_host=host
    )


def _prefill_scheduler(backend: object = OURS, speculative: bool = False) -> SimpleNamespace:
    return SimpleNamespace(
        disaggregation_mode=PREFILL,
        transfer_backend=backend,
        spec_algorithm=SimpleNamespace(is_none=lambda: not speculative),
    )


def test_the_prefill_copy_loses_its_last_token_and_its_grammar() -> None:
    recv = _recv([5, 6, 7])
    first_token.before_handle_generate_request(_prefill_scheduler(), recv)
    assert list(recv.input_ids) == [5, 6]
    assert recv.sampling_params.json_schema is None
    assert recv.sampling_params.temperature == 0.7  # sampling itself is untouched


def test_a_speculative_prefill_ends_its_draft_input_on_the_dropped_token() -> None:
    """The draft extend's tail token is the prompt's last token, not a sampled one."""
    scheduler = _prefill_scheduler(speculative=True)
    recv = _recv([5, 6, 7], rid="spec")
    first_token.before_handle_generate_request(scheduler, recv)
    req = SimpleNamespace(rid="spec")
    first_token.before_prefill_bootstrap_add(SimpleNamespace(), req)
    first_token.after_handle_generate_request(None, scheduler, recv)
    assert getattr(req, first_token.DRAFT_TAIL) == 7
    assert not first_token._Process.draft_tails


def test_a_refused_request_leaves_no_tail_token_behind() -> None:
    scheduler = _prefill_scheduler(speculative=True)
    recv = _recv([5, 6, 7], rid="refused")
    first_token.before_handle_generate_request(scheduler, recv)
    first_token.after_handle_generate_request(None, scheduler, recv)  # never queued
    assert not first_token._Process.draft_tails


def test_without_speculation_no_tail_token_is_kept() -> None:
    recv = _recv([5, 6, 7], rid="plain")
    first_token.before_handle_generate_request(_prefill_scheduler(), recv)
    req = SimpleNamespace(rid="plain")
    first_token.before_prefill_bootstrap_add(SimpleNamespace(), req)
    assert not hasattr(req, first_token.DRAFT_TAIL)


@pytest.mark.parametrize(
    ("recv", "scheduler"),
    [
        (_recv([5]), _prefill_scheduler()),  # one token: upstream's way on both sides
        (_recv([5, 6], host="2.2.2.2"), _prefill_scheduler()),  # SGLang's health check
        (_recv([5, 6]), _prefill_scheduler(SimpleNamespace(value="mooncake"))),
        (
            _recv([5, 6]),
            SimpleNamespace(
                disaggregation_mode=SimpleNamespace(value="decode"), transfer_backend=OURS
            ),
        ),
    ],
)
def test_what_the_prefill_hook_leaves_alone(recv: SimpleNamespace, scheduler: object) -> None:
    before = list(recv.input_ids)
    first_token.before_handle_generate_request(scheduler, recv)
    assert list(recv.input_ids) == before and recv.sampling_params.json_schema is not None


def _req(ids: list[int], output: list[int] | None = None) -> SimpleNamespace:
    return SimpleNamespace(origin_input_ids=ids, output_ids=output or [], bootstrap_host="h")


def test_the_decode_copy_is_marked_unless_it_cannot_be() -> None:
    queue = SimpleNamespace(transfer_backend=OURS)
    marked, one_token, resumed = _req([1, 2]), _req([1]), _req([1, 2], output=[9])
    for req in (marked, one_token, resumed):
        first_token.before_decode_prealloc_add(queue, req)
    assert getattr(marked, first_token.MARK, False)
    assert not hasattr(one_token, first_token.MARK) and not hasattr(resumed, first_token.MARK)


def test_upstream_mode_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(first_token._Process, "decode_first", False)
    recv, req = _recv([5, 6, 7]), _req([1, 2])
    first_token.before_handle_generate_request(_prefill_scheduler(), recv)
    first_token.before_decode_prealloc_add(SimpleNamespace(transfer_backend=OURS), req)
    assert list(recv.input_ids) == [5, 6, 7] and not hasattr(req, first_token.MARK)


def test_a_decoder_refuses_to_start_without_the_pinned_patches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The installed SGLang carries both patches; one whose prefix match does not
    honour the mark (SGLang reinstalled, say) is refused with the fix in one line."""
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    from sgl_pd.errors import ConfigError

    first_token.require_decode_patches()

    def _match_prefix_and_lock(self, req):  # type: ignore[no-untyped-def]
        return None  # as SGLang ships it: no cap before the prompt's last token

    monkeypatch.setattr(DecodePreallocQueue, "_match_prefix_and_lock", _match_prefix_and_lock)
    with pytest.raises(ConfigError, match=r"_match_prefix_and_lock.*launch/install\.sh"):
        first_token.require_decode_patches()
