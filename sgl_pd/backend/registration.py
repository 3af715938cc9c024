"""Makes ``--disaggregation-transfer-backend sgl_pd`` select sgl_pd's classes in SGLang.

SGLang 0.5.23 resolves a backend in two places: ``TransferBackend(<flag value>)`` (an
enum) and the ``get_kv_class`` if-chain. We add one enum member and wrap the function.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

from sgl_pd.config import BACKEND_NAME

_MEMBER_NAME = "SGL_PD"


def add_backend_member(enum_cls: type[enum.Enum]) -> enum.Enum:
    """Adds the ``sgl_pd`` member to SGLang's ``TransferBackend`` (idempotent).

    ``enum`` has no public way to extend an existing class; this uses the same
    internals as ``aenum.extend_enum`` so ``TransferBackend("sgl_pd")``, equality and
    ``.value`` behave like a built-in member everywhere SGLang compares them.
    """
    existing = enum_cls._value2member_map_.get(BACKEND_NAME)
    if existing is not None:
        return existing
    member = object.__new__(enum_cls)
    member._name_ = _MEMBER_NAME
    member._value_ = BACKEND_NAME
    enum_cls._member_map_[_MEMBER_NAME] = member
    enum_cls._value2member_map_[BACKEND_NAME] = member
    enum_cls._member_names_.append(_MEMBER_NAME)
    type.__setattr__(enum_cls, _MEMBER_NAME, member)
    return member


def kv_class_around_hook(original: Any, transfer_backend: Any, class_type: Any) -> Any:
    """``get_kv_class`` for our member; SGLang's own answer for every other backend."""
    from sglang.srt.disaggregation.utils import KVClassType

    if getattr(transfer_backend, "value", None) != BACKEND_NAME:
        return original(transfer_backend, class_type)
    if class_type == KVClassType.KVARGS:
        return original(transfer_backend, class_type)

    from sgl_pd.backend.decode.receiver import SglPdKVReceiver
    from sgl_pd.backend.prefill.bootstrap_server import SglPdBootstrapServer
    from sgl_pd.backend.prefill.sender import SglPdKVSender
    from sgl_pd.backend.roles import new_kv_manager

    return {
        KVClassType.MANAGER: new_kv_manager,  # called like a class: the role's manager
        KVClassType.SENDER: SglPdKVSender,
        KVClassType.RECEIVER: SglPdKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: SglPdBootstrapServer,
    }[class_type]


