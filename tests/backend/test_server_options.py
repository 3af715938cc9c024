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


def test_a_model_with_state_sgl_pd_does_not_move_is_refused_at_start() -> None:
    """Only the kinds it does not move are named (Mamba state and the hybrid SWA pool's
    window move); two moved kinds in one model were never tested: refused, named."""
    why = unsupported_option(
        SimpleNamespace(), "prefill", kv_send="layerwise", first_token="decode",
        state_kinds=["MAMBA", "DSA", "SWA", "BLOCK_SCALE_SWA"],
    )  # fmt: skip
    assert why is not None and "block_scale_swa, dsa" in why and "mamba" not in why, why
    both = unsupported_option(
        SimpleNamespace(), "decode", kv_send="layerwise", first_token="decode",
        state_kinds=["MAMBA", "SWA"],
    )  # fmt: skip
    assert both is not None and "mamba, swa" in both, both


def test_checksums_are_refused_beside_state_they_do_not_cover() -> None:
    for kind in ("MAMBA", "SWA"):
        why = unsupported_option(
            SimpleNamespace(), "decode", kv_send="layerwise", first_token="decode",
            state_kinds=[kind], kv_checksum=True,
        )  # fmt: skip
        assert why is not None and why.startswith("--pd-kv-checksum"), why
        assert kind.lower() in why and "drop the flag" in why, why
    plain = unsupported_option(
        SimpleNamespace(), "decode", kv_send="layerwise", first_token="decode", kv_checksum=True
    )
    assert plain is None


def test_a_model_with_mamba_state_is_served_but_not_prefilled_on_its_decoder() -> None:
    def refusal(role: str, local_prefill_max_tokens: int = -1) -> str | None:
        return unsupported_option(
            SimpleNamespace(), role, kv_send="layerwise", first_token="decode",
            state_kinds=["MAMBA"], local_prefill_max_tokens=local_prefill_max_tokens,
        )  # fmt: skip

    assert refusal("prefill") is None and refusal("decode") is None
    why = refusal("decode", local_prefill_max_tokens=64)
    assert why is not None and "Mamba / linear-attention state" in why, why


def test_what_moves_beside_a_mamba_state_untested_is_refused() -> None:
    """Only each request's main state slot moves: ReplaySSM's ring and a draft model's
    states are refused with the flag to drop."""
    for options, named in (
        (SimpleNamespace(enable_linear_replayssm=True), "--enable-linear-replayssm"),
        (SimpleNamespace(enable_linear_replayssm_spec=True), "--enable-linear-replayssm-spec"),
        (SimpleNamespace(speculative_algorithm="NEXTN"), "speculative decoding (NEXTN)"),
    ):
        for role in ("prefill", "decode"):
            why = unsupported_option(
                options, role, kv_send="layerwise", first_token="decode", state_kinds=["MAMBA"]
            )
            assert why is not None and why.startswith(named) and "drop it" in why, why
        plain = unsupported_option(options, "decode", kv_send="layerwise", first_token="decode")
        assert plain is None or named not in plain


def test_a_sliding_window_pool_is_served_without_a_draft_model() -> None:
    """SGLang's hybrid SWA pool moves (either spelling of the kind), on both roles; a
    draft model beside it is refused with the flag that serves it (every layer in one
    pool, which sgl_pd moves as any KV)."""
    for kind in ("SWA", "swa"):
        for role in ("prefill", "decode"):
            served = unsupported_option(
                SimpleNamespace(), role, kv_send="layerwise", first_token="decode",
                state_kinds=[kind], local_prefill_max_tokens=64,
            )  # fmt: skip
            assert served is None, served
            why = unsupported_option(
                SimpleNamespace(speculative_algorithm="EAGLE"), role, kv_send="layerwise",
                first_token="decode", state_kinds=[kind],
            )  # fmt: skip
            assert why is not None and why.startswith("speculative decoding (EAGLE)"), why
            assert "--disable-hybrid-swa-memory" in why, why


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


