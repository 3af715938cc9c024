"""Local prefill turned down at run time through SGLang's own `/set_internal_state`
(`backend/decode/local_switch.py`): SGLang's real settings controller, with the hook
applied as the registry applies it, over a decoder's `LocalPrefills`."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

from sgl_pd.backend.decode import local_switch
from sgl_pd.backend.decode.direct import DirectDispatcher
from sgl_pd.backend.decode.local_prefill import _STATE, LocalPrefills
from sgl_pd.config import CONFIG_ENV, SglPdConfig
from sgl_pd.core.placement import PromptKey

internal_state = pytest.importorskip("sglang.srt.managers.scheduler_components.internal_state")
SetInternalStateReq = pytest.importorskip("sglang.srt.managers.io_struct").SetInternalStateReq


def _controller(local: LocalPrefills | None, http_workers: int = 1) -> Any:
    """SGLang's controller of a scheduler holding `local` (None: a decoder started
    without local prefill), `_update_handlers` hooked as the registry hooks it."""
    server_args = types.SimpleNamespace(tokenizer_worker_num=http_workers)
    scheduler = types.SimpleNamespace(max_running_requests=64, server_args=server_args)
    setattr(scheduler, _STATE, local)
    controller = internal_state.SchedulerInternalStateController(scheduler, False)
    original = internal_state.SchedulerInternalStateController._update_handlers
    controller._update_handlers = lambda: local_switch.around_update_handlers(original, controller)
    return controller


def _set(controller: Any, value: Any) -> bool:
    request = SetInternalStateReq(server_args={local_switch.SETTING: value})
    return bool(controller.set_internal_state(request).updated)


def test_a_decoder_turns_local_prefill_down_off_and_on_again() -> None:
    local = LocalPrefills(128)
    controller = _controller(local)
    assert _set(controller, 0) and local.max_tokens == 0
    assert _set(controller, 40) and local.max_tokens == 40
    assert _set(controller, 128) and local.max_tokens == 128


@pytest.mark.parametrize("value", [129, -1, 1.5, "64", True, None])
def test_a_value_outside_what_it_started_with_is_refused_and_changes_nothing(
    value: Any,
) -> None:
    local = LocalPrefills(128)
    assert not _set(_controller(local), value)
    assert local.max_tokens == 128


def test_a_decoder_without_local_prefill_does_not_take_the_setting() -> None:
    assert not _set(_controller(None), 0)


def test_a_direct_mode_decoder_with_several_http_workers_refuses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each HTTP worker places its own requests and only the one asked hears the answer:
    the others would go on placing them here."""
    monkeypatch.setenv(CONFIG_ENV, SglPdConfig(prefill_bootstrap="127.0.0.1:8998").to_json())
    local = LocalPrefills(128)
    assert not _set(_controller(local, http_workers=2), 0) and local.max_tokens == 128
    assert _set(_controller(local, http_workers=1), 0) and local.max_tokens == 0
    monkeypatch.delenv(CONFIG_ENV)  # the router flow: the schedulers place
    assert _set(_controller(local, http_workers=2), 64) and local.max_tokens == 64


def test_sglang_s_own_settings_still_work_beside_it() -> None:
    controller = _controller(LocalPrefills(128))
    handlers = controller._update_handlers()
    assert local_switch.SETTING in handlers and "pp_max_micro_batch_size" in handlers


def test_the_http_process_follows_once_every_rank_took_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Direct mode's placement: a follow-up whose prefix this decoder holds is placed
    here until every scheduler rank took the limit 0, then goes to a prefill server."""
    from sgl_pd.backend.decode import direct

    dispatcher = DirectDispatcher(
        "127.0.0.1:9", auth=None, probe_interval_s=0.05, local_max_tokens=128,
        prefix_cache=True,
    )  # fmt: skip
    monkeypatch.setattr(direct, "dispatcher_of", lambda _manager: dispatcher)
    dispatcher.served(PromptKey.of_ids(list(range(400))))
    follow_up = PromptKey.of_ids([*range(400), *range(1000, 1040)])

    def ranks_took(updated: list[bool]) -> list[bool]:
        async def original(_manager: Any, _obj: Any) -> list[bool]:
            return updated

        obj = SetInternalStateReq(server_args={local_switch.SETTING: 0})
        return asyncio.run(local_switch.around_set_internal_state(original, None, obj))

    try:
        assert dispatcher.prefill_here(follow_up) == "cached_prefix"
        assert ranks_took([True, False]) == [True, False]  # a rank refused: unchanged
        assert dispatcher.prefill_here(follow_up) == "cached_prefix"
        assert ranks_took([True, True]) == [True, True]
        assert dispatcher.prefill_here(follow_up) is None
    finally:
        dispatcher.close()
