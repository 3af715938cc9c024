"""The request features SGLang serves, and what a PD pair of sgl_pd makes of each.

One table (`ROWS`), read in two places: the end-to-end parity test sends every row to a
monolithic server and through a PD pair behind SGLang's router, both started with
`SERVER_FLAGS`, and checks each row's `Outcome`; ``python -m sgl_pd.cluster.parity``
writes the table of the docs (`markdown`), which a unit test keeps in step with it.

How two answers are compared (`answers_agree`): token ids, texts and finish reasons
exactly; logprobs and hidden states to `TOLERANCE` and `HIDDEN_STATE_TOLERANCE` (the
decoder attends over float16 KV the prefill server computed in other batches than a
monolithic server's, whose sums differ in the last bits; a greedy step whose top two
logprobs lie within `streaming.TIE_NATS` may flip between runs on either).
"""

from __future__ import annotations

import enum
import json
import math
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import requests

# The servers' own flags for the parity runs: every request feature below is turned on
# (a LoRA adapter named "tiny" at the path the caller writes with `write_tiny_lora`).
LORA_NAME = "tiny"


def server_flags(lora_dir: str) -> list[str]:
    return [
        "--enable-lora", "--lora-paths", f"{LORA_NAME}={lora_dir}",
        "--lora-backend", "torch_native", "--max-loras-per-batch", "2",
        "--return-hidden-states-mode", "last", "--enable-custom-logit-processor",
    ]  # fmt: skip


# absolute and relative: the servers keep KV in float16 (SGLang's choice on this CPU
# engine), and the decoder attends over KV computed in other batches than monolithic's
TOLERANCE = 5e-3  # on logprobs
HIDDEN_STATE_TOLERANCE = 3e-2  # on hidden-state entries (float16 activations)

# A prompt the bundled model continues with a few distinct words: 24 token ids
PROMPT_IDS = [323, 29, 224, 22, 224, 23, 224, 24, 224, 25, 202, 287, 292, 224, 28, 290,
              224, 29, 202, 487, 29, 332, 423, 424]  # fmt: skip
N = len(PROMPT_IDS)
TEXT = "Count: 1 2 3 4 5"


class Outcome(enum.Enum):
    SAME = "the same answer"
    BOTH_REFUSE = "refused, as a monolithic server refuses it"
    PD_REFUSES = "refused with the reason (HTTP 400)"


@dataclass(frozen=True)
class ParityRow:
    feature: str  # what the user sends, as the docs name it
    body: Mapping[str, Any]
    outcome: Outcome = Outcome.SAME
    path: str = "/generate"
    why: str = ""  # what the docs say besides the outcome
    stream: bool = False


def _sampling(**more: Any) -> dict[str, Any]:
    return {"max_new_tokens": 12, "temperature": 0, **more}


def _ids(**more: Any) -> dict[str, Any]:
    return {"input_ids": PROMPT_IDS, "sampling_params": _sampling(), **more}


def _chat(**more: Any) -> dict[str, Any]:
    return {"model": "default", "messages": [{"role": "user", "content": TEXT}],
            "max_tokens": 12, "temperature": 0, **more}  # fmt: skip


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def _custom_logit_processor() -> str:
    from sgl_pd.cluster.parity_processor import BanTokenLogitProcessor

    return str(BanTokenLogitProcessor().to_str())


