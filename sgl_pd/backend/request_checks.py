"""Requests a PD server of ours cannot serve, refused as they arrive, with the reason.

`n > 1` (parallel sampling): SGLang's tokenizer turns one request into a prefix warm-up
plus n copies, and every copy keeps the one bootstrap room the router gave the request.
The prefill and decode servers each see n + 1 requests under one room, with nothing that
pairs the k-th copy on one side with the k-th on the other, so a transfer cannot be
matched to its request (upstream's backends cannot either). The client gets a 400 that
says so and what to do instead: send n requests.
"""

from __future__ import annotations

from typing import Any

from sgl_pd.config import sgl_pd_role

PARALLEL_SAMPLING_REFUSED = (
    "n > 1 (parallel sampling) is not supported by prefill/decode disaggregation: SGLang "
    "sends the n samples as copies of the request that share one bootstrap room, which the "
    "prefill and decode servers cannot pair; send n separate requests instead"
)


def _samples(obj: Any) -> int:
    params = getattr(obj, "sampling_params", None)
    if isinstance(params, dict):
        return int(params.get("n", 1) or 1)
    return 1


def before_validate_one_request(manager: Any, obj: Any, *args: Any, **kw: Any) -> None:
    """BEFORE hook of ``TokenizerManager._validate_one_request`` (the HTTP process): a
    ValueError here is SGLang's own way to answer 400 with the message."""
    if sgl_pd_role(manager.server_args) is None:
        return
    if _samples(obj) > 1:
        raise ValueError(PARALLEL_SAMPLING_REFUSED)
