"""The decoder says how many prompt tokens' KV it needs, and a request whose prefill
computes another number fails at once, naming both: the prefill server and the decoder
may read one request's prompt differently (input embeddings, multimodal or session
prompts, a peer without the pinned patch), and with the page count agreeing by chance the
request would complete by counting and decode from the wrong token."""

from __future__ import annotations

from sgl_pd.core.states import DecodeState, PrefillState

from .pd_fakes import Rig, wait_state


def test_a_prefill_computing_another_prompt_length_fails_the_request_at_once() -> None:
    """SGLang fixes the prompt before the forward (`finalize_bootstrap`): nothing is
    computed or written for a decoder that expects other tokens."""
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 21, [0, 1, 2, 3], slot=1, kv_tokens=4)
    rig.prefill.track(21)
    rig.prefill.prompt_known(21, 5)
    state, _, error = rig.prefill.state(21)
    assert state is PrefillState.FAILED and error is not None
    assert "computes the KV of 5 prompt tokens and the decoder expects 4" in error
    wait_state(d, 21, DecodeState.FAILED)
    assert "expects 4" in (d.messenger.poll(21)[1] or "")
    rig.prefill.writers.close()


def test_a_decode_rank_asking_after_the_prompt_was_fixed_is_checked_too() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.prefill.track(22)
    rig.prefill.prompt_known(22, 3)
    rig.request(d, 22, [0, 1], slot=2, kv_tokens=2)
    wait_state(d, 22, DecodeState.FAILED)
    assert rig.prefill.state(22)[0] is PrefillState.FAILED
    rig.prefill.writers.close()


def test_the_decoder_checks_the_length_the_prefill_wrote_whatever_the_prefill_checked() -> None:
    """A prefill that does not check (it never learnt the prompt, or a future path
    forgets to): its last notice says how many tokens it wrote, and the decoder compares.
    The page counts agree (with 16-token pages, 17 and 18 tokens both take two pages;
    here one-token pages, and the decoder's count is off by one)."""
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 23, [4, 5, 6, 7], slot=3, kv_tokens=5)
    rig.prefill_all(23, [10, 11, 12, 13])
    wait_state(d, 23, DecodeState.FAILED)
    error = d.messenger.poll(23)[1] or ""
    assert "computed the KV of 4 prompt tokens and this decoder expects 5" in error
    rig.prefill.writers.close()


def test_lengths_that_agree_complete() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 24, [4, 5, 6, 7], slot=4, kv_tokens=4)
    rig.prefill.track(24)
    rig.prefill.prompt_known(24, 4)
    rig.prefill_all(24, [10, 11, 12, 13])
    wait_state(d, 24, DecodeState.COMPLETE)
    rig.prefill.writers.close()
