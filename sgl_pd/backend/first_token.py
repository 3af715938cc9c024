"""Who samples a request's first token (D16): by default the decoder, never the prefiller.

Upstream PD prefills all n prompt tokens, samples the first output token on the
prefill server (grammar, penalties and seed included) and ships it in the metadata.
With `--pd-first-token decode` (the default):

- the prefill server prefills tokens [0, n-1) only, and never runs a grammar: its copy
  of the request loses the last prompt token and every constraint as it arrives
  (`before_handle_generate_request`);
- the decode server allocates n-1 tokens of KV for it, takes no token from the
  metadata, and its first decode step feeds prompt token n-1 at position n-1 and samples
  the first output token there, with the request's full sampling state
  (`before_decode_prealloc_add` marks the request; the pinned patch
  `patches/sglang-*-decode-samples-first.patch` honours the mark in SGLang's decode
  queue and batch).

A one-token prompt has nothing to prefill without its last token, so it goes the upstream
way on both sides (both decide from n alone, so they always agree).
`--pd-first-token prefill` keeps upstream's behaviour for every request, for comparison.
"""

from __future__ import annotations

import logging
from typing import Any

from sgl_pd.config import BACKEND_NAME, SglPdConfig

logger = logging.getLogger("sgl_pd.first_token")

MARK = "pd_decode_samples_first"  # the Req attribute the SGLang patch reads
_CONSTRAINTS = ("json_schema", "regex", "ebnf", "structural_tag")  # grammars, decoder only


class _Process:
    decode_first: bool | None = None  # this process's choice, read once


def decoder_samples_first() -> bool:
    if _Process.decode_first is None:
        _Process.decode_first = SglPdConfig.from_environment().first_token == "decode"
    return _Process.decode_first


def samples_on_decoder(num_prompt_tokens: int) -> bool:
    """Whether the decoder samples the first token of a prompt of this length."""
    return decoder_samples_first() and num_prompt_tokens >= 2


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
    if input_ids is None or not samples_on_decoder(len(input_ids)):
        return
    recv_req.input_ids = input_ids[:-1]
    sampling = recv_req.sampling_params
    for name in _CONSTRAINTS:
        if getattr(sampling, name, None) is not None:
            setattr(sampling, name, None)


def before_decode_prealloc_add(queue: Any, req: Any, *args: Any, **kw: Any) -> None:
    """BEFORE hook of ``DecodePreallocQueue.add``: marks a request whose first token this
    decode server samples (the patch then allocates and batches it one token short)."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    if not _ours(getattr(queue, "transfer_backend", None)):
        return
    if getattr(req, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST:
        return  # SGLang's own warm-up and health checks: no prefill behind them
    if req.output_ids or not samples_on_decoder(len(req.origin_input_ids)):
        return  # a retracted request resumes with its own tokens
    setattr(req, MARK, True)
