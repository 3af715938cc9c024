"""The plugin's hooks: one AROUND hook per SGLang target (SGLang warns, in every process,
about each target with several), nested in the order separate hooks had."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from sgl_pd.backend.registration import nested


def test_each_target_carries_at_most_one_around_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sgl_pd.backend import registration

    registered: list[tuple[str, Any]] = []
    monkeypatch.setattr(
        HookRegistry,
        "register",
        lambda target, hook, kind, *a, **k: registered.append((target, kind)),
    )
    registration.register_backend()
    arounds = Counter(target for target, kind in registered if kind is HookType.AROUND)
    assert arounds and max(arounds.values()) == 1, arounds


def test_nested_hooks_run_as_sglang_nests_them_the_first_innermost() -> None:
    calls: list[str] = []

    def inner(original: Any, x: int) -> int:
        calls.append("inner")
        return original(x) + 1

    def outer(original: Any, x: int) -> int:
        calls.append("outer")
        return original(x) * 10

    assert nested(inner, outer)(lambda x: x, 2) == 30
    assert calls == ["outer", "inner"]
