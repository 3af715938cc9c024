"""The decode scheduler's local offer, read by its HTTP process: a direct request whose
first token the scheduler would predict sooner remote is submitted to a prefill server at
once, by the very check the scheduler makes; a stale, missing or unreadable offer places
nothing differently."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from sgl_pd.backend.decode.local_offer import MAX_AGE_S, REREAD_S, OfferReader, write_offer
from sgl_pd.core.local_budget import (
    LocalOffer,
    LocalStep,
    Models,
    RemoteCoefficients,
    StepCoefficients,
    plan_local_step,
    prefill_here_is_sooner,
    remote_is_sooner,
)

# decode 20 ms at 10 streams, a local token 1 ms: the SLO (1.25x) allows 5 tokens a step
STEP = StepCoefficients(0.010, 0.001, 0.001, unmixed_offset=0.010)
REMOTE = RemoteCoefficients(offset=0.060, per_token=0.0001)


def _offer(**changes: object) -> LocalOffer:
    fields: dict[str, object] = {
        "written_s": time.time(), "models": Models(STEP, REMOTE, 1.0), "running": 10,
        "tokens_ahead": 0, "local_share": 1.0, "burst_ready": False, "slo_factor": 1.25,
        "cap": 64, "page_size": 1,
    }  # fmt: skip
    return LocalOffer(**{**fields, **changes})  # type: ignore[arg-type]


def test_the_offer_decides_as_the_scheduler_would() -> None:
    # 40 tokens at 5 a step: 8 steps of 25 ms here, against 64 ms remote and a decode step
    assert remote_is_sooner(_offer(), 40)
    plan = plan_local_step(STEP, 10, slo_factor=1.25, cap=64, page_size=1)
    assert not prefill_here_is_sooner(
        STEP, REMOTE, running=10, tokens_ahead=0, tokens=40, plan=plan
    )
    # a burst allowed now carries the 40 tokens in one step: here is sooner
    assert not remote_is_sooner(_offer(burst_ready=True), 40)
    # ... unless the local work queued ahead takes the burst
    assert remote_is_sooner(_offer(burst_ready=True, tokens_ahead=60), 40)
    # a few tokens fit a step within the SLO
    assert not remote_is_sooner(_offer(), 2)
    # without both models the placement rules decide: here
    assert not remote_is_sooner(_offer(models=Models(None, REMOTE, 1.0)), 40)
    assert not remote_is_sooner(_offer(models=Models(STEP, None, 1.0)), 40)
    # no step carries a page within the SLO: out, as the scheduler sends it (`itl_slo`)
    assert remote_is_sooner(_offer(slo_factor=1.01, page_size=16), 2)


def test_the_http_process_judges_behind_the_remote_queue_it_placed_itself() -> None:
    """40 tokens take 8 steps of 25 ms here: 200 ms. Remote takes 64 ms and the decode
    step, behind a queue of 300 ms when the offer was written: here is sooner by the
    offer; remote where the HTTP process, which places every remote request, knows
    that queue is down to 500 tokens (0.1 ms each: 50 ms)."""
    queued = Models(STEP, RemoteCoefficients(0.060, 0.0001, 0.3, per_queued_token=1e-4), 1.0)
    assert not remote_is_sooner(_offer(models=queued), 40)
    assert remote_is_sooner(_offer(models=queued), 40, queued_tokens=500)
    assert not remote_is_sooner(_offer(models=queued), 40, queued_tokens=3000)


def test_an_offer_survives_the_file(tmp_path: Path) -> None:
    offer = _offer(burst_ready=True, models=Models(STEP, None, 1.3))
    write_offer(tmp_path / "offers" / "offer.json", offer)
    assert LocalOffer.from_json((tmp_path / "offers" / "offer.json").read_text()) == offer
    assert LocalStep(5, True) == plan_local_step(STEP, 10, slo_factor=1.25, cap=64, page_size=1)


def test_a_stale_missing_or_unreadable_offer_is_no_offer(tmp_path: Path) -> None:
    path = tmp_path / "offers" / "offer.json"
    reader = OfferReader(path)
    assert reader.current() is None  # (no file yet)
    now = time.time()
    write_offer(path, _offer(written_s=now))
    assert reader.current(now + 2 * REREAD_S) == _offer(written_s=now)
    path.write_text("{not json")
    assert reader.current(now + 4 * REREAD_S) is None
    path.write_text('{"written_s": 1.0}')  # (another version's fields)
    assert reader.current(now + 6 * REREAD_S) is None
    write_offer(path, _offer(written_s=now))
    assert reader.current(now + MAX_AGE_S + 1.0) is None  # the scheduler stopped writing


def test_the_reader_rereads_at_most_every_so_often(tmp_path: Path) -> None:
    path = tmp_path / "offers" / "offer.json"
    now = time.time()
    write_offer(path, _offer(written_s=now, running=3))
    reader = OfferReader(path)
    assert reader.current(now).running == 3  # type: ignore[union-attr]
    write_offer(path, _offer(written_s=now, running=4))
    assert reader.current(now + REREAD_S / 2).running == 3  # type: ignore[union-attr]
    assert reader.current(now + 1.5 * REREAD_S).running == 4  # type: ignore[union-attr]


@contextlib.contextmanager
def _dispatcher(offers: Path) -> Iterator[Any]:
    """A direct-mode dispatcher of a decoder with its prefix cache on, reading `offers`."""
    from sgl_pd.backend.decode.direct import DirectDispatcher

    dispatcher = DirectDispatcher(
        "127.0.0.1:9", auth=None, probe_interval_s=0.05, local_max_tokens=256,
        prefix_cache=True, offers=OfferReader(offers),
    )  # fmt: skip
    try:
        yield dispatcher
    finally:
        dispatcher.close()


def test_a_follow_up_sooner_remote_is_submitted_at_once(tmp_path: Path) -> None:
    """Judged at the tokens the scheduler would find uncached: a prompt of token ids
    past what this decoder served, to the token."""
    from sgl_pd.core.placement import BLOCK_TOKENS, PromptKey

    path = tmp_path / "offers" / "offer.json"
    with _dispatcher(path) as dispatcher:
        dispatcher.served(PromptKey.of_ids(list(range(400))))  # (6 whole blocks known)
        follow_up = PromptKey.of_ids([*range(400), *range(1000, 1100)])
        assert dispatcher.prefill_here(follow_up) == "cached_prefix"
        assert not dispatcher.sooner_remote(follow_up)  # (no offer yet)
        write_offer(path, _offer())
        time.sleep(REREAD_S)
        assert dispatcher.sooner_remote(follow_up)  # 100 uncached: remote
        # 129 tokens, the first 127 held: 65 uncached by whole blocks, 2 to the token
        dispatcher.served(PromptKey.of_ids(list(range(2000, 2127))))
        short = PromptKey.of_ids([*range(2000, 2127), 7, 8])
        assert short.cached_tokens(dispatcher._held, "") == BLOCK_TOKENS
        assert not dispatcher.sooner_remote(short)


def test_a_follow_up_of_token_ids_is_judged_at_the_tokens_it_adds(tmp_path: Path) -> None:
    """A conversation of 1032 tokens served here (16 whole blocks and 8 tokens), then
    its follow-up of 40 more: judged by whole blocks and a block of doubt it had 1
    token to compute and stayed here, where the scheduler (40 tokens) sent it out after
    all - a hop through the scheduler and a hand-off later than had it gone at once."""
    from sgl_pd.core.placement import PromptKey

    assert remote_is_sooner(_offer(), 40) and not remote_is_sooner(_offer(), 1)
    path = tmp_path / "offers" / "offer.json"
    with _dispatcher(path) as dispatcher:
        conversation = [*range(1024), *range(5000, 5008)]
        dispatcher.served(PromptKey.of_ids(conversation))
        write_offer(path, _offer())
        time.sleep(REREAD_S)
        follow_up = PromptKey.of_ids([*conversation, *range(7000, 7040)])
        assert dispatcher.sooner_remote(follow_up)
        # a turn that goes on with one token: here, as the scheduler would keep it
        assert not dispatcher.sooner_remote(PromptKey.of_ids([*conversation, 7]))
        # whole pages of 16 are held: 1032 -> 1024, 9 tokens to compute (more than 2)
        write_offer(path, _offer(page_size=16))
        time.sleep(REREAD_S)
        assert dispatcher.sooner_remote(PromptKey.of_ids([*conversation, 7]))


def test_a_prompt_held_whole_is_judged_at_its_last_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retry of a prompt that ends inside a served conversation: SGLang computes its
    last token at least, so in pages of 16 its last page."""
    from sgl_pd.backend.decode import direct
    from sgl_pd.core.placement import PromptKey

    judged: list[int] = []
    monkeypatch.setattr(direct, "remote_is_sooner", lambda o, n, q: judged.append(n) or False)
    path = tmp_path / "offers" / "offer.json"
    with _dispatcher(path) as dispatcher:
        conversation = [*range(1024), *range(5000, 5008)]
        dispatcher.served(PromptKey.of_ids(conversation))
        for page_size, least in ((1, 1), (16, 16)):
            write_offer(path, _offer(page_size=page_size))
            time.sleep(REREAD_S)
            dispatcher.sooner_remote(PromptKey.of_ids(conversation[:1024]))
            assert judged.pop() == least


