"""Who samples a request's first token (D16): by default the decoder, never the prefiller.

Upstream PD prefills all n prompt tokens, samples the first output token on the
prefill server (grammar, penalties and seed included) and ships it in the metadata.
With `--pd-first-token decode` (the default):

- the prefill server prefills tokens [0, n-1) only, and never runs a grammar or a custom
  logit processor: its copy of the request loses the last prompt token and every
  constraint as it arrives
  (`before_handle_generate_request`);
- the decode server allocates n-1 tokens of KV for it, takes no token from the
  metadata, and its first decode step feeds prompt token n-1 at position n-1 and samples
  the first output token there, with the request's full sampling state
  (`before_decode_prealloc_add` marks the request; the pinned patch
  `patches/sglang-*-decode-samples-first.patch` honours the mark in SGLang's decode
  queue and batch).

With speculative decoding (NEXTN/EAGLE) the prefill server also runs the draft model
over the prompt, whose input is the prompt shifted by one with a tail token appended:
upstream appends the token it sampled; here it is the known prompt token n-1
(`before_prefill_bootstrap_add` hands it to the request, the patch's
`_eagle_prefill_tail_tokens` uses it). The draft's last position then proposes the first
output token, and the decoder's first step verifies that proposal while it feeds token
n-1: the draft's KV, top-k and hidden state come from the prefill (the MTP hand-off),
nothing is re-prefilled.

Some requests go the upstream way on both sides (`whole_prompt_reason`): a one-token
prompt (nothing to prefill without its last token), and requests whose answer holds
something computed at prompt positions - input logprobs (a `logprob_start_len` inside
the prompt), routed experts - or whose prompt is not plain token ids (input embeddings,
multimodal inputs, sessions). Output logprobs and hidden states come from the decoder's
steps, the first one's included. A `logprob_start_len` of n (no prompt position) becomes
n - 1 on the prefill's shortened copy, which says the same.
Each side decides from the same fields of the same request; should they still read the
prompt differently, the decoder's `TransferRequest.kv_tokens` makes the request fail at
once with both numbers rather than decode from the wrong token.
`--pd-first-token prefill` keeps upstream's behaviour for every request, for comparison.

The first-token rule, which every check below enforces. A remote request of n prompt
tokens: its prefill computes the KV of c tokens, c = n - 1 when the decoder samples the
first token and c = n otherwise (`expected_kv_tokens`, on both servers from the same
fields); the decoder holds h <= c of them in its prefix cache (the pinned patch caps its
match at n - 1) and asks for exactly c (`TransferRequest.kv_tokens`). A prefill rank
refuses a room whose decode ranks disagree on h, or whose h changed after it fixed
where it sends from (`prefill/destinations.join`), and, once it knows c, one that holds
h > c (it would never make the last send) or expects another c
(`prefill/destinations.prompt_mismatch`, checked from `prefill/sender.
after_finalize_bootstrap`); with h == c no chunk carries KV and only the metadata row is
awaited (`prefill/writes_due.WritesDue.expect`); the decoder fails a request whose
prefill reports another c (`decode/completion.Completion._seal`). The decoder samples
the first token exactly when c = n - 1. A request prefilled on the decoder itself
(`decode/local_prefill`) computes all n there and samples there: no transfer.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from sgl_pd.config import BACKEND_NAME, SglPdConfig
from sgl_pd.errors import ConfigError

logger = logging.getLogger("sgl_pd.first_token")

MARK = "pd_decode_samples_first"  # the Req attribute the SGLang patch reads
DRAFT_TAIL = "pd_draft_tail_token"  # the Req attribute the patch's draft extend reads
_CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")  # grammars, decoder only


class _Process:
    decode_first: bool | None = None  # this process's choice, read once
    # rid -> the prompt token a prefill copy lost, from arrival until SGLang queues its
    # Req (both happen inside one `handle_generate_request` call)
    draft_tails: ClassVar[dict[str, int]] = {}


def decoder_samples_first() -> bool:
    if _Process.decode_first is None:
        _Process.decode_first = SglPdConfig.from_environment().first_token == "decode"
    return _Process.decode_first


def whole_prompt_reason(
    num_prompt_tokens: int,
    *,
    input_logprobs: bool = False,
    routed_experts: bool = False,
    embeddings: bool = False,
    multimodal: bool = False,
    session: bool = False,
) -> str | None:
    """Why the prefill server must prefill this request's whole prompt and sample its
    first token (the upstream way), or None: the decoder samples it (D16)."""
    if num_prompt_tokens < 2:
        return "a one-token prompt"
    for wanted, why in (
        (input_logprobs, "input logprobs"),
        (routed_experts, "routed experts"),
        (embeddings, "input embeddings"),
        (multimodal, "multimodal inputs"),
        (session, "a session"),
    ):
        if wanted:
            return why
    return None


def samples_on_decoder(num_prompt_tokens: int, **request: bool) -> bool:
    """Whether the decoder samples the first token of a prompt of this length, for a
    request with these properties (`whole_prompt_reason`'s flags)."""
    return decoder_samples_first() and whole_prompt_reason(num_prompt_tokens, **request) is None


def _input_logprobs(request: Any, num_prompt_tokens: int) -> bool:
    """The request asks for logprobs of prompt positions. SGLang's scheduler turns the
    default -1 into n (or keeps -1) before the decoder queues the request: either way
    outside [0, n), as the raw -1 the prefill reads."""
    start = getattr(request, "logprob_start_len", -1)
    return bool(getattr(request, "return_logprob", False)) and 0 <= start < num_prompt_tokens


def _tokenized_request(recv_req: Any, radix_native_sessions: bool = False) -> dict[str, bool]:
    """`whole_prompt_reason`'s flags of a request as the prefill scheduler receives it
    (SGLang's ``TokenizedGenerateReqInput``). A session request becomes a session's Req
    as the scheduler routes it: not when the server serves sessions from its radix cache
    and the request names one by ``session_id`` (then it is an ordinary Req)."""
    radix_native = radix_native_sessions and getattr(recv_req, "session_id", None) is not None
    num_prompt_tokens = len(getattr(recv_req, "input_ids", None) or ())
    return {
        "input_logprobs": _input_logprobs(recv_req, num_prompt_tokens),
        "routed_experts": bool(getattr(recv_req, "return_routed_experts", False)),
        "embeddings": getattr(recv_req, "input_embeds", None) is not None,
        "multimodal": getattr(recv_req, "mm_inputs", None) is not None,
        "session": getattr(recv_req, "session_params", None) is not None and not radix_native,
    }


def queued_request_flags(req: Any) -> dict[str, bool]:
    """The same flags of the same request as the decode scheduler queues it (a ``Req``)."""
    return {
        "input_logprobs": _input_logprobs(req, len(req.origin_input_ids)),
        "routed_experts": bool(getattr(req, "return_routed_experts", False)),
        "embeddings": getattr(req, "input_embeds", None) is not None,
        "multimodal": getattr(req, "multimodal_inputs", None) is not None,
        "session": getattr(req, "session", None) is not None,
    }


def expected_kv_tokens(req: Any) -> int:
    """The prompt tokens whose KV a decode request needs from its prefill: all but the
    last when this decoder samples the first token, else the prompt and any output
    already kept (a request recomputed after a retraction, `decode_retract`)."""
    if getattr(req, MARK, False) and not req.output_ids:
        return len(req.origin_input_ids) - 1
    return len(req.origin_input_ids) + len(req.output_ids)


def _ours(transfer_backend: Any) -> bool:
    return getattr(transfer_backend, "value", None) == BACKEND_NAME


def before_handle_generate_request(scheduler: Any, recv_req: Any, *args: Any, **kw: Any) -> None:
    """BEFORE hook of ``Scheduler.handle_generate_request``, on a prefill server: its
    copy of a request prefills every prompt token but the last, and runs no grammar."""
    if getattr(getattr(scheduler, "disaggregation_mode", None), "value", None) != "prefill":
        return
    if not _ours(getattr(scheduler, "transfer_backend", None)):
        return
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    if getattr(recv_req, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST:
        return  # SGLang's own warm-up and health checks: no decoder behind them
    input_ids = getattr(recv_req, "input_ids", None)
    if input_ids is None or not samples_on_decoder(
        len(input_ids),
        **_tokenized_request(
            recv_req, bool(getattr(scheduler, "enable_session_radix_cache", False))
        ),
    ):
        return
    recv_req.input_ids = input_ids[:-1]
    for start in ("logprob_start_len", "routed_experts_start_len"):
        if getattr(recv_req, start, None) == len(input_ids):  # no prompt position, still
            setattr(recv_req, start, len(input_ids) - 1)
    if not scheduler.spec_algorithm.is_none():
        _Process.draft_tails[recv_req.rid] = int(input_ids[-1])
    sampling = recv_req.sampling_params
    for name in _CONSTRAINTS:
        if getattr(sampling, name, None) is not None:
            setattr(sampling, name, None)
    # a custom logit processor shapes sampling too, which happens on the decoder only
    if getattr(recv_req, "custom_logit_processor", None) is not None:
        recv_req.custom_logit_processor = None


def before_decode_prealloc_add(queue: Any, req: Any, *args: Any, **kw: Any) -> None:
    """BEFORE hook of ``DecodePreallocQueue.add``: marks a request whose first token this
    decode server samples (the patch then allocates and batches it one token short)."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    if not _ours(getattr(queue, "transfer_backend", None)):
        return
    if getattr(req, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST:
        return  # SGLang's own warm-up and health checks: no prefill behind them
    # a retracted request resumes with its own tokens (its first one was sampled)
    forced = getattr(req, "pd_rebootstrap_forced_output_id", None)
    resumed = bool(req.output_ids) or forced is not None
    # (a retracted request is queued again as the same Req: its old mark must go)
    decides = not resumed and samples_on_decoder(
        len(req.origin_input_ids), **queued_request_flags(req)
    )
    setattr(req, MARK, decides)
    retracted = kw.get("is_retracted", args[0] if args else False)
    if not retracted:  # (a retracted request resumes from its host copy: no transfer)
        queue.kv_manager.expect_prompt(
            req.bootstrap_room, expected_kv_tokens(req), resumes_from=forced
        )


def after_handle_generate_request(
    result: Any, scheduler: Any, recv_req: Any, *args: Any, **kw: Any
) -> Any:
    """AFTER hook of ``Scheduler.handle_generate_request``: a request SGLang refused
    before queueing it leaves no tail token behind."""
    _Process.draft_tails.pop(recv_req.rid, None)
    return result


def before_prefill_bootstrap_add(queue: Any, req: Any, *args: Any, **kw: Any) -> None:
    """BEFORE hook of ``PrefillBootstrapQueue.add``: a speculative prefill's draft extend
    ends on the prompt's last token, which its copy of the request no longer holds."""
    tail = _Process.draft_tails.pop(req.rid, None)
    if tail is not None:
        setattr(req, DRAFT_TAIL, tail)


def require_decode_patches() -> None:
    """Refuses to serve decode without the pinned patches that honour `MARK` (SGLang's
    own code would then hand the request KV for every prompt token, and with a prefix
    cache hold tokens the prefill never computes): one line, at start-up."""
    import inspect

    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    patched = (
        DecodePreallocQueue._pre_alloc_fill_len,  # decode-samples-first
        DecodePreallocQueue._match_prefix_and_lock,  # decode-holds-before-last-token
    )
    missing = [f.__name__ for f in patched if MARK not in inspect.getsource(f)]
    if missing:
        raise ConfigError(
            f"SGLang's {', '.join(missing)} lack sgl_pd's pinned patches: run"
            " launch/install.sh (python -m sgl_pd.harness.patches apply)"
        )
