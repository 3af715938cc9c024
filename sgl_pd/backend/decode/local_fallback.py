"""Decoder, local prefill: where a request meant for a local prefill goes when it should
not wait for one after all - its predicted first token is sooner remote, or no step
admitted it within `core.local_budget.ADMISSION_STEPS` steps, or the local queue is full.

Each local request that may go remote carries a `Fallback`: the prefill server's
bootstrap address, and whether that server has the request already.

- Router flow: the router sent the prefill server a copy, which waits there for this
  decoder's `TransferRequest`s. The decoder tells it to skip the copy only once a local
  step admitted the request (`skip_pending`), so until then the request can still go
  the ordinary way: into SGLang's transfer queues, whose receiver asks that server for
  the KV.
- Direct mode: the decoder's HTTP process chose the prefill server it would have used
  (the bootstrap host `LOCAL_HOST/<host>`, its port), without submitting. Sending out
  submits it there (one rank, as a retracted request's recompute is submitted), then
  queues it for the transfer like any direct request. (A request the scheduler's latest
  offer predicts sooner remote never comes here: the HTTP process submits it at once,
  `local_offer`.)

A request with no fallback (a retracted one recomputing its output, one whose answer
needs something only a whole-prompt prefill gives, or no prefill server was there to
choose) waits for a local step as SGLang's own waiting queue waits for memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("sgl_pd.local_prefill")

LOCAL_HOST = "sgl-pd-local"  # the bootstrap host that marks a request prefilled here


@dataclass(frozen=True)
class Fallback:
    host: str
    port: int
    room: int  # the request's bootstrap room
    submit: bool  # direct mode: the prefill server has not seen the request
    # the request may go there after all (`local_prefill._sendable`); a router request
    # that may not still has its prefill copy skipped (`skip_pending`)
    may_send: bool = True


def direct_sender(server_args: Any) -> str:
    """How a decoder names itself to prefill servers in direct mode: its HTTP process
    submits under this name and reads the refusals made to it in its probes, those of
    requests its scheduler sent out included."""
    return f"decoder {getattr(server_args, 'host', '')}:{getattr(server_args, 'port', '')}"


def local_host(fallback_host: str | None) -> str:
    """The bootstrap host of a direct request prefilled here, naming the prefill server
    it goes to if it does not wait for a local step."""
    return LOCAL_HOST if not fallback_host else f"{LOCAL_HOST}/{fallback_host}"


def is_local(req: Any) -> bool:
    host = getattr(req, "bootstrap_host", None)
    return isinstance(host, str) and (host == LOCAL_HOST or host.startswith(LOCAL_HOST + "/"))


def direct_fallback(req: Any) -> Fallback | None:
    """A direct request's fallback, from its bootstrap host (which becomes `LOCAL_HOST`)."""
    host = req.bootstrap_host
    req.bootstrap_host = LOCAL_HOST
    _, _, fallback_host = host.partition("/")
    port = getattr(req, "bootstrap_port", None)
    if not fallback_host or not isinstance(port, int) or port <= 0:
        return None
    return Fallback(fallback_host, port, int(req.bootstrap_room), submit=True)


def send_out(scheduler: Any, req: Any, fallback: Fallback, why: str) -> None:
    """Queues `req` for a remote prefill at `fallback` (every rank alike)."""
    req.bootstrap_host, req.bootstrap_port = fallback.host, fallback.port
    req.time_stats.wait_queue_entry_time = 0.0  # (its wait for the transfer starts later)
    queue = scheduler.disagg_decode_prealloc_queue
    queue.add(req)
    req.time_stats.set_decode_prealloc_queue_entry_time()
    if fallback.submit:
        receivers = [d.kv_receiver for d in queue.queue if d.req is req]
        if receivers:  # (none: SGLang refused it at once, and told its client)
            # the body a prefill server needs, as SGLang builds it for a recompute
            # (prompt, sampling parameters, bootstrap fields): the decoder samples the
            # first token, the prefill computes KV only. No priority: the decoder's
            # default would be refused by a prefill server not scheduling by priority
            # (the HTTP process does not forward it either).
            body = req.build_rebootstrap_payload()
            body.pop("priority", None)
            queue.kv_manager.submit_sent_out(receivers[-1], body)
    if queue.kv_manager.rank == 0:
        logger.debug("request %s sent to a prefill server instead (%s)", req.rid, why)


def skip_pending(scheduler: Any, fallback: Fallback) -> None:
    """Router flow: a local step admitted the request, or it ended before one did; its
    prefill server's copy, waiting there for this decoder, is skipped."""
    if not fallback.submit:
        manager = scheduler.disagg_decode_prealloc_queue.kv_manager
        manager.skip_prefill(_addr(fallback), fallback.room)


def _addr(fallback: Fallback) -> str:
    from sglang.srt.utils.network import NetworkAddress

    return NetworkAddress(fallback.host, fallback.port).to_host_port_str()
