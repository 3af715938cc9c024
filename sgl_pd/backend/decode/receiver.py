"""Decode side of one request, in SGLang's ``BaseKVReceiver`` terms."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import BaseKVReceiver, KVPoll

from sgl_pd.backend.failure_cause import cause_of, cause_of_abort
from sgl_pd.backend.state_slots import named_slots, slot_mismatch
from sgl_pd.core.errors import DuplicateRequest
from sgl_pd.core.failures import FailureCause
from sgl_pd.core.states import DECODE_TABLE, DecodeState
from sgl_pd.core.wire import AbortReason
from sgl_pd.errors import SglPdError
from sgl_pd.messenger.peers import PrefillTable

logger = logging.getLogger("sgl_pd.receiver")


class KvReceiveFailed(SglPdError):
    """A request's KV did not arrive; SGLang aborts it with this message."""


class SglPdKVReceiver(BaseKVReceiver):
    # attributes SGLang's decode scheduler reads on every receiver
    require_staging = False

    def __init__(self, mgr: Any, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        self.kv_mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.bootstrap_room = int(bootstrap_room or 0)
        # SGLang's deferred release reads these: whether the prefill ranks were told to
        # stop, and how many drain acks that takes (one per rank asked for the KV)
        self.abort_notified = False
        self.bootstrap_infos: list[Any] | None = None
        self.conclude_state: int | None = None
        self._requested = False
        # the prefiller's ranks as found at bootstrap: this request keeps talking to them
        # even if the directory forgets the server meanwhile (another request's failure)
        self._table: PrefillTable | None = None
        self._error: str | None = None
        self._created_s = time.monotonic()  # seconds; the bootstrap wait starts here
        self._found_s: float | None = None  # the prefiller's ranks known
        # the prompt tokens whose KV this request needs (None: SGLang queued it unseen)
        self._kv_tokens: int | None = mgr.expected_prompt(self.bootstrap_room)

    def init(self, prefill_dp_rank: int) -> None:
        if prefill_dp_rank != 0:
            self._fail(f"prefill data-parallel rank {prefill_dp_rank}: sgl_pd serves DP size 1")
            return
        self.kv_mgr.peers.lookup(self.bootstrap_addr)  # starts the lookup in the background

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if not self._requested:
            if self._table is None:
                self._table = self.kv_mgr.peers.lookup(self.bootstrap_addr)
                if self._table is not None:
                    self._found_s = time.monotonic()
                    self.kv_mgr.metrics.bootstrap_waited(self._found_s - self._created_s)
            if self._table is not None:
                return KVPoll.WaitingForInput
            failure = self.kv_mgr.peers.failure(self.bootstrap_addr)
            if failure is not None:
                self.kv_mgr.peers.invalidate(self.bootstrap_addr)  # ask afresh next time
                self._fail(str(failure), cause=cause_of(failure))
                return KVPoll.Failed
            return KVPoll.Bootstrapping
        state, error = self.kv_mgr.decode.poll(self.bootstrap_room)
        if state is DecodeState.COMPLETE:
            if self.kv_mgr.decode.hand_off(self.bootstrap_room):
                self._conclude(KVPoll.Success)
            else:
                self._fail(self.kv_mgr.decode.poll(self.bootstrap_room)[1] or "KV not verified")
        elif DECODE_TABLE.is_final(state) or error is not None:
            self._fail(error or "transfer failed")
        return self.conclude_state if self.conclude_state is not None else KVPoll.Transferring

    def send_metadata(
        self,
        kv_indices: list[int],
        aux_index: int | None = None,
        state_indices: list[Any] | None = None,
        decode_prefix_len: int | None = None,
    ) -> None:
        if self.conclude_state is not None:  # (refused before SGLang named its pages)
            return
        state_slots, why = named_slots(self.kv_mgr.registration.state, state_indices)
        if why is not None:
            self._fail(why)
            return
        held = int(decode_prefix_len or 0)
        page_size = self.kv_mgr.layout.page_size
        if held % page_size:
            self._fail(f"the held prefix ({held} tokens) is not whole pages of {page_size}")
            return
        table = self._table
        if table is None or aux_index is None:
            self._fail("destination pages were sent before the prefiller was found")
            return
        theirs = table.shards[0].decoder_samples_first
        if theirs != self.kv_mgr.registration.decoder_samples_first:
            who = {True: "decode", False: "prefill"}
            self._fail(
                f"the prefill server at {self.bootstrap_addr} runs --pd-first-token"
                f" {who[theirs]}, this decoder --pd-first-token"
                f" {who[not theirs]}: start both with the same"
            )
            return
        mine = self.kv_mgr.registration
        why = next(
            (
                w
                for s in table.shards
                if (w := slot_mismatch(mine.state, mine.scheme, s.state, s.scheme))
            ),
            None,
        )
        if why is not None:
            self._fail(f"{why} (prefill server {self.bootstrap_addr})")
            return
        needed_s = max(s.writes_end_within_ms for s in table.shards) / 1000
        holds_s = self.kv_mgr.bounds.deferred_release_s or 0.0
        if needed_s > holds_s:
            self._fail(
                f"the prefill server at {self.bootstrap_addr} may still write {needed_s:g} s"
                " after a decoder lost contact with it (its --pd-hang-timeout and transfer"
                f" engine timeout), and this decoder frees an ended request's pages after"
                f" {holds_s:g} s: start both with the same"
                " --pd-hang-timeout"
            )
            return
        try:
            self.kv_mgr.decode.request(
                self.bootstrap_room,
                list(table.shards),
                self.kv_mgr.registration,
                np.asarray(kv_indices, dtype=np.int64),
                int(aux_index),
                bootstrap=(self._created_s, self._found_s or self._created_s),
                held_tokens=held,
                owner=self,
                kv_tokens=self._kv_tokens,
                state_slots=state_slots,
            )
        except DuplicateRequest as e:
            # the room belongs to an earlier request still here: an Abort naming it
            # would stop that one, whose prefill ranks this receiver must leave alone
            self._fail(str(e), cause=cause_of(e), tell_prefill=False)
            return
        except SglPdError as e:
            self._fail(str(e), cause=cause_of(e))
            return
        self._requested = True
        self.bootstrap_infos = list(table.shards)

    def failure_exception(self) -> None:
        raise KvReceiveFailed(
            f"KV of request {self.bootstrap_room} from {self.bootstrap_addr} did not arrive: "
            f"{self._error or 'aborted'}"
        )

    def refuse(self, why: str) -> None:
        """Fails the request before its pages are asked for (the scheduler's thread)."""
        if self.conclude_state is None:
            self._fail(why)

    def fail_recompute(self, why: str) -> None:
        """The prefill server did not take this request (a recompute, or a local one sent out)
        (another thread's word: the scheduler reads it at its next poll)."""
        if self.conclude_state is None:
            self._fail(why)

    def abort(self) -> None:
        if self.conclude_state is None:
            self._fail("aborted by the decode scheduler", AbortReason.CLIENT)

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Tells every prefill rank asked for this request's KV to stop writing it (once);
        SGLang then holds the pages until they all acked or were declared lost."""
        if self._requested and not self.abort_notified:
            self.kv_mgr.decode.fail(self.bootstrap_room, self._error or "aborted")
            self.abort_notified = True

    def clear(self) -> None:
        self.kv_mgr.decode.forget(self.bootstrap_room, owner=self)

    def _fail(
        self,
        reason: str,
        abort: AbortReason = AbortReason.ERROR,
        cause: FailureCause = FailureCause.REFUSED,
        tell_prefill: bool = True,
    ) -> None:
        """`cause`: what is counted when no page was asked for yet (the decode messenger
        counts requests it tracks); by default a configuration this decoder refuses."""
        self._error = reason
        self.conclude_state = KVPoll.Failed
        if self._requested:
            self.kv_mgr.decode.fail(self.bootstrap_room, reason, abort)
            self.abort_notified = True
        else:
            if abort is not AbortReason.ERROR:
                cause = cause_of_abort(abort)
            self.kv_mgr.metrics.add_failure(cause)
            # no page was asked for, so nothing is in flight; but the prefiller holds the
            # router's copy of the request and would wait for us until its timeout
            if tell_prefill:
                self.kv_mgr.abort_unrequested(
                    self.bootstrap_addr, self._table, self.bootstrap_room, reason, abort
                )
        # a client that went away is no server problem: not a warning
        log = logger.info if abort is AbortReason.CLIENT else logger.warning
        log("request %d: %s", self.bootstrap_room, reason)

    def _conclude(self, state: int) -> None:
        self.conclude_state = state
