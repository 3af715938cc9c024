"""Request fields that could crash or corrupt a scheduler, checked before any does.

A token id past the vocabulary (or negative) reaches the embedding gather: on CPU an
`IndexError` kills the scheduler process, on a GPU a device-side assert poisons the CUDA
context. So do top logprobs wider than the vocabulary, stop token ids or logit bias keys
outside it (penalizers scatter them into vocabulary-wide rows), and input embeddings of
the wrong width. In a disaggregated cluster one prefill server serves many decoders, so
one such request would fail every request in flight. Each check here names the field,
and the server answers 400 with it.

Two passes, both pure:
- `raw_request_problem` reads the request as it arrived - single or batch, before
  SGLang normalizes it and before anything is sent anywhere (a prefill server included):
  value ranges and types that need no prompt;
- `tokenized_request_problem` reads one request of it once its prompt is token ids: ids
  against the vocabulary, and embedding widths against the model's.

Sampling parameters SGLang itself verifies at its door (`SamplingParams.verify`: top_p,
min_p, penalties, min/max new tokens, logit bias keys) are checked again only for what
its check lets through: types (its parameters are not type-checked on construction) and
non-finite numbers.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# Samples one HTTP request may ask for (prompts of a batch times `n`): more is a request
# no client needs and every scheduler would hold in its queues at once
MAX_SAMPLES_PER_REQUEST = 65536
# nesting of a request body's JSON (objects and lists): a tool schema nested a thousand
# deep ran SGLang's request handling out of Python's recursion limit (a 500)
MAX_JSON_DEPTH = 64
# Parallel samples of one prompt (SGLang copies the request this many times)
MAX_N = 1024
# Stop token ids and logit bias entries of one request (each is a vocabulary row write)
MAX_TOKEN_LIST = 4096
# A sampling seed is an int64 in SGLang's sampler; top_k an int32 in its sampling batch
INT64 = (-(2**63), 2**63 - 1)
INT32_MAX = 2**31 - 1
# A logit bias is added to float32 logits: past float32's range it is an infinity, and
# the softmax of an infinite logit is NaN
MAX_LOGIT_BIAS = 1e30


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the served model's."""

    vocab_size: int  # token ids are in [0, vocab_size)
    context_len: int  # tokens a request may hold, prompt and output
    hidden_size: int | None = None  # the width of one input embedding; None: unknown


@dataclass(frozen=True)
class BadField:
    """The first field of a request that cannot be served, and why."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"invalid request field {self.field}: {self.message}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _per_item(value: Any) -> Iterator[tuple[str, Any]]:
    """A field that is one value for a single request or a list of them for a batch:
    (suffix naming the item, value) for each."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            yield f"[{i}]", item
    else:
        yield "", value


def token_ids_problem(
    field: str, ids: Any, vocab_size: int, *, max_len: int | None = None
) -> BadField | None:
    """`ids` must be a flat list of ints in [0, vocab_size). Checked with numpy: a
    prompt of a million ids costs milliseconds."""
    if not isinstance(ids, (list, tuple)):
        return BadField(field, f"a list of token ids, not {type(ids).__name__}")
    if max_len is not None and len(ids) > max_len:
        return BadField(field, f"{len(ids)} token ids, at most {max_len}")
    if not ids:
        return None
    # the types present, not each id (a type per id in C: a long prompt costs little)
    if not all(issubclass(t, int) and t is not bool for t in set(map(type, ids))):
        bad = next(i for i in ids if not _is_int(i))
        return BadField(field, f"token ids are integers, not {bad!r:.40}")
    try:
        array = np.asarray(ids, dtype=np.int64)
    except OverflowError:
        return BadField(field, f"token ids are in [0, {vocab_size})")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        worst = low if low < 0 else high
        return BadField(field, f"token id {worst} is outside the vocabulary [0, {vocab_size})")
    return None


