"""Server options sgl_pd cannot serve are refused by the backend itself, read from
SGLang's own parsed arguments: also a server started by SGLang's launcher refuses them."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import pytest

from sgl_pd.backend import server_options
from sgl_pd.backend.server_options import unsupported_option
from sgl_pd.config import CONFIG_ENV, SglPdConfig
from sgl_pd.errors import ConfigError


def sglang_options(*flags: str) -> argparse.Namespace:
    """`flags` parsed by SGLang's own parser (what its launcher hands a scheduler)."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(["--model-path", "m", *flags])


REFUSED = [
    ("prefill", ["--enable-two-batch-overlap"], server_options.TWO_BATCH_OVERLAP),
    ("prefill", ["--optimistic-prefill-attempts", "2"], "--optimistic-prefill-attempts 2"),
    (
        "decode",
        ["--disaggregation-decode-allocation-policy", "prefill_complete"],
        server_options.PREFILL_COMPLETE_POLICY,
    ),
    ("prefill", ["--enable-prefill-cp"], server_options.PREFILL_CONTEXT_PARALLEL),
    ("decode", ["--enable-multi-layer-eagle"], server_options.MULTI_LAYER_EAGLE),
    ("decode", ["--enable-hierarchical-cache"], "decode HiCache"),
    ("decode", ["--enable-return-hidden-states"], server_options.FULL_HIDDEN_STATES),
    ("prefill", ["--return-hidden-states-mode", "full"], server_options.FULL_HIDDEN_STATES),
]


@pytest.mark.parametrize(("role", "flags", "says"), REFUSED)
def test_each_unserved_option_is_refused_with_its_reason(
    role: str, flags: list[str], says: str
) -> None:
    why = unsupported_option(
        sglang_options(*flags), role, kv_send="layerwise", first_token="decode"
    )
    assert why is not None and says in why


def test_served_variants_of_the_same_options_pass() -> None:
    defaults = sglang_options()
    for role in ("prefill", "decode"):
        assert unsupported_option(defaults, role, kv_send="layerwise", first_token="decode") is None
    tbo = sglang_options("--enable-two-batch-overlap")
    assert unsupported_option(tbo, "prefill", kv_send="after-forward", first_token="decode") is None
    assert unsupported_option(tbo, "decode", kv_send="layerwise", first_token="decode") is None
    last = sglang_options("--return-hidden-states-mode", "last")
    assert unsupported_option(last, "decode", kv_send="layerwise", first_token="decode") is None
    eagle = sglang_options("--enable-multi-layer-eagle")
    assert unsupported_option(eagle, "decode", kv_send="layerwise", first_token="prefill") is None


def test_a_model_with_state_besides_the_kv_pages_is_refused_at_start() -> None:
    why = unsupported_option(
        SimpleNamespace(), "prefill", kv_send="layerwise", first_token="decode",
        state_kinds=["MAMBA", "SWA"],
    )  # fmt: skip
    assert why is not None and "MAMBA, SWA" in why


def test_the_manager_refuses_before_it_builds_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    """However SGLang was launched, a scheduler's manager is where sgl_pd starts: it
    refuses there, before a port or a thread exists."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    from sgl_pd.backend.roles import new_kv_manager

    monkeypatch.setenv(CONFIG_ENV, SglPdConfig(kv_send="layerwise").to_json())
    args: Any = SimpleNamespace(state_types=[])
    with pytest.raises(ConfigError, match="two-batch"):
        new_kv_manager(
            args, DisaggregationMode.PREFILL, sglang_options("--enable-two-batch-overlap")
        )
