"""Operations SGLang 0.5.23's CPU engine lacks for DeepSeek-V3 (MLA) and NEXTN/EAGLE
speculative decoding, supplied at run time (nothing in site-packages is edited).

`apply_cpu_shims` runs from the plugin's ``register()`` in every SGLang process and acts
only where SGLang itself runs on its CPU engine (``sglang.srt.utils.is_cpu()``, which the
CPU harness turns on). Each shim is a real implementation of a missing piece, hooked through
SGLang's ``HookRegistry`` where a hook fits, and logged once per process:

1. MLA on ``torch_native``: DeepSeek's attention looks its backend up in
   ``AttentionBackendRegistry``; ``torch_native`` is missing, so the triton handler chooses
   the MHA path for prefills, whose k/v the torch-native backend ignores (it reads the pool,
   which holds the MLA latent): a shape error. Registered: the absorbed-MLA dispatcher.
2. RoPE: on CPU ``get_rope_cpu`` serves only DeepSeek's yarn; any other (or no)
   ``rope_scaling`` falls back to SGLang's generic ``get_rope``, whose rotary embeddings
   run on plain torch ops.
3. ``set_embed_and_head`` (the NEXTN draft shares the target's embedding and head) calls
   ``torch.cuda.synchronize()``; on CPU the swap needs no synchronization.
4. The EAGLE draft-extend backend factory has no ``torch_native`` entry; added (one draft
   step: steps > 1 need a multi-step decode container the CPU engine does not have).
5. The spec kernels missing from the CUDA-only kernel wheel: ``spec_kernels_cpu``.
6. TARGET_VERIFY on ``torch_native``: the batch has no extend lengths there; each request
   extends its committed ``seq_lens`` by ``draft_token_num`` tokens (as the intel_amx
   backend derives them). Exact for chain drafts (topk 1): the causal mask is the chain.
7. Tensor parallelism (``--tp N``): ``init_model_parallel_group`` asks for pynccl (and
   custom all-reduce) on every platform but NPU/XPU, and pynccl refuses a CPU device. Built
   without them, a group's all-reduce is ``torch.distributed`` over its gloo group
   (``GroupCoordinator.all_reduce``'s CPU-tensor branch), which SGLang has for CPU tensors.
8. Per-rank cores: SGLang picks each rank's entry of ``SGLANG_CPU_OMP_THREADS_BIND``
   (``init_threads_binding``) but binds threads to it only with AMX or arm64 kernels;
   elsewhere every rank of a server would run on all its cores. The rank's process is
   pinned to its entry, with as many torch threads as the entry has cores.
9. DP attention pads every attention-DP rank's batch to a common size before the MoE
   (``ForwardBatch._pad_inputs_to_size``) and, on CPU, asks the attention backend for the
   padded rows' sequence length with ``get_cpu_graph_seq_len_fill_value``, which only the
   AMX backend has. ``torch_native`` gets the AMX backend's answer, 1: one token per
   padded row, whose output is dropped.
10. LoRA (``--enable-lora --lora-backend torch_native``): SGLang's LoRA layers ask for
   pinned host tensors, which need a CUDA driver; with no device to copy to, the harness
   gives them plain host tensors (``pin_memory`` is dropped in the LoRA layers' factory
   calls, and ``Tensor.pin_memory()`` returns the tensor itself in a CPU-engine process).
11. Sliding-window layers in SGLang's hybrid SWA pool on ``torch_native``: the backend
   reads them through full-pool slots; they read through SWA slots
   (``swa_attention_cpu``), as SGLang's other backends do.
12. Gated-DeltaNet layers (Qwen3-Next, Qwen3.5): the five GDN kernels missing from the
   kernel wheel, the gated RMSNorm in torch (SGLang runs it on Triton without its AMX
   kernels) and a CPU device for the layer's constructor (``gdn_kernels_cpu``).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any

logger = logging.getLogger("sgl_pd.harness.cpu_shims")

_HOOK = "sglang.srt."
_applied = False


def _announce(what: str) -> None:
    logger.info("applying CPU shim: %s", what)


def apply_cpu_shims() -> bool:
    """Registers the shims when SGLang runs on its CPU engine; True if it did. Idempotent."""
    global _applied
    from sglang.srt.utils import is_cpu

    if _applied or not is_cpu():
        return _applied
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    _register_mla_dispatch()
    HookRegistry.register(
        _HOOK + "layers.rotary_embedding.factory.get_rope_cpu", around_get_rope_cpu, HookType.AROUND
    )
    _announce("get_rope_cpu falls back to get_rope for rope_scaling other than deepseek_yarn")
    HookRegistry.register(
        _HOOK + "models.deepseek_v2.DeepseekV2ForCausalLM.set_embed_and_head",
        set_embed_and_head,
        HookType.REPLACE,
    )
    _announce("DeepseekV2ForCausalLM.set_embed_and_head without torch.cuda.synchronize")
    HookRegistry.register(
        _HOOK + "speculative.draft_utils.DraftBackendFactory._create_backend",
        around_create_draft_backend,
        HookType.AROUND,
    )
    _announce("torch_native draft-extend backend for EAGLE/NEXTN (one draft step)")
    from sgl_pd.harness import gdn_kernels_cpu, spec_kernels_cpu

    _install_kernels(spec_kernels_cpu.KERNELS)
    _install_kernels(gdn_kernels_cpu.KERNELS)  # (before SGLang's GDN backend binds two)
    _register_gated_delta_net(HookRegistry, HookType)
    HookRegistry.register(
        _HOOK + "layers.attention.torch_native_backend.TorchNativeAttnBackend.forward_extend",
        around_forward_extend,
        HookType.AROUND,
    )
    _announce("TARGET_VERIFY extend lengths for torch_native (chain drafts, topk 1)")
    from sgl_pd.harness import swa_attention_cpu

    native = _HOOK + "layers.attention.torch_native_backend.TorchNativeAttnBackend."
    HookRegistry.register(
        native + "forward_decode", swa_attention_cpu.around_forward_decode, HookType.AROUND
    )
    HookRegistry.register(
        native + "init_forward_metadata",
        swa_attention_cpu.after_init_forward_metadata,
        HookType.AFTER,
    )
    _announce("torch_native reads sliding-window layers through SWA-pool slots")
    from sgl_pd.harness.extend_attention_cpu import around_run_sdpa_forward_extend

    HookRegistry.register(
        _HOOK + "layers.attention.torch_native_backend.TorchNativeAttnBackend."
        "_run_sdpa_forward_extend",
        around_run_sdpa_forward_extend,
        HookType.AROUND,
    )
    _announce("torch_native extend attention over the new tokens only (not context x context)")
    HookRegistry.register(
        _HOOK + "distributed.parallel_state.init_model_parallel_group",
        around_init_model_parallel_group,
        HookType.AROUND,
    )
    _announce("TP groups without pynccl and custom all-reduce (gloo all-reduce)")
    HookRegistry.register(
        _HOOK + "utils.numa_utils.init_threads_binding", after_init_threads_binding, HookType.AFTER
    )
    _announce("each TP rank pinned to its SGLANG_CPU_OMP_THREADS_BIND entry")
    _add_padding_fill_value()
    _unpin_lora_tensors()
    _applied = True
    return True


class _UnpinnedTorch:
    """``torch`` as a module of SGLang's sees it in a CPU-engine process: tensor factories
    that ignore ``pin_memory`` (there is no device whose copies pinning would speed up)."""

    def __init__(self, torch: Any) -> None:
        self._torch = torch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def tensor(self, *args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return self._torch.tensor(*args, **kwargs)

    def empty(self, *args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return self._torch.empty(*args, **kwargs)

    def zeros(self, *args: Any, pin_memory: bool = False, **kwargs: Any) -> Any:
        return self._torch.zeros(*args, **kwargs)


# SGLang's LoRA modules that ask for pinned host tensors
_LORA_MODULES = ("sglang.srt.lora.layers", "sglang.srt.lora.backend.torch_backend")


def _unpin_lora_tensors() -> None:
    import importlib

    import torch

    for name in _LORA_MODULES:
        importlib.import_module(name).torch = _UnpinnedTorch(torch)  # type: ignore[attr-defined]
    torch.Tensor.pin_memory = _unpinned  # type: ignore[method-assign]
    _announce("LoRA layers on plain host tensors (no pinned memory without a GPU)")


def _unpinned(self: Any, *args: Any, **kwargs: Any) -> Any:
    return self


def _register_mla_dispatch() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    AttentionBackendRegistry.register("torch_native", _dispatch_mla_subtype)
    _announce("MLA attention dispatch registered for torch_native (absorbed MLA)")


def _add_padding_fill_value() -> None:
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    if not hasattr(TorchNativeAttnBackend, "get_cpu_graph_seq_len_fill_value"):
        TorchNativeAttnBackend.get_cpu_graph_seq_len_fill_value = _one_token  # type: ignore[attr-defined]
        _announce("torch_native pads DP-attention batches with one-token rows")


def _one_token(self: Any) -> int:
    """Sequence length of a padded row (as SGLang's AMX backend answers)."""
    return 1


def _install_kernels(kernels: dict[str, Any]) -> None:
    """Each of `kernels` as ``torch.ops.sgl_kernel.<name>``, where the installed kernel
    build lacks it."""
    import torch

    with contextlib.suppress(ImportError):
        import sgl_kernel  # noqa: F401 - loads whatever ops the installed wheel has
    namespace = torch.ops.sgl_kernel
    for name, fn in kernels.items():
        try:
            getattr(namespace, name)
            continue  # a kernel build that has it: keep the native op
        except (AttributeError, RuntimeError):
            pass
        setattr(namespace, name, fn)
        _announce(f"torch.ops.sgl_kernel.{name} (pure torch)")


def _register_gated_delta_net(registry: Any, hook_type: Any) -> None:
    from sglang.srt.utils import cpu_has_amx_support

    from sgl_pd.harness import gdn_kernels_cpu

    registry.register(
        _HOOK + "models.qwen3_next.Qwen3GatedDeltaNet.__init__",
        gdn_kernels_cpu.around_gated_delta_net_init,
        hook_type.AROUND,
    )
    _announce("Qwen3GatedDeltaNet built with torch.cpu as its device module")
    registry.register(
        _HOOK + "models.qwen2_moe.fused_gate_sigmoid_mul_add",
        gdn_kernels_cpu.fused_gate_sigmoid_mul_add,
        hook_type.REPLACE,
    )
    _announce("the gated shared expert of Qwen2-style MoEs in torch (no Triton)")
    if not cpu_has_amx_support():  # (with SGLang's AMX kernels it has a CPU op of its own)
        registry.register(
            "sglang.kernels.ops.attention.fla.fused_norm_gate.FusedRMSNormGated.forward",
            gdn_kernels_cpu.forward_gated_rms_norm,
            hook_type.REPLACE,
        )
        _announce("FusedRMSNormGated in torch (no Triton on the CPU engine)")


# --------------------------------------------------------------------------- hooks


def around_get_rope_cpu(original: Any, *args: Any, **kwargs: Any) -> Any:
    """``get_rope_cpu`` for DeepSeek yarn; SGLang's generic ``get_rope`` for the rest."""
    import inspect

    bound = inspect.signature(original).bind(*args, **kwargs)
    scaling = bound.arguments.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "deepseek_yarn":
        return original(*args, **kwargs)
    from sglang.srt.layers.rotary_embedding.factory import get_rope

    arguments = dict(bound.arguments)
    arguments.pop("device", None)  # get_rope places its cache on the default device: CPU
    return get_rope(**arguments)


def set_embed_and_head(self: Any, embed: Any, head: Any) -> None:
    """SGLang's body without the CUDA calls: on CPU the new tensors are ready at once."""
    del self.model.embed_tokens.weight
    del self.lm_head.weight
    self.model.embed_tokens.weight = embed
    self.lm_head.weight = head


def around_init_model_parallel_group(original: Any, *args: Any, **kwargs: Any) -> Any:
    """Every process group SGLang builds, without the CUDA-only communicators."""
    kwargs["use_pynccl"] = False
    kwargs["use_custom_allreduce"] = False
    return original(*args, **kwargs)


def parse_cpu_list(text: str) -> list[int]:
    """Cores of a Linux CPU list such as ``0,2-3`` (what SGLANG_CPU_OMP_THREADS_BIND holds
    per rank)."""
    cores: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def after_init_threads_binding(result: Any, *args: Any, **kwargs: Any) -> Any:
    """Pins this scheduler process to the cores SGLang chose for its rank (`result`, a
    CPU list) and sizes torch's thread pool to them; SGLang's return value is untouched."""
    import os

    import torch

    cores = parse_cpu_list(str(result)) if isinstance(result, str) else []
    if cores:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))
        logger.info("this rank runs on cores %s with %d torch threads", result, len(cores))
    return result


