"""The pure-torch spec kernels of the CPU harness against plain loop references and, for
the kernels without Triton standard-library calls (which the interpreter can only run when
``TRITON_INTERPRET`` is set before Triton is imported), against SGLang's own Triton kernel
of the same name run by Triton's CPU interpreter."""

from __future__ import annotations

import random

import pytest
import torch

from sgl_pd.harness import spec_kernels_cpu as k

I64 = torch.int64


def interpreted(jit_fn):  # type: ignore[no-untyped-def]
    """A ``@triton.jit`` kernel run by Triton's interpreter on CPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(jit_fn.fn)


def pool(max_reqs: int = 6, pool_len: int = 40) -> torch.Tensor:
    return torch.arange(max_reqs * pool_len, dtype=torch.int32).view(max_reqs, pool_len) + 1000


def ranges(rng: random.Random, bs: int, pool_len: int) -> tuple[torch.Tensor, ...]:
    """Distinct request rows and [start, end) windows, some of them empty."""
    reqs = torch.tensor(rng.sample(range(6), bs), dtype=I64)
    starts, ends = [], []
    for _ in range(bs):
        s = rng.randrange(pool_len - 8)
        starts.append(s)
        ends.append(s + rng.choice([0, 1, 3, 8]))
    return reqs, torch.tensor(starts, dtype=I64), torch.tensor(ends, dtype=I64)


# --------------------------------------------------------------------------- cache slots


@pytest.mark.parametrize("seed", range(4))
def test_assign_req_to_token_pool_writes_each_window(seed: int) -> None:
    rng = random.Random(seed)
    req_to_token = pool()
    reqs, starts, ends = ranges(rng, rng.randint(1, 4), req_to_token.shape[1])
    total = int((ends - starts).sum())
    out_cache_loc = torch.arange(total, dtype=I64) + 7

    expected = req_to_token.clone()
    offset = 0
    for r, s, e in zip(reqs.tolist(), starts.tolist(), ends.tolist(), strict=True):
        for j in range(s, e):
            expected[r, j] = int(out_cache_loc[offset])
            offset += 1
    got = req_to_token.clone()
    k.assign_req_to_token_pool_cpu(reqs, got, starts, ends, out_cache_loc, got.shape[1])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("seed", range(4))
def test_assign_extend_cache_locs_gathers_each_window(seed: int) -> None:
    rng = random.Random(seed)
    req_to_token = pool()
    reqs, starts, ends = ranges(rng, rng.randint(1, 4), req_to_token.shape[1])
    total = int((ends - starts).sum())

    expected = [
        int(req_to_token[r, j])
        for r, s, e in zip(reqs.tolist(), starts.tolist(), ends.tolist(), strict=True)
        for j in range(s, e)
    ]
    got = torch.full((total,), -1, dtype=I64)
    k.assign_extend_cache_locs_cpu(reqs, req_to_token, starts, ends, got, req_to_token.shape[1])
    assert got.tolist() == expected


@pytest.mark.parametrize(("topk", "steps"), [(1, 1), (1, 3), (2, 2), (4, 1)])
def test_assign_draft_cache_locs_contiguous(topk: int, steps: int) -> None:
    req_to_token = pool()
    reqs = torch.tensor([3, 0, 5], dtype=I64)
    seq_lens = torch.tensor([0, 17, 9], dtype=I64)
    n = topk * steps

    expected = []
    for r, s in zip(reqs.tolist(), seq_lens.tolist(), strict=True):
        expected += [int(req_to_token[r, s + j]) for j in range(n)]
    got = torch.full((3 * n,), -1, dtype=I64)
    k.assign_draft_cache_locs_contiguous_cpu(
        reqs, req_to_token, seq_lens, got, req_to_token.shape[1], topk, steps
    )
    assert got.tolist() == expected


# --------------------------------------------------------------------------- accept


def test_fill_bonus_tokens_takes_the_last_accepted_token() -> None:
    accept_tokens = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]], dtype=torch.int32)
    accept_lens = torch.tensor([1, 3, 2], dtype=torch.int32)
    got = torch.zeros(3, dtype=torch.int32)
    k.fill_bonus_tokens_cpu(accept_tokens, accept_lens, got, 3)
    assert got.tolist() == [5, 10, 12]

    from sglang.kernels.ops.speculative import eagle

    triton_out = torch.zeros(3, dtype=torch.int32)
    interpreted(eagle.fill_bonus_tokens)[(3,)](accept_tokens, accept_lens, triton_out, 3)
    assert torch.equal(got, triton_out)


@pytest.mark.parametrize(
    "accept_index",
    [
        [[0, 1], [2, 3]],  # all accepted
        [[0, -1], [2, -1]],  # none beyond the root
        [[0, 1, -1], [3, -1, -1], [6, 7, 8]],  # mixed
        [[4]],  # one request, one slot
    ],
)
def test_fill_accept_out_cache_loc_compacts_accepted_slots(accept_index: list[list[int]]) -> None:
    index = torch.tensor(accept_index, dtype=torch.int32)
    out_cache_loc = torch.arange(100, 116, dtype=I64)
    expected = [int(out_cache_loc[i]) for row in accept_index for i in row if i != -1]
    got = torch.full((len(expected),), -1, dtype=I64)
    k.fill_accept_out_cache_loc_cpu(index, out_cache_loc, got)
    assert got.tolist() == expected


# --------------------------------------------------------------------------- trees


def draft_tree(
    bs: int, topk: int, steps: int, num_draft: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(parent_list, top_scores_index, draft_tokens) as EAGLE's draft loop builds them
    (``select_top_k_tokens`` + ``organize_draft_results``) from random scores."""
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    g = torch.Generator().manual_seed(seed)
    p = torch.rand(bs, topk, generator=g)
    scores = p
    score_list, token_list = [p.unsqueeze(1)], [torch.randint(0, 50, (bs, topk), generator=g)]
    parents_list = [torch.arange(-1, topk).expand(bs, -1)]
    for i in range(1, steps):
        p = torch.rand(bs * topk, topk, generator=g)
        expand = scores.unsqueeze(2) * p.view(-1, topk, topk)
        scores, cs_index = expand.flatten(1).topk(topk, dim=-1)
        score_list.append(expand)
        token_list.append(torch.randint(0, 50, (bs, topk * topk), generator=g))
        parents_list.append(cs_index + (topk * topk * (i - 1) + topk))
    return organize_draft_results(score_list, token_list, parents_list, num_draft)


