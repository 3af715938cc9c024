"""Decoder, direct mode (D3): clients send requests to a decoder, which picks a prefill
server and submits the prefill itself; SGLang's router flow keeps working beside it.

A request that reaches the decoder's HTTP API without a bootstrap room (native
/generate or the OpenAI-compatible endpoints, streaming or not) gets a fresh room and the
bootstrap address of the prefill server with the fewest prompt tokens outstanding
(`sgl_pd.core.dispatch`); that server's registry is handed the request (`SubmitPrefill`),
and only then does the request continue into the decoder, exactly as a router request
does: the decode scheduler allocates un-evictable pages and a metadata slot, its ranks
send their `TransferRequest`s, and the request is decoded once its KV is complete by
counting. A prefill server that refuses or does not answer is marked unavailable and the
next one is tried; with none left the client gets a 400 that says so. A server that took
the request and then could not serve it (its API answered an error) says so in its next
probe answer: the decoder aborts the request and the client gets the reason as a 400.

Prefill servers are the addresses of --pd-prefill-bootstrap (or of its @FILE, re-read on
every probe round); a probe thread asks each registry whether all its ranks registered,
so servers that start later, stop or come back are picked up without a restart.

Runs in the decoder's HTTP front-end process (a hook on `TokenizerManager.generate_request`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sgl_pd.backend import request_checks
from sgl_pd.backend.decode.local_fallback import direct_sender, local_host
from sgl_pd.backend.decode.local_offer import OfferReader, offer_path
from sgl_pd.backend.metrics import PlacementMetrics, TableEntries
from sgl_pd.backend.streams import Stopped, until_stopped
from sgl_pd.config import SglPdConfig, sgl_pd_role
from sgl_pd.core.dispatch import PrefillerLoad, parse_bootstrap_addresses
from sgl_pd.core.local_budget import remote_is_sooner
from sgl_pd.core.placement import (
    BLOCK_TOKENS,
    HeldTails,
    Prediction,
    PromptKey,
    RateEstimate,
    SentPrefixes,
    choose_prefiller,
    direct_room,
    prefill_locally,
)
from sgl_pd.core.wire import MAX_SUBMIT_BYTES, ErrorCode, RefusedSubmission, SubmitPrefill
from sgl_pd.errors import SglPdError
from sgl_pd.log_limits import LogLimiter
from sgl_pd.messenger.auth import ClusterAuth
from sgl_pd.messenger.errors import RegistryRefused
from sgl_pd.messenger.registry import RegistryClient

logger = logging.getLogger("sgl_pd.direct")

PROBE_INTERVAL_S = 1.0  # between probe rounds over every prefill server
PROBE_TIMEOUT_S = 1.0  # one probe waits this long for a registry's answer
CHARS_PER_TOKEN = 4  # outstanding-token estimate of a text prompt (ids are counted)
# generate-request fields that change what the prefill computes; the rest is the decoder's
FORWARDED = (
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "token_ids_logprob",
    "lora_path",
    # what decides, on both servers alike, who samples the first token (first_token.py)
    "return_hidden_states",
    "return_routed_experts",
    "routed_experts_start_len",
    "session_params",
)
UNSUPPORTED = ("image_data", "video_data", "audio_data", "input_embeds")
_HERE = ""  # this decoder, among the "servers" whose cached prefixes are predicted
MAX_TRACED_PLACEMENTS = 4096  # decisions waiting for their request's span (bounded)


class NoPrefillServer(ValueError):
    """No prefill server took the request (a ValueError: SGLang answers it with 400)."""


class DirectDispatcher:
    """The decoder's view of its prefill servers and the submissions in flight."""

    def __init__(
        self,
        spec: str,
        *,
        auth: ClusterAuth | None,
        name: str = "decoder",
        probe_interval_s: float = PROBE_INTERVAL_S,
        metrics: PlacementMetrics | None = None,
        tables: TableEntries | None = None,
        local_max_tokens: int = 0,
        saturated_tokens: int = 8192,
        prefix_cache: bool = False,
        tracing: bool = False,
        offers: OfferReader | None = None,
    ) -> None:
        self._spec = spec
        # what the decode scheduler would offer a local request now (`local_offer`)
        self._offers = offers
        # local prefill (`local_prefill`): the largest uncached suffix this decoder
        # prefills itself, and what it is predicted to hold (with its prefix cache on)
        self._local_max_tokens = local_max_tokens
        self._saturated_tokens = saturated_tokens
        self._prefix_cache = prefix_cache
        self._held = SentPrefixes()  # under _lock; one "server": this decoder
        self._held_tails = HeldTails()  # under _lock: past the held blocks, to the token
        self._tracing = tracing  # SGLang's --enable-trace: decisions go into request spans
        self._placements: dict[int, dict[str, Any]] = {}  # room -> decision; under _lock
        self._lock = threading.Lock()
        self._loads: dict[str, PrefillerLoad] = {}  # under _lock
        # submitted requests still served -> (their loop, resolved with a refusal); under _lock
        self._watched: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[str]]] = {}
        self._turn = 0  # under _lock
        self._prefixes = SentPrefixes()  # what each prefill server got from here; under _lock
        self._rates: dict[str, RateEstimate] = {}  # measured per prefill server; under _lock
        self._metrics = metrics or PlacementMetrics(False)
        self._tables = tables or TableEntries(False, "decode")
        self._name = name[:200]  # names its submissions and probes alike (refusals match)
        self._client = RegistryClient(self._name, auth=auth, attempt_timeout_s=PROBE_TIMEOUT_S)
        self._log = LogLimiter(logger)
        self._stop = threading.Event()
        self._submitting = ThreadPoolExecutor(16, thread_name_prefix="sgl-pd-direct")
        self._refresh(self._read_addresses())  # every address is tried before any probe
        self._probe_interval_s = probe_interval_s
        self._prober = threading.Thread(target=self._probe_loop, name="sgl-pd-probe", daemon=True)
        self._prober.start()

    # -- what requests use ---------------------------------------------------------------

    @property
    def name(self) -> str:
        """How this decoder names itself to prefill servers (their logs)."""
        return self._name

    def loads(self) -> dict[str, PrefillerLoad]:
        with self._lock:
            return dict(self._loads)

    def trace_placement(self, room: int, attrs: dict[str, Any]) -> None:
        """Keeps the decision for the request's span (`after_init_req_state`)."""
        if self._tracing:
            with self._lock:
                self._placements[room] = attrs
                while len(self._placements) > MAX_TRACED_PLACEMENTS:
                    self._placements.pop(next(iter(self._placements)))

    def traced_placement(self, room: int) -> dict[str, Any] | None:
        with self._lock:
            return self._placements.pop(room, None)

    def prefill_here(self, prompt: PromptKey, *, none_took: bool = False) -> str | None:
        """Why this decoder should prefill `prompt` itself (`core.placement.
        prefill_locally`), or None: a prefill server should. `none_took`: every
        available prefill server was tried and none took it. Not counted (`placed`)."""
        with self._lock:
            cached = prompt.cached_tokens(self._held, _HERE)
            reason = prefill_locally(
                prompt.tokens,
                cached,
                max_tokens=self._local_max_tokens,
                loads={} if none_took else self._loads,
                saturated_tokens=self._saturated_tokens,
            )
        if reason is not None:
            logger.debug(
                "prefilled here (%s): %d of %d prompt tokens cached",
                reason, cached, prompt.tokens,
            )  # fmt: skip
        return reason

    def local_reason(self, prompt: PromptKey, *, plain: bool) -> str | None:
        """Why `prompt` goes to this decoder's scheduler to be prefilled here
        (`prefill_here`), or None: to a prefill server now - also where the placement
        rules chose here for a held prefix or for saturated prefill servers, and the
        scheduler would send a `plain` request out anyway (`sooner_remote`: its first
        token sooner remote, or no step within the ITL SLO): it goes at once, sparing
        the trip through the scheduler. (Where no prefill server is available there is
        nowhere else to go.)"""
        reason = self.prefill_here(prompt)
        if reason in ("cached_prefix", "saturated") and plain and self.sooner_remote(prompt):
            return None
        return reason

    def set_local_max_tokens(self, tokens: int) -> None:
        """The largest uncached suffix placed here from now on (`local_switch`: every
        scheduler rank took it already)."""
        with self._lock:
            self._local_max_tokens = tokens

    @contextlib.contextmanager
    def placed_here(self, reason: str, room: int) -> Iterator[None]:
        """While the request of bootstrap room `room`, sent to this decoder's scheduler
        to be prefilled here (`reason`), is served: a burst the scheduler's offer has
        ready is its (`local_offer`), until an offer shows it past the local queue or the
        request ends."""
        self._metrics.local(reason)
        if self._offers is not None:
            self._offers.claim_burst_if_ready(room)
        try:
            yield
        finally:
            if self._offers is not None:
                self._offers.request_ended(room)

    def sooner_remote(self, prompt: PromptKey) -> bool:
        """Whether the decode scheduler's latest offer would send a plain request of
        `prompt`, placed here, to a prefill server (no fresh offer: no). The scheduler
        matches its prefix cache to the token (whole pages): a prompt of token ids is
        judged at the tokens past what the conversations this decoder served hold of it
        (`HeldTails`), in whole pages; a text
        prompt, known here in whole blocks only, at the least the scheduler could find
        uncached (a block more held) - so a request the scheduler would keep is not sent
        out, and one it would send out does not cross it first."""
        offer = None if self._offers is None else self._offers.current()
        if offer is None:
            return False
        with self._lock:
            blocks = self._held.cached_blocks(_HERE, prompt.blocks)
            if prompt.ids:
                held = prompt.served_of(self._held_tails.held_tokens(prompt, blocks))
                held = min(held, prompt.tokens - 1)  # (SGLang computes the last token)
                least = prompt.tokens - (held - held % max(1, offer.page_size))
            else:
                least = prompt.tokens - blocks * BLOCK_TOKENS - (BLOCK_TOKENS - 1)
            # the queue it would join now: this process places every remote request
            best = choose_prefiller(self._loads, prompt, self._prefixes, self._rates)
        least = max(1, least)
        queued = None if best is None else best.queued_tokens
        try:
            return remote_is_sooner(offer, least, queued)
        except (ArithmeticError, TypeError, ValueError):  # (an offer no model can use)
            return False

    def served(self, conversation: PromptKey) -> None:
        """This decoder served a request: its prefix cache holds the prompt and output
        (`conversation`), the start of a follow-up turn."""
        if self._prefix_cache:
            with self._lock:
                self._held.record(_HERE, conversation.blocks)
                self._held_tails.record(conversation)

    def fallback(self, prompt: PromptKey) -> str | None:
        """The prefill server a request placed here goes to if the decoder's scheduler
        sends it out after all (`local_fallback`): the one `choose` would pick, nothing
        counted against it yet."""
        with self._lock:
            best = choose_prefiller(self._loads, prompt, self._prefixes, self._rates)
        return None if best is None else best.addr

    def choose(self, prompt: PromptKey, exclude: list[str]) -> Prediction | None:
        """The available prefill server predicted to give the first token soonest
        (`core.placement`); the tokens it will compute count as outstanding there."""
        with self._lock:
            self._turn += 1
            best = choose_prefiller(
                self._loads, prompt, self._prefixes, self._rates, exclude=exclude, turn=self._turn
            )
            if best is not None:
                self._add(best.addr, best.computed_tokens)
            return best

    def taken(self, chosen: Prediction, prompt: PromptKey) -> None:
        """`chosen.addr` took the request: it will hold the prompt's prefix."""
        with self._lock:
            self._prefixes.record(chosen.addr, prompt.blocks)
        self._metrics.placed(chosen.cached_tokens)
        logger.debug(
            "prefill server %s chosen: %d tokens queued, %d of %d cached, %.3f s predicted",
            chosen.addr, chosen.queued_tokens, chosen.cached_tokens,
            chosen.cached_tokens + chosen.computed_tokens, chosen.seconds,
        )  # fmt: skip

    def release(self, chosen: Prediction, first_token_after_s: float | None = None) -> None:
        """The request's prefill is over there (`first_token_after_s` after its
        submission, when it gave a first token: a measurement of the server's rate)."""
        with self._lock:
            self._add(chosen.addr, -chosen.computed_tokens)
            if first_token_after_s is not None:
                rate = self._rates.setdefault(chosen.addr, RateEstimate())
                rate.observe(first_token_after_s, chosen.queued_tokens + chosen.computed_tokens)

    async def submit(self, addr: str, msg: SubmitPrefill) -> str | None:
        """Hands `msg` to the registry at `addr`; None when taken, else why not (and the
        server is marked unavailable until a probe finds it again)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._submitting, self._client.submit, addr, msg)
            return None
        except SglPdError as e:
            if not (isinstance(e, RegistryRefused) and e.code is ErrorCode.OVERLOADED):
                self._mark(addr, available=False)
            return str(e)

    def watch(self, room: int) -> asyncio.Future[str]:
        """A future the probe resolves with the reason if the prefill server that took
        `room` refuses it later; call `unwatch` once the request ended."""
        loop = asyncio.get_running_loop()
        refused: asyncio.Future[str] = loop.create_future()
        with self._lock:
            self._watched[room] = (loop, refused)
        return refused

    def unwatch(self, room: int) -> None:
        with self._lock:
            self._watched.pop(room, None)

    def _refused(self, addr: str, refusals: tuple[RefusedSubmission, ...]) -> None:
        for refusal in refusals:
            with self._lock:
                watched = self._watched.pop(refusal.request_id, None)
            if watched is not None:
                loop, refused = watched
                why = f"prefill server {addr} refused the request: {refusal.message}"
                loop.call_soon_threadsafe(_resolve, refused, why)

    def close(self) -> None:
        self._stop.set()
        self._client.close()
        self._submitting.shutdown(wait=False, cancel_futures=True)

    # -- prefill servers ---------------------------------------------------------------

    def _add(self, addr: str, tokens: int) -> None:
        load = self._loads.get(addr)
        if load is not None:
            outstanding = max(0, load.outstanding_tokens + tokens)
            self._loads[addr] = PrefillerLoad(load.available, outstanding)

    def _mark(self, addr: str, *, available: bool) -> None:
        with self._lock:
            load = self._loads.get(addr)
            if load is not None and load.available != available:
                self._loads[addr] = PrefillerLoad(available, load.outstanding_tokens)
                logger.info(
                    "prefill server %s is %s", addr, "available" if available else "unavailable"
                )

    def _read_addresses(self) -> tuple[str, ...]:
        spec = self._spec
        if spec.startswith("@"):
            path = Path(spec[1:])
            try:
                spec = path.read_text()
            except OSError as e:
                self._log.warning("file", "--pd-prefill-bootstrap %s: %s", path, e)
                return tuple(self._loads)
        try:
            return parse_bootstrap_addresses(spec)
        except ValueError as e:
            self._log.warning("parse", "--pd-prefill-bootstrap %s: %s", self._spec, e)
            return tuple(self._loads)

    def _refresh(self, addresses: tuple[str, ...]) -> None:
        with self._lock:
            for addr in addresses:
                if addr not in self._loads:
                    logger.info("prefill server %s added", addr)
                    self._loads[addr] = PrefillerLoad(True, 0)
            for addr in [a for a in self._loads if a not in addresses]:
                logger.info("prefill server %s removed", addr)
                del self._loads[addr]

    def tables(self) -> dict[str, int]:
        """Submissions whose request is still served here, and placement decisions
        waiting for their request's trace span."""
        with self._lock:
            return {
                "direct_submissions": len(self._watched),
                "direct_traced_placements": len(self._placements),
            }

    def _probe_loop(self) -> None:
        while not self._stop.wait(self._probe_interval_s):
            self._tables.set(self.tables())  # (a round a second: the gauge's resolution)
            addresses = self._read_addresses()
            self._refresh(addresses)
            for addr in addresses:
                if self._stop.is_set():
                    return
                try:
                    refusals = self._client.probe(addr, timeout_s=PROBE_TIMEOUT_S, stop=self._stop)
                    self._mark(addr, available=True)
                except SglPdError:
                    self._mark(addr, available=False)
                    continue
                self._refused(addr, refusals)


