"""Which KV manager serves a scheduler's role.

SGLang asks ``get_kv_class`` for one manager for both roles and calls what it gets with
the disaggregation mode: ``kv_manager_class(kv_args, mode, server_args, is_mla_backend)``.
`registration` hands it `new_kv_manager`, which builds `PrefillKVManager` for a prefill
scheduler and `DecodeKVManager` otherwise, so the base class (`manager.SglPdKVManager`)
knows neither role's class.
"""

from __future__ import annotations

from typing import Any

from sgl_pd.backend.decode.manager import DecodeKVManager
from sgl_pd.backend.manager import SglPdKVManager
from sgl_pd.backend.prefill.manager import PrefillKVManager


def manager_class(disaggregation_mode: Any) -> type[SglPdKVManager]:
    """The class for SGLang's ``DisaggregationMode``: prefill's, else decode's."""
    return PrefillKVManager if disaggregation_mode.value == "prefill" else DecodeKVManager


def new_kv_manager(
    args: Any,
    disaggregation_mode: Any,
    server_args: Any,
    is_mla_backend: bool | None = False,
) -> SglPdKVManager:
    """What SGLang calls as its manager class: this scheduler's role's manager."""
    cls = manager_class(disaggregation_mode)
    return cls(args, disaggregation_mode, server_args, is_mla_backend)
