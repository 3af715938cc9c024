"""Malformed request bodies answered 400 where SGLang's HTTP layer would answer 500.

A hostile-body campaign (`benchmarks/bench_hostile_requests.py`) found bodies that no
scheduler ever saw but that SGLang's HTTP process failed on with an unhandled exception
(a 500, logged with a traceback):
- a request model's own validator that assumes a shape the body does not have (a
  `response_format` that is a list: `'list' object has no attribute 'get'`) - FastAPI
  turns only pydantic's validation errors into 400s (`around_request_body_to_args`);
- `/v1/detokenize` with token ids outside the vocabulary (`after_detokenize_validate`);
- the Ollama endpoints, whose handlers let a ValueError through - the chat template's
  refusal of an empty conversation, and the 400s of `request_checks` - and whose
  streams (their default) dropped the connection on one (`around_ollama_handler`).

Runs in each server's HTTP process, on every server sgl_pd launches.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

from sgl_pd.backend.request_checks import model_limits
from sgl_pd.core.request_limits import id_lists_problem, json_depth_problem


async def around_request_body_to_args(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of FastAPI's ``request_body_to_args`` (body -> the endpoint's request
    model): an exception while validating a body is a validation error of the body,
    which SGLang answers 400, naming it; so is a body nested past `MAX_JSON_DEPTH`."""
    body = kwargs.get("received_body", args[1] if len(args) > 1 else None)
    problem = json_depth_problem(body)
    if problem is not None:
        return {}, [{"type": "value_error", "loc": ("body",), "msg": str(problem), "input": None}]
    try:
        return await original(*args, **kwargs)
    except Exception as e:  # a validator broken by the body's shape
        error = {
            "type": "value_error",
            "loc": ("body",),
            "msg": f"invalid request body: {type(e).__name__}: {e}"[:500],
            "input": None,
        }
        return {}, [error]


def after_detokenize_validate(result: Any, serving: Any, request: Any, *a: Any, **k: Any) -> Any:
    """AFTER hook of ``OpenAIServingDetokenize._validate_request``: the ids to decode must
    be in the vocabulary (the tokenizer raises OverflowError or IndexError otherwise)."""
    if result:
        return result
    tokens = getattr(request, "tokens", None)
    if not isinstance(tokens, list):
        return result
    vocab_size = model_limits(serving.tokenizer_manager).vocab_size
    problem = id_lists_problem("tokens", tokens, vocab_size)
    return str(problem) if problem is not None else result


async def around_ollama_handler(original: Any, serving: Any, request: Any, *args: Any) -> Any:
    """AROUND hook of ``OllamaServing.handle_chat`` / ``handle_generate``: a request it
    cannot serve (a ValueError: an empty conversation, a field `request_checks` refused)
    is answered 400 with the reason, in Ollama's error shape; once a stream has started
    (Ollama streams by default), as its last line, instead of a dropped connection."""
    from fastapi.responses import ORJSONResponse, StreamingResponse

    try:
        response = await original(serving, request, *args)
    except ValueError as e:
        return ORJSONResponse({"error": str(e)}, status_code=400)
    if isinstance(response, StreamingResponse):
        response.body_iterator = _ending_with_the_error(response.body_iterator)
    return response


async def _ending_with_the_error(chunks: AsyncIterable[Any]) -> AsyncIterator[Any]:
    try:
        async for chunk in chunks:
            yield chunk
    except ValueError as e:
        yield json.dumps({"error": str(e)}) + "\n"
