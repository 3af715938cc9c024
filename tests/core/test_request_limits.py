"""The request fields that could crash a scheduler are refused, naming the field; every
valid request passes - properties over generated requests, and the bodies that once
killed a server."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_pd.core.request_limits import (
    MAX_JSON_DEPTH,
    MAX_N,
    MAX_SAMPLES_PER_REQUEST,
    ModelLimits,
    json_depth_problem,
    raw_request_problem,
    tokenized_request_problem,
)

LIMITS = ModelLimits(vocab_size=512, context_len=8192, hidden_size=64)

valid_ids = st.lists(st.integers(0, LIMITS.vocab_size - 1), max_size=64)
valid_params = st.fixed_dictionaries(
    {},
    optional={
        "max_new_tokens": st.integers(0, 100),
        "temperature": st.floats(0, 5),
        "top_p": st.floats(0.01, 1),
        "top_k": st.sampled_from([-1, 1, 5, 10**9]),
        "min_p": st.floats(0, 1),
        "frequency_penalty": st.floats(-2, 2),
        "repetition_penalty": st.floats(0.01, 2),
        "n": st.integers(1, MAX_N),
        "stop_token_ids": valid_ids,
        "logit_bias": st.dictionaries(
            st.integers(0, LIMITS.vocab_size - 1).map(str), st.floats(-100, 100), max_size=8
        ),
        "sampling_seed": st.integers(-(2**63), 2**63 - 1),
        "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3)),
        "regex": st.text(max_size=10),
        "ignore_eos": st.booleans(),
    },
)


@given(
    ids=valid_ids,
    params=valid_params,
    top=st.integers(0, LIMITS.vocab_size),
    start=st.integers(-1, 100),
    logprob_ids=valid_ids,
)
def test_every_valid_request_passes(
    ids: list[int], params: dict, top: int, start: int, logprob_ids: list[int]
) -> None:
    request = {
        "input_ids": ids,
        "sampling_params": params,
        "return_logprob": True,
        "top_logprobs_num": top,
        "logprob_start_len": start,
        "token_ids_logprob": logprob_ids,
        "session_params": {"id": "s", "offset": 3, "replace": False, "rid": None},
        "bootstrap_host": "10.0.0.1",
        "bootstrap_port": 8998,
        "bootstrap_room": 2**63 + 5,
        "rid": "r1",
    }
    assert raw_request_problem(request, LIMITS) is None
    assert tokenized_request_problem(ids, LIMITS) is None


@given(ids=valid_ids, bad=st.one_of(st.integers(max_value=-1), st.integers(min_value=512)))
def test_a_prompt_id_outside_the_vocabulary_is_refused(ids: list[int], bad: int) -> None:
    prompt = [*ids, bad]
    for problem in (
        raw_request_problem({"input_ids": prompt}, LIMITS),
        raw_request_problem({"input_ids": [[1, 2], prompt]}, LIMITS),
        tokenized_request_problem(prompt, LIMITS),
    ):
        assert problem is not None
        assert problem.field.startswith("input_ids")
        assert "vocabulary" in problem.message or "[0, 512)" in problem.message


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        # the bodies that killed a server before they were checked
        ({"return_logprob": True, "top_logprobs_num": 100000}, "top_logprobs_num"),
        ({"input_ids": [1, 512, 2]}, "input_ids"),
        ({"input_ids": [1, -1, 2]}, "input_ids"),
        ({"input_ids": [1, 2**70]}, "input_ids"),
        ({"input_ids": [1, 2.5]}, "input_ids"),
        ({"input_ids": [1, True]}, "input_ids"),
        ({"top_logprobs_num": -3}, "top_logprobs_num"),
        ({"top_logprobs_num": [1, 100000]}, "top_logprobs_num[1]"),
        ({"logprob_start_len": -5}, "logprob_start_len"),
        ({"token_ids_logprob": [520]}, "token_ids_logprob"),
        ({"token_ids_logprob": [[1], [520]]}, "token_ids_logprob[1]"),
        ({"sampling_params": {"stop_token_ids": [1, 600]}}, "sampling_params.stop_token_ids"),
        ({"sampling_params": {"stop_token_ids": "12"}}, "sampling_params.stop_token_ids"),
        ({"sampling_params": {"logit_bias": {"600": 1.0}}}, "sampling_params.logit_bias"),
        ({"sampling_params": {"logit_bias": {"x": 1.0}}}, "sampling_params.logit_bias"),
        ({"sampling_params": {"logit_bias": {"3": math.inf}}}, "sampling_params.logit_bias[3]"),
        ({"sampling_params": {"logit_bias": {"3": 1e300}}}, "sampling_params.logit_bias[3]"),
        ({"sampling_params": {"temperature": math.inf}}, "sampling_params.temperature"),
        ({"sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"sampling_params": {"top_p": math.nan}}, "sampling_params.top_p"),
        ({"sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"sampling_params": {"top_k": 2.5}}, "sampling_params.top_k"),
        ({"sampling_params": {"max_new_tokens": 10**12}}, "sampling_params.max_new_tokens"),
        ({"sampling_params": {"min_new_tokens": -1}}, "sampling_params.min_new_tokens"),
        ({"sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"sampling_params": {"n": MAX_N + 1}}, "sampling_params.n"),
        ({"sampling_params": {"regex": 5}}, "sampling_params.regex"),
        ({"sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos"),
        ({"sampling_params": {"sampling_seed": 2**70}}, "sampling_params.sampling_seed"),
        ({"sampling_params": {"stop": [1, 2]}}, "sampling_params.stop"),
        ({"sampling_params": {"stream_interval": 0}}, "sampling_params.stream_interval"),
        ({"sampling_params": "greedy"}, "sampling_params"),
        (
            {"text": ["a", "b"], "sampling_params": [{}, {"temperature": -1.0}]},
            "sampling_params[1].temperature",
        ),
        ({"text": ["a"] * 65, "sampling_params": {"n": MAX_N}}, "batch"),
        ({"text": ["a"] * 65, "sampling_params": [{"n": MAX_N}] * 65}, "batch"),
        ({"text": ["a"] * (MAX_SAMPLES_PER_REQUEST + 1)}, "batch"),
        ({"session_params": {"r!": "x"}}, "session_params"),
        ({"session_params": ["id"]}, "session_params"),
        ({"session_params": {"offset": "3"}}, "session_params.offset"),
        ({"session_params": {"offset": True}}, "session_params.offset"),
        ({"session_params": {"replace": 1}}, "session_params.replace"),
        # a room without a host ended a decoder's scheduler
        ({"bootstrap_room": 52}, "bootstrap_host"),
        ({"bootstrap_host": "10.0.0.1"}, "bootstrap_room"),
        ({"bootstrap_host": "h", "bootstrap_room": -1}, "bootstrap_room"),
        ({"bootstrap_host": "h", "bootstrap_room": 5, "bootstrap_port": "x"}, "bootstrap_port"),
        ({"rid": ["a", "b"]}, "rid"),
        ({"sampling_params": []}, "sampling_params"),
        ({"text": ["a", "b"], "bootstrap_port": [1]}, "bootstrap_port"),
        ({"return_logprob": [True]}, "return_logprob"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"sampling_params": {"top_k": 2**32}}, "sampling_params.top_k"),
        ({"rid": 5}, "rid"),
        ({"text": ["a", "b"], "rid": [1, 2]}, "rid"),
    ],
)
def test_each_hostile_field_is_named(request_fields: dict, field: str) -> None:
    problem = raw_request_problem(request_fields, LIMITS)
    assert problem is not None, request_fields
    assert problem.field == field
    assert str(problem).startswith(f"invalid request field {field}: ")


@pytest.mark.parametrize(
    "request_fields",
    [
        # what a router adds to a batch of one (a completions prompt given as a list)
        {"text": ["Hello"], "bootstrap_host": ["h"], "bootstrap_port": [1], "bootstrap_room": [7]},
        {"input_ids": [[1, 2, 3]], "rid": ["r1"], "return_logprob": [True]},
        # n > 1: SGLang copies the request, then reads its lists
        {"text": "hi", "sampling_params": {"n": 2}, "rid": ["a"]},
        {
            "text": "hi",
            "sampling_params": {"n": 2},
            "bootstrap_host": ["h", "h"],
            "bootstrap_room": [1, 2],
        },
        # /v1/score's one request of every item
        {"text": ["item"] * 1500},
        {"sampling_params": {"n": 200}},
        # the context is SGLang's to check (it shrinks them with --allow-auto-truncate)
        {"sampling_params": {"max_new_tokens": 100000}},
        {"sampling_params": {"stop_token_ids": [2, None]}},
        {"sampling_params": {"stop_token_ids": {2, 3}}},
    ],
)
def test_requests_sglang_serves_pass(request_fields: dict) -> None:
    assert raw_request_problem(request_fields, LIMITS) is None


@pytest.mark.parametrize(
    ("embeds", "why"),
    [
        ([[0.1, 0.2]], "rows of 2 numbers"),
        ([[0.0] * 64, [0.0] * 63], "rows of numbers"),
        ([[math.nan] * 64], "finite"),
        ([], "non-empty"),
        ([0.1] * 64, "2 dimensions"),
    ],
)
def test_input_embeddings_of_the_wrong_shape_are_refused(embeds: list, why: str) -> None:
    problem = tokenized_request_problem(None, LIMITS, input_embeds=embeds)
    assert problem is not None and problem.field == "input_embeds"
    assert why in problem.message
    assert tokenized_request_problem(None, LIMITS, input_embeds=[[0.5] * 64] * 3) is None


# what the full hostile-request campaign found (each was a 500 or a stream cut short)


def test_a_batch_of_texts_with_a_flat_id_list_beside_it_is_refused() -> None:
    body = {"text": ["a", "b", "c"], "input_ids": [0, 323, 29], "sampling_params": {}}
    problem = raw_request_problem(body, LIMITS)
    assert problem is not None and problem.field == "input_ids"
    fine = {"text": ["a", "b"], "input_ids": [[1, 2], [3]], "sampling_params": {}}
    assert raw_request_problem(fine, LIMITS) is None


def test_empty_input_embeddings_are_refused() -> None:
    problem = raw_request_problem({"input_embeds": []}, LIMITS)
    assert problem is not None and problem.field == "input_embeds"
    batch = {"input_embeds": [[[0.0] * 64], []], "text": None}
    assert raw_request_problem(batch, LIMITS) is not None


def test_a_per_prompt_list_shorter_than_the_prompts_is_refused_with_n_samples_too() -> None:
    body = {"text": "hi", "bootstrap_host": [], "sampling_params": {"n": 4}}
    problem = raw_request_problem(body, LIMITS)
    assert problem is not None and problem.field == "bootstrap_host"
    router = {
        "text": "hi",
        "bootstrap_host": ["10.0.0.1"] * 4,
        "bootstrap_room": [1, 2, 3, 4],
        "sampling_params": {"n": 4},
    }
    assert raw_request_problem(router, LIMITS) is None  # (SGLang reads such lists itself)


@pytest.mark.parametrize("rank", [18920, -1, "0", True, 0.0])
def test_a_prefill_dp_rank_other_than_zero_is_refused(rank: object) -> None:
    problem = raw_request_problem({"text": "hi", "disagg_prefill_dp_rank": rank}, LIMITS)
    assert problem is not None and problem.field == "disagg_prefill_dp_rank"
    assert raw_request_problem({"text": "hi", "disagg_prefill_dp_rank": 0}, LIMITS) is None


def test_a_body_nested_past_the_limit_is_refused_without_recursion() -> None:
    deep: object = 1
    for _ in range(100_000):  # (far past Python's recursion limit)
        deep = [deep]
    problem = json_depth_problem({"tools": [{"function": {"parameters": deep}}]})
    assert problem is not None and problem.field == "body"
    shallow: object = {"type": "object"}
    for _ in range(MAX_JSON_DEPTH - 2):
        shallow = {"properties": shallow}
    assert json_depth_problem({"a": shallow}) is None


def test_a_batch_item_whose_ids_are_not_a_list_is_refused() -> None:
    problem = tokenized_request_problem(323, LIMITS)  # type: ignore[arg-type]
    assert problem is not None and problem.field == "input_ids"
