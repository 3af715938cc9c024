"""Deterministic prompts for the bundled model, of varied length (in tokens: ~10 to ~450)."""

from __future__ import annotations

import random

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


def long_prompt_ids(num_tokens: int) -> list[int]:
    """Token ids of a counting text cut to exactly `num_tokens` tokens."""
    from transformers import AutoTokenizer

    from sgl_pd.models import TINY_LLAMA_PATH

    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA_PATH)
    text = "Count: " + " ".join(str(i) for i in range(1, num_tokens))
    return list(tokenizer(text).input_ids[:num_tokens])