def id_lists_problem(
    field: str,
    value: Any,
    vocab_size: int,
    *,
    max_len: int | None = None,
    skip_none: bool = False,
) -> BadField | None:
    """`value`: token ids, or a list of them (one per prompt of a batch, `field[i]`);
    None is no ids. `skip_none`: a list's None entries are prompts without any."""
    if value is None:
        return None
    if not (isinstance(value, list) and value and isinstance(value[0], list)):
        return token_ids_problem(field, value, vocab_size, max_len=max_len)
    for i, ids in enumerate(value):
        if ids is None and skip_none:
            continue
        problem = token_ids_problem(f"{field}[{i}]", ids, vocab_size, max_len=max_len)
        if problem is not None:
            return problem
    return None


@dataclass(frozen=True)
class _Prompts:
    """How SGLang reads a request's prompts (`GenerateReqInput._determine_batch_size`): a
    batch - of one, too - when text is a list, input_ids a list of lists or input_embeds
    a list of lists of rows; per-prompt fields may then be lists of `count` values."""

    batch: bool
    count: int


def _prompts(request: Mapping[str, Any]) -> _Prompts:
    text, ids, embeds = (request.get(k) for k in ("text", "input_ids", "input_embeds"))
    if isinstance(text, list):
        return _Prompts(True, len(text))
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return _Prompts(True, len(ids))
    if isinstance(embeds, list) and embeds and isinstance(embeds[0], list):
        first_row = embeds[0][0] if embeds[0] else None
        if isinstance(first_row, list):  # prompts of rows, not rows of numbers
            return _Prompts(True, len(embeds))
    return _Prompts(False, 1)


# sampling parameters that are numbers: (lowest, highest) allowed, None = unbounded; the
# ranges SGLang's own check enforces are repeated so that a non-number fails here first
_NUMBER_RANGES: dict[str, tuple[float | None, float | None]] = {
    "temperature": (0.0, None),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, 2.0),
}
_INT_PARAMS = ("max_new_tokens", "min_new_tokens", "n", "top_k", "stream_interval")
_STRING_PARAMS = ("json_schema", "regex", "ebnf", "structural_tag")
_BOOL_PARAMS = ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                "no_stop_trim")  # fmt: skip


def sampling_params_problem(field: str, params: Any, limits: ModelLimits) -> BadField | None:
    """One request's sampling parameters: types, and the ranges a scheduler relies on."""
    if params is None:
        return None
    if not isinstance(params, dict):
        return BadField(field, f"an object, not {type(params).__name__}")
    for name, (low, high) in _NUMBER_RANGES.items():
        value = params.get(name)
        if value is None:
            continue
        if not _is_number(value) or not math.isfinite(value):
            return BadField(f"{field}.{name}", f"a finite number, not {value!r:.40}")
        if (low is not None and value < low) or (high is not None and value > high):
            return BadField(f"{field}.{name}", f"{value} is outside [{low}, {high}]")
    for name in _INT_PARAMS:
        value = params.get(name)
        if value is not None and not _is_int(value):
            return BadField(f"{field}.{name}", f"an integer, not {value!r:.40}")
    for name in _STRING_PARAMS:
        value = params.get(name)
        if value is not None and not isinstance(value, str):
            return BadField(f"{field}.{name}", f"a string, not {type(value).__name__}")
    for name in _BOOL_PARAMS:
        value = params.get(name)
        if value is not None and not isinstance(value, bool):
            return BadField(f"{field}.{name}", f"true or false, not {value!r:.40}")
    n = params.get("n")
    if n is not None and not 1 <= n <= MAX_N:
        return BadField(f"{field}.n", f"{n} samples; 1 to {MAX_N}")
    for name in ("max_new_tokens", "min_new_tokens"):
        # (SGLang checks them against the context, or shrinks them with
        # --allow-auto-truncate; a scheduler keeps them in int32 tensors)
        value = params.get(name)
        if value is not None and not 0 <= value <= INT32_MAX:
            return BadField(f"{field}.{name}", f"{value} is outside [0, {INT32_MAX}]")
    top_k = params.get("top_k")
    if top_k is not None and top_k != -1 and not 1 <= top_k <= INT32_MAX:
        # (a sampling batch holds top_k in an int32 tensor: a larger one ended a scheduler)
        return BadField(
            f"{field}.top_k", f"-1 (the whole vocabulary) or 1 to {INT32_MAX}, not {top_k}"
        )
    interval = params.get("stream_interval")
    if interval is not None and interval < 1:
        return BadField(f"{field}.stream_interval", f"at least 1, not {interval}")
    stop_ids = params.get("stop_token_ids")
    if stop_ids is not None:
        if isinstance(stop_ids, (set, frozenset, tuple, list)):  # (SGLang drops None entries)
            stop_ids = [t for t in stop_ids if t is not None]
        problem = token_ids_problem(
            f"{field}.stop_token_ids", stop_ids, limits.vocab_size, max_len=MAX_TOKEN_LIST
        )
        if problem is not None:
            return problem
    bias = params.get("logit_bias")
    if bias is not None:
        problem = _logit_bias_problem(f"{field}.logit_bias", bias, limits.vocab_size)
        if problem is not None:
            return problem
    seed = params.get("sampling_seed")
    if seed is not None and (not _is_int(seed) or not INT64[0] <= seed <= INT64[1]):
        return BadField(f"{field}.sampling_seed", "an integer in [-2**63, 2**63 - 1]")
    stop = params.get("stop")
    strings = isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    if stop is not None and not isinstance(stop, str) and not strings:
        return BadField(f"{field}.stop", "a string or a list of strings")
    return None