# fmt: off
ROWS: tuple[ParityRow, ...] = (
    ParityRow("text prompt, greedy", {"text": TEXT, "sampling_params": _sampling()}),
    ParityRow("token-id prompt", _ids()),
    ParityRow(
        "one-token prompt",
        {"input_ids": [323], "sampling_params": _sampling()},
        why="prefilled whole on the prefill server",
    ),
    ParityRow(
        "frequency, presence and repetition penalties",
        _ids(
            sampling_params=_sampling(
                frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2
            )
        ),
    ),
    ParityRow(
        "min_new_tokens with stop token ids",
        _ids(sampling_params=_sampling(min_new_tokens=8, stop_token_ids=[224])),
    ),
    ParityRow("stop strings", _ids(sampling_params=_sampling(stop=["5"]))),
    ParityRow("stop token ids", _ids(sampling_params=_sampling(stop_token_ids=[29]))),
    ParityRow("ignore_eos", _ids(sampling_params=_sampling(ignore_eos=True, max_new_tokens=20))),
    ParityRow(
        "output logprobs",
        _ids(return_logprob=True),
        why="the decoder samples the first token and computes its logprobs",
    ),
    ParityRow("input logprobs from position 0", _ids(return_logprob=True, logprob_start_len=0),
              why="requests for input logprobs are prefilled whole on the prefill server"),
    ParityRow(
        f"input logprobs from n - 1 (= {N - 1})", _ids(return_logprob=True, logprob_start_len=N - 1)
    ),
    ParityRow(f"input logprobs from n (= {N})", _ids(return_logprob=True, logprob_start_len=N)),
    ParityRow(
        "logprob_start_len past the prompt",
        _ids(return_logprob=True, logprob_start_len=N + 1),
        Outcome.BOTH_REFUSE,
    ),
    ParityRow("top logprobs of output positions", _ids(return_logprob=True, top_logprobs_num=3)),
    ParityRow(
        "top logprobs of prompt positions",
        _ids(return_logprob=True, logprob_start_len=0, top_logprobs_num=3),
        Outcome.PD_REFUSES,
        why="sglang_router passes on only the prefill server's input token logprobs (top"
        " and token-id logprobs of output positions are served)",
    ),
    ParityRow("token-id logprobs", _ids(return_logprob=True, token_ids_logprob=[22, 29])),
    ParityRow("hidden states", _ids(return_hidden_states=True), Outcome.BOTH_REFUSE,
              why="sglang_router takes only true, i.e. every position's (mode full), which"
              " a PD pair cannot serve: its servers refuse mode full at start, so they run"
              " mode last, as do these"),
    ParityRow("JSON schema", _ids(sampling_params=_sampling(json_schema=json.dumps(SCHEMA)))),
    ParityRow("regex", _ids(sampling_params=_sampling(regex="[0-9]+( [0-9]+)*"))),
    ParityRow("EBNF grammar", _ids(sampling_params=_sampling(ebnf='root ::= "yes" | "no"'))),
    ParityRow(f"LoRA adapter ({LORA_NAME})", _ids(lora_path=LORA_NAME)),
    ParityRow(
        "custom logit processor",
        {**_ids(), "custom_logit_processor": None},
        why="sglang_router drops sampling_params.custom_params: use processors"
        " without parameters behind it",
    ),
    ParityRow(
        "custom logit processor that does not load",
        {**_ids(), "custom_logit_processor": json.dumps({"callable": "00ff"})},
        Outcome.BOTH_REFUSE,
        why="loaded at the door: in the scheduler it would end the process",
    ),
    ParityRow(
        "input embeddings",
        {"input_embeds": [[0.01] * 128] * 5, "sampling_params": _sampling()},
        Outcome.BOTH_REFUSE,
        why="SGLang serves them only with --disable-radix-cache; the prefill"
        " server's refusal reaches the client at once",
    ),
    ParityRow(
        "session of an unknown id",
        _ids(session_params={"id": "no-such-session"}),
        Outcome.BOTH_REFUSE,
    ),
    ParityRow(
        "n = 2 (parallel sampling)",
        _ids(sampling_params=_sampling(n=2)),
        Outcome.PD_REFUSES,
        why="SGLang sends the n samples under one bootstrap room, which the two"
        " servers cannot pair: send n requests",
    ),
    ParityRow("streaming", _ids(stream=True), stream=True),
    ParityRow(
        "OpenAI completions with logprobs",
        {"model": "default", "prompt": TEXT, "max_tokens": 12, "temperature": 0, "logprobs": 2},
        path="/v1/completions",
    ),
    ParityRow("OpenAI chat", _chat(), path="/v1/chat/completions"),
    ParityRow(
        "OpenAI chat, JSON schema response format",
        _chat(
            response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
        ),
        path="/v1/chat/completions",
    ),
    ParityRow(
        "OpenAI chat, streamed", _chat(stream=True), path="/v1/chat/completions", stream=True
    ),
)


def request_body(row: ParityRow) -> dict[str, Any]:
    """The JSON a row sends (the custom logit processor serialized here, not at import)."""
    body = dict(row.body)
    if "custom_logit_processor" in body and body["custom_logit_processor"] is None:
        body["custom_logit_processor"] = _custom_logit_processor()
    return body


@dataclass
class Answer:
    status: int
    body: Any  # the JSON answer; for a stream, the list of its events' JSON
    text: str = field(default="", repr=False)  # the raw body, for messages


def send(base_url: str, row: ParityRow, timeout_s: float) -> Answer:
    """One row's request; raises `requests.Timeout` past `timeout_s` (no answer at all)."""
    response = requests.post(
        f"{base_url}{row.path}", json=request_body(row), timeout=timeout_s, stream=row.stream
    )
    if not row.stream or response.status_code != 200:
        text = response.text
        try:
            return Answer(response.status_code, json.loads(text), text)
        except ValueError:
            return Answer(response.status_code, None, text)
    events = [json.loads(line[len(b"data: ") :]) for line in _data_lines(response)]
    return Answer(response.status_code, events)


def _data_lines(response: requests.Response) -> Iterator[bytes]:
    for line in response.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield line


# meta_info entries that differ between any two runs (ids, timings, cache hits)
_VOLATILE = {"id", "e2e_latency", "cached_tokens", "cached_tokens_details", "weight_versions",
             "response_sent_to_client_ts", "queue_time", "prefill_launch_delay",
             "prefill_launch_latency", "prefill_finished_ts", "request_received_ts",
             "inference_time", "decode_throughput", "spec_verify_ct", "dp_rank",
             "created", "system_fingerprint"}  # fmt: skip