def _resolve(future: asyncio.Future[str], why: str) -> None:
    if not future.done():
        future.set_result(why)


_dispatcher: DirectDispatcher | None = None
_dispatcher_lock = threading.Lock()


def dispatcher_of(manager: Any) -> DirectDispatcher | None:
    """This decoder's dispatcher; None unless it serves sgl_pd PD decode in direct mode."""
    global _dispatcher
    server_args = manager.server_args
    if sgl_pd_role(server_args) != "decode":
        return None
    with _dispatcher_lock:
        if _dispatcher is None:
            config = SglPdConfig.from_environment()
            if not config.prefill_bootstrap:
                return None
            from sgl_pd.backend.manager import cluster_auth
            from sgl_pd.backend.server_options import local_prefill_limit

            name = direct_sender(server_args)
            metrics_on = bool(getattr(server_args, "enable_metrics", False))
            _dispatcher = DirectDispatcher(
                config.prefill_bootstrap,
                auth=cluster_auth(config),
                name=name,
                metrics=PlacementMetrics(metrics_on),
                tables=TableEntries(metrics_on, "decode"),
                local_max_tokens=local_prefill_limit(
                    server_args,
                    config.local_prefill_max_tokens,
                    getattr(manager, "model_config", None),
                ),
                saturated_tokens=config.prefill_saturated_tokens,
                prefix_cache=bool(
                    getattr(server_args, "disaggregation_decode_enable_radix_cache", False)
                ),
                tracing=bool(getattr(server_args, "enable_trace", False)),
                offers=OfferReader(offer_path(int(server_args.port))),
            )
        return _dispatcher


