"""Requests a PD server cannot serve are refused with SGLang's 400 path (a ValueError)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_pd.backend import request_checks
from sgl_pd.config import BACKEND_NAME


def _manager(mode: str = "decode", backend: str = BACKEND_NAME) -> SimpleNamespace:
    return SimpleNamespace(
        server_args=SimpleNamespace(
            disaggregation_mode=mode, disaggregation_transfer_backend=backend
        ),
        model_config=SimpleNamespace(vocab_size=512, hidden_size=64),
        context_len=2048,
    )


def _request(n: int | None) -> SimpleNamespace:
    params = {"max_new_tokens": 8} if n is None else {"max_new_tokens": 8, "n": n}
    return SimpleNamespace(sampling_params=params)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_parallel_sampling_is_refused_with_the_reason(mode: str) -> None:
    with pytest.raises(ValueError, match=r"n > 1 .* send n separate requests"):
        request_checks.before_validate_one_request(_manager(mode), _request(2), [1, 2])


@pytest.mark.parametrize(
    ("manager", "n"),
    [
        (_manager(), None),
        (_manager(), 1),
        (_manager(mode="null"), 4),  # an ordinary server samples n in parallel itself
        (_manager(backend="mooncake"), 4),  # not our backend: not our call
    ],
)
def test_what_is_left_alone(manager: SimpleNamespace, n: int | None) -> None:
    request_checks.before_validate_one_request(manager, _request(n), [1, 2])


def _logprobs(start: int, **more: object) -> SimpleNamespace:
    fields = {"top_logprobs_num": 0, "token_ids_logprob": None, **more}
    return SimpleNamespace(
        sampling_params={"max_new_tokens": 8}, return_logprob=True, logprob_start_len=start,
        **fields,
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("wants", [{"top_logprobs_num": 2}, {"token_ids_logprob": [5]}])
def test_top_logprobs_of_prompt_positions_are_refused_on_both_servers(
    mode: str, wants: dict[str, object]
) -> None:
    request = _logprobs(0)
    for name, value in wants.items():
        setattr(request, name, value)
    with pytest.raises(ValueError, match=r"logprob_start_len 0 inside a 3-token prompt"):
        request_checks.before_validate_one_request(_manager(mode), request, [1, 2, 3])


@pytest.mark.parametrize("start", [-1, 3])
def test_top_logprobs_of_output_positions_and_plain_input_logprobs_pass(start: int) -> None:
    manager = _manager()
    request_checks.before_validate_one_request(
        manager, _logprobs(start, top_logprobs_num=2), [1, 2, 3]
    )
    request_checks.before_validate_one_request(manager, _logprobs(0), [1, 2, 3])