def normalized(answer: Any) -> Any:
    """`answer` without what differs between two runs of one request anywhere."""
    if isinstance(answer, dict):
        return {k: normalized(v) for k, v in answer.items()
                if k not in _VOLATILE and not k.endswith(("_ts", "_time", "_latency"))}  # fmt: skip
    if isinstance(answer, list):
        return [normalized(v) for v in answer]
    return answer


def streamed_text(events: list[Any]) -> str:
    """What a stream said in all: /generate repeats the text so far, OpenAI sends deltas."""
    if events and "text" in events[-1]:
        return str(events[-1]["text"])
    parts = []
    for event in events:
        for choice in event.get("choices", []):
            delta = choice.get("delta") or {}
            parts.append(str(delta.get("content") or choice.get("text") or ""))
    return "".join(parts)


def differences(mono: Any, pd: Any, where: str = "") -> list[str]:
    """Where two normalized answers differ beyond `TOLERANCE` on floats."""
    if isinstance(mono, dict) and isinstance(pd, dict):
        out = [f"{where}.{k}: only in {'monolithic' if k in mono else 'PD'}"
               for k in sorted(mono.keys() ^ pd.keys())]  # fmt: skip
        for key in sorted(mono.keys() & pd.keys()):
            out += differences(mono[key], pd[key], f"{where}.{key}")
        return out
    if isinstance(mono, list) and isinstance(pd, list):
        if len(mono) != len(pd):
            return [f"{where}: {len(mono)} entries in monolithic, {len(pd)} in PD"]
        return [d for i, (a, b) in enumerate(zip(mono, pd, strict=True))
                for d in differences(a, b, f"{where}[{i}]")]  # fmt: skip
    if isinstance(mono, float) and isinstance(pd, float | int) and not isinstance(pd, bool):
        tol = HIDDEN_STATE_TOLERANCE if ".hidden_states" in where else TOLERANCE
        close = math.isclose(mono, float(pd), rel_tol=tol, abs_tol=tol) or (
            math.isinf(mono) and mono == pd
        )
        return [] if close else [f"{where}: {mono} vs {pd}"]
    return [] if mono == pd else [f"{where}: {mono!r} vs {pd!r}"]


def answers_agree(row: ParityRow, mono: Answer, pd: Answer) -> list[str]:
    """Why `pd` is not what the row's outcome demands given `mono` ([] when it is)."""
    if row.outcome is Outcome.PD_REFUSES:
        if mono.status != 200:
            return [f"monolithic answered {mono.status}: {mono.text[:200]}"]
        return [] if 400 <= pd.status < 500 else [f"PD answered {pd.status}, not a 4xx"]
    if row.outcome is Outcome.BOTH_REFUSE:
        problems = [] if 400 <= mono.status < 500 else [f"monolithic answered {mono.status}"]
        if not 400 <= pd.status < 500:
            problems.append(f"PD answered {pd.status}: {pd.text[:300]}")
        return problems
    if (mono.status, pd.status) != (200, 200):
        return [f"answered {mono.status} monolithic, {pd.status} PD: {pd.text[:300]}"]
    if row.stream:
        a, b = streamed_text(mono.body), streamed_text(pd.body)
        return [] if a == b else [f"streamed {a!r} monolithic, {b!r} PD"]
    return differences(normalized(mono.body), normalized(pd.body))


def markdown() -> str:
    """The docs' table of request features through PD, from `ROWS`."""
    lines = [
        "# Request features through a PD pair",
        "",
        "Generated from `sgl_pd/cluster/parity.py` (`python -m sgl_pd.cluster.parity`);",
        "`tests/e2e/test_parity.py` sends every row to a monolithic server and through a",
        "prefill and a decode server behind `sglang_router`, and checks the outcome.",
        "",
        "| Feature | Endpoint | Through PD | Notes |",
        "|---|---|---|---|",
    ]
    for row in ROWS:
        path = row.path + (" (stream)" if row.stream else "")
        lines.append(f"| {row.feature} | `{path}` | {row.outcome.value} | {row.why} |")
    lines += [
        "",
        "Server options sgl_pd cannot serve are refused when a server starts, with the",
        "reason (`sgl_pd/backend/server_options.py`): two-batch overlap with layer-wise",
        "sends, optimistic prefill and the `prefill_complete` allocation policy, prefill",
        "context parallelism, multi-layer EAGLE with the decoder-sampled first token,",
        "models whose pools keep state besides the paged KV cache other than Mamba /",
        "linear-attention state and SGLang's hybrid sliding-window pool (sparse",
        "attention), a draft model beside that pool, checksums beside such state, hidden",
        "states of every",
        "position (`--return-hidden-states-mode full`), decode HiCache, pipeline",
        "parallelism, DP attention on a prefill server, several tokenizer workers on a",
        "prefill server, and local prefill asked for on a decoder with speculative",
        "decoding, DP attention or a model with Mamba / linear-attention state.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown())