def test_local_prefill_is_refused_where_a_local_step_cannot_run() -> None:
    """A local prefill step is SGLang's prefill inside the decode loop: asked for with a
    draft model or DP attention, the decoder refuses at start; by default it is off there."""
    for flags, what in (
        (["--speculative-algorithm", "EAGLE"], "speculative decoding"),
        (["--enable-dp-attention", "--tp", "2", "--dp", "2"], "DP attention"),
        (["--tp", "2", "--attn-dp-size", "2"], "DP attention"),
    ):
        options = sglang_options(*flags)
        why = unsupported_option(
            options, "decode", kv_send="layerwise", first_token="decode",
            local_prefill_max_tokens=64,
        )  # fmt: skip
        assert why is not None and what in why and "--pd-local-prefill-max-tokens 64" in why
        for off in (-1, 0):  # derived, or off: served, with local prefill off
            assert (
                unsupported_option(
                    options,
                    "decode",
                    kv_send="layerwise",
                    first_token="decode",
                    local_prefill_max_tokens=off,
                )
                is None
            )
        assert server_options.local_prefill_limit(options, -1) == 0
        assert server_options.local_prefill_limit(options, 64) == 0


def test_the_local_prefill_limit_is_derived_from_the_chunk_size_unless_given() -> None:
    assert (
        server_options.local_prefill_limit(sglang_options("--chunked-prefill-size", "128"), -1)
        == 16
    )
    assert (
        server_options.local_prefill_limit(sglang_options("--chunked-prefill-size", "8192"), -1)
        == 512
    )
    assert server_options.local_prefill_limit(sglang_options(), -1) == 256  # SGLang's unset
    assert server_options.local_prefill_limit(sglang_options(), 0) == 0
    assert server_options.local_prefill_limit(sglang_options(), 1000) == 1000


def test_local_prefill_is_off_for_a_model_sglang_keeps_mamba_state_for() -> None:
    """Read from SGLang's own model config, as the scheduler and the HTTP process do:
    the bundled gated-DeltaNet hybrid gets no local prefill, derived or given; a plain
    model keeps its limit."""
    from sglang.srt.configs.model_config import ModelConfig

    from sgl_pd.models import TINY_LLAMA_PATH, TINY_QWEN3_NEXT_PATH

    hybrid, plain = (ModelConfig(str(p)) for p in (TINY_QWEN3_NEXT_PATH, TINY_LLAMA_PATH))
    assert server_options.keeps_mamba_state(hybrid)
    assert not server_options.keeps_mamba_state(plain)
    assert not server_options.keeps_mamba_state(None)
    options = sglang_options()
    for configured in (-1, 64):
        assert server_options.local_prefill_limit(options, configured, hybrid) == 0
    assert server_options.local_prefill_limit(options, -1, plain) == 256


def test_a_prefill_server_with_several_tokenizer_workers_is_refused() -> None:
    """Its registry hears which rooms decoders prefill themselves; the requests are
    answered by the HTTP process that holds that knowledge."""
    options = sglang_options("--tokenizer-worker-num", "2")
    why = unsupported_option(options, "prefill", kv_send="layerwise", first_token="decode")
    assert why is not None and "--tokenizer-worker-num 2" in why
    assert unsupported_option(options, "decode", kv_send="layerwise", first_token="decode") is None


def test_every_state_type_sglang_has_is_planned_and_refused_with_its_reason() -> None:
    """SGLang's state types (its ``StateType``): each has a plan (`core.state_components`);
    those sgl_pd does not move are refused with the plan's reason."""
    from sglang.srt.disaggregation.base.conn import StateType

    from sgl_pd.core.state_components import PLANS

    assert {t.name.lower() for t in StateType} == set(PLANS)
    for kind, plan in PLANS.items():
        why = unsupported_option(
            SimpleNamespace(), "decode", kv_send="layerwise", first_token="decode",
            state_kinds=[kind.upper()],
        )  # fmt: skip
        if plan.refused is None:
            assert why is None, why
        else:
            assert why is not None and plan.refused in why and plan.models in why, why