def _logit_bias_problem(field: str, bias: Any, vocab_size: int) -> BadField | None:
    if not isinstance(bias, dict):
        return BadField(field, f"an object of token id -> bias, not {type(bias).__name__}")
    if len(bias) > MAX_TOKEN_LIST:
        return BadField(field, f"{len(bias)} entries, at most {MAX_TOKEN_LIST}")
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            return BadField(field, f"keys are token ids, not {key!r:.40}")
        if not 0 <= token < vocab_size:
            return BadField(field, f"token id {token} is outside the vocabulary [0, {vocab_size})")
        if not _is_number(value) or not abs(value) <= MAX_LOGIT_BIAS:
            return BadField(f"{field}[{key}]", f"a number in [-1e30, 1e30], not {value!r:.40}")
    return None


def _logprob_problem(request: Mapping[str, Any], limits: ModelLimits) -> BadField | None:
    for suffix, num in _per_item(request.get("top_logprobs_num")):
        if num is None:
            continue
        if not _is_int(num) or not 0 <= num <= limits.vocab_size:
            return BadField(
                f"top_logprobs_num{suffix}", f"{num!r:.40} is outside [0, {limits.vocab_size}]"
            )
    for suffix, start in _per_item(request.get("logprob_start_len")):
        if start is not None and (not _is_int(start) or start < -1):
            return BadField(
                f"logprob_start_len{suffix}",
                f"-1 (output only) or a prompt position, not {start!r:.40}",
            )
    return id_lists_problem(
        "token_ids_logprob", request.get("token_ids_logprob"), limits.vocab_size,
        max_len=MAX_TOKEN_LIST, skip_none=True,
    )  # fmt: skip


# SGLang's SessionParams fields, and the types each takes (None allowed for all)
_SESSION_FIELDS: dict[str, type] = {
    "id": str, "rid": str, "offset": int, "replace": bool, "drop_previous_output": bool,
}  # fmt: skip


def _session_problem(session: Any) -> BadField | None:
    if session is None:
        return None
    if not isinstance(session, dict):
        return BadField("session_params", f"an object, not {type(session).__name__}")
    for key, value in session.items():
        kind = _SESSION_FIELDS.get(key)
        if kind is None:
            return BadField("session_params", f"unknown field {key!r:.40}")
        if value is not None and (
            not isinstance(value, kind) or isinstance(value, bool) != (kind is bool)
        ):
            return BadField(f"session_params.{key}", f"a {kind.__name__}, not {value!r:.40}")
    return None