def nested(*hooks: Callable[..., Any]) -> Callable[..., Any]:
    """One AROUND hook that runs `hooks` nested as SGLang would nest them if each were
    registered on the target (the first innermost): SGLang warns about every target with
    more than one AROUND hook."""

    def around(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        wrapped = original
        for hook in hooks:
            wrapped = functools.partial(hook, wrapped)
        return wrapped(*args, **kwargs)

    return around


def register_backend() -> None:
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    add_backend_member(TransferBackend)
    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", kv_class_around_hook, HookType.AROUND
    )
    from sgl_pd.backend.pool_report import after_pool_check, after_run_batch

    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.invariant_checker."
        "SchedulerInvariantChecker._check_all_pools",
        after_pool_check,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.run_batch", after_run_batch, HookType.AFTER
    )
    from sgl_pd.backend import first_token, health, request_checks
    from sgl_pd.backend.decode import direct, release_bound

    HookRegistry.register(
        "sglang.srt.disaggregation.decode.DecodeTransferQueue.__init__",
        release_bound.after_transfer_queue_init,
        HookType.AFTER,
    )
    from sgl_pd.backend import refusals
    from sgl_pd.backend.prefill import layerwise_glue

    HookRegistry.register(
        "sglang.srt.disaggregation.decode.prepare_abort",
        refusals.around_decode_prepare_abort,
        HookType.AROUND,
    )

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.retire_unadmitted_request",
        refusals.before_retire_unadmitted_request,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue._check_if_req_exceed_kv_capacity",
        refusals.after_exceed_kv_capacity,
        HookType.AFTER,
    )
    from sgl_pd.backend.decode import local_prefill

    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request",
        nested(
            request_checks.around_generate_request,
            refusals.around_generate_request,
            direct.around_generate_request,
        ),
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.abort_request",
        nested(refusals.around_abort_request, local_prefill.around_abort_request),
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._init_req_state",
        direct.after_init_req_state,
        HookType.AFTER,
    )
    from sgl_pd.backend.prefill import skips

    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._stream_one_response",
        skips.around_stream_one_response,
        HookType.AROUND,
    )

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue",
        local_prefill.around_add_request_to_queue,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.decode.SchedulerDisaggregationDecodeMixin"
        ".get_next_disagg_decode_batch_to_run",
        local_prefill.around_get_next_batch,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.pause_generation",
        local_prefill.around_pause_generation,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.is_fully_idle",
        local_prefill.around_is_fully_idle,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue.hold_rebootstrap",
        local_prefill.around_hold_rebootstrap,
        HookType.AROUND,
    )

    from sgl_pd.backend.decode import local_switch

    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.internal_state"
        ".SchedulerInternalStateController._update_handlers",
        local_switch.around_update_handlers,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager.set_internal_state",
        local_switch.around_set_internal_state,
        HookType.AROUND,
    )

    HookRegistry.register(
        "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
        request_checks.before_validate_one_request,
        HookType.BEFORE,
    )
    from sgl_pd.backend import body_errors

    HookRegistry.register(
        "fastapi.dependencies.utils.request_body_to_args",
        body_errors.around_request_body_to_args,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.entrypoints.openai.serving_tokenize.OpenAIServingDetokenize._validate_request",
        body_errors.after_detokenize_validate,
        HookType.AFTER,
    )
    for handler in ("handle_chat", "handle_generate"):
        HookRegistry.register(
            f"sglang.srt.entrypoints.ollama.serving.OllamaServing.{handler}",
            body_errors.around_ollama_handler,
            HookType.AROUND,
        )

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.handle_generate_request",
        first_token.before_handle_generate_request,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue.add",
        first_token.before_decode_prealloc_add,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.handle_generate_request",
        first_token.after_handle_generate_request,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.add",
        first_token.before_prefill_bootstrap_add,
        HookType.BEFORE,
    )
    from sgl_pd.backend.prefill import sender

    HookRegistry.register(
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.finalize_bootstrap",
        sender.after_finalize_bootstrap,
        HookType.AFTER,
    )
    from sgl_pd.backend import tracing

    # SGLang's trace context of each request, where our spans of it attach (--enable-trace)
    for queue_add in (
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.add",
        "sglang.srt.disaggregation.decode.DecodePreallocQueue.add",
    ):
        HookRegistry.register(queue_add, tracing.remember_request, HookType.BEFORE)
    from sgl_pd.backend.prefill import page_pins

    HookRegistry.register(
        "sglang.srt.disaggregation.prefill.PrefillBootstrapQueue.add",
        page_pins.before_prefill_bootstrap_add,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.invariant_checker.SchedulerInvariantChecker"
        "._check_all_pools",
        page_pins.around_check_all_pools,
        HookType.AROUND,
    )

    from sgl_pd.backend import scheduler_door

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.handle_generate_request",
        nested(
            scheduler_door.around_handle_generate_request, health.around_handle_generate_request
        ),
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler._create_generation_req",
        scheduler_door.around_create_generation_req,
        HookType.AROUND,
    )

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model",
        layerwise_glue.after_load_model,
        HookType.AFTER,
    )
    from sgl_pd.backend import sliding_window_glue

    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.load_model",
        sliding_window_glue.after_load_model,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue._send_kv_metadata",
        sliding_window_glue.around_send_kv_metadata,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler._send_kv_chunk",
        sliding_window_glue.before_send_kv_chunk,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.model_executor.model_runner.ModelRunner.init_lora_manager",
        layerwise_glue.after_init_lora_manager,
        HookType.AFTER,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.run_batch",
        layerwise_glue.before_run_batch,
        HookType.BEFORE,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.run_batch",
        layerwise_glue.after_run_batch,
        HookType.AFTER,
    )
