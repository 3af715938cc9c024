"""The decode role of a rank's messenger: finds prefillers through their registries,
asks them for pages and counts their completion words (D2, D3, D10); tells SGLang's
deferred release when an early-ended request's pages are safe to reuse."""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sgl_pd.backend.decode.local_fallback import direct_sender
from sgl_pd.backend.decode.messenger import DecodeMessenger
from sgl_pd.backend.first_token import require_decode_patches
from sgl_pd.backend.heartbeats import Watched
from sgl_pd.backend.manager import SglPdKVManager
from sgl_pd.core.clock import Clock
from sgl_pd.core.wire import (
    AbortAck,
    AbortReason,
    ChunkNotice,
    ErrorMsg,
    Message,
    Role,
    SkipPrefill,
    SubmitPrefill,
    TransferRequest,
)
from sgl_pd.errors import SglPdError
from sgl_pd.messenger.peers import PeerDirectory, PrefillTable
from sgl_pd.messenger.registry import RegistryClient

logger = logging.getLogger("sgl_pd.manager")
SKIP_THREADS = 4  # skip notices in flight at once (one slow registry does not hold others)

# requests SGLang queued but refused before making their receiver, remembered at most
MAX_EXPECTED_PROMPTS = 4096


class DecodeKVManager(SglPdKVManager):
    role = Role.DECODE
    # A decode request that ends early keeps its pages in SGLang's deferred release until
    # `is_abort_release_safe`: the release rule, `decode.release.nothing_can_land`.
    enable_deferred_decode_kv_release = True

    def _start_role(self, server_args: Any, clock: Clock) -> Watched:
        if self.config.first_token == "decode":  # (a server SGLang's own launcher started)
            require_decode_patches()
        self.decode = DecodeMessenger(
            rank=self.rank,
            instance=self.instance,
            scheme=self.scheme,
            pool=self.pool,
            engine=self.engine,
            send_to_prefill=self.reliable.send,
            transfer_timeout_s=self.config.transfer_timeout_s,
            metrics=self.metrics,
            clock=clock,
            staging=self.staging,
            tracing=self.tracing,
            staging_hold_s=self.bounds.staging_hold_s,
            sums=self._kv_sums(server_args),
            pool_device=self._pool_device(server_args),
            withdraw=lambda inbox, room: self.reliable.withdraw(
                inbox, lambda m: isinstance(m, TransferRequest) and m.request_id == room
            ),
        )
        self.registration = self.registration_for(
            layer_group_size=1, completion=self.decode.completion_area
        )
        self._sender_name = direct_sender(server_args)  # (see `submit_sent_out`)
        # (bootstrap addr, room, reason, abort reason, since): see `abort_unrequested`
        self._parked_aborts: list[tuple[str, int, str, AbortReason, float]] = []
        self._parked_lock = threading.Lock()
        self._clock = clock
        # room -> prompt tokens whose KV its request needs, from its queueing until its
        # receiver is made (both on the scheduler thread, in one `DecodePreallocQueue.add`)
        self._expected_prompts: OrderedDict[int, int] = OrderedDict()
        # room -> the output token a retracted request resumes from (see `recompute_tail`)
        self._recompute_tails: OrderedDict[int, int] = OrderedDict()
        # room -> its recomputes so far: each is a new hand-off (`SubmitPrefill.attempt`)
        self._recompute_attempts: OrderedDict[int, int] = OrderedDict()
        # registry calls off the scheduler thread (recomputes, skipped rooms), made at the
        # first one
        self._recomputes: ThreadPoolExecutor | None = None
        self._recompute_client: RegistryClient | None = None
        self._skips: ThreadPoolExecutor | None = None  # skip notices, made at the first
        self._skip_client: RegistryClient | None = None
        self.peers = PeerDirectory(
            self.codec.layout_hash,
            query_timeout_s=self.config.bootstrap_timeout_s,
            name=f"decode-{self.rank}",
            auth=self.auth,
        )
        return self

    def expect_prompt(self, room: int, kv_tokens: int, resumes_from: int | None = None) -> None:
        """The request queued in `room` needs the KV of `kv_tokens` prompt tokens
        (`first_token.expected_kv_tokens`); its receiver takes it with `expected_prompt`.
        `resumes_from`: the output token a retracted request resumes from, when its KV
        is recomputed by the prefill server (`submit_prefill_recompute`)."""
        _remember(self._expected_prompts, room, kv_tokens)
        _remember(self._recompute_tails, room, resumes_from)

    def expected_prompt(self, room: int) -> int | None:
        return self._expected_prompts.pop(room, None)

    def submit_prefill_recompute(self, kv_receiver: Any, payload: dict[str, Any]) -> None:
        """SGLang's decode scheduler resumes a request retracted by
        ``pause_generation(mode="retract")`` by having the prefill server recompute its
        KV (prompt and kept output) into new pages, under its old room: `payload` is the
        ``/generate`` body it built. One decode rank (the first of the attention TP
        group) hands it to the prefill server's registry, as a direct-mode submission;
        every rank asks for its pages as usual. A failed hand-off fails the request.

        With the decoder sampling first tokens (D16) the prefill server prefills all but
        the body's last token: the output token the request resumes from goes at its
        end, so that the KV computed is exactly that of every token before it, as SGLang
        expects (it feeds that token next, and the decoder checks the length)."""
        room = int(kv_receiver.bootstrap_room)
        tail = self._recompute_tails.pop(room, None)
        if self.rank != 0:
            return
        body = dict(payload)
        if self.config.first_token == "decode" and tail is not None:
            body["input_ids"] = [*payload["input_ids"], tail]
        attempt = self._recompute_attempts.get(room, 0) + 1
        _remember(self._recompute_attempts, room, attempt)
        message = SubmitPrefill(
            request_id=room,
            sender=f"decode-{self.rank}",
            request=json.dumps(body).encode(),
            attempt=attempt,
        )
        self._registry_calls().submit(self._recompute, kv_receiver, message)

    def skip_prefill(self, bootstrap_addr: str, room: int) -> None:
        """Router flow: this decoder prefills `room` itself (`local_prefill`). One rank
        tells the prefill server's registry, resending until it acknowledges, so that
        the prefill server answers its copy of the request at once (`prefill/skips.py`)."""
        if self.rank != 0:
            return
        message = SkipPrefill(request_id=room, sender=f"decode-{self.rank}")
        if self._skips is None:  # (apart from recomputes: neither waits behind the other)
            self._skips = ThreadPoolExecutor(SKIP_THREADS, thread_name_prefix="sgl-pd-skip")
            self._skip_client = RegistryClient(f"decode-{self.rank}-skip", auth=self.auth)
        self._skips.submit(self._skip, bootstrap_addr, message)

    def submit_sent_out(self, kv_receiver: Any, payload: dict[str, Any]) -> None:
        """Direct mode: a request this decoder meant to prefill itself goes to a prefill
        server after all (`local_fallback`), its receiver made: one rank hands `payload`
        (the /generate body) to that server's registry, off the scheduler thread, as a
        direct-mode submission; every rank asks for its pages as usual. A failed
        hand-off fails the request (the scheduler reads it at its next poll)."""
        if self.rank != 0:
            return
        room = int(kv_receiver.bootstrap_room)
        message = SubmitPrefill(
            request_id=room,
            # (the HTTP process's name: its probes read what the prefill server refuses)
            sender=self._sender_name,
            request=json.dumps(payload).encode(),
        )
        self._registry_calls().submit(self._recompute, kv_receiver, message)

    def _registry_calls(self) -> ThreadPoolExecutor:
        if self._recomputes is None:
            self._recomputes = ThreadPoolExecutor(1, thread_name_prefix="sgl-pd-registry")
            self._recompute_client = RegistryClient(f"decode-{self.rank}-registry", auth=self.auth)
        return self._recomputes

    def _skip(self, addr: str, message: SkipPrefill) -> None:
        assert self._skip_client is not None
        try:
            self._skip_client.skip(addr, message)
        except SglPdError as e:
            # its copy waits out the prefill's bootstrap timeout and fails (`prefill/skips.py`)
            logger.warning("prefill server %s was not told room %d is prefilled here: %s",
                           addr, message.request_id, e)  # fmt: skip

    def _recompute(self, kv_receiver: Any, message: SubmitPrefill) -> None:
        assert self._recompute_client is not None
        try:
            self._recompute_client.submit(kv_receiver.bootstrap_addr, message)
        except SglPdError as e:
            kv_receiver.fail_recompute(f"the prefill server did not take the request: {e}")

    # -- what the liveness thread watches -------------------------------------------------

    def active_peers(self) -> dict[str, str | None]:
        return self.decode.active_peers()

    def resumed_after_freeze(self, frozen_s: float) -> None:
        self.decode.resumed_after_freeze(frozen_s)

    def peer_lost(self, inbox: str, why: str, gone: bool) -> None:
        self.peers.invalidate_inbox(inbox)  # a restarted prefiller has new endpoints
        self.decode.peer_lost(inbox, why, gone)

    def tables(self) -> dict[str, int]:
        """This rank's tables and their entries, for `sgl_pd_table_entries`."""
        return {
            **self.decode.tables(),
            "expected_prompts": len(self._expected_prompts),
            "recompute_tails": len(self._recompute_tails),
            "recompute_attempts": len(self._recompute_attempts),
            "parked_aborts": len(self._parked_aborts),
        }

    def housekeeping(self) -> None:
        self.decode.housekeeping()
        self._send_parked_aborts()

    # -- aborts of requests that never asked for pages ------------------------------------

    def abort_unrequested(
        self,
        addr: str,
        table: PrefillTable | None,
        room: int,
        reason: str,
        abort: AbortReason,
    ) -> None:
        """Tells the prefiller at `addr` to drop `room`. Its ranks may not be known yet
        (the request ended while still bootstrapping): then the abort waits here until
        the lookup finishes, for at most the bootstrap timeout."""
        table = table or self.peers.lookup(addr)
        if table is not None:
            inboxes = [peer.inbox for peer in table.shards]
            self.decode.abort_unrequested(room, inboxes, reason, abort)
            return
        with self._parked_lock:
            self._parked_aborts.append((addr, room, reason, abort, self._clock.monotonic()))

    def _send_parked_aborts(self) -> None:
        with self._parked_lock:
            parked, self._parked_aborts = self._parked_aborts, []
        now = self._clock.monotonic()
        for addr, room, reason, abort, since in parked:
            table = self.peers.lookup(addr)
            if table is not None:
                inboxes = [peer.inbox for peer in table.shards]
                self.decode.abort_unrequested(room, inboxes, reason, abort)
            elif now - since < self.config.bootstrap_timeout_s:
                with self._parked_lock:
                    self._parked_aborts.append((addr, room, reason, abort, since))

    def register_to_bootstrap(self) -> None:
        """Decode ranks register nowhere: they look prefillers up (SGLang's abstract API)."""

    def _on_role_message(self, message: Message) -> None:
        if isinstance(message, ChunkNotice):
            self.decode.on_chunk_notice(message)
        elif isinstance(message, AbortAck):
            self.decode.on_abort_ack(message)
        elif isinstance(message, ErrorMsg):
            self.decode.on_error(message)
        else:
            self.ignore(message)

    # -- SGLang's deferred release of a decode request that ended early --------------------

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        return self.decode.is_release_safe(int(bootstrap_room), int(required_acks))

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        """Nothing beyond the request's track, which the receiver's `clear` drops."""

    def _close_role(self) -> None:
        self.peers.close()
        if self._recomputes is not None:
            self._recomputes.shutdown(wait=False, cancel_futures=True)
        if self._recompute_client is not None:
            self._recompute_client.close()
        if self._skips is not None:
            self._skips.shutdown(wait=False, cancel_futures=True)
        if self._skip_client is not None:
            self._skip_client.close()


def _remember(table: OrderedDict[int, int], room: int, value: int | None) -> None:
    """`room`'s entry in one of the manager's per-room tables, the newest (None: none);
    the oldest go beyond `MAX_EXPECTED_PROMPTS` (requests queued, then refused)."""
    table.pop(room, None)
    if value is not None:
        table[room] = value
    while len(table) > MAX_EXPECTED_PROMPTS:
        table.popitem(last=False)
