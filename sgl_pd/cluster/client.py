"""A small client for SGLang's OpenAI-compatible API: greedy completions, chat, streaming.

Kept to the standard library plus ``requests`` (an SGLang dependency) so the demo, the
tests and the benchmarks measure the same way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import requests

REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Completion:
    text: str
    ttft_s: float  # first streamed token's arrival minus the request's start
    total_s: float


def complete(base_url: str, prompt: str, max_tokens: int = 32) -> str:
    """Greedy text completion (temperature 0) through ``/v1/completions``."""
    response = requests.post(
        f"{base_url}/v1/completions",
        json={"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=REQUEST_TIMEOUT_S,
    )
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


def _chat_body(message: str, max_tokens: int, *, stream: bool) -> dict[str, object]:
    """One user turn, greedy."""
    return {
        "model": "default",
        "messages": [{"role": "user", "content": message}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }


def chat(base_url: str, message: str, max_tokens: int = 32) -> str:
    """Greedy chat completion through ``/v1/chat/completions``."""
    response = requests.post(
        f"{base_url}/v1/chat/completions",
        json=_chat_body(message, max_tokens, stream=False),
        timeout=REQUEST_TIMEOUT_S,
    )
    response.raise_for_status()
    return str(response.json()["choices"][0]["message"]["content"])


def stream_chat(base_url: str, message: str, max_tokens: int = 32) -> Completion:
    """Streams a greedy chat completion, timing the first token."""
    start = time.perf_counter()
    first: float | None = None
    parts: list[str] = []
    with requests.post(
        f"{base_url}/v1/chat/completions",
        json=_chat_body(message, max_tokens, stream=True),
        stream=True,
        timeout=REQUEST_TIMEOUT_S,
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            delta = json.loads(line[len(b"data: ") :])["choices"][0]["delta"].get("content")
            if delta:
                if first is None:
                    first = time.perf_counter()
                parts.append(delta)
    end = time.perf_counter()
    return Completion("".join(parts), (first or end) - start, end - start)


def generate_ids(base_url: str, prompt: str | list[int], max_new_tokens: int = 16) -> list[int]:
    """Greedy output token ids through SGLang's native ``/generate`` (text or token ids)."""
    response = requests.post(
        f"{base_url}/generate",
        json={
            ("text" if isinstance(prompt, str) else "input_ids"): prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        },
        timeout=REQUEST_TIMEOUT_S,
    )
    response.raise_for_status()
    return [int(t) for t in response.json()["output_ids"]]


def stream_generate(
    base_url: str,
    prompt: str | list[int],
    max_new_tokens: int,
    timeout_s: float = REQUEST_TIMEOUT_S,
    *,
    ignore_eos: bool = False,
) -> Iterator[tuple[float, dict[str, Any]]]:
    """Streams one greedy ``/generate`` request (text or token ids): yields
    (``time.perf_counter()`` at arrival, the chunk's JSON) per streamed chunk.
    `ignore_eos`: generate all `max_new_tokens` (timing runs want a fixed length)."""
    with requests.post(
        f"{base_url}/generate",
        json={
            ("text" if isinstance(prompt, str) else "input_ids"): prompt,
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": max_new_tokens,
                "ignore_eos": ignore_eos,
            },
            "stream": True,
        },
        stream=True,
        timeout=timeout_s,
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data:"):
                continue
            payload = line[len(b"data:") :].strip()
            if payload == b"[DONE]":
                return
            yield time.perf_counter(), json.loads(payload)


def set_local_prefill_limit(decoder_url: str, tokens: int) -> list[bool]:
    """A serving decoder's local prefill limit from now on (0: off), through SGLang's
    /set_internal_state (`backend/decode/local_switch.py`): whether each data-parallel
    group's ranks took it."""
    from sgl_pd.backend.decode.local_switch import SETTING

    response = requests.post(
        f"{decoder_url}/set_internal_state",
        json={"server_args": {SETTING: tokens}},
        timeout=REQUEST_TIMEOUT_S,
    )
    response.raise_for_status()
    return [bool(x) for x in response.json()]


def send_as_router(
    prefill_url: str,
    decoder_url: str,
    bootstrap_port: int,
    body: dict[str, Any],
    *,
    prefill_late: bool = False,
    timeout_s: float = 120,
) -> tuple[requests.Response, requests.Response]:
    """What SGLang's router does with a request: `body` with a fresh bootstrap room
    naming the prefill server, to the prefill server and to the decoder at once (or,
    `prefill_late`, to the prefill server only once the decoder answered). Returns the
    (prefill, decoder) answers."""
    import secrets
    from concurrent.futures import ThreadPoolExecutor

    body = {
        **body,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": secrets.randbits(63),
    }

    def post(url: str) -> requests.Response:
        return requests.post(f"{url}/generate", json=body, timeout=timeout_s)

    if prefill_late:
        decoded = post(decoder_url)
        return post(prefill_url), decoded
    with ThreadPoolExecutor(2) as pool:
        prefilled, decoded = pool.map(post, (prefill_url, decoder_url))
    return prefilled, decoded
