"""The decode scheduler's local offer, read by its HTTP process: a direct request whose
first token the scheduler would predict sooner remote is submitted to a prefill server at
once, by the very check the scheduler makes; a stale, missing or unreadable offer places
nothing differently."""

from __future__ import annotations

import time
from pathlib import Path

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


def test_an_offer_survives_the_file(tmp_path: Path) -> None:
    offer = _offer(burst_ready=True, models=Models(STEP, None, 1.3))
    write_offer(tmp_path / "offer.json", offer)
    assert LocalOffer.from_json((tmp_path / "offer.json").read_text()) == offer
    assert LocalStep(5, True) == plan_local_step(STEP, 10, slo_factor=1.25, cap=64, page_size=1)


def test_a_stale_missing_or_unreadable_offer_is_no_offer(tmp_path: Path) -> None:
    path = tmp_path / "offer.json"
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
    path = tmp_path / "offer.json"
    now = time.time()
    write_offer(path, _offer(written_s=now, running=3))
    reader = OfferReader(path)
    assert reader.current(now).running == 3  # type: ignore[union-attr]
    write_offer(path, _offer(written_s=now, running=4))
    assert reader.current(now + REREAD_S / 2).running == 3  # type: ignore[union-attr]
    assert reader.current(now + 1.5 * REREAD_S).running == 4  # type: ignore[union-attr]


def test_a_follow_up_sooner_remote_is_submitted_at_once(tmp_path: Path) -> None:
    """The dispatcher counts it placed here and sent out (as the scheduler would have)
    and answers that a prefill server should prefill it; with no fresh offer it stays."""
    from prometheus_client import CollectorRegistry

    from sgl_pd.backend.decode.direct import DirectDispatcher
    from sgl_pd.backend.metrics import PlacementMetrics
    from sgl_pd.core.placement import PromptKey

    path = tmp_path / "offer.json"
    registry = CollectorRegistry()
    dispatcher = DirectDispatcher(
        "127.0.0.1:9", auth=None, probe_interval_s=0.05, local_max_tokens=128,
        prefix_cache=True, metrics=PlacementMetrics(True, registry), offers=OfferReader(path),
    )  # fmt: skip
    try:
        held = PromptKey.of_ids(list(range(400)))
        dispatcher.served(held)
        follow_up = PromptKey.of_ids([*range(400), *range(1000, 1040)])
        assert dispatcher.prefill_here(follow_up) == "cached_prefix"  # (no offer yet)
        write_offer(path, _offer())
        time.sleep(REREAD_S)
        assert dispatcher.prefill_here(follow_up) is None
        sent = registry.get_sample_value("sgl_pd_local_prefills_sent_out_total", {"why": "slower"})
        assert sent == 1.0
    finally:
        dispatcher.close()


@pytest.fixture(autouse=True)
def _quiet_probes(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("ERROR", logger="sgl_pd.direct")