def around_create_draft_backend(
    original: Any, self: Any, backend_name: str, backend_map: dict, *args: Any, **kwargs: Any
) -> Any:
    """Adds ``torch_native`` to the draft-extend choices (not to the multi-step decode
    ones, whose entries build per-step containers)."""
    stamps_children = kwargs.get("stamps_children", args[1] if len(args) > 1 else False)
    if "torch_native" not in backend_map and not stamps_children:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        runner = self.draft_model_runner
        backend_map = {
            **backend_map,
            "torch_native": lambda: ("torch_native", TorchNativeAttnBackend(runner)),
        }
    return original(self, backend_name, backend_map, *args, **kwargs)


def around_forward_extend(
    original: Any, self: Any, q: Any, k: Any, v: Any, layer: Any, forward_batch: Any,
    *args: Any, **kwargs: Any,
) -> Any:  # fmt: skip
    """TARGET_VERIFY batches carry committed ``seq_lens`` and no extend lengths; give the
    backend a copy of the batch with prefix = seq_lens, extend = draft_token_num and
    seq_lens + draft_token_num, so its causal SDPA covers prefix + chain. A sliding
    layer of the hybrid SWA pool reads through SWA slots (`swa_attention_cpu`)."""
    from sgl_pd.harness.swa_attention_cpu import with_swa_reads

    if not forward_batch.forward_mode.is_target_verify():
        return with_swa_reads(original, self, q, k, v, layer, forward_batch, *args, **kwargs)
    spec = forward_batch.spec_info
    topk = getattr(spec, "topk", 1)
    if topk != 1:
        raise NotImplementedError(
            f"torch_native verifies chain drafts only (got --speculative-eagle-topk {topk}); "
            "use --speculative-eagle-topk 1"
        )
    import torch

    n = int(spec.draft_token_num)
    committed = forward_batch.seq_lens
    batch = copy.copy(forward_batch)
    batch.extend_prefix_lens = committed
    batch.extend_seq_lens = torch.full_like(committed, n)
    batch.seq_lens = committed + n
    return with_swa_reads(original, self, q, k, v, layer, batch, *args, **kwargs)