def _plain(obj: Any) -> bool:
    """A request the decode scheduler may send to a prefill server after all, as far as
    the HTTP process can tell: no logprobs (they decide whether a step mixes, and input
    logprobs need the whole prompt's prefill), adapter, session or hidden states."""
    return not any(
        getattr(obj, name, None)
        for name in (
            "return_logprob", "lora_path", "lora_id", "session_params",
            "return_hidden_states", "return_routed_experts",
        )
    )  # fmt: skip


def _direct(obj: Any) -> bool:
    """A request that came to the decoder itself rather than through a router."""
    return (
        getattr(obj, "bootstrap_room", None) is None
        and getattr(obj, "bootstrap_host", None) is None
        and hasattr(obj, "sampling_params")  # generate, not embedding
    )


def _prompt_key(obj: Any) -> PromptKey:
    """The prompt as the choice of prefill server sees it (its size in tokens estimated
    for text); raises ValueError for what direct mode does not serve."""
    for name in UNSUPPORTED:
        if getattr(obj, name, None) is not None:
            raise ValueError(f"direct mode serves text and token prompts; {name} is not supported")
    text, ids = getattr(obj, "text", None), getattr(obj, "input_ids", None)
    if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
        raise ValueError(
            "direct mode takes one prompt per request: send a batch as separate requests"
        )
    reusable = _logprob_start(obj)
    if isinstance(ids, list):
        return PromptKey.of_ids(ids, reusable)
    return PromptKey.of_text(text or "", CHARS_PER_TOKEN, reusable)


