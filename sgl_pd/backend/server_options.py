"""SGLang server options an sgl_pd server cannot serve, each with the reason.

(The parallel layout - DP, PP, DP attention on a prefill server - is checked apart, on
SGLang's resolved layout: `backend.manager.Parallelism`.)

One list, read in two places: the backend's manager refuses them when a scheduler
starts (however SGLang was launched: its own launcher with the plugin loaded refuses
them too), and ``sgl_pd.launch_server`` asks the same question of the command line
before any rank starts, so the operator reads one line instead of one traceback per rank.

`options` is SGLang's ``ServerArgs`` (or anything with its attribute names); a missing
attribute reads as SGLang's default. Pure: no SGLang import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sgl_pd.config import DECODE_HICACHE_REFUSAL
from sgl_pd.core.state_components import PLANS

# Two-batch overlap runs each layer's attention for micro-batch A, then B: the hook that
# marks "layer L done" fires after A's o_proj, before B wrote layer L's KV.
TWO_BATCH_OVERLAP = (
    "--enable-two-batch-overlap is not served with layer-wise streaming (a layer counts as"
    " done after the first micro-batch, before the second wrote its KV): add --pd-kv-send"
    " after-forward"
)
# Optimistic prefill runs the forward while the decoder is still bootstrapping, so chunks
# would be counted with no destination to write them to.
OPTIMISTIC_PREFILL = (
    "--optimistic-prefill-attempts {attempts} is not served: sgl_pd sends a chunk only to a"
    " decoder that has asked for it; drop the flag"
)
PREFILL_COMPLETE_POLICY = (
    "--disaggregation-decode-allocation-policy prefill_complete is not served (it turns on"
    " optimistic prefill): keep the default, early"
)
HYBRID_STATE = (
    "this model keeps state besides the paged KV cache ({kinds}), which sgl_pd does not"
    " transfer yet{why}"
)
# The state components sgl_pd moves beside the KV pages (SGLang's StateType names):
# the allow-list; every other kind is refused at start-up.
MOVED_STATE_KINDS = tuple(kind for kind, plan in PLANS.items() if plan.refused is None)
# A local prefill on the decoder extends a request whose Mamba state came over the
# wire: SGLang's extend starts linear-attention layers from the prompt's cached state,
# which a decoder's prefix cache of full-attention pages does not hold.
MAMBA_STATE = "a model with Mamba / linear-attention state"
# sgl_pd moves a request's main state slot only: not the replay ring SGLang's ReplaySSM
# keeps beside it, nor a draft model's states (neither was run through PD here).
MAMBA_UNSERVED = (
    "{what} is not served yet with a model whose Mamba / linear-attention state sgl_pd"
    " moves between servers (only each request's main state slot moves): drop it"
)
# sgl_pd moves the target model's sliding-window pages only: a draft model's layers in
# the hybrid SWA pool were never run through PD here. (With the hybrid pool off, every
# layer's KV sits in one pool and moves as pages, draft layers included.)
SLIDING_WINDOW_UNSERVED = (
    "{what} is not served yet with SGLang's hybrid SWA pool (only the target model's"
    " sliding-window pages move): drop it, or start both servers with"
    " --disable-hybrid-swa-memory (every layer's KV then moves as pages)"
)
# The keyed sums cover the KV pages (`core.kv_checksum`), not the state beside them: a
# checksum that passed would vouch for bytes it never read.
CHECKSUM_STATE = (
    "--pd-kv-checksum covers the KV pages only, and this model keeps state besides them"
    " ({kinds}): drop the flag"
)
PREFILL_CONTEXT_PARALLEL = (
    "prefill context parallelism (--enable-prefill-cp / --attn-cp-size) is not served yet:"
    " each rank would hold part of the tokens of every page sgl_pd sends whole"
)
# "full" returns the hidden states of every position a forward computes: a prompt's are
# computed on the prefill server, and the router passes on the decoder's answer only.
FULL_HIDDEN_STATES = (
    "--return-hidden-states-mode full (or --enable-return-hidden-states, which means it)"
    " is not served: the prompt's hidden states stay on the prefill server; use"
    " --return-hidden-states-mode last (one per output token, as served monolithic)"
)
# The multi-layer draft extends the prompt without `_eagle_prefill_tail_tokens`, the one
# place the pinned patch feeds the prompt's last token as the draft's tail (D16).
MULTI_LAYER_EAGLE = (
    "--enable-multi-layer-eagle does not take the decoder-sampled first token's draft tail:"
    " start both servers with --pd-first-token prefill to run it"
)
# A local prefill step is SGLang's prefill scheduling inside the decode loop; with a
# draft model it would also run the draft extend, and with DP attention every attention
# rank would have to agree on the step, neither of which the decode loop does.
LOCAL_PREFILL_UNSERVED = (
    "--pd-local-prefill-max-tokens {tokens} is not served with {what} on the decoder:"
    " drop it (the default turns local prefill off there)"
)
LOCAL_PREFILL_MAX_DERIVED = 512  # the derived limit's ceiling: one step of a decode loop
DEFAULT_CHUNKED_PREFILL_SIZE = 2048  # what the derived limit assumes when SGLang's is unset


# The registry (which hears decoders' skip notices, router flow) and the request handling
# share one HTTP process's memory (`prefill/skips.py`).
TOKENIZER_WORKERS = (
    "--tokenizer-worker-num {workers} is not served on a prefill server: its registry and"
    " its HTTP API must be one process; drop the flag"
)


def _speculative(options: Any) -> str | None:
    """ "speculative decoding (<algorithm>)" when `options` turn it on, else None."""
    spec = getattr(options, "speculative_algorithm", None)
    return None if spec in (None, "", "None", "NONE") else f"speculative decoding ({spec})"


def _local_prefill_blocker(options: Any) -> str | None:
    spec = _speculative(options)
    if spec is not None:
        return spec
    if getattr(options, "enable_dp_attention", False) or _int(options, "attn_dp_size", 1) > 1:
        return "DP attention"
    return None


def local_prefill_limit(options: Any, configured: int, model_config: Any = None) -> int:
    """The largest uncached suffix a decoder with `options` prefills itself: `configured`
    (--pd-local-prefill-max-tokens) when given, else an eighth of its chunked prefill
    size - a step that costs a fraction of a chunk - at most 512 tokens; 0 where a local
    step cannot run (see `LOCAL_PREFILL_UNSERVED`, which `unsupported_option` refuses):
    also for a model with Mamba state (SGLang's `model_config`, when given)."""
    if _local_prefill_blocker(options) is not None or keeps_mamba_state(model_config):
        return 0
    if configured >= 0:
        return configured
    chunk = _int(options, "chunked_prefill_size", DEFAULT_CHUNKED_PREFILL_SIZE)
    if chunk <= 0:
        chunk = DEFAULT_CHUNKED_PREFILL_SIZE
    return min(LOCAL_PREFILL_MAX_DERIVED, chunk // 8)


def keeps_mamba_state(model_config: Any) -> bool:
    """SGLang's `ModelConfig` is of a model with Mamba / linear-attention layers (gated
    DeltaNet, Mamba2, KDA, ...): its pools keep a state slot per request (False for None)."""
    if model_config is None:
        return False
    from sglang.srt.configs.hybrid_arch import mambaish_config

    return mambaish_config(model_config) is not None


def _int(options: Any, name: str, default: int = 0) -> int:
    value = getattr(options, name, default)
    return default if value is None else int(value)


def unsupported_option(
    options: Any,
    role: str,
    *,
    kv_send: str,
    first_token: str,
    state_kinds: Sequence[str] = (),
    local_prefill_max_tokens: int = -1,
    kv_checksum: bool = False,
) -> str | None:
    """Why a server of `role` ("prefill" or "decode") cannot run with `options`, or None.
    `kv_send`, `first_token`, `local_prefill_max_tokens`, `kv_checksum`: sgl_pd's
    settings (`SglPdConfig`); `state_kinds`: the
    kinds of extra per-request state the model's pools keep (SGLang's
    ``KVArgs.state_types``), known once the pools exist."""
    prefill = role == "prefill"
    workers = _int(options, "tokenizer_worker_num", 1)
    if prefill and workers > 1:
        return TOKENIZER_WORKERS.format(workers=workers)
    blocker = _local_prefill_blocker(options)
    if not prefill and local_prefill_max_tokens > 0 and blocker is not None:
        return LOCAL_PREFILL_UNSERVED.format(tokens=local_prefill_max_tokens, what=blocker)
    if not prefill and getattr(options, "enable_hierarchical_cache", False):
        return DECODE_HICACHE_REFUSAL
    if prefill and kv_send == "layerwise" and getattr(options, "enable_two_batch_overlap", False):
        return TWO_BATCH_OVERLAP
    attempts = _int(options, "optimistic_prefill_attempts")
    if attempts:
        return OPTIMISTIC_PREFILL.format(attempts=attempts)
    if getattr(options, "disaggregation_decode_allocation_policy", None) == "prefill_complete":
        return PREFILL_COMPLETE_POLICY
    if getattr(options, "enable_prefill_cp", False) or _int(options, "attn_cp_size", 1) > 1:
        return PREFILL_CONTEXT_PARALLEL
    mode = getattr(options, "return_hidden_states_mode", None)
    if mode == "full" or (mode is None and getattr(options, "enable_return_hidden_states", False)):
        return FULL_HIDDEN_STATES
    if first_token == "decode" and getattr(options, "enable_multi_layer_eagle", False):
        return MULTI_LAYER_EAGLE
    kinds = sorted({str(getattr(k, "value", k)).lower() for k in state_kinds})
    spec = _speculative(options)
    if "mamba" in kinds:
        if not prefill and local_prefill_max_tokens > 0:
            return LOCAL_PREFILL_UNSERVED.format(tokens=local_prefill_max_tokens, what=MAMBA_STATE)
        for flag in ("enable_linear_replayssm", "enable_linear_replayssm_spec"):
            if getattr(options, flag, False):
                return MAMBA_UNSERVED.format(what="--" + flag.replace("_", "-"))
        if spec is not None:
            return MAMBA_UNSERVED.format(what=spec)
    if "swa" in kinds and spec is not None:
        return SLIDING_WINDOW_UNSERVED.format(what=spec)
    unmoved = [k for k in kinds if k not in MOVED_STATE_KINDS]
    if unmoved:
        plan = PLANS.get(unmoved[0])
        why = f" ({plan.models}: {plan.refused})" if plan is not None else " (not planned)"
        return HYBRID_STATE.format(kinds=", ".join(unmoved), why=why)
    if len(kinds) > 1:  # (two moved kinds in one model: never seen, never tested)
        return HYBRID_STATE.format(kinds=", ".join(kinds), why=": never tested together")
    if kinds and kv_checksum:
        return CHECKSUM_STATE.format(kinds=", ".join(kinds))
    return None
