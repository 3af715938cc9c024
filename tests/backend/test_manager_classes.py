"""The role classes SGLang instantiates implement every abstract method of its base."""

from __future__ import annotations

from sgl_pd.backend.decode.manager import DecodeKVManager
from sgl_pd.backend.decode.receiver import SglPdKVReceiver
from sgl_pd.backend.prefill.manager import PrefillKVManager
from sgl_pd.backend.prefill.sender import SglPdKVSender


def test_nothing_abstract_is_left() -> None:
    for cls in (PrefillKVManager, DecodeKVManager, SglPdKVSender, SglPdKVReceiver):
        assert not cls.__abstractmethods__, f"{cls.__name__}: {cls.__abstractmethods__}"


def test_only_the_decode_role_defers_release() -> None:
    assert DecodeKVManager.enable_deferred_decode_kv_release
    assert not PrefillKVManager.enable_deferred_decode_kv_release