def _logprob_start(obj: Any) -> int | None:
    """The first prompt position whose logprob the request asks for (SGLang computes the
    prompt from there on, cached or not), or None."""
    start = getattr(obj, "logprob_start_len", None)
    if getattr(obj, "return_logprob", False) is True and isinstance(start, int) and start >= 0:
        return start
    return None


def after_init_req_state(result: Any, manager: Any, obj: Any, *args: Any, **kw: Any) -> Any:
    """AFTER hook of ``TokenizerManager._init_req_state``: SGLang's span of a direct
    request exists now; the decision of where it is prefilled goes inside it."""
    room = getattr(obj, "bootstrap_room", None)
    if _dispatcher is None or not isinstance(room, int):
        return result
    attrs = _dispatcher.traced_placement(room)
    if attrs is not None:
        from sgl_pd.backend.tracing import placement_span

        state = manager.rid_to_state.get(getattr(obj, "rid", None))
        placement_span(getattr(getattr(state, "time_stats", None), "trace_ctx", None), room, attrs)
    return result


def _note_served(dispatcher: DirectDispatcher, obj: Any, out: Any) -> None:
    """At a request's last output (SGLang's consumer may stop reading there): this
    decoder's prefix cache now holds its prompt and answer."""
    meta = out.get("meta_info") if isinstance(out, dict) else None
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    if finish is not None and not (isinstance(finish, dict) and finish.get("type") == "abort"):
        dispatcher.served(_conversation_key(obj, out))


