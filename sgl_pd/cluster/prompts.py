"""Deterministic prompts for the bundled model, of varied length (in tokens: ~10 to
~450), for the end-to-end tests and the benchmarks."""

from __future__ import annotations

import functools
import random
import threading
from typing import Any

DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]


def varied_prompts(count: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        length = 2 + (i * 37) % 150  # numbers in the prompt: short to several chunks long
        if i % 3 == 2:
            start = rng.randrange(7)
            prompts.append(" ".join(DAYS[(start + k) % 7] for k in range(length // 4 + 2)))
        else:
            start = rng.randrange(1, 500)
            prompts.append("Count: " + " ".join(str(start + k) for k in range(length)))
    return prompts


_TOKENIZER_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def _loaded_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from sgl_pd.models import TINY_LLAMA_PATH

    return AutoTokenizer.from_pretrained(TINY_LLAMA_PATH)


def _tokenizer() -> Any:
    """The bundled model's tokenizer, loaded once. Threads asking at once (a benchmark's
    streams starting together) load it one at a time: transformers' lazy first import
    from several threads at once fails in all but one."""
    with _TOKENIZER_LOCK:
        return _loaded_tokenizer()


def prompt_ids(text: str) -> list[int]:
    """The bundled model's token ids of `text`."""
    return list(_tokenizer()(text).input_ids)


def long_prompt_ids(num_tokens: int, start: int = 1) -> list[int]:
    """Token ids of a counting text from `start`, cut to exactly `num_tokens` tokens."""
    text = "Count: " + " ".join(str(start + i) for i in range(num_tokens))
    return prompt_ids(text)[:num_tokens]