def test_the_scheduler_s_own_limits_come_with_the_offer() -> None:
    # it never sends out (--pd-first-token prefill)
    assert not remote_is_sooner(_offer(may_send_out=False), 40)
    # a running stream wants logprobs: steps run unmixed, as the scheduler plans them.
    # 25 tokens. Mixed: 10 a 25 ms step, 73 ms (remote: 83 ms); alone: 5 a 5 ms step, with
    # the streams' 20 ms decode step between two, 105 ms
    cheap_alone = StepCoefficients(0.010, 0.001, 0.0005, 0.0, unmixed_offset=0.004,
                                   unmixed_per_token=0.0002)  # fmt: skip
    offer = _offer(models=Models(cheap_alone, REMOTE, 1.0))
    assert not remote_is_sooner(offer, 25)
    assert remote_is_sooner(dataclasses.replace(offer, can_mix=False), 25)


def test_requests_the_scheduler_never_sends_out_are_never_judged() -> None:
    from types import SimpleNamespace

    from sgl_pd.backend.decode.direct import _plain

    assert _plain(SimpleNamespace(return_logprob=False, lora_path=None))
    for flag in ("return_logprob", "lora_path", "session_params", "return_hidden_states"):
        assert not _plain(SimpleNamespace(**{flag: True})), flag


