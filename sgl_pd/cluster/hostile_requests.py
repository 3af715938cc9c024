"""Hostile request bodies against a server's HTTP API, and how the servers took them.

Shared by `benchmarks/bench_hostile_requests.py` (the campaign) and the suite's
regression rows (`load_cases`, `send`).

Bodies (`draw_bodies`), for each endpoint:
- Schemathesis over the server's own OpenAPI schema (FastAPI's `/openapi.json`): bodies
  that fit the schema, laid over a small valid request so that they reach the tokenizer
  and the scheduler, and bodies that break it, sent as they are;
- Hypothesis strategies for the fields the schema leaves loose (`sampling_params` is any
  object, ids are any integers): token ids around and past the vocabulary, non-finite and
  mistyped numbers, hostile grammars, logprob options, batches - also laid over a valid
  request.

Each body is sent as JSON that may hold NaN and Infinity (Python's parser on the server
takes them). Output is capped unless a body sets it: the campaign measures the doors,
not generation.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import requests

# the endpoints a client sends requests to (operators' endpoints - pausing, weights,
# logging, aborts - are not a public API's)
GENERATE = "/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAIN_ENDPOINTS = (GENERATE, COMPLETIONS, CHAT)
OTHER_ENDPOINTS = ("/v1/tokenize", "/v1/detokenize", "/api/generate", "/api/chat",
                   "/v1/messages", "/v1/responses")  # fmt: skip
MODEL = "default"  # the model name OpenAI bodies carry (SGLang serves whatever it is)
OUTPUT_CAP = 4  # output tokens of a body that does not say


@dataclass(frozen=True)
class Body:
    endpoint: str
    body: Any  # a JSON value (an object, mostly), NaN and Infinity allowed
    kind: str  # which generator drew it: schema, schema_overlay, schema_negative, loose


@dataclass(frozen=True)
class Outcome:
    """How a server answered one body: an HTTP status, or `timeout` / `connection`
    (no answer: the server closed the connection or was gone)."""

    status: int | str
    error_in_stream: bool = False  # a 200 stream that carried an error of 5xx
    excerpt: str = ""

    @property
    def server_error(self) -> bool:
        """A 5xx, but 501: an endpoint a server does not offer (the router's /v1/responses)
        says so with a 501, which is no failure."""
        failed = isinstance(self.status, int) and self.status >= 500 and self.status != 501
        return failed or self.error_in_stream

    @property
    def no_answer(self) -> bool:
        return self.status in ("timeout", "connection")


def encode(body: Any) -> bytes:
    return json.dumps(body, allow_nan=True).encode()


def send(url: str, item: Body, timeout_s: float, session: Any = None) -> Outcome:
    """Posts one body to `url` + its endpoint and reads the whole answer."""
    post = (session or requests).post
    try:
        response = post(
            url + item.endpoint,
            data=encode(item.body),
            headers={"Content-Type": "application/json"},
            timeout=timeout_s,
            stream=True,
        )
        with response:
            text = response.content.decode(errors="replace")
    except requests.Timeout:
        return Outcome("timeout")
    except requests.RequestException as e:
        return Outcome("connection", excerpt=str(e)[:200])
    streamed_5xx = response.status_code == 200 and _stream_error_5xx(text)
    excerpt = text[:300] if response.status_code >= 400 or streamed_5xx else ""
    return Outcome(response.status_code, streamed_5xx, excerpt)


def _stream_error_5xx(text: str) -> bool:
    """A server-sent-events answer carrying an error event of a 5xx code."""
    for line in text.splitlines():
        if not line.startswith("data:") or '"error"' not in line:
            continue
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        error = event.get("error") if isinstance(event, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        if isinstance(code, int) and code >= 500:
            return True
    return False


# -- bodies ------------------------------------------------------------------------------


def valid_body(endpoint: str, prompt_ids: Sequence[int]) -> dict[str, Any]:
    """A small request the server answers, to lay drawn fields over."""
    if endpoint == GENERATE:
        return {"input_ids": list(prompt_ids), "sampling_params": {"max_new_tokens": OUTPUT_CAP}}
    if endpoint == COMPLETIONS:
        return {"model": MODEL, "prompt": list(prompt_ids), "max_tokens": OUTPUT_CAP}
    if endpoint == CHAT:
        return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": OUTPUT_CAP}  # fmt: skip
    if endpoint == "/v1/tokenize":
        return {"model": MODEL, "prompt": "Say hi."}
    if endpoint == "/v1/detokenize":
        return {"model": MODEL, "tokens": list(prompt_ids)}
    if endpoint == "/api/generate":
        return {"model": MODEL, "prompt": "Say hi.", "stream": False,
                "options": {"num_predict": OUTPUT_CAP}}  # fmt: skip
    if endpoint == "/api/chat":
        return {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}],
                "stream": False, "options": {"num_predict": OUTPUT_CAP}}  # fmt: skip
    if endpoint == "/v1/messages":
        return {"model": MODEL, "max_tokens": OUTPUT_CAP,
                "messages": [{"role": "user", "content": "Say hi."}]}  # fmt: skip
    if endpoint == "/v1/responses":
        return {"model": MODEL, "input": "Say hi.", "max_output_tokens": OUTPUT_CAP}
    raise ValueError(f"no valid body known for {endpoint}")


def _strategies(vocab_size: int, context_len: int) -> dict[str, Any]:
    """Hypothesis strategies of hostile values for the fields a schema leaves loose."""
    from hypothesis import strategies as st

    edges = [0, 1, vocab_size - 1, vocab_size, vocab_size + 1, -1, -2, 2**31, 2**31 - 1,
             2**32, 2**63 - 1, 2**63, 2**64, -(2**63), context_len, context_len + 1]  # fmt: skip
    token = st.one_of(st.integers(0, vocab_size - 1), st.sampled_from(edges))
    number = st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0, -1, 1, 2, 1e308, -1e308, 1e-320, 0.5]),
        st.integers(-(2**70), 2**70),
    )
    junk = st.recursive(
        st.none() | st.booleans() | number | st.text(max_size=20),
        lambda children: (
            st.lists(children, max_size=4)
            | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=12,
    )
    scalar = st.one_of(number, token, junk)
    ids = st.lists(token, min_size=0, max_size=24)
    regexes = st.sampled_from([
        "((((", "(a*)*b", "(a|aa)*c", "a{1000000}", "[^]", "\\", "(?P<x>a)(?P=x)", ".*" * 200,
        "(\\d+){999}", "[" + "a-z" * 500 + "]", "", "(?=a)b", "\\p{L}+",
    ])  # fmt: skip
    schemas = st.sampled_from([
        "{not json", "[]", "{}", json.dumps({"type": "string", "pattern": "(a|a)*$"}),
        json.dumps({"type": "string", "minLength": 10**9}),
        json.dumps({"type": "array", "minItems": 10**6}),
        json.dumps({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
        json.dumps({"$ref": "#/definitions/missing"}),
        json.dumps({"type": "integer", "minimum": 5, "maximum": 1}),
        json.dumps({"enum": list(range(20000))}),
        "[" * 400 + "]" * 400,
        json.dumps({"anyOf": [{"type": "string", "pattern": f"a{{{i}}}"} for i in range(200)]}),
    ])  # fmt: skip
    ebnfs = st.sampled_from([
        "root ::= (", 'root ::= "a" root', "root ::= root", 'root ::= [^]*', "root ::= x",
        'root ::= "a"{1000000}', "",
    ])  # fmt: skip
    grammar = st.one_of(regexes, schemas, ebnfs, st.text(max_size=40), junk)
    sampling = st.fixed_dictionaries(
        {},
        optional={
            name: scalar
            for name in ("max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k",
                         "min_p", "frequency_penalty", "presence_penalty",
                         "repetition_penalty", "n", "sampling_seed", "stream_interval",
                         "ignore_eos", "skip_special_tokens", "no_stop_trim", "beam_width")
        }
        | {
            "stop_token_ids": st.one_of(ids, junk),
            "logit_bias": st.one_of(st.dictionaries(token.map(str), scalar, max_size=6), junk),
            "stop": st.one_of(st.text(max_size=10), st.lists(st.text(max_size=5)), junk),
            "regex": grammar, "json_schema": grammar, "ebnf": grammar,
            "structural_tag": grammar, "custom_params": junk,
        },
    )  # fmt: skip
    return {"token": token, "ids": ids, "scalar": scalar, "junk": junk, "sampling": sampling,
            "grammar": grammar, "schemas": schemas, "regexes": regexes}  # fmt: skip


def loose_overlays(endpoint: str, vocab_size: int, context_len: int) -> Any:
    """A strategy of hostile fields to lay over `valid_body(endpoint)`."""
    from hypothesis import strategies as st

    s = _strategies(vocab_size, context_len)
    token, ids, scalar, junk = s["token"], s["ids"], s["scalar"], s["junk"]
    bools = st.one_of(st.booleans(), junk)
    if endpoint == GENERATE:
        fields = {
            "input_ids": st.one_of(ids, st.lists(ids, max_size=3), junk),
            "text": st.one_of(st.text(max_size=50), st.lists(st.text(max_size=10), max_size=3)),
            "sampling_params": st.one_of(s["sampling"], st.lists(s["sampling"], max_size=3), junk),
            "return_logprob": bools, "top_logprobs_num": scalar, "logprob_start_len": scalar,
            "token_ids_logprob": st.one_of(ids, st.lists(ids, max_size=3), junk),
            "return_text_in_logprobs": bools, "stream": bools, "return_hidden_states": bools,
            "rid": st.one_of(st.text(max_size=8), st.lists(st.text(max_size=4), max_size=3), junk),
            "priority": scalar, "custom_logit_processor": st.one_of(st.text(max_size=30), junk),
            "input_embeds": st.one_of(st.lists(st.lists(scalar, max_size=4), max_size=3), junk),
            "session_params": junk, "lora_path": junk, "routed_dp_rank": scalar,
            "bootstrap_room": scalar, "bootstrap_host": junk, "bootstrap_port": scalar,
            "return_routed_experts": bools, "max_thinking_tokens": scalar, "image_data": junk,
            "log_metrics": bools, "extra_key": junk, "return_prompt_token_ids": bools,
        }  # fmt: skip
    elif endpoint in (COMPLETIONS, CHAT):
        fields = {
            "max_tokens": scalar, "temperature": scalar, "top_p": scalar, "top_k": scalar,
            "min_p": scalar, "n": scalar, "best_of": scalar, "seed": scalar, "stream": bools,
            "logprobs": scalar if endpoint == COMPLETIONS else bools,
            "logit_bias": st.one_of(st.dictionaries(token.map(str), scalar, max_size=6), junk),
            "stop": st.one_of(st.text(max_size=10), st.lists(st.text(max_size=5)), junk),
            "stop_token_ids": st.one_of(ids, junk), "min_tokens": scalar,
            "frequency_penalty": scalar, "presence_penalty": scalar,
            "repetition_penalty": scalar, "regex": s["grammar"], "ebnf": s["grammar"],
            "json_schema": s["grammar"], "stream_options": junk, "ignore_eos": bools,
            "skip_special_tokens": bools, "no_stop_trim": bools, "rid": junk,
        }  # fmt: skip
        if endpoint == COMPLETIONS:
            fields |= {
                "prompt": st.one_of(ids, st.lists(ids, max_size=3), st.text(max_size=40), junk),
                "echo": bools,
                "suffix": junk,
            }
        else:
            message = st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]),
                 "content": st.one_of(st.text(max_size=30), junk)},
                optional={"tool_calls": junk, "name": junk, "reasoning_content": junk},
            )  # fmt: skip
            tool_schema = s["schemas"].map(lambda text: _json_or_text(text))
            fields |= {
                "messages": st.one_of(st.lists(message, max_size=4), junk),
                "top_logprobs": scalar, "max_completion_tokens": scalar,
                "response_format": st.one_of(
                    st.fixed_dictionaries({"type": st.sampled_from(["json_schema", "json_object",
                                                                    "structural_tag", "text"]),
                                           "json_schema": st.fixed_dictionaries(
                                               {"name": st.text(max_size=5),
                                                "schema": tool_schema})}),
                    junk,
                ),
                "tools": st.one_of(st.lists(st.fixed_dictionaries(
                    {"type": st.just("function"),
                     "function": st.fixed_dictionaries({"name": st.text(max_size=6),
                                                        "parameters": tool_schema})}),
                    max_size=2), junk),
                "tool_choice": junk, "continue_final_message": bools,
                "chat_template_kwargs": junk, "separate_reasoning": bools,
            }  # fmt: skip
    else:
        fields = {name: junk for name in ("prompt", "tokens", "messages", "input", "options")}
    names = sorted(fields)
    return st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True).flatmap(
        lambda chosen: st.fixed_dictionaries({name: fields[name] for name in chosen})
    )


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def draw_bodies(
    endpoint: str,
    count: int,
    *,
    openapi: Mapping[str, Any],
    prompt_ids: Sequence[int],
    vocab_size: int,
    context_len: int,
    seed: int,
    negative_budget_s: float = 30.0,
) -> list[Body]:
    """About `count` bodies for `endpoint`: 20% that break its schema, as many as
    Schemathesis draws in `negative_budget_s` (some schemas take seconds a body), and of
    the rest half loose-field overlays, a third schema overlays, a sixth schema bodies as
    drawn."""
    import schemathesis
    from hypothesis import strategies as st

    schema = schemathesis.openapi.from_dict(dict(openapi))
    operation = schema[endpoint]["POST"]
    positive = operation.as_strategy(generation_mode=schemathesis.GenerationMode.POSITIVE)
    negative = operation.as_strategy(generation_mode=schemathesis.GenerationMode.NEGATIVE)
    base = valid_body(endpoint, prompt_ids)
    overlay = loose_overlays(endpoint, vocab_size, context_len)

    def laid_over(fields: Any) -> Any:
        return {**base, **fields} if isinstance(fields, dict) else fields

    mixed = st.one_of(
        overlay.map(lambda f: ("loose", laid_over(f))),
        overlay.map(lambda f: ("loose", laid_over(f))),
        overlay.map(lambda f: ("loose", laid_over(f))),
        positive.map(lambda case: ("schema_overlay", laid_over(_body_of(case)))),
        positive.map(lambda case: ("schema_overlay", laid_over(_body_of(case)))),
        positive.map(lambda case: ("schema", _body_of(case))),
    )
    broken = negative.map(lambda case: ("schema_negative", _body_of(case)))
    wanted_broken = count // 5
    probe = _collect(broken, min(3, wanted_broken), seed)
    per_body_s = probe.seconds / max(1, len(probe.pairs))
    affordable = int(negative_budget_s / per_body_s) if per_body_s > 0 else wanted_broken
    drawn = probe.pairs + _collect(broken, min(wanted_broken, affordable) - len(probe.pairs),
                                   seed + 1).pairs  # fmt: skip
    drawn += _collect(mixed, count - len(drawn), seed + 2).pairs
    return [Body(endpoint, body, kind) for kind, body in drawn if _jsonable(body)]


@dataclass
class _Drawn:
    pairs: list[tuple[str, Any]]
    seconds: float


def _collect(strategy: Any, count: int, seed: int) -> _Drawn:
    """`count` examples of `strategy`, drawn by Hypothesis as a test would (seeded)."""
    import time

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed

    pairs: list[tuple[str, Any]] = []
    started = time.monotonic()
    if count <= 0:
        return _Drawn(pairs, 0.0)

    @hypothesis_seed(seed)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(pair=strategy)
    def collect(pair: tuple[str, Any]) -> None:
        pairs.append(pair)

    collect()
    return _Drawn(pairs[:count], time.monotonic() - started)


def _body_of(case: Any) -> Any:
    body = getattr(case, "body", None)
    return None if body is None or type(body).__name__ == "NotSet" else body


def _jsonable(body: Any) -> bool:
    try:
        encode(body)
    except (TypeError, ValueError):
        return False
    return True


# -- regression cases --------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A body that once got a 5xx or took a server down, and where."""

    endpoint: str
    body: Any
    target: str  # monolithic, router, direct
    status: int | str
    killed: bool  # a server process was gone, or /health failed, after it alone
    excerpt: str = ""

    def as_json(self) -> str:
        return json.dumps(asdict(self), allow_nan=True, sort_keys=True)


def load_cases(path: Path) -> list[Case]:
    if not path.exists():
        return []
    return [Case(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def save_cases(path: Path, cases: Iterable[Case]) -> int:
    """Adds `cases` not already in the file (by endpoint and body); returns how many."""
    known = {(c.endpoint, encode(c.body)) for c in load_cases(path)}
    new = [c for c in cases if (c.endpoint, encode(c.body)) not in known]
    if new:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            for case in new:
                f.write(case.as_json() + "\n")
    return len(new)
