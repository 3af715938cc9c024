"""The role classes SGLang instantiates implement every abstract method of its base, and
each scheduler gets its role's class."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_pd.backend import roles
from sgl_pd.backend.decode.manager import DecodeKVManager
from sgl_pd.backend.decode.receiver import SglPdKVReceiver
from sgl_pd.backend.prefill.manager import PrefillKVManager
from sgl_pd.backend.prefill.sender import SglPdKVSender
from sgl_pd.backend.roles import manager_class, new_kv_manager
from sgl_pd.config import BACKEND_NAME


def test_nothing_abstract_is_left() -> None:
    for cls in (PrefillKVManager, DecodeKVManager, SglPdKVSender, SglPdKVReceiver):
        assert not cls.__abstractmethods__, f"{cls.__name__}: {cls.__abstractmethods__}"


def test_only_the_decode_role_defers_release() -> None:
    assert DecodeKVManager.enable_deferred_decode_kv_release
    assert not PrefillKVManager.enable_deferred_decode_kv_release


def test_the_role_picks_the_manager_class() -> None:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    assert manager_class(DisaggregationMode.PREFILL) is PrefillKVManager
    assert manager_class(DisaggregationMode.DECODE) is DecodeKVManager


def test_sglang_gets_the_role_factory_as_its_manager_class() -> None:
    from sglang.srt.disaggregation.utils import KVClassType

    from sgl_pd.backend.registration import kv_class_around_hook

    def sglang_own(transfer_backend: object, class_type: object) -> None:
        raise AssertionError("sgl_pd's classes come from sgl_pd")

    ours = SimpleNamespace(value=BACKEND_NAME)
    assert kv_class_around_hook(sglang_own, ours, KVClassType.MANAGER) is new_kv_manager


def test_the_factory_builds_the_role_class_with_sglangs_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    built: list[tuple[str, tuple[object, ...]]] = []
    monkeypatch.setattr(roles, "PrefillKVManager", lambda *a: built.append(("prefill", a)))
    monkeypatch.setattr(roles, "DecodeKVManager", lambda *a: built.append(("decode", a)))
    new_kv_manager("kv_args", DisaggregationMode.PREFILL, "server_args", True)
    new_kv_manager("kv_args", DisaggregationMode.DECODE, "server_args")
    assert built == [
        ("prefill", ("kv_args", DisaggregationMode.PREFILL, "server_args", True)),
        ("decode", ("kv_args", DisaggregationMode.DECODE, "server_args", False)),
    ]


def test_a_decoder_with_host_tiers_of_its_prefix_cache_is_refused() -> None:
    """Decode HiCache is refused by the backend itself, however the server was started:
    one line that says why and what to keep."""
    from sgl_pd.backend.decode.manager import DecodeKVManager
    from sgl_pd.errors import ConfigError

    server_args = SimpleNamespace(enable_hierarchical_cache=True)
    with pytest.raises(ConfigError, match=r"decode HiCache.*--disaggregation-decode-enable-radix"):
        DecodeKVManager(SimpleNamespace(), None, server_args)