def _older_offer() -> str:
    """An offer as the version before a mixed step's own cost wrote it: eleven model
    words."""
    fields = json.loads(_offer().to_json())
    fields["models"] = fields["models"][:6] + fields["models"][7:]
    return json.dumps(fields)


def test_an_offer_file_of_another_kind_is_no_offer(tmp_path: Path) -> None:
    path = tmp_path / "offers" / "offer.json"
    write_offer(path, _offer())
    reader = OfferReader(path)
    assert reader.current() is not None
    for text in (
        '{"written_s": 1.0}',
        _offer().to_json().replace('"running": 10', '"running": null'),
        _offer().to_json().replace('"models": [', '"models": [1.0], "x": ['),
        _older_offer(),
    ):
        with pytest.raises(ValueError):
            LocalOffer.from_json(text)
    path.write_text(_offer().to_json().replace('"running": 10', '"running": "10"'))
    assert reader.current(time.time() + REREAD_S) is None


def test_an_offer_in_a_directory_others_may_write_is_no_offer(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    (shared / "offer.json").write_text(_offer().to_json())
    assert OfferReader(shared / "offer.json").current() is None
    write_offer(shared / "offer2.json", _offer())
    assert not (shared / "offer2.json").exists()


@pytest.fixture(autouse=True)
def _quiet_probes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="sgl_pd.direct")


def test_the_offer_is_written_at_least_every_quarter_second(tmp_path: Path) -> None:
    """At 300 streams a step took 0.5 s here: written only at model syncs (every 32
    steps, 16 s) the offer was older than the HTTP process takes (2 s), and every
    follow-up reached the scheduler unjudged, a fifth of them to be sent out from there."""
    from sgl_pd.backend.decode import local_prefill
    from sgl_pd.backend.decode.local_offer import MAX_AGE_S

    local = local_prefill.LocalPrefills(128, offer_path=tmp_path / "offer.json")
    now = [50.0]
    local.pacer._clock = lambda: now[0]
    assert local_prefill.OFFER_EVERY_S < MAX_AGE_S
    assert local_prefill._offer_due(local)  # the first iteration
    now[0] += local_prefill.OFFER_EVERY_S / 2
    assert not local_prefill._offer_due(local)
    local.pacer.synced_now = True  # (a sync writes it whatever the time)
    assert local_prefill._offer_due(local)
    local.pacer.synced_now = False
    now[0] += 0.5  # one step at 300 streams
    assert local_prefill._offer_due(local) and not local_prefill._offer_due(local)