def build_tree(fn, parent_list, selected, seq_lens, topk, steps, n, mode):  # type: ignore[no-untyped-def]
    bs = seq_lens.shape[0]
    mask_len = (
        int(sum((s + n) * n for s in seq_lens.tolist())) if mode == k.FULL_MASK else bs * n * n
    )
    out = {
        "tree_mask": torch.ones(mask_len, dtype=torch.bool),
        "positions": torch.zeros(bs * n, dtype=I64),
        "retrive_index": torch.full((bs, n), -1, dtype=I64),
        "retrive_next_token": torch.full((bs, n), -1, dtype=I64),
        "retrive_next_sibling": torch.full((bs, n), -1, dtype=I64),
    }
    fn(parent_list, selected, seq_lens, *out.values(), topk, steps, n, mode)
    return out


def triton_build_tree(parent_list, selected, seq_lens, mask, pos, r_idx, r_next, r_sib,  # type: ignore[no-untyped-def]
                      topk, steps, n, mode):  # fmt: skip
    from sglang.kernels.ops.speculative import spec_tree

    interpreted(spec_tree.sgl_build_tree_kernel_efficient_triton)[(seq_lens.shape[0],)](
        parent_list, selected, seq_lens, torch.cumsum(seq_lens, 0) - seq_lens, mask, pos,
        r_idx, r_next, r_sib, topk=topk, depth=steps, draft_token_num=n,
        tree_mask_mode=mode, batch_size=seq_lens.shape[0],
        parent_list_stride=parent_list.stride(0) if parent_list.dim() > 1 else parent_list.shape[0],
        selected_index_stride=selected.stride(0),
    )  # fmt: skip


TREES = [(1, 1, 2), (1, 3, 4), (2, 2, 4), (2, 3, 5), (4, 2, 8), (3, 3, 6)]


@pytest.mark.parametrize("mode", [k.FULL_MASK, k.QLEN_ONLY])
@pytest.mark.parametrize(("topk", "steps", "n"), TREES)
def test_build_tree_matches_sglang_triton(topk: int, steps: int, n: int, mode: int) -> None:
    for seed in range(3):
        seq_lens = torch.tensor([5, 1, 12][: 1 + seed], dtype=I64)
        parents, selected, _ = draft_tree(len(seq_lens), topk, steps, n, seed)
        got = build_tree(k.build_tree_kernel_efficient_cpu, parents, selected, seq_lens,
                         topk, steps, n, mode)  # fmt: skip
        want = build_tree(triton_build_tree, parents, selected, seq_lens, topk, steps, n, mode)
        for name in got:
            assert torch.equal(got[name], want[name]), (name, got[name], want[name])


def test_chain_tree_is_a_causal_chain() -> None:
    """topk 1: every draft token hangs below the previous one."""
    n, seq_lens = 4, torch.tensor([7], dtype=I64)
    parents, selected, _ = draft_tree(1, 1, 3, n, 0)
    got = build_tree(k.build_tree_kernel_efficient_cpu, parents, selected, seq_lens,
                     1, 3, n, k.QLEN_ONLY)  # fmt: skip
    assert got["positions"].tolist() == [7, 8, 9, 10]
    assert got["retrive_next_token"].tolist() == [[1, 2, 3, -1]]
    assert got["retrive_next_sibling"].tolist() == [[-1, -1, -1, -1]]
    assert got["tree_mask"].view(n, n).tolist() == [[j <= i for j in range(n)] for i in range(n)]


