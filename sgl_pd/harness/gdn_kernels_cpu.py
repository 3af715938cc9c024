"""Pure-torch versions of what SGLang 0.5.23's gated-DeltaNet layers (Qwen3-Next,
Qwen3.5) call on its CPU engine and the pip kernel wheel (a CUDA build) lacks.

The five ``torch.ops.sgl_kernel.*_cpu`` ops, with the argument lists SGLang passes them
(positionally through ``sgl_kernel/mamba.py``'s wrappers; the decode op by keyword from
``layers/attention/linear/kernels/gdn_triton.py``) and their in-place effects, written
from the Triton kernels of the same math (``sglang/kernels/ops/attention/fla/``,
``.../linear/fused_sigmoid_gating_recurrent.py``, ``.../mamba/causal_conv1d_triton.py``) and
checked against transformers' torch reference for Qwen3-Next. Two of them are bound when
SGLang's GDN backend module loads, so all are installed before any model is built.

Conventions (SGLang's, not transformers'):
- varlen batches: tensors carry a leading batch dim of 1; ``cu_seqlens`` /
  ``query_start_loc`` (int32, ``[N + 1]``) bound the N sequences' tokens;
- state slots: ``cache_indices[i]`` (int32) is sequence i's slot in the layer's pool; a
  negative slot (SGLang's pad id, -1) is a padded row: nothing read or written;
- the recurrent state pool is ``[slots, HV, V, K]`` (V before K; transformers keeps
  ``[HV, K, V]``), float32, updated in place - SGLang ignores the returned state on CPU;
- the conv state pool is ``[slots, dim, W - 1]``, oldest column first, in its own dtype
  (bfloat16 unless ``SGLANG_MAMBA_CONV_DTYPE`` says otherwise), updated in place;
- q and k are l2-normalized inside the kernel (eps 1e-6), q scaled by ``K ** -0.5``; a
  value head h reads q/k head ``h // (HV // H)``.
Everything is computed in float32, token by token: batches on the CPU engine are small,
and the loop reads like the recurrence.

Besides the ops, three things SGLang's Qwen3-Next does only through a GPU: the gated
RMSNorm runs a Triton kernel unless the CPU has SGLang's AMX kernels
(``forward_gated_rms_norm`` is its torch form), the layer's constructor asks
``torch.get_device_module().current_device()``, which is ``torch.cuda`` with a CUDA torch
build (``around_gated_delta_net_init`` answers ``torch.cpu`` while it runs), and its MoE
adds the gated shared expert with a Triton kernel (``fused_gate_sigmoid_mul_add``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # SGLang's in-kernel q/k l2 normalization


def causal_conv1d_fwd_cpu(
    x: torch.Tensor,  # [dim, T] (a transposed view of [T, dim])
    weight: torch.Tensor,  # [dim, W]
    bias: torch.Tensor | None,  # [dim]
    conv_states: torch.Tensor | None,  # [slots, dim, W - 1], written
    query_start_loc: torch.Tensor | None,  # [N + 1]
    cache_indices: torch.Tensor | None,  # [N]
    has_initial_state: torch.Tensor | None,  # [N] bool: the slot holds the prefix's window
    silu_activation: bool,
    pad_slot_id: int,
    is_vnni: bool,
) -> torch.Tensor:
    """Depthwise causal conv over each sequence, continuing from its slot's window when it
    has one (a chunked or prefix-cached prefill); each slot keeps the last W - 1 inputs.
    Returns ``[dim, T]`` as a transposed ``[T, dim]`` (what SGLang transposes back).
    ``is_vnni`` (prepacked AMX weights) does not apply: weights arrive unpacked."""
    del is_vnni
    dim, total = x.shape
    window = weight.shape[1] - 1
    out = torch.zeros(total, dim, dtype=x.dtype)
    bounds = [0, total] if query_start_loc is None else query_start_loc.tolist()
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        slot = i if cache_indices is None else int(cache_indices[i])
        if end <= start or slot == pad_slot_id or slot < 0:
            continue
        tokens = x[:, start:end].float()
        continues = conv_states is not None and has_initial_state is not None
        prev = (
            conv_states[slot].float()  # type: ignore[index]
            if continues and bool(has_initial_state[i])  # type: ignore[index]
            else tokens.new_zeros(dim, window)
        )
        y, state = _conv(torch.cat([prev, tokens], dim=1), weight, bias, silu_activation)
        out[start:end] = y.t().to(x.dtype)
        if conv_states is not None:
            conv_states[slot] = state.to(conv_states.dtype)
    return out.t()


def causal_conv1d_update_cpu(
    x: torch.Tensor,  # [bs, dim]: one new token per sequence
    conv_states: torch.Tensor,  # [slots, dim, W - 1], written
    weight: torch.Tensor,  # [dim, W]
    bias: torch.Tensor | None,
    silu_activation: bool,
    cache_seqlens: torch.Tensor | None,
    conv_state_indices: torch.Tensor | None,  # [bs]
    pad_slot_id: int,
    is_vnni: bool,
) -> torch.Tensor:
    """One decode step of the conv: each sequence's new token after its slot's window.
    Returns ``[bs, dim]`` (a padded row: zeros)."""
    del is_vnni
    if cache_seqlens is not None:
        raise NotImplementedError("circular conv state buffers (cache_seqlens) are not served")
    out = torch.zeros_like(x)
    for i in range(x.shape[0]):
        slot = i if conv_state_indices is None else int(conv_state_indices[i])
        if slot == pad_slot_id or slot < 0:
            continue
        joined = torch.cat([conv_states[slot].float(), x[i].float().unsqueeze(-1)], dim=1)
        y, state = _conv(joined, weight, bias, silu_activation)
        out[i] = y[:, -1].to(x.dtype)
        conv_states[slot] = state.to(conv_states.dtype)
    return out


def _conv(
    joined: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the conv of the tokens after the first W - 1 columns of `joined` [dim, W - 1 + L],
    the last W - 1 columns: the window the next token continues from)."""
    dim, width = weight.shape
    y = F.conv1d(
        joined.unsqueeze(0),
        weight.float().unsqueeze(1),
        None if bias is None else bias.float(),
        groups=dim,
    )[0]
    return (F.silu(y) if silu else y), joined[:, joined.shape[1] - (width - 1) :]