def test_a_prompt_placed_here_for_saturated_prefill_servers_is_judged_too(
    tmp_path: Path,
) -> None:
    """Every prefill server has its saturation's worth queued, so a short fresh prompt is
    placed here - where, at 300 streams ramping up, no step carried one within the ITL
    SLO and the scheduler sent 202 of them out, each after a trip through it. The HTTP
    process asks the offer first, as for a held prefix."""
    from sgl_pd.core.dispatch import PrefillerLoad
    from sgl_pd.core.placement import PromptKey

    path = tmp_path / "offers" / "offer.json"
    with _dispatcher(path) as dispatcher:
        dispatcher._saturated_tokens = 1000
        # (its prober would find nothing at that address and mark it unavailable)
        dispatcher._mark = lambda addr, *, available: None  # type: ignore[method-assign]
        dispatcher._loads["127.0.0.1:9"] = PrefillerLoad(True, 5000)
        fresh = PromptKey.of_ids(list(range(5000, 5100)))
        assert dispatcher.local_reason(fresh, plain=True) == "saturated"  # (no offer yet)
        write_offer(path, _offer(slo_factor=1.01))  # (no page within the SLO)
        time.sleep(max(REREAD_S, 1.5))  # (past the prober's first timeout too)
        assert dispatcher.local_reason(fresh, plain=True) is None
        assert dispatcher.local_reason(fresh, plain=False) == "saturated"  # (never sent out)
        # a burst of 128 carries it (120 ms), sooner than behind the 5000 queued (570 ms)
        queueing = RemoteCoefficients(offset=0.060, per_token=0.0001, per_queued_token=0.0001)
        models = Models(STEP, queueing, 1.0)
        write_offer(path, _offer(slo_factor=1.01, burst_ready=True, cap=128, models=models))
        time.sleep(REREAD_S)
        assert dispatcher.local_reason(fresh, plain=True) == "saturated"


def test_a_request_asking_for_its_prompt_s_logprobs_is_judged_by_what_sglang_recomputes(
    tmp_path: Path,
) -> None:
    """SGLang computes every prompt token from `logprob_start_len` on, cached or not: a
    follow-up asking for its whole prompt's logprobs is a whole prefill (too long for
    here: a prefill server's), one asking for its new tokens' is its short suffix."""
    from types import SimpleNamespace

    from sgl_pd.backend.decode.direct import UNSUPPORTED, _plain, _prompt_key
    from sgl_pd.core.placement import PromptKey

    conversation = list(range(400))
    prompt = [*conversation, *range(1000, 1020)]

    def request(**logprobs: object) -> Any:
        return SimpleNamespace(
            input_ids=prompt, text=None, **dict.fromkeys(UNSUPPORTED), **logprobs
        )

    with _dispatcher(tmp_path / "offer.json") as dispatcher:
        dispatcher.served(PromptKey.of_ids(conversation))
        for logprobs, reason in (
            ({}, "cached_prefix"),
            ({"return_logprob": True, "logprob_start_len": -1}, "cached_prefix"),
            ({"return_logprob": True, "logprob_start_len": len(prompt) - 20}, "cached_prefix"),
            ({"return_logprob": False, "logprob_start_len": 0}, "cached_prefix"),
            ({"return_logprob": True, "logprob_start_len": 0}, None),
            # from inside the held prefix: 320 tokens computed, past the 256 done here
            ({"return_logprob": True, "logprob_start_len": 100}, None),
        ):
            obj = request(**logprobs)
            assert dispatcher.local_reason(_prompt_key(obj), plain=_plain(obj)) == reason
            assert dispatcher.local_reason(_prompt_key(obj), plain=False) == reason


