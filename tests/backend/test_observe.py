"""The transfer-timestamp observer: off unless asked for, and its lines read back."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from sgl_pd import observe


def test_nothing_is_hooked_without_the_environment_switch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(observe.OBSERVE_ENV, raising=False)
    registered: list[str] = []
    monkeypatch.setattr(
        "sglang.srt.plugins.hook_registry.HookRegistry.register",
        lambda target, *a, **k: registered.append(target),
    )
    observe.register()
    assert registered == []
    monkeypatch.setenv(observe.OBSERVE_ENV, "1")
    observe.register()
    assert any(t.endswith("DecodeTransferQueue.pop_transferred") for t in registered)
    assert any(t.endswith("Scheduler.run_batch") for t in registered)


def _req(room: int | None, host: str = "10.0.0.1", end: int = 8, n: int = 8) -> SimpleNamespace:
    return SimpleNamespace(
        bootstrap_room=room, bootstrap_host=host, extend_end=end, origin_input_ids=[0] * n
    )


def test_stamps_are_logged_for_real_requests_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    scheduler = SimpleNamespace(disaggregation_mode=SimpleNamespace(value="prefill"))
    batch = SimpleNamespace(
        forward_mode=SimpleNamespace(is_extend=lambda: True),
        reqs=[_req(5), _req(6, end=4), _req(7, host=FAKE_BOOTSTRAP_HOST), _req(None)],
    )
    with caplog.at_level("INFO", logger="sgl_pd.observe"):
        assert observe.after_run_batch("result", scheduler, batch) == "result"
        done = [_req(5), _req(8, host=FAKE_BOOTSTRAP_HOST)]
        assert observe.after_pop_transferred(done, object()) is done
    log = tmp_path / "server.log"
    log.write_text("\n".join(r.getMessage() for r in caplog.records) + "\nnoise\n")
    stamps = observe.read_stamps(log)
    # room 6's forward did not reach its last prompt token; 7 and 8 are SGLang's own
    assert [(s.side, s.room) for s in stamps] == [("forward_end", 5), ("kv_complete", 5)]
    assert stamps[0].t <= stamps[1].t
    assert observe.read_stamps(tmp_path / "missing.log") == []
