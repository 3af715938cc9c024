"""/health: health-check requests are dropped (so SGLang answers 503) exactly while the
messenger reports a problem; other requests always go through."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sglang.srt.constants import HEALTH_CHECK_RID_PREFIX

from sgl_pd.backend import health


def _original(scheduler: Any, req: Any) -> str:
    return f"handled {req.rid}"


def test_health_checks_fail_only_while_something_is_broken() -> None:
    problem: list[str | None] = [None]
    health.watch(lambda: problem[0])
    check = SimpleNamespace(rid=f"{HEALTH_CHECK_RID_PREFIX}_abc")
    user = SimpleNamespace(rid="user-1")
    hook = health.around_handle_generate_request
    assert hook(_original, None, check) == f"handled {check.rid}"
    problem[0] = "the messenger's inbox thread stopped"
    assert hook(_original, None, check) is None
    assert hook(_original, None, user) == "handled user-1"
    problem[0] = None
    assert hook(_original, None, check) == f"handled {check.rid}"