def test_a_burst_goes_to_one_request_until_the_scheduler_shows_it_past_its_queue(
    tmp_path: Path,
) -> None:
    """Two follow-ups between two offers, each of 40 uncached tokens that only the
    ready burst carries sooner here than remote: the first is placed here and claims
    it; the second is judged without it (remote) until an offer lists the first among
    the requests that left the scheduler's local queue - that offer's own burst state
    counts - or the first request ends."""
    from sgl_pd.core.placement import PromptKey

    path = tmp_path / "offers" / "offer.json"
    with _dispatcher(path) as dispatcher:
        conversation = [*range(1024), *range(5000, 5008)]
        dispatcher.served(PromptKey.of_ids(conversation))
        follow_up = PromptKey.of_ids([*conversation, *range(7000, 7040)])
        write_offer(path, _offer(burst_ready=True))
        time.sleep(REREAD_S)
        assert not dispatcher.sooner_remote(follow_up)
        with dispatcher.placed_here("cached_prefix", 11):
            assert dispatcher.sooner_remote(follow_up)  # the burst is the first one's
            # an offer written before the first left the queue still says ready
            write_offer(path, _offer(burst_ready=True, arrived_rooms=(5, 7)))
            time.sleep(REREAD_S)
            assert dispatcher.sooner_remote(follow_up)
            # it left the queue, and the burst was refilled since: for the next one
            write_offer(path, _offer(burst_ready=True, arrived_rooms=(7, 11)))
            time.sleep(REREAD_S)
            assert not dispatcher.sooner_remote(follow_up)
        # placed on an offer without a burst, a request claims nothing
        write_offer(path, _offer(burst_ready=False))
        time.sleep(REREAD_S)
        with dispatcher.placed_here("cached_prefix", 12):
            write_offer(path, _offer(burst_ready=True))
            time.sleep(REREAD_S)
            assert not dispatcher.sooner_remote(follow_up)
            with dispatcher.placed_here("cached_prefix", 13):  # (this one claims it)
                assert dispatcher.sooner_remote(follow_up)
            assert not dispatcher.sooner_remote(follow_up)  # it ended: no claim is left


def test_a_claimed_burst_is_released_however_its_request_ends(tmp_path: Path) -> None:
    """A request placed on the burst that never left the scheduler's queue (refused
    before it got there, aborted by its client, failed) must not keep the burst from
    every later request: its claim ends with it - an exception or a consumer that stops
    reading (the generator closed) too."""
    path = tmp_path / "offers" / "offer.json"
    with _dispatcher(path) as dispatcher:
        reader = dispatcher._offers
        write_offer(path, _offer(burst_ready=True))
        with pytest.raises(RuntimeError), dispatcher.placed_here("cached_prefix", 21):
            assert not reader.current().burst_ready
            raise RuntimeError("the request failed")
        assert reader.current().burst_ready

        async def served() -> AsyncIterator[int]:
            with dispatcher.placed_here("cached_prefix", 22):
                for token in range(3):
                    yield token

        async def read_one_then_stop() -> None:
            outputs = served()
            await outputs.__anext__()
            assert not reader.current().burst_ready  # (claimed while it is served)
            await outputs.aclose()

        asyncio.run(read_one_then_stop())
        assert reader.current().burst_ready


def test_only_the_claiming_request_s_end_releases_the_burst(tmp_path: Path) -> None:
    path = tmp_path / "offers" / "offer.json"
    reader = OfferReader(path)
    now = time.time()
    write_offer(path, _offer(written_s=now, burst_ready=True))
    reader.claim_burst_if_ready(21, now)
    assert not reader.current(now).burst_ready  # type: ignore[union-attr]
    reader.claim_burst_if_ready(22, now)  # (judged without the burst: claims nothing)
    reader.request_ended(22)
    assert not reader.current(now).burst_ready  # type: ignore[union-attr]
    reader.request_ended(21)
    assert reader.current(now).burst_ready  # type: ignore[union-attr]


def test_the_rooms_that_arrived_survive_the_file_and_nothing_else_passes_for_them(
    tmp_path: Path,
) -> None:
    path = tmp_path / "offers" / "offer.json"
    offer = _offer(arrived_rooms=(3, 2**62))
    write_offer(path, offer)
    assert LocalOffer.from_json(path.read_text()) == offer
    for rooms in (["3"], [-1], [1.5], [True], 7):
        fields = json.loads(offer.to_json())
        with pytest.raises(ValueError):
            LocalOffer.from_json(json.dumps({**fields, "arrived_rooms": rooms}))
    # an offer of the version before (no rooms): none arrived
    fields = json.loads(offer.to_json())
    del fields["arrived_rooms"]
    assert LocalOffer.from_json(json.dumps(fields)).arrived_rooms == ()