def _bootstrap_problem(request: Mapping[str, Any]) -> BadField | None:
    """Where a decoder gets a request's KV (a router names the prefill server): a room
    and a host come together, each of its type, one per prompt of a batch. A room
    without a host reached the decoder's scheduler and ended it."""
    hosts, ports, rooms = (
        _per_item(request.get(f"bootstrap_{k}")) for k in ("host", "port", "room")
    )
    for (suffix, host), (_, port), (_, room) in zip(hosts, ports, rooms, strict=False):
        if host is None and room is None and port is None:
            continue
        if not isinstance(host, str) or not host:
            return BadField(f"bootstrap_host{suffix}", "a host name, given with bootstrap_room")
        if not _is_int(room) or not 0 <= room < 2**64:
            return BadField(
                f"bootstrap_room{suffix}", "an integer in [0, 2**64), given with bootstrap_host"
            )
        if port is not None and (not _is_int(port) or not 0 <= port <= 65535):
            return BadField(f"bootstrap_port{suffix}", f"a port number, not {port!r:.40}")
    return None


# fields that hold one value per prompt of a batch (a list of them, or one for all)
_PER_PROMPT = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "return_logprob",
               "top_logprobs_num", "logprob_start_len")  # fmt: skip


def _per_prompt_problem(request: Mapping[str, Any], prompts: _Prompts, n: int) -> BadField | None:
    """A per-prompt field given as a list: a batch's has one value per prompt (a shorter
    list was a 500: SGLang indexes it by prompt); a single prompt sampled once takes no
    list (a list request id was a 500). With n > 1 SGLang copies the request first and
    reads the lists itself - but a list shorter than the prompts is still indexed past
    its end (a chat request's `bootstrap_host: []` with n = 4 was a 500)."""
    rid = request.get("rid")
    named = rid if isinstance(rid, list) else [rid]
    if not all(r is None or isinstance(r, str) for r in named):
        return BadField("rid", "a string (a list of them for a batch)")
    if not prompts.batch and n > 1:
        for name in (*_PER_PROMPT, "rid"):
            value = request.get(name)
            if isinstance(value, list) and len(value) < prompts.count:
                return BadField(name, "one value, or a list of one per prompt")
        return None
    for name in (*_PER_PROMPT, "rid"):
        value = request.get(name)
        if not isinstance(value, list):
            continue
        if not prompts.batch:
            return BadField(name, "one value for a single prompt, not a list")
        if len(value) != prompts.count:
            return BadField(name, f"one value, or a list of one per prompt ({prompts.count})")
    return None


def raw_request_problem(request: Mapping[str, Any], limits: ModelLimits) -> BadField | None:
    """The first field of a generate request, as it arrived (single or batch), that no
    scheduler can safely take; None when there is none. `request` maps field names to
    values (a `GenerateReqInput`'s attributes)."""
    problem = id_lists_problem("input_ids", request.get("input_ids"), limits.vocab_size)
    if problem is not None:
        return problem
    prompts = _prompts(request)
    problem = _prompt_shapes_problem(request, prompts)
    if problem is not None:
        return problem
    listed = request.get("sampling_params")
    if isinstance(listed, list) and len(listed) != prompts.count:  # (an empty one was a 500)
        return BadField(
            "sampling_params", f"an object, or a list of one per prompt ({prompts.count})"
        )
    samples = 0  # what SGLang makes of the request: each prompt, n times
    for suffix, params in _per_item(listed):
        problem = sampling_params_problem(f"sampling_params{suffix}", params, limits)
        if problem is not None:
            return problem
        n = params.get("n") if isinstance(params, dict) else None
        each = n if isinstance(n, int) and n > 1 else 1
        samples += each if isinstance(listed, list) else each * prompts.count
    if samples > MAX_SAMPLES_PER_REQUEST:
        return BadField(
            "batch", f"{samples} samples in one request, at most {MAX_SAMPLES_PER_REQUEST}"
        )
    n = listed.get("n") if isinstance(listed, dict) else None
    return (
        _logprob_problem(request, limits)
        or _session_problem(request.get("session_params"))
        or _per_prompt_problem(request, prompts, n if isinstance(n, int) else 1)
        or _bootstrap_problem(request)
        or _prefill_dp_rank_problem(request.get("disagg_prefill_dp_rank"))
    )


