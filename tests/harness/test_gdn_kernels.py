"""The pure-torch gated-DeltaNet kernels of the CPU harness against transformers' own
torch reference for Qwen3-Next: a prefill in one go, chunked, or followed by decode
steps gives the same outputs and the same final state, several sequences of one batch
each in their own slot, a padded row (slot -1) touching nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sgl_pd.harness import gdn_kernels_cpu as gdn

transformers_qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

H, HV, K, V, W = 2, 4, 32, 32, 4  # key heads, value heads, head dims, conv width
DIM = 2 * H * K + HV * V  # the conv runs over q | k | v


def _i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _conv_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """transformers' causal conv (from zeros) over one sequence x [T, dim]: [T, dim]."""
    out = transformers_qwen3_next.causal_conv1d_fn(x.t().unsqueeze(0), weight, None, "silu")
    return out[0].t()


def test_the_prefill_conv_continues_each_sequence_from_its_slot() -> None:
    torch.manual_seed(0)
    weight = torch.randn(DIM, W) * 0.3
    prefix, first, second = torch.randn(5, DIM), torch.randn(9, DIM), torch.randn(2, DIM)
    pool = torch.zeros(8, DIM, W - 1)
    gdn.causal_conv1d_fwd_cpu(
        prefix.t(),
        weight,
        None,
        pool,
        _i32([0, 5]),
        _i32([3]),
        torch.tensor([False]),
        True,
        -1,
        True,
    )
    # one batch: sequence 0 continues slot 3's prefix, 1 starts fresh in slot 6 (2 tokens,
    # fewer than the window), 2 is a padded row
    batch = torch.cat([first, second, torch.randn(1, DIM)])
    untouched = pool[0].clone()
    out = gdn.causal_conv1d_fwd_cpu(
        batch.t(), weight, None, pool, _i32([0, 9, 11, 12]), _i32([3, 6, -1]),
        torch.tensor([True, False, False]), True, -1, True,
    )  # fmt: skip
    whole = _conv_reference(torch.cat([prefix, first]), weight)
    torch.testing.assert_close(out.t()[:9], whole[5:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.t()[9:11], _conv_reference(second, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[3], torch.cat([prefix, first])[-(W - 1) :].t())
    torch.testing.assert_close(pool[6][:, 1:], second.t())  # (a zero column before it)
    assert torch.equal(pool[0], untouched) and not out.t()[11].any()


def test_decode_steps_of_the_conv_continue_the_prefill() -> None:
    torch.manual_seed(1)
    weight = torch.randn(DIM, W) * 0.3
    tokens = torch.randn(7, DIM)
    pool = torch.zeros(4, DIM, W - 1)
    gdn.causal_conv1d_fwd_cpu(
        tokens[:4].t(),
        weight,
        None,
        pool,
        _i32([0, 4]),
        _i32([2]),
        torch.tensor([False]),
        True,
        -1,
        True,
    )
    steps = [
        gdn.causal_conv1d_update_cpu(
            tokens[t : t + 1], pool, weight, None, True, None, _i32([2]), -1, True
        )
        for t in range(4, 7)
    ]
    torch.testing.assert_close(
        torch.cat(steps), _conv_reference(tokens, weight)[4:], rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(pool[2], tokens[-(W - 1) :].t())


def test_a_bfloat16_conv_pool_keeps_its_dtype() -> None:
    weight = torch.randn(DIM, W)
    pool = torch.zeros(2, DIM, W - 1, dtype=torch.bfloat16)
    gdn.causal_conv1d_fwd_cpu(
        torch.randn(3, DIM).t(),
        weight,
        None,
        pool,
        _i32([0, 3]),
        _i32([1]),
        torch.tensor([False]),
        True,
        -1,
        True,
    )
    assert pool.dtype == torch.bfloat16 and pool[1].any()


def _gates(tokens: int) -> tuple[torch.Tensor, ...]:
    a, b = torch.randn(tokens, HV), torch.randn(tokens, HV)
    return a, b, torch.rand(HV).log(), torch.rand(HV)  # a, b, A_log, dt_bias


def _reference(q, k, v, g, beta) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' chunked delta rule over one sequence: (outputs [T, HV, V], final
    state in SGLang's layout [HV, V, K])."""
    repeat = HV // H
    out, state = transformers_qwen3_next.torch_chunk_gated_delta_rule(
        q.repeat_interleave(repeat, 2), k.repeat_interleave(repeat, 2), v, g=g, beta=beta,
        initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out[0], state[0].transpose(-1, -2)


def test_prefill_then_decode_steps_match_the_reference_recurrence() -> None:
    torch.manual_seed(2)
    total, prompt = 67, 60
    q, k = torch.randn(1, total, H, K), torch.randn(1, total, H, K)
    v = torch.randn(1, total, HV, V)
    a, b, a_log, dt_bias = _gates(total)
    g, beta = gdn.fused_gdn_gating_cpu(a_log, a, b, dt_bias)
    torch.testing.assert_close(g[0], -a_log.exp() * torch.nn.functional.softplus(a + dt_bias))
    torch.testing.assert_close(beta[0], b.sigmoid())
    expected, final = _reference(q, k, v, g, beta)
    pool = torch.zeros(4, HV, V, K)
    out, same = gdn.chunk_gated_delta_rule_cpu(
        q[:, :prompt], k[:, :prompt], v[:, :prompt], g[:, :prompt], beta[:, :prompt], pool,
        True, _i32([0, prompt]), False, True, _i32([2]),
    )  # fmt: skip
    assert same is pool
    outputs = [out[0]]
    for t in range(prompt, total):
        step = gdn.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=a_log, dt_bias=dt_bias, q=q[:, t : t + 1], k=k[:, t : t + 1],
            v=v[:, t : t + 1], a=a[t : t + 1], b=b[t : t + 1], initial_state_source=pool,
            initial_state_indices=_i32([2]), cu_seqlens=_i32([0, 1]),
            use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0,
        )  # fmt: skip
        assert step.shape == (1, 1, HV, V)
        outputs.append(step[0])
    torch.testing.assert_close(torch.cat(outputs), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[2], final, rtol=1e-4, atol=1e-5)


def test_a_chunked_prefill_and_a_batch_of_sequences_match_their_prefills_alone() -> None:
    torch.manual_seed(3)
    lengths = (23, 41)
    total = sum(lengths)
    q, k = torch.randn(1, total, H, K), torch.randn(1, total, H, K)
    v = torch.randn(1, total, HV, V)
    a, b, a_log, dt_bias = _gates(total)
    g, beta = gdn.fused_gdn_gating_cpu(a_log, a, b, dt_bias)
    first = slice(0, lengths[0])
    expected, final = _reference(q[:, first], k[:, first], v[:, first], g[:, first], beta[:, first])
    # sequence 0 in two chunks (10 + 13 tokens), the second continuing from slot 1
    pool = torch.zeros(5, HV, V, K)
    parts = []
    for lo, hi in ((0, 10), (10, 23)):
        out, _ = gdn.chunk_gated_delta_rule_cpu(
            q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], pool, True,
            _i32([0, hi - lo]), False, True, _i32([1]),
        )  # fmt: skip
        parts.append(out[0])
    torch.testing.assert_close(torch.cat(parts), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool[1], final, rtol=1e-4, atol=1e-5)
    # both sequences in one batch, in slots 3 and 4, with a padded row between them
    batch = torch.zeros(5, HV, V, K)
    out, _ = gdn.chunk_gated_delta_rule_cpu(
        q, k, v, g, beta, batch, True, _i32([0, 23, 23, total]), False, True, _i32([3, -1, 4]),
    )  # fmt: skip
    torch.testing.assert_close(out[0, first], expected, rtol=1e-4, atol=1e-5)
    second = slice(lengths[0], total)
    alone, state = _reference(
        q[:, second], k[:, second], v[:, second], g[:, second], beta[:, second]
    )
    torch.testing.assert_close(out[0, second], alone, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(batch[4], state, rtol=1e-4, atol=1e-5)
    assert not batch[0].any()  # (the padded row's slot stays as it was)


def test_the_gated_norm_matches_transformers() -> None:
    torch.manual_seed(4)
    reference = transformers_qwen3_next.Qwen3NextRMSNormGated(V, eps=1e-6)
    with torch.no_grad():
        reference.weight.uniform_(0.5, 1.5)
    norm = SimpleNamespace(eps=1e-6, weight=reference.weight, activation="silu")
    x, gate = torch.randn(12, V), torch.randn(12, V)
    torch.testing.assert_close(gdn.forward_gated_rms_norm(norm, x, gate), reference(x, gate))


def test_the_layer_is_built_with_torch_cpu_as_its_device_module_and_only_then() -> None:
    before = torch.get_device_module

    def build() -> object:
        return torch.get_device_module()

    assert gdn.around_gated_delta_net_init(build) is torch.cpu
    assert torch.get_device_module is before


def test_every_kernel_takes_the_arguments_sglang_passes() -> None:
    """As called from SGLang's source: positionally through ``sgl_kernel/mamba.py``'s
    wrappers, and the decode op by keyword from the GDN backend's Triton kernel module."""
    import ast
    import importlib.util
    import inspect
    from pathlib import Path

    def calls(path: Path) -> list[ast.Call]:
        return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]

    def name(call: ast.Call) -> str | None:
        func = call.func
        return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)

    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        pytest.skip("sgl_kernel is not installed")
    checked = set()
    for call in calls(Path(spec.origin).parent / "mamba.py"):
        fn = gdn.KERNELS.get(name(call) or "")
        if fn is not None:  # positional
            params = list(inspect.signature(fn).parameters.values())
            required = [p for p in params if p.default is inspect.Parameter.empty]
            assert len(required) <= len(call.args) <= len(params), name(call)
            checked.add(fn.__name__)
    sglang = importlib.util.find_spec("sglang")
    assert sglang is not None and sglang.origin is not None
    triton = Path(sglang.origin).parent / "srt/layers/attention/linear/kernels/gdn_triton.py"
    decode = gdn.fused_sigmoid_gating_delta_rule_update_cpu
    for call in calls(triton):
        if name(call) == "fused_sigmoid_gating_delta_rule_update" and not call.args:
            keywords = {k.arg for k in call.keywords}
            if "is_kda" in keywords:  # (speculative verification: not served on CPU)
                continue
            assert keywords <= set(inspect.signature(decode).parameters)
            checked.add(decode.__name__)
    assert checked == {
        "causal_conv1d_fwd_cpu",
        "causal_conv1d_update_cpu",
        "chunk_gated_delta_rule_cpu",
        "fused_sigmoid_gating_delta_rule_update_cpu",
    }  # fmt: skip  (fused_gdn_gating_cpu: called directly, A_log, a, b, dt_bias)


def test_the_gated_shared_expert_is_added_as_sglangs_unfused_form_adds_it() -> None:
    torch.manual_seed(5)
    hidden, shared, routed = torch.randn(6, 64), torch.randn(6, 64), torch.randn(6, 64)
    gate = torch.nn.Linear(64, 1, bias=False)
    expected = routed + torch.sigmoid(gate(hidden)) * shared
    gdn.fused_gate_sigmoid_mul_add(hidden, gate.weight.squeeze(), shared, routed)
    torch.testing.assert_close(routed, expected.detach())
