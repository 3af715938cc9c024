"""Prefill side of one request, in SGLang's ``BaseKVSender`` terms."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import BaseKVSender, KVPoll, KVTransferMetric

from sgl_pd.backend.state_slots import named_slots
from sgl_pd.core.failures import FailureCause
from sgl_pd.core.states import PREFILL_TABLE, PrefillState
from sgl_pd.core.wire import state_named_wrong
from sgl_pd.errors import SglPdError

logger = logging.getLogger("sgl_pd.sender")

_POLL = {
    PrefillState.WAITING_FOR_DECODER: KVPoll.Bootstrapping,
    PrefillState.READY: KVPoll.WaitingForInput,
    PrefillState.SENDING: KVPoll.Transferring,
    PrefillState.DONE: KVPoll.Success,
}


class KvTransferFailed(SglPdError):
    """A request's KV could not be delivered; SGLang aborts it with this message."""


class SglPdKVSender(BaseKVSender):
    # SGLang's prefill moves page indices to pinned host memory for senders that accept
    # device tensors; ours takes numpy indices, which keeps that CUDA-only path away.
    supports_host_tensor_indices = False

    def __init__(
        self,
        mgr: Any,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ) -> None:
        self.kv_mgr = mgr
        self.bootstrap_room = int(bootstrap_room)
        self._messenger = mgr.prefill
        self._messenger.track(self.bootstrap_room)
        self._error: str | None = None
        self._concluded: int | None = None
        self._metric = KVTransferMetric()
        # SGLang's early send of a cached prefix sets this (with the overlap scheduler) to
        # a CUDA event on the forward stream: the prefix pages may still be written by the
        # previous forward until it completes. It belongs to the next `send` only.
        self._early_send_wait_event: Any = None
        # the request's state slots final before its last send (`state_final_so_far`),
        # for the next send to carry
        self._state_so_far: tuple[tuple[int, ...], ...] | None = None

    def pop_decode_prefix_len(self) -> int:
        """The prompt's first tokens the decoder holds (its prefix cache): SGLang sends
        only the pages after them. Asked once every decode rank asked for the request."""
        return self._messenger.rooms.held_tokens(self.bootstrap_room)

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        """The last send goes even without pages (a full prefix hit): it is what lets
        the metadata go."""
        return num_pages > 0 or last_chunk

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self._messenger.expect(self.bootstrap_room, int(num_kv_indices), aux_index)

    def state_final_so_far(self, slots: tuple[tuple[int, ...], ...] | None) -> None:
        """Per state component, the leading slots of the lists SGLang will name in its
        last send whose bytes the forwards so far made final (the sliding window's
        pages of the chunks done): the next send carries them with its KV. None, or
        slots this rank cannot take (the last send then names them all, and is
        checked): nothing goes early."""
        why = None if slots is None else state_named_wrong(self.kv_mgr.pool.state, slots)
        if why is not None:
            logger.debug("request %d: no state goes early: %s", self.bootstrap_room, why)
        self._state_so_far = None if why is not None else slots

    def send(
        self,
        kv_indices: npt.NDArray[np.int32],
        state_indices: list[Any] | None = None,
        num_kv_tokens: int | None = None,
    ) -> None:
        """`state_indices`: SGLang names the request's state slots (a Mamba slot, the
        sliding window's pages) in its last send, once the last chunk's forward ended."""
        state_slots = None
        if state_indices is not None:
            state_slots, why = named_slots(self.kv_mgr.pool.state, state_indices)
            if why is not None:  # (SGLang's poll reads it failed, with the reason)
                self._messenger.fail(self.bootstrap_room, why, FailureCause.REFUSED)
                return
        pages = np.asarray(kv_indices, dtype=np.int64)
        page_size = self.kv_mgr.layout.page_size
        tokens = int(num_kv_tokens) if num_kv_tokens is not None else len(pages) * page_size
        ready, self._early_send_wait_event = self._early_send_wait_event, None
        so_far, self._state_so_far = self._state_so_far, None
        self._messenger.submit_chunk(
            self.bootstrap_room,
            pages,
            tokens,
            ready=ready,
            state_slots=state_slots,
            state_so_far=None if state_slots is not None else so_far,
        )

    def poll(self) -> int:
        """A failed request reads as Failed at once, writes in flight or not: SGLang then
        frees its source pages, but every page a queued, running or possibly still
        landing write names stays pinned until the request drained (`core.pins`: the
        allocator holds such pages back), so the client hears now rather than after a
        failed batch's quarantine."""
        if self._concluded is not None:
            return self._concluded
        seen = self._messenger.state(self.bootstrap_room)
        if seen is None:
            self._error = self._error or "the request is no longer known to this rank"
            self._conclude(KVPoll.Failed)
            return KVPoll.Failed
        state, _drained, error = seen
        if PREFILL_TABLE.is_final(state) and state is not PrefillState.DONE:
            self._error = error
            self._conclude(KVPoll.Failed)
            return KVPoll.Failed
        status = _POLL[state]
        if status == KVPoll.Success:
            self._conclude(status)
        return status

    def _conclude(self, status: int) -> None:
        self._concluded = status
        sent, seconds = self._messenger.forget(self.bootstrap_room)
        self._metric = KVTransferMetric(transfer_latency_s=seconds, transfer_total_bytes=sent)

    def get_transfer_metric(self) -> KVTransferMetric:
        return self._metric

    def failure_exception(self) -> None:
        reason = self._error
        raise KvTransferFailed(
            f"KV transfer of request {self.bootstrap_room} failed: {reason or 'aborted'}"
        )

    def abort(self) -> None:
        """SGLang aborts the request. Its writes stop; the request stays known (and its
        pages reported in flight by `poll`) until they have."""
        self._messenger.abort(self.bootstrap_room, "aborted by the prefill scheduler")

    def clear(self) -> None:
        self._messenger.forget(self.bootstrap_room)


def after_finalize_bootstrap(result: Any, queue: Any, req: Any, *args: Any, **kw: Any) -> Any:
    """AFTER hook of ``PrefillBootstrapQueue.finalize_bootstrap``: SGLang has read the
    held prefix and fixed where the request's sends start; one past the prompt this
    prefill computes is refused now (SGLang would never make the last send)."""
    sender = getattr(req, "disagg_kv_sender", None)
    if result and isinstance(sender, SglPdKVSender):
        sender.kv_mgr.prefill.prompt_known(sender.bootstrap_room, len(req.origin_input_ids))
    return result