def _prompt_shapes_problem(request: Mapping[str, Any], prompts: _Prompts) -> BadField | None:
    """Prompt fields that agree on the prompts: a batch's ids and embeddings hold one
    entry per prompt (a batch of texts with a flat id list beside it was a 500: SGLang
    indexes the ids by prompt), and embeddings are not empty (an empty list reached the
    scheduler as a prompt of nothing: a 500, or a stream cut short)."""
    ids, embeds = request.get("input_ids"), request.get("input_embeds")
    if prompts.batch and ids is not None:
        per_prompt = isinstance(ids, list) and all(isinstance(x, list) for x in ids)
        if not per_prompt or len(ids) != prompts.count:
            return BadField("input_ids", f"a list of one id list per prompt ({prompts.count})")
    if embeds is not None:
        if not isinstance(embeds, list) or not embeds:
            return BadField("input_embeds", "a non-empty list of embedding rows")
        per_prompt = isinstance(embeds[0], list) and bool(embeds[0])
        per_prompt = per_prompt and isinstance(embeds[0][0], list)  # (rows, per prompt)
        short = len(embeds) != prompts.count or not all(isinstance(e, list) and e for e in embeds)
        if prompts.batch and per_prompt and short:
            return BadField(
                "input_embeds", f"one non-empty list of rows per prompt ({prompts.count})"
            )
    return None


def _prefill_dp_rank_problem(rank: Any) -> BadField | None:
    """sgl_pd serves prefill servers of one data-parallel rank: a request naming another
    failed its KV hand-off at the decoder (a 500)."""
    if rank is None or (isinstance(rank, int) and not isinstance(rank, bool) and rank == 0):
        return None
    return BadField("disagg_prefill_dp_rank", "0 or absent: sgl_pd serves prefill DP size 1")


def json_depth_problem(body: Any, limit: int = MAX_JSON_DEPTH) -> BadField | None:
    """A request body nested deeper than `limit` objects and lists (walked without
    recursion: the point is not to need it)."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            return BadField("body", f"JSON nested at most {limit} deep")
        stack.extend((child, depth + 1) for child in children)
    return None


def tokenized_request_problem(
    input_ids: Sequence[int] | None,
    limits: ModelLimits,
    *,
    input_embeds: Any = None,
) -> BadField | None:
    """One request of a batch, its prompt tokenized: the ids a scheduler will embed (a
    text or chat prompt's too), and its input embeddings' width."""
    if input_ids is not None:
        if not isinstance(input_ids, (list, tuple)):  # (a batch's flat list, indexed)
            return BadField("input_ids", "a list of token ids for each prompt")
        problem = token_ids_problem("input_ids", list(input_ids), limits.vocab_size)
        if problem is not None:
            return problem
    if input_embeds is not None:
        problem = _embeds_problem(input_embeds, limits.hidden_size)
        if problem is not None:
            return problem
    return None


def _embeds_problem(embeds: Any, width: int | None) -> BadField | None:
    """Input embeddings: a list of rows, each `width` finite numbers."""
    if not isinstance(embeds, list) or not embeds:
        return BadField("input_embeds", "a non-empty list of embedding rows")
    try:
        array = np.asarray(embeds, dtype=np.float64)
    except (TypeError, ValueError):
        return BadField("input_embeds", "rows of numbers, all of one width")
    if array.ndim != 2:
        return BadField("input_embeds", f"a list of rows (2 dimensions), not {array.ndim}")
    if width is not None and array.shape[1] != width:
        return BadField(
            "input_embeds", f"rows of {array.shape[1]} numbers; the model's are {width}"
        )
    if not np.isfinite(array).all():
        return BadField("input_embeds", "finite numbers")
    return None