def fused_gdn_gating_cpu(
    A_log: torch.Tensor,  # [HV] float32
    a: torch.Tensor,  # [T, HV]
    b: torch.Tensor,  # [T, HV]
    dt_bias: torch.Tensor,  # [HV]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decay and write gates: ``g = -exp(A_log) * softplus(a + dt_bias)`` ([1, T, HV]
    float32) and ``beta = sigmoid(b)`` ([1, T, HV], b's dtype)."""
    g = _decay(A_log, a, dt_bias, softplus_beta=1.0, softplus_threshold=20.0)
    return g.unsqueeze(0), torch.sigmoid(b.float()).to(b.dtype).unsqueeze(0)


def _decay(
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    softplus_beta: float,
    softplus_threshold: float,
) -> torch.Tensor:
    step = F.softplus(a.float() + dt_bias.float(), beta=softplus_beta, threshold=softplus_threshold)
    return -A_log.float().exp() * step


def chunk_gated_delta_rule_cpu(
    query: torch.Tensor,  # [1, T, H, K]
    key: torch.Tensor,  # [1, T, H, K]
    value: torch.Tensor,  # [1, T, HV, V]
    g: torch.Tensor,  # [1, T, HV] float32
    beta: torch.Tensor,  # [1, T, HV]
    initial_state: torch.Tensor,  # the layer's pool [slots, HV, V, K], written
    output_final_state: bool,
    cu_seqlens: torch.Tensor,  # [N + 1]
    head_first: bool,
    use_qk_l2norm_in_kernel: bool,
    initial_state_indices: torch.Tensor,  # [N]
    eps: float = L2_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over each sequence of a prefill, from its slot's state (SGLang
    zeroes a new request's slot first), which ends as the sequence's final state.
    Returns (the outputs [1, T, HV, V] in value's dtype, the pool)."""
    del output_final_state  # (the pool is always written: SGLang reads nothing else)
    if head_first:
        raise NotImplementedError("head-first layouts are not served")
    q, k = _normalized(query[0], key[0], value.shape[2], use_qk_l2norm_in_kernel, eps)
    out = _delta_rule(
        q, k, value[0].float(), g[0].float(), beta[0].float(),
        initial_state, initial_state_indices, cu_seqlens,
    )  # fmt: skip
    return out.to(value.dtype).unsqueeze(0), initial_state


def fused_sigmoid_gating_delta_rule_update_cpu(
    A_log: torch.Tensor,  # [HV]
    dt_bias: torch.Tensor,  # [HV]
    q: torch.Tensor,  # [1, bs, H, K]
    k: torch.Tensor,  # [1, bs, H, K]
    v: torch.Tensor,  # [1, bs, HV, V]
    a: torch.Tensor,  # [bs, HV]: before the gates
    b: torch.Tensor,  # [bs, HV]
    initial_state_source: torch.Tensor,  # the layer's pool [slots, HV, V, K], written
    initial_state_indices: torch.Tensor,  # [bs]
    cu_seqlens: torch.Tensor,  # [bs + 1]
    use_qk_l2norm_in_kernel: bool,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """One decode step of the gated delta rule, gates computed here from `a` and `b`.
    Returns ``[1, bs, HV, V]`` (v's shape, as SGLang's Triton kernel)."""
    heads, v_dim = v.shape[2], v.shape[3]
    qn, kn = _normalized(
        q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), heads,
        use_qk_l2norm_in_kernel, L2_EPS,
    )  # fmt: skip
    g = _decay(
        A_log, a, dt_bias, softplus_beta=softplus_beta, softplus_threshold=softplus_threshold
    )
    out = _delta_rule(
        qn, kn, v.reshape(-1, heads, v_dim).float(), g, torch.sigmoid(b.float()),
        initial_state_source, initial_state_indices, cu_seqlens,
    )  # fmt: skip
    return out.to(v.dtype).view(v.shape)


def _normalized(
    q: torch.Tensor, k: torch.Tensor, value_heads: int, l2norm: bool, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [T, H, K] as the recurrence reads them: float32, l2-normalized (`l2norm`),
    q scaled by K ** -0.5, each head repeated for the value heads that read it."""
    q, k = q.float(), k.float()
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
    repeat = value_heads // q.shape[1]
    q = (q * q.shape[-1] ** -0.5).repeat_interleave(repeat, dim=1)
    return q, k.repeat_interleave(repeat, dim=1)


def _delta_rule(
    q: torch.Tensor,  # [T, HV, K]
    k: torch.Tensor,  # [T, HV, K]
    v: torch.Tensor,  # [T, HV, V]
    g: torch.Tensor,  # [T, HV]: log decay
    beta: torch.Tensor,  # [T, HV]
    pool: torch.Tensor,  # [slots, HV, V, K]
    slots: torch.Tensor,  # [N]
    cu_seqlens: torch.Tensor,  # [N + 1]
) -> torch.Tensor:
    """Per sequence, per token: S *= exp(g); S += outer((v - S k) * beta, k); o = S q.
    The outputs [T, HV, V] float32; each sequence's final S into its slot."""
    out = torch.zeros(v.shape, dtype=torch.float32)
    bounds = cu_seqlens.tolist()
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        slot = int(slots[i])
        if slot < 0 or end <= start:
            continue
        state = pool[slot].float()  # [HV, V, K]
        for t in range(start, end):
            state = state * g[t].exp()[:, None, None]
            delta = (v[t] - torch.einsum("hvk,hk->hv", state, k[t])) * beta[t][:, None]
            state = state + delta[:, :, None] * k[t][:, None, :]
            out[t] = torch.einsum("hvk,hk->hv", state, q[t])
        pool[slot] = state.to(pool.dtype)
    return out


KERNELS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        causal_conv1d_fwd_cpu,
        causal_conv1d_update_cpu,
        fused_gdn_gating_cpu,
        chunk_gated_delta_rule_cpu,
        fused_sigmoid_gating_delta_rule_update_cpu,
    )
}


def forward_gated_rms_norm(
    self: Any,
    x: torch.Tensor,
    g: torch.Tensor,
    residual: torch.Tensor | None = None,
    prenorm: bool = False,
    residual_in_fp32: bool = False,
) -> torch.Tensor:
    """``FusedRMSNormGated.forward`` in torch (SGLang's ``rms_norm_ref`` with the norm
    before the gate, no groups): ``rmsnorm(x) * weight * act(g)``, act silu (swish) or
    sigmoid. Qwen3-Next passes no residual."""
    if residual is not None or prenorm:
        raise NotImplementedError("the gated RMSNorm's residual form is not served on CPU")
    del residual_in_fp32
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
    if self.weight is not None:
        y = y * self.weight.float()
    gate = torch.sigmoid(g.float()) if self.activation == "sigmoid" else F.silu(g.float())
    return (y * gate).to(x.dtype)


def fused_gate_sigmoid_mul_add(
    hidden_states: torch.Tensor,  # [T, hidden]
    gate_weight: torch.Tensor,  # [hidden]: the shared expert's gate, one output
    shared_output: torch.Tensor,  # [T, hidden]
    final_hidden_states: torch.Tensor,  # [T, hidden], added to
) -> None:
    """The MoE's shared expert, gated, added to the routed experts' output in place:
    ``final += sigmoid(hidden @ gate) * shared`` (SGLang's unfused form, in torch)."""
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float()).unsqueeze(-1)
    final_hidden_states += (gate * shared_output.float()).to(final_hidden_states.dtype)


def around_gated_delta_net_init(original: Any, *args: Any, **kwargs: Any) -> Any:
    """``Qwen3GatedDeltaNet.__init__`` with ``torch.get_device_module()`` (no argument)
    answering ``torch.cpu``: the layer places its norm on the current device's module,
    which a CUDA torch build says is ``torch.cuda``."""
    module_of = torch.get_device_module

    def on_cpu(device: Any = None) -> Any:
        return torch.cpu if device is None else module_of(device)

    torch.get_device_module = on_cpu  # type: ignore[assignment]
    try:
        return original(*args, **kwargs)
    finally:
        torch.get_device_module = module_of  # type: ignore[assignment]