def _conversation_key(obj: Any, out: dict[str, Any]) -> PromptKey:
    """The prompt and the answer of a request served here, as the next turn of its
    conversation will start (the answer as its last output carried it: whole unless the
    client streamed increments, whose loss only shortens what is predicted held)."""
    ids = getattr(obj, "input_ids", None)
    if isinstance(ids, list):
        return PromptKey.of_ids([*ids, *(out.get("output_ids") or [])])
    text = getattr(obj, "text", None) or ""
    answer = out.get("text")
    return PromptKey.of_text(text + (answer if isinstance(answer, str) else ""), CHARS_PER_TOKEN)


def _host_and_port(addr: str) -> tuple[str, int]:
    """ "host:port" (IPv6 in brackets) -> (host, port), as SGLang's bootstrap fields take them."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


def _prefill_body(obj: Any, room: int, addr: str) -> bytes:
    """The request a router would send the prefill server at `addr`, as JSON."""
    body = {name: getattr(obj, name, None) for name in FORWARDED}
    body = {k: v for k, v in body.items() if v is not None}
    host, port = _host_and_port(addr)
    body.update(bootstrap_host=host, bootstrap_port=port, bootstrap_room=room, stream=False)
    encoded = json.dumps(body).encode()
    if len(encoded) > MAX_SUBMIT_BYTES:
        raise ValueError(f"a request of {len(encoded)} bytes, over {MAX_SUBMIT_BYTES}")
    return encoded


async def around_generate_request(
    original: Any, manager: Any, obj: Any, request: Any = None
) -> AsyncIterator[Any]:
    """AROUND hook of ``TokenizerManager.generate_request``: direct requests are submitted
    to a prefill server first, then served like router requests."""
    dispatcher = dispatcher_of(manager) if _direct(obj) else None
    if dispatcher is None:
        async for out in original(manager, obj, request):
            yield out
        return
    request_checks.refuse_unsafe(manager, obj)  # before any prefill server sees it
    room = direct_room(secrets.randbits(63))
    prompt = _prompt_key(obj)
    tried: list[str] = []
    refusals: list[str] = []
    chosen = None
    local_reason = dispatcher.local_reason(prompt, plain=_plain(obj))
    while local_reason is None:
        chosen = dispatcher.choose(prompt, tried)
        if chosen is None:
            local_reason = dispatcher.prefill_here(prompt, none_took=True)
            if local_reason is not None:
                break  # no prefill server took it (busy, refusing): short enough for here
        if chosen is None:
            known = ", ".join(
                f"{a} ({'up' if load.available else 'down'})"
                for a, load in sorted(dispatcher.loads().items())
            )
            raise NoPrefillServer(
                "no prefill server took the request"
                + (f": {'; '.join(refusals)}" if refusals else "")
                + f" (prefill servers: {known or 'none configured'})"
            )
        addr = chosen.addr
        body = _prefill_body(obj, room, addr)
        msg = SubmitPrefill(request_id=room, sender=dispatcher.name, request=body)
        submitted_s = time.monotonic()
        why = await dispatcher.submit(addr, msg)
        if why is None:
            dispatcher.taken(chosen, prompt)
            break
        dispatcher.release(chosen)
        tried.append(addr)
        refusals.append(why)
        chosen = None
        local_reason = dispatcher.prefill_here(prompt)
    if chosen is None:  # prefilled here (`local_prefill`): no prefill server involved
        assert local_reason is not None
        # ... unless its scheduler sends it out after all: then to this one
        fallback = None if refusals else dispatcher.fallback(prompt)
        host, port = _host_and_port(fallback) if fallback else (None, 0)
        obj.bootstrap_host, obj.bootstrap_port, obj.bootstrap_room = local_host(host), port, room
        dispatcher.trace_placement(
            room, {"prefill": "local", "reason": local_reason or "", "prompt_tokens": prompt.tokens}
        )
        outputs = original(manager, obj, request)
        if fallback is not None:  # its scheduler may send it there: it may be refused
            refused = dispatcher.watch(room)
            outputs = _unless_refused(outputs, refused, lambda: manager.abort_request(obj.rid))
        try:
            with dispatcher.placed_here(local_reason, room):
                async for out in outputs:
                    _note_served(dispatcher, obj, out)
                    yield out
        finally:
            dispatcher.unwatch(room)
        return
    (obj.bootstrap_host, obj.bootstrap_port), obj.bootstrap_room = _host_and_port(addr), room
    dispatcher.trace_placement(
        room,
        {
            "prefill": addr,
            "reason": "cached_prefix" if chosen.cached_tokens else "load",
            "prompt_tokens": prompt.tokens,
            "predicted_cached_tokens": chosen.cached_tokens,
            "predicted_queued_tokens": chosen.queued_tokens,
            "predicted_s": chosen.seconds,
        },
    )
    released = False
    refused = dispatcher.watch(room)
    try:
        outputs = _unless_refused(
            original(manager, obj, request), refused, lambda: manager.abort_request(obj.rid)
        )
        async for out in outputs:
            if not released:  # the first output: the prefill is done there
                dispatcher.release(chosen, time.monotonic() - submitted_s)
                dispatcher.unwatch(room)
                released = True
            _note_served(dispatcher, obj, out)
            yield out
    finally:
        dispatcher.unwatch(room)
        if not released:
            dispatcher.release(chosen)


async def _unless_refused(
    outputs: AsyncIterator[Any], refused: asyncio.Future[str], abort: Callable[[], None]
) -> AsyncIterator[Any]:
    """`outputs` until the prefill server refuses the request: then the decoder aborts it
    (its pages go back once the prefill ranks acked) and the client gets the reason as a
    400 rather than waiting for the transfer timeout."""
    try:
        async for out in until_stopped(outputs, refused, abort):
            yield out
    except Stopped:
        raise NoPrefillServer(refused.result()) from None
