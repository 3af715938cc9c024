"""A custom logit processor for the parity runs, importable on every server (SGLang
serializes a processor class by reference). It takes no parameters: sglang_router drops
``sampling_params.custom_params`` on the way to the servers."""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor

BANNED_TOKEN = 348  # the bundled model's first answer to the parity prompt


class BanTokenLogitProcessor(CustomLogitProcessor):
    def __call__(
        self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None
    ) -> torch.Tensor:
        logits[..., BANNED_TOKEN] = float("-inf")
        return logits
