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
        rid=rid, input_ids=array("q", ids), sampling_params=sampling, bootstrap_host=host,
        custom_logit_processor="serialized processor",
    )  # fmt: skip


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
    assert recv.sampling_params.json_schema is None and recv.custom_logit_processor is None
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


def _req(ids: list[int], output: list[int] | None = None, **more: object) -> SimpleNamespace:
    return SimpleNamespace(
        origin_input_ids=ids, output_ids=output or [], bootstrap_host="h",
        bootstrap_room=len(ids) * 100 + len(output or []), **more,
    )  # fmt: skip


class _Expected:
    """The decode manager's record of the KV each queued request needs."""

    def __init__(self) -> None:
        self.tokens: dict[int, int] = {}

    def expect_prompt(self, room: int, kv_tokens: int, resumes_from: int | None = None) -> None:
        self.tokens[room] = kv_tokens


def _decode_queue() -> SimpleNamespace:
    return SimpleNamespace(transfer_backend=OURS, kv_manager=_Expected())


def test_the_decode_copy_is_marked_unless_it_cannot_be() -> None:
    queue = _decode_queue()
    marked, one_token, resumed = _req([1, 2]), _req([1]), _req([1, 2], output=[9])
    recomputed = _req([1, 2, 3], pd_rebootstrap_forced_output_id=8)  # its one output popped
    for req in (marked, one_token, resumed, recomputed):
        first_token.before_decode_prealloc_add(queue, req)
    assert getattr(marked, first_token.MARK, False)
    for req in (one_token, resumed, recomputed):
        assert not getattr(req, first_token.MARK)
    expected = queue.kv_manager.tokens
    assert expected[marked.bootstrap_room] == 1 and expected[one_token.bootstrap_room] == 1
    assert expected[resumed.bootstrap_room] == 3 and expected[recomputed.bootstrap_room] == 3


def test_a_request_resumed_from_its_host_copy_expects_no_transfer() -> None:
    queue = _decode_queue()
    first_token.before_decode_prealloc_add(queue, _req([1, 2], output=[9]), is_retracted=True)
    assert not queue.kv_manager.tokens


WHOLE_PROMPT = [
    (
        {"return_logprob": True, "logprob_start_len": 0},
        {"return_logprob": True, "logprob_start_len": 0},
    ),
    (
        {"return_logprob": True, "logprob_start_len": 2},
        {"return_logprob": True, "logprob_start_len": 2},
    ),
    ({"return_routed_experts": True}, {"return_routed_experts": True}),
    ({"input_embeds": [[0.0]] * 3}, {"input_embeds": [[0.0]] * 3}),
    ({"mm_inputs": object()}, {"multimodal_inputs": object()}),
    ({"session_params": object()}, {"session": object()}),
]


@pytest.mark.parametrize(("tokenized", "queued"), WHOLE_PROMPT)
def test_requests_whose_answer_needs_the_whole_prompt_go_the_upstream_way_on_both_sides(
    tokenized: dict[str, object], queued: dict[str, object]
) -> None:
    """Each side reads the same request's fields: the prefill keeps every prompt token,
    the decoder samples nothing itself and expects the KV of all of them."""
    recv = _recv([5, 6, 7])
    for name, value in tokenized.items():
        setattr(recv, name, value)
    first_token.before_handle_generate_request(_prefill_scheduler(), recv)
    assert list(recv.input_ids) == [5, 6, 7]
    queue, req = _decode_queue(), _req([5, 6, 7], **queued)
    first_token.before_decode_prealloc_add(queue, req)
    assert not getattr(req, first_token.MARK)
    assert queue.kv_manager.tokens[req.bootstrap_room] == len(recv.input_ids)


def test_upstream_mode_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(first_token._Process, "decode_first", False)
    recv, req = _recv([5, 6, 7]), _req([1, 2])
    first_token.before_handle_generate_request(_prefill_scheduler(), recv)
    first_token.before_decode_prealloc_add(_decode_queue(), req)
    assert list(recv.input_ids) == [5, 6, 7] and not getattr(req, first_token.MARK)


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


@pytest.mark.parametrize(("raw_start", "queued_start"), [(-1, 3), (-1, -1), (3, 3)])
def test_output_logprobs_leave_the_first_token_to_the_decoder(
    raw_start: int, queued_start: int
) -> None:
    """-1 (SGLang's default, turned into n or kept by the decode scheduler) and n: no
    prompt position, so the decoder samples the first token and computes its logprobs;
    the prefill's shortened copy reads n as n - 1, which says the same."""
    recv = _recv([5, 6, 7])
    recv.return_logprob, recv.logprob_start_len = True, raw_start
    first_token.before_handle_generate_request(_prefill_scheduler(), recv)
    assert list(recv.input_ids) == [5, 6] and recv.logprob_start_len == min(raw_start, 2)
    queue = _decode_queue()
    req = _req([5, 6, 7], return_logprob=True, logprob_start_len=queued_start)
    first_token.before_decode_prealloc_add(queue, req)
    assert getattr(req, first_token.MARK) and queue.kv_manager.tokens[req.bootstrap_room] == 2


def test_a_retracted_request_queued_again_loses_its_old_mark() -> None:
    """``pause_generation(mode="retract")`` queues the same Req again, its first output
    token kept aside as the one it resumes from: the prefill recomputes every token
    before that one, and the decoder samples nothing first."""
    queue, req = _decode_queue(), _req([5, 6, 7])
    first_token.before_decode_prealloc_add(queue, req)
    assert getattr(req, first_token.MARK)
    req.pd_rebootstrap_forced_output_id = 9  # SGLang popped the one output token
    first_token.before_decode_prealloc_add(queue, req, is_rebootstrap=True)
    assert not getattr(req, first_token.MARK)
    assert queue.kv_manager.tokens[req.bootstrap_room] == 3


def test_a_radix_native_session_request_is_an_ordinary_one_on_both_sides() -> None:
    """A server serving sessions from its radix cache makes an ordinary Req of a request
    naming its session by session_id (the decoder's Req has no session): the prefill
    reads it alike, so the two agree that the decoder samples the first token."""
    scheduler = _prefill_scheduler()
    scheduler.enable_session_radix_cache = True
    recv = _recv([5, 6, 7])
    recv.session_id, recv.session_params = "s", object()
    first_token.before_handle_generate_request(scheduler, recv)
    assert list(recv.input_ids) == [5, 6]
    queue, req = _decode_queue(), _req([5, 6, 7], session=None)
    first_token.before_decode_prealloc_add(queue, req)
    assert getattr(req, first_token.MARK) and queue.kv_manager.tokens[req.bootstrap_room] == 2
