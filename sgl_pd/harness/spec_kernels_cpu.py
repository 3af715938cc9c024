"""Pure-torch versions of the ``torch.ops.sgl_kernel.*_cpu`` speculative-decoding kernels.

The pip ``sglang-kernel`` wheel is a CUDA build without them, and SGLang 0.5.23's CPU engine
calls them for EAGLE / NEXTN (``sgl_kernel/speculative.py`` wraps each as
``torch.ops.sgl_kernel.<name>(...)``). Each function here has the op's argument list and
in-place semantics, written from SGLang's Triton kernel of the same name
(``sglang/kernels/ops/speculative/{cache_locs,eagle,spec_tree}.py``,
``sglang/srt/mem_cache/allocation.py``). They loop over the batch in Python: batches on
the CPU engine are small, and a loop reads like the kernel it mirrors.

Tensors are 1-D or 2-D and contiguous; ``req_to_token`` is ``(max_reqs, pool_len)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FULL_MASK, QLEN_ONLY, QLEN_ONLY_BITPACKING = 0, 1, 2  # SGLang's TreeMaskMode values


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,  # (bs,)
    req_to_token: torch.Tensor,  # (max_reqs, pool_len), written
    start_offset: torch.Tensor,  # (bs,)
    end_offset: torch.Tensor,  # (bs,)
    out_cache_loc: torch.Tensor,  # (sum(end - start),) slots, request after request
    pool_len: int,
) -> None:
    """``req_to_token[req, start:end] = `` the request's run of ``out_cache_loc``."""
    del pool_len  # the row length; req_to_token knows its own shape
    offset = 0
    for req, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = max(0, end - start)
        req_to_token[req, start : start + n] = out_cache_loc[offset : offset + n]
        offset += n


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,  # (bs,)
    req_to_token: torch.Tensor,  # (max_reqs, pool_len)
    start_offset: torch.Tensor,  # (bs,)
    end_offset: torch.Tensor,  # (bs,)
    out_cache_loc: torch.Tensor,  # (sum(end - start),), written
    pool_len: int,
) -> None:
    """The reverse gather: ``out_cache_loc`` gets each request's ``req_to_token[req,
    start:end]``, request after request."""
    del pool_len
    offset = 0
    for req, start, end in zip(
        req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True
    ):
        n = max(0, end - start)
        out_cache_loc[offset : offset + n] = req_to_token[req, start : start + n]
        offset += n


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,  # (bs,)
    req_to_token: torch.Tensor,  # (max_reqs, pool_len)
    seq_lens: torch.Tensor,  # (bs,)
    out_cache_loc: torch.Tensor,  # (bs * topk * num_steps,), written
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Request i's ``topk * num_steps`` slots from ``seq_lens[i]`` on, into row i of
    ``out_cache_loc`` viewed as ``(bs, topk * num_steps)``."""
    del pool_len
    n = topk * num_steps
    for i, (req, start) in enumerate(
        zip(req_pool_indices.tolist(), seq_lens.tolist(), strict=True)
    ):
        out_cache_loc[i * n : (i + 1) * n] = req_to_token[req, start : start + n]


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,  # (bs, accept_stride) or flat
    accept_lens: torch.Tensor,  # (bs,), counts the bonus token
    bonus_tokens: torch.Tensor,  # (bs,), written
    accept_stride: int,
) -> None:
    """``bonus_tokens[i]`` = request i's last accepted token (the target's own)."""
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[accept_stride * i + n - 1]


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,  # (bs, spec_steps + 1) or flat; -1 = not accepted
    out_cache_loc: torch.Tensor,  # (bs * draft_tokens,)
    accept_out_cache_loc: torch.Tensor,  # (number accepted,), written
) -> None:
    """Compacts the slots of accepted draft tokens: entry p of ``accept_index`` that is
    not -1 lands at the count of non -1 entries before it."""
    dst = 0
    for src in accept_index.reshape(-1).tolist():
        if src > -1:
            accept_out_cache_loc[dst] = out_cache_loc[src]
        if src != -1:
            dst += 1


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,  # (bs, parents) or flat when bs == 1
    selected_index: torch.Tensor,  # (bs, draft_token_num - 1)
    verified_seq_len: torch.Tensor,  # (bs,)
    tree_mask: torch.Tensor,  # flat bool, written
    positions: torch.Tensor,  # (bs * draft_token_num,), written
    retrive_index: torch.Tensor,  # (bs, draft_token_num), written
    retrive_next_token: torch.Tensor,  # (bs, draft_token_num), -1 filled, written
    retrive_next_sibling: torch.Tensor,  # (bs, draft_token_num), -1 filled, written
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """The EAGLE draft tree: retrieval links, positions and the attention mask, as
    ``sgl_build_tree_kernel_efficient_triton`` builds them (one program per request)."""
    if tree_mask_mode == QLEN_ONLY_BITPACKING:
        raise NotImplementedError(
            "build_tree_kernel_efficient_cpu: the bit-packed tree mask is not implemented; "
            "the torch_native backend uses FULL_MASK"
        )
    n = draft_token_num
    bs = verified_seq_len.shape[0]
    # one draft step: (bs, 0), no parents beyond the root
    parents = parent_list.reshape(bs, -1).tolist() if parent_list.numel() else [[]] * bs
    selected = selected_index.reshape(bs, -1).tolist()
    seq_lens = verified_seq_len.tolist()
    mask = tree_mask.view(-1)
    pos = positions.view(-1)
    r_index, r_next, r_sibling = (
        t.view(bs, n) for t in (retrive_index, retrive_next_token, retrive_next_sibling)
    )

    def position_of(b: int, token: int) -> int | None:
        """Index in ``selected[b]`` of the draft token numbered `token`, or None."""
        for p in range(n - 1):
            if selected[b][p] == token:
                return p
        return None

    prefix_sum = 0
    for b in range(bs):
        seq_len = seq_lens[b]
        seq_tree_idx = n * n * b + prefix_sum * n
        prefix_sum += seq_len
        pos[b * n] = seq_len
        for i in range(n - 1, 0, -1):
            r_index[b, i] = b * n + i
            parent_tb = selected[b][i - 1] // topk
            if parent_tb == 0:
                parent_position: int | None = 0
            else:
                p = position_of(b, parents[b][parent_tb])
                parent_position = None if p is None else p + 1
            if parent_position is not None:
                sibling = int(r_next[b, parent_position])
                r_next[b, parent_position] = i
                if sibling != -1:
                    r_sibling[b, i] = sibling
        r_index[b, 0] = b * n

        for x in range(n):
            if tree_mask_mode == FULL_MASK:
                row = seq_tree_idx + (seq_len + n) * x + seq_len + 1
            else:
                row = n * n * b + n * x + 1
            mask[row - 1] = True
            mask[row : row + n - 1] = False
            if x == 0:
                continue
            cur, level = x - 1, 0
            for _ in range(depth):
                level += 1
                mask[row + cur] = True
                parent_tb = selected[b][cur] // topk
                if parent_tb == 0:
                    break
                p = position_of(b, parents[b][parent_tb])
                if p is None:
                    break
                cur = p
            pos[b * n + x] = level + seq_len


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,  # (bs * draft_token_num,), written
    accept_index: torch.Tensor,  # (bs, spec_steps + 1), written
    accept_token_num: torch.Tensor,  # (bs,), written
    candidates: torch.Tensor,  # (bs, draft_token_num)
    retrive_index: torch.Tensor,  # (bs, draft_token_num)
    retrive_next_token: torch.Tensor,  # (bs, draft_token_num)
    retrive_next_sibling: torch.Tensor,  # (bs, draft_token_num)
    target_predict: torch.Tensor,  # (bs, draft_token_num): the target's greedy tokens
) -> None:
    """Greedy verification: walk the tree from the root, at each level accept the child
    whose token equals the target's prediction at the last accepted node, stop when none
    does; ``predicts`` gets the target's token at every accepted node (the last one is the
    bonus token). Mirrors ``verify_tree_greedy_kernel_triton``."""
    bs = candidates.shape[0]
    steps = accept_index.shape[1]
    cand, r_index = candidates.tolist(), retrive_index.tolist()
    r_next, r_sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    pred = predicts.view(-1)
    for b in range(bs):
        last = r_index[b][0]
        accept_index[b, 0] = last
        accepted = 0
        cur = 0
        for j in range(1, steps):
            cur = r_next[b][cur]
            want = target[last]
            while cur != -1 and cand[b][cur] != want:
                cur = r_sibling[b][cur]
            if cur == -1:
                break
            pred[last] = want
            accepted += 1
            accept_index[b, j] = r_index[b][cur]
            last = r_index[b][cur]
        accept_token_num[b] = accepted
        pred[last] = target[last]


KERNELS: dict[str, Callable[..., None]] = {
    f.__name__: f
    for f in (
        assign_req_to_token_pool_cpu,
        assign_extend_cache_locs_cpu,
        assign_draft_cache_locs_contiguous_cpu,
        fill_bonus_tokens_cpu,
        fill_accept_out_cache_loc_cpu,
        build_tree_kernel_efficient_cpu,
        verify_tree_greedy_cpu,
    )
}