def test_build_tree_rejects_the_bitpacked_mask() -> None:
    parents, selected, _ = draft_tree(1, 1, 1, 2, 0)
    with pytest.raises(NotImplementedError, match="bit-packed"):
        build_tree(k.build_tree_kernel_efficient_cpu, parents, selected,
                   torch.tensor([3]), 1, 1, 2, k.QLEN_ONLY_BITPACKING)  # fmt: skip


def verify(fn, candidates, tree, target):  # type: ignore[no-untyped-def]
    bs, n = candidates.shape
    predicts = torch.full((bs * n,), -7, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accept_num = torch.full((bs,), -7, dtype=torch.int32)
    fn(predicts, accept_index, accept_num, candidates, tree["retrive_index"],
       tree["retrive_next_token"], tree["retrive_next_sibling"], target)  # fmt: skip
    return predicts, accept_index, accept_num


def triton_verify(predicts, accept_index, accept_num, candidates, r_idx, r_next, r_sib, target):  # type: ignore[no-untyped-def]
    from sglang.kernels.ops.speculative import spec_tree

    bs, n = candidates.shape
    interpreted(spec_tree.verify_tree_greedy_kernel_triton)[(bs,)](
        predicts, accept_index, accept_num, candidates, r_idx, r_next, r_sib, target,
        batch_size=bs, num_speculative_tokens=accept_index.shape[1], num_draft_tokens=n,
    )  # fmt: skip


def reference_verify_chain(candidates: list[int], target: list[int]) -> tuple[list[int], int]:
    """A chain: accept drafts while each equals the target's token at the previous one."""
    accepted = 0
    while accepted + 1 < len(candidates) and candidates[accepted + 1] == target[accepted]:
        accepted += 1
    return target[: accepted + 1], accepted


@pytest.mark.parametrize("agree", [0, 1, 2, 3])
def test_verify_chain_against_a_loop(agree: int) -> None:
    n = 4
    candidates = torch.tensor([[9, 20, 21, 22]])
    target = [20, 21, 22, 23]
    target = target[:agree] + [99] * (n - agree)  # the target diverges after `agree` drafts
    tree = build_tree(k.build_tree_kernel_efficient_cpu, *draft_tree(1, 1, 3, n, 0)[:2],
                      torch.tensor([5]), 1, 3, n, k.QLEN_ONLY)  # fmt: skip
    predicts, accept_index, accept_num = verify(
        k.verify_tree_greedy_cpu, candidates, tree, torch.tensor([target])
    )
    tokens, accepted = reference_verify_chain(candidates[0].tolist(), target)
    assert int(accept_num[0]) == accepted == min(agree, n - 1)
    assert accept_index[0].tolist() == list(range(accepted + 1)) + [-1] * (n - accepted - 1)
    assert [int(predicts[i]) for i in range(accepted + 1)] == tokens


@pytest.mark.parametrize(("topk", "steps", "n"), TREES)
def test_verify_tree_matches_sglang_triton(topk: int, steps: int, n: int) -> None:
    for seed in range(4):
        bs = 1 + seed % 3
        parents, selected, drafts = draft_tree(bs, topk, steps, n, seed)
        tree = build_tree(k.build_tree_kernel_efficient_cpu, parents, selected,
                          torch.full((bs,), 6, dtype=I64), topk, steps, n, k.QLEN_ONLY)  # fmt: skip
        candidates = torch.cat([torch.full((bs, 1), 3), drafts], dim=1)  # root = bonus token
        g = torch.Generator().manual_seed(seed)
        # the target agrees with some draft at random nodes, so paths get accepted
        shifted = torch.roll(candidates, -1, dims=1)
        target = torch.where(torch.rand(bs, n, generator=g) < 0.7, shifted, 49)
        got = verify(k.verify_tree_greedy_cpu, candidates, tree, target)
        want = verify(triton_verify, candidates, tree, target)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), (a, b)


# --------------------------------------------------------------------------- install


def test_every_kernel_keeps_the_wrapper_signature() -> None:
    """Same parameter names as sgl_kernel's Python wrappers, which SGLang calls by keyword
    (read from the source: importing sgl_kernel needs a CUDA driver or the stand-in)."""
    import ast
    import importlib.util
    import inspect
    from pathlib import Path

    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        pytest.skip("sgl_kernel is not installed")
    tree = ast.parse((Path(spec.origin).parent / "speculative.py").read_text())
    theirs = {
        f.name: [a.arg for a in f.args.args] for f in tree.body if isinstance(f, ast.FunctionDef)
    }
    for name, fn in k.KERNELS.items():
        assert list(inspect.signature(fn).parameters) == theirs[name], name


def test_a_ranks_cpu_list_is_read_as_linux_writes_it() -> None:
    from sgl_pd.harness.cpu_shims import parse_cpu_list

    assert parse_cpu_list("0") == [0]
    assert parse_cpu_list("0,2-4") == [0, 2, 3, 4]
    assert parse_cpu_list(" 1 , 3 ") == [1, 3]
