"""Requests a server of ours cannot serve, refused as they arrive, with the reason.

On every server launched with sgl_pd (monolithic included): a request field that could
crash or corrupt a scheduler (`core.request_limits`) is answered 400 naming the field -
checked as the request arrives (`around_generate_request`, before a direct-mode decoder
sends it to a prefill server) and again once its prompt is token ids
(`before_validate_one_request`).

On a PD server:

`n > 1` (parallel sampling): SGLang's tokenizer turns one request into a prefix warm-up
plus n copies, and every copy keeps the one bootstrap room the router gave the request.
The prefill and decode servers each see n + 1 requests under one room, with nothing that
pairs the k-th copy on one side with the k-th on the other, so a transfer cannot be
matched to its request (upstream's backends cannot either). The client gets a 400 that
says so and what to do instead: send n requests.

Input top logprobs and input token-id logprobs (``top_logprobs_num`` or
``token_ids_logprob`` with a ``logprob_start_len`` inside the prompt): the prefill server
computes them, and SGLang's router copies only a prefill server's input token logprobs
into the answer; the client would get the answer without them. Refused with the reason
(output top logprobs, and input token logprobs, are served).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from sgl_pd.config import sgl_pd_role
from sgl_pd.core.request_limits import (
    ModelLimits,
    raw_request_problem,
    tokenized_request_problem,
)

_LIMITS = "_sgl_pd_model_limits"  # the TokenizerManager attribute caching `ModelLimits`

PARALLEL_SAMPLING_REFUSED = (
    "n > 1 (parallel sampling) is not supported by prefill/decode disaggregation: SGLang "
    "sends the n samples as copies of the request that share one bootstrap room, which the "
    "prefill and decode servers cannot pair; send n separate requests instead"
)


INPUT_TOP_LOGPROBS_REFUSED = (
    "top logprobs and token-id logprobs of prompt positions (top_logprobs_num or"
    " token_ids_logprob with logprob_start_len {start} inside a {n}-token prompt) are not"
    " served through prefill/decode disaggregation: SGLang's router passes on only the"
    " prefill server's input token logprobs; ask for them from logprob_start_len {n} (output"
    " positions), or send the request to a monolithic server"
)


def _input_top_logprobs(obj: Any, num_prompt_tokens: int) -> int | None:
    """The request's logprob start when it asks for top or token-id logprobs of prompt
    positions, else None."""
    if not getattr(obj, "return_logprob", False):
        return None
    wants = bool(getattr(obj, "top_logprobs_num", 0)) or bool(
        getattr(obj, "token_ids_logprob", None)
    )
    start = getattr(obj, "logprob_start_len", -1)
    if not wants or not isinstance(start, int) or not 0 <= start < num_prompt_tokens:
        return None
    return start


def _samples(obj: Any) -> int:
    params = getattr(obj, "sampling_params", None)
    if isinstance(params, dict):
        return int(params.get("n", 1) or 1)
    return 1


def model_limits(manager: Any) -> ModelLimits:
    """The served model's limits, as this HTTP process's tokenizer manager knows them."""
    limits = getattr(manager, _LIMITS, None)
    if limits is None:
        config = manager.model_config
        limits = ModelLimits(
            vocab_size=int(config.vocab_size),
            context_len=int(manager.context_len),
            hidden_size=getattr(config, "hidden_size", None),
        )
        setattr(manager, _LIMITS, limits)
    return limits


def refuse_unsafe(manager: Any, obj: Any) -> None:
    """Raises ValueError (SGLang's 400) for a generate request with a field no scheduler
    can safely take; called before anything else sees the request."""
    if hasattr(obj, "sampling_params"):  # generate, not embedding
        problem = raw_request_problem(vars(obj), model_limits(manager))
        if problem is not None:
            raise ValueError(str(problem))
        _check_logit_processors(manager, getattr(obj, "custom_logit_processor", None))


async def around_generate_request(
    original: Any, manager: Any, obj: Any, request: Any = None
) -> AsyncIterator[Any]:
    """AROUND hook of ``TokenizerManager.generate_request``, innermost of sgl_pd's: on a
    prefill server `refusals` wraps it, so a refused router request's room is refused
    too and its decoder hears at once; a direct-mode decoder calls `refuse_unsafe`
    itself before it submits a request anywhere."""
    refuse_unsafe(manager, obj)
    async for out in original(manager, obj, request):
        yield out


def _check_logit_processors(manager: Any, payloads: Any) -> None:
    """A custom logit processor (served with --enable-custom-logit-processor) is built
    from its payload in the scheduler, where a payload that does not load would end the
    process: loaded here first, by SGLang's own loader (which caches it), and refused
    with a 400 unless it is callable."""
    if not payloads or not getattr(manager.server_args, "enable_custom_logit_processor", False):
        return  # (without the flag SGLang refuses every payload itself)
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

    for payload in payloads if isinstance(payloads, list) else [payloads]:
        if payload is None:
            continue
        try:
            processor = CustomLogitProcessor.from_str(payload)
        except Exception as e:
            raise ValueError(
                f"invalid request field custom_logit_processor: it does not load ({e})"[:500]
            ) from None
        if not callable(processor):  # (the scheduler only calls it)
            raise ValueError("invalid request field custom_logit_processor: not callable")


def before_validate_one_request(manager: Any, obj: Any, *args: Any, **kw: Any) -> None:
    """BEFORE hook of ``TokenizerManager._validate_one_request`` (the HTTP process): a
    ValueError here is SGLang's own way to answer 400 with the message."""
    input_ids = args[0] if args else kw.get("input_ids")
    problem = tokenized_request_problem(
        input_ids, model_limits(manager), input_embeds=getattr(obj, "input_embeds", None)
    )
    if problem is not None:
        raise ValueError(str(problem))
    if sgl_pd_role(manager.server_args) is None:
        return
    if _samples(obj) > 1:
        raise ValueError(PARALLEL_SAMPLING_REFUSED)
    n = len(input_ids) if input_ids is not None else 0
    start = _input_top_logprobs(obj, n)
    if start is not None:
        raise ValueError(INPUT_TOP_LOGPROBS_REFUSED.format(start=start, n=n))
