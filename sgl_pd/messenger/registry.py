"""The prefill server's registry (at SGLang's bootstrap port) and its blocking client.

Each prefill rank registers its `ShardRegistration` frame with the registry of its server;
a decode rank asks the registry for all of them once every rank has registered. The
registry does not know the model: its own frames use `REGISTRY_LAYOUT_HASH` and carry the
registrations as opaque frames, which only the decoder decodes.

Threading: `RegistryServer`'s ROUTER is bound on the constructing thread, then used and
closed only by the registry thread, which also owns the table of registrations.
`RegistryClient` holds no socket between calls: each attempt of a call makes a DEALER on
the calling thread and closes it before returning, so any thread may call it, and a reply
that arrives after its attempt gave up lands on a closed socket instead of being mistaken
for the answer to a later attempt.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from sgl_pd.core.clock import Clock, SystemClock
from sgl_pd.core.errors import WireError
from sgl_pd.core.wire import (
    HEADER_BYTES,
    MAX_FRAME_BYTES,
    MAX_SUBMIT_BYTES,
    REGISTRY_LAYOUT_HASH,
    ErrorCode,
    ErrorMsg,
    FrameCodec,
    Message,
    RefusedSubmission,
    RegisterAck,
    RegisterShard,
    RegistryQuery,
    RegistryReply,
    Role,
    ShardRegistration,
    SkipPrefill,
    SubmitAck,
    SubmitPrefill,
    frame_layout_hash,
)
from sgl_pd.errors import SglPdError
from sgl_pd.log_limits import LogLimiter, peer_text
from sgl_pd.messenger._sockets import (
    POLL_S,
    ContextOwner,
    RouterThread,
    ZmqContext,
    ZmqSocket,
    tcp_endpoint,
)
from sgl_pd.messenger.auth import ClusterAuth
from sgl_pd.messenger.errors import (
    BootstrapError,
    BootstrapTimeout,
    InvalidAddress,
    MessengerClosed,
    RegistryRefused,
)
from sgl_pd.messenger.probe import listener_gone
from sgl_pd.messenger.submissions import RecentSubmissions, digest

logger = logging.getLogger(__name__)

REGISTER_TIMEOUT_S = 60.0  # a prefill rank waits this long for its server's registry
QUERY_TIMEOUT_S = 30.0  # a decode rank waits this long for all prefill ranks of a server
RETRY_INTERVAL_S = 0.5  # pause after a NOT_READY answer before asking again
ATTEMPT_TIMEOUT_S = 2.0  # one attempt waits this long for a reply before a fresh one
MAX_REGISTRATION_BYTES = 1 << 20  # one rank's registration frame (a few KiB in practice)
# what the registry lets ZMQ receive: a registration, or a submitted request
MAX_REGISTRY_FRAME_BYTES = max(MAX_REGISTRATION_BYTES, MAX_SUBMIT_BYTES) + 4096
# what a direct-mode submission may be refused with: (code, why); None = queued
SubmitFn = Callable[[SubmitPrefill], "tuple[ErrorCode, str] | None"]
# asker's name -> its submissions refused after they were taken (direct mode)
RefusalsFn = Callable[[str], "tuple[RefusedSubmission, ...]"]
SkipFn = Callable[[int], None]  # a room its decoder prefills itself (never blocks)
SUBMIT_TIMEOUT_S = 5.0  # a decoder waits this long for a prefill server to take a request
# all ranks' registrations together, so that a reply always fits in one frame
MAX_REPLY_REGISTRATIONS_BYTES = MAX_FRAME_BYTES - HEADER_BYTES - (1 << 16)


class RegistryServer(RouterThread):
    """Answers `RegisterShard` with `RegisterAck` and `RegistryQuery` with `RegistryReply`
    (or `ErrorMsg(NOT_READY)` until every rank of the announced TP size registered).

    Who may hold a rank: the instance that registered it. Another instance (a restarted
    process, or a second server pointed at the same port by mistake) replaces it only
    once the holder's inbox refuses connections, i.e. the old process is gone; until
    then it is refused with `CONFLICT`. The same rule guards a change of TP size.

    Direct mode: a room is handed to the prefill server once within `SUBMISSION_MEMORY_S`.
    A resent copy of a submission (its client stopped waiting for the answer) is answered
    as the first copy was; another submission of a room already taken gets `CONFLICT`.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        auth: ClusterAuth | None = None,
        context: ZmqContext | None = None,
        is_gone: Callable[[str], bool] = listener_gone,
        submit: SubmitFn | None = None,
        refusals: RefusalsFn | None = None,
        skip: SkipFn | None = None,
        clock: Clock | None = None,
    ) -> None:
        """Binds tcp://host:port (0: a free port). Raises `AddressInUse` / `BindError`.
        With `auth`, only members of the cluster can register or query. With `submit`,
        decoders may also hand it requests to prefill (direct mode): `submit` queues one
        and returns None, or returns why it cannot (never blocks); `refusals` names the
        asker's submissions that were taken and then refused, for its next query. Each
        room is handed to `submit` once: a resent copy gets the first copy's answer.
        With `skip`, decoders may say that they prefill a room themselves (router flow)."""
        super().__init__(host, port, context, max_message_bytes=MAX_REGISTRY_FRAME_BYTES, auth=auth)
        self._host = host
        self._is_gone = is_gone
        self._submit = submit
        self._refusals = refusals
        self._skip = skip
        self._codec = FrameCodec(REGISTRY_LAYOUT_HASH)  # registry thread only
        self._shards: dict[int, _Shard] = {}  # by rank; registry thread only
        self._submissions = RecentSubmissions(clock or SystemClock())  # registry thread only
        self._bad_frames = 0  # written by the registry thread only
        self._resent_submissions = 0  # written by the registry thread only
        self._log = LogLimiter(logger)
        self._start(f"sgl-pd-registry-{self._port}")

    @property
    def address(self) -> str:
        """ "host:port", what decoders are given as the bootstrap address."""
        return f"{self._host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    @property
    def bad_frames(self) -> int:
        return self._bad_frames

    @property
    def resent_submissions(self) -> int:
        """Copies of submissions already answered, answered again and not handed over."""
        return self._resent_submissions

    # -- registry thread ---------------------------------------------------------------

    def _run(self, sock: ZmqSocket) -> None:
        try:
            while not self._stop.is_set():
                if not self._wait_input(sock):
                    continue
                try:
                    self._serve_one(sock)
                except zmq.ZMQError:
                    raise
                except Exception:  # whatever a peer sent, the registry keeps answering
                    self._log.log(
                        logging.ERROR,
                        "bug",
                        "registry %s: request failed",
                        self.address,
                        exc_info=True,
                    )
        except zmq.ZMQError:
            logger.exception("registry %s: socket failed; the registry stopped", self.address)
        finally:
            self._close_sockets(sock)

    def _serve_one(self, sock: ZmqSocket) -> None:
        try:
            parts = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        if len(parts) != 2:
            self._bad_frames += 1
            self._log.warning(
                "parts", "registry %s: %d-part message dropped", self.address, len(parts)
            )
            return
        ident, frame = parts
        reply = self._answer(frame)
        try:
            encoded = self._codec.encode(reply)
        except SglPdError as e:  # cannot happen within the size checks; answer anyway
            encoded = self._codec.encode(
                ErrorMsg(request_id=None, code=ErrorCode.INTERNAL, message=str(e)[:200])
            )
        try:
            # ROUTER drops a reply to a client that is gone; never blocks.
            sock.send_multipart([ident, encoded], zmq.NOBLOCK)
        except zmq.Again:
            self._log.warning("slow", "registry %s: reply dropped, client too slow", self.address)

    def _answer(self, frame: bytes) -> Message:
        try:
            msg = self._codec.decode(frame)
        except WireError as e:
            # The asker decodes our ErrorMsg, or sees our protocol version if it differs.
            self._bad_frames += 1
            self._log.warning("frame", "registry %s: bad frame: %s", self.address, peer_text(e))
            return _refusal(ErrorCode.BAD_REQUEST, str(e))
        if isinstance(msg, RegisterShard):
            return self._register(msg)
        if isinstance(msg, RegistryQuery):
            return self._reply(msg)
        if isinstance(msg, SubmitPrefill):
            return self._submit_prefill(msg)
        if isinstance(msg, SkipPrefill):
            if self._skip is None:
                return _refusal(ErrorCode.BAD_REQUEST, "this registry takes no skipped rooms")
            self._skip(msg.request_id)
            return SubmitAck(request_id=msg.request_id)
        return _refusal(
            ErrorCode.BAD_REQUEST,
            "a registry answers register_shard, registry_query, submit_prefill and"
            f" skip_prefill, not {type(msg).__name__}",
        )

    def _submit_prefill(self, msg: SubmitPrefill) -> SubmitAck | ErrorMsg:
        if self._submit is None:
            return _refusal(
                ErrorCode.BAD_REQUEST,
                "this prefill server does not take requests from decoders (direct mode)",
            )
        # A client that waited too long for an answer sends the same submission again; a
        # second hand-off would give two prefill requests one bootstrap room.
        seen = self._submissions.recall(msg)
        if seen is not None:
            if seen.digest != digest(msg):
                return ErrorMsg(
                    request_id=msg.request_id,
                    code=ErrorCode.CONFLICT,
                    message=f"room {msg.request_id} is taken by another request on this"
                    " prefill server: submit this one under a fresh room",
                )
            self._resent_submissions += 1
            logger.debug(
                "registry %s: room %d from %s resent; answered as before",
                self.address,
                msg.request_id,
                peer_text(msg.sender),
            )
            return _submit_answer(msg.request_id, seen.refusal)
        not_ready = self._not_ready()
        if not_ready is not None:
            return not_ready  # its ranks are still starting; nothing taken, nothing kept
        refusal = self._submit(msg)
        self._submissions.remember(msg, refusal)
        return _submit_answer(msg.request_id, refusal)

    def _register(self, msg: RegisterShard) -> RegisterAck | ErrorMsg:
        try:
            reg = _registration_of(msg)
        except SglPdError as e:
            self._log.warning("invalid", "registry %s: %s", self.address, peer_text(e))
            return _refusal(ErrorCode.BAD_REQUEST, str(e))
        # Ranks this registration would replace: the same rank, or any rank of another TP.
        displaced = [
            s
            for r, s in self._shards.items()
            if s.instance != msg.instance and (r == msg.rank or s.tp_size != msg.tp_size)
        ]
        alive = [s for s in displaced if not self._is_gone(s.inbox)]
        if alive:
            held = ", ".join(f"rank {s.rank} of TP {s.tp_size} at {s.inbox}" for s in alive)
            why = (
                f"prefill {held} is registered by another running instance: stop it first"
                " (or give this server another --disaggregation-bootstrap-port)"
            )
            self._log.warning(
                "conflict", "registry %s: refused rank %d: %s", self.address, msg.rank, why
            )
            return _refusal(ErrorCode.CONFLICT, why)
        kept = {r: s for r, s in self._shards.items() if s not in displaced and r != msg.rank}
        total = sum(len(s.frame) for s in kept.values()) + len(msg.registration)
        if total > MAX_REPLY_REGISTRATIONS_BYTES:
            return _refusal(
                ErrorCode.BAD_REQUEST,
                f"registrations would total {total} bytes, over {MAX_REPLY_REGISTRATIONS_BYTES}",
            )
        for s in displaced:
            logger.info(
                "registry %s: prefill rank %d of TP %d was restarted or replaced",
                self.address,
                s.rank,
                s.tp_size,
            )
        kept[msg.rank] = _Shard(msg.rank, msg.tp_size, msg.instance, reg.inbox, msg.registration)
        self._shards = kept
        return RegisterAck(rank=msg.rank)

    def _not_ready(self) -> ErrorMsg | None:
        """NOT_READY until every rank of the announced TP size registered, else None."""
        tp_size = next(iter(self._shards.values())).tp_size if self._shards else None
        if tp_size is None or len(self._shards) < tp_size:
            have = sorted(self._shards)
            return ErrorMsg(
                request_id=None,
                code=ErrorCode.NOT_READY,
                message=f"prefill ranks {have} of TP {tp_size or '?'} registered so far",
            )
        return None

    def _reply(self, msg: RegistryQuery) -> RegistryReply | ErrorMsg:
        not_ready = self._not_ready()
        if not_ready is not None:
            return not_ready
        tp_size = next(iter(self._shards.values())).tp_size
        logger.debug("registry %s: registrations sent to %s", self.address, peer_text(msg.sender))
        return RegistryReply(
            tp_size=tp_size,
            registrations=tuple(self._shards[r].frame for r in range(tp_size)),
            refused=() if self._refusals is None else self._refusals(msg.sender),
        )


@dataclass(frozen=True)
class _Shard:
    """One registered prefill rank, as the registry keeps it."""

    rank: int
    tp_size: int
    instance: int
    inbox: str
    frame: bytes  # its ShardRegistration frame, passed on to decoders as is


def _submit_answer(room: int, refusal: tuple[ErrorCode, str] | None) -> SubmitAck | ErrorMsg:
    if refusal is None:
        return SubmitAck(request_id=room)
    code, why = refusal
    return ErrorMsg(request_id=room, code=code, message=why[:500])


def _refusal(code: ErrorCode, why: str) -> ErrorMsg:
    return ErrorMsg(request_id=None, code=code, message=why[:500])


def _registration_of(msg: RegisterShard) -> ShardRegistration:
    """The registration a `RegisterShard` carries, checked against what it claims."""
    frame = msg.registration
    if len(frame) > MAX_REGISTRATION_BYTES:
        raise BootstrapError(f"a registration of {len(frame)} bytes, over {MAX_REGISTRATION_BYTES}")
    reg = FrameCodec(frame_layout_hash(frame)).decode(frame)
    if not isinstance(reg, ShardRegistration):
        raise BootstrapError(f"register_shard carries a {type(reg).__name__}, not a registration")
    if (reg.role, reg.rank, reg.scheme.tp_size, reg.instance) != (
        Role.PREFILL,
        msg.rank,
        msg.tp_size,
        msg.instance,
    ):
        raise BootstrapError(
            f"register_shard for prefill rank {msg.rank} of TP {msg.tp_size} carries the"
            f" registration of {reg.role.value} rank {reg.rank} of TP {reg.scheme.tp_size}"
            " (or of another instance)"
        )
    return reg


class RegistryClient:
    """Blocking register / query calls with retries; safe to call from any thread.

    Every wait is bounded: each attempt waits at most `attempt_timeout_s` for a reply (then
    a fresh socket tries again), and a whole call at most its `timeout_s`, after which it
    raises `BootstrapTimeout` naming the address. `close()` or a set `stop` event ends a
    call in progress within about 0.1 s with `MessengerClosed`.
    """

    def __init__(
        self,
        name: str,
        *,
        clock: Clock | None = None,
        attempt_timeout_s: float = ATTEMPT_TIMEOUT_S,
        auth: ClusterAuth | None = None,
        context: ZmqContext | None = None,
    ) -> None:
        """`name` identifies this process in the registry's log (RegistryQuery.sender).
        With `auth`, the registry must be a member of the cluster (else no answer comes,
        and calls end in `BootstrapTimeout`)."""
        self._name = name
        self._auth = auth
        self._clock = clock or SystemClock()
        self._attempt_timeout_s = attempt_timeout_s
        self._ctx = ContextOwner(context)
        self._closed = threading.Event()
        self._calls = 0  # calls in progress, under _idle
        self._idle = threading.Condition()

    def register(
        self,
        addr: str,
        msg: RegisterShard,
        timeout_s: float = REGISTER_TIMEOUT_S,
        retry_interval_s: float = RETRY_INTERVAL_S,
        stop: threading.Event | None = None,
    ) -> None:
        """Register one prefill rank with the registry at "host:port"; returns once acked."""
        reply = self._exchange(
            addr, msg, f"register rank {msg.rank}", timeout_s, retry_interval_s, stop
        )
        if not (isinstance(reply, RegisterAck) and reply.rank == msg.rank):
            raise BootstrapError(f"prefill registry at {addr} answered a registration with {reply}")

    def query(
        self,
        addr: str,
        timeout_s: float = QUERY_TIMEOUT_S,
        retry_interval_s: float = RETRY_INTERVAL_S,
        stop: threading.Event | None = None,
    ) -> list[bytes]:
        """The registration frames of all prefill ranks at "host:port", indexed by rank;
        asks again while the registry answers NOT_READY or nothing."""
        return list(self._query(addr, timeout_s, retry_interval_s, stop).registrations)

    def probe(
        self, addr: str, timeout_s: float = QUERY_TIMEOUT_S, stop: threading.Event | None = None
    ) -> tuple[RefusedSubmission, ...]:
        """Is the prefill server at "host:port" serving? Returns this client's submissions
        it refused after taking them (direct mode); raises as `query` does."""
        return self._query(addr, timeout_s, RETRY_INTERVAL_S, stop).refused

    def _query(
        self, addr: str, timeout_s: float, retry_interval_s: float, stop: threading.Event | None
    ) -> RegistryReply:
        query = RegistryQuery(sender=self._name)
        reply = self._exchange(addr, query, "query", timeout_s, retry_interval_s, stop)
        if not isinstance(reply, RegistryReply):
            raise BootstrapError(f"prefill registry at {addr} answered a query with {reply}")
        return reply

    def submit(
        self,
        addr: str,
        msg: SubmitPrefill,
        timeout_s: float = SUBMIT_TIMEOUT_S,
        stop: threading.Event | None = None,
    ) -> None:
        """Hands a request to the prefill server whose registry is at "host:port"; returns
        once it took it. Raises `BootstrapError` (refused) or `BootstrapTimeout`."""
        reply = self._exchange(addr, msg, "take a request", timeout_s, RETRY_INTERVAL_S, stop)
        if not (isinstance(reply, SubmitAck) and reply.request_id == msg.request_id):
            raise BootstrapError(f"prefill registry at {addr} answered a submission with {reply}")

    def skip(self, addr: str, msg: SkipPrefill, timeout_s: float = SUBMIT_TIMEOUT_S) -> None:
        """Tells the prefill server whose registry is at "host:port" that the decoder
        prefills `msg.request_id` itself; returns once acknowledged (resent meanwhile).
        Raises `BootstrapError` (refused) or `BootstrapTimeout`."""
        reply = self._exchange(addr, msg, "skip a room", timeout_s, RETRY_INTERVAL_S, None)
        if not (isinstance(reply, SubmitAck) and reply.request_id == msg.request_id):
            raise BootstrapError(f"prefill registry at {addr} answered a skip with {reply}")

    def close(self) -> None:
        """Cancel calls in progress, wait for them to let go of their sockets; idempotent."""
        self._closed.set()
        with self._idle:
            self._idle.wait_for(lambda: self._calls == 0, timeout=5.0)
            if self._calls == 0:
                self._ctx.release()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one call --------------------------------------------------------------------

    def _exchange(
        self,
        addr: str,
        request: Message,
        what: str,
        timeout_s: float,
        retry_interval_s: float,
        stop: threading.Event | None,
    ) -> Message:
        endpoint = tcp_endpoint(addr)
        with self._idle:
            if self._closed.is_set():
                raise MessengerClosed("registry client is closed")
            self._calls += 1
        try:
            codec = FrameCodec(REGISTRY_LAYOUT_HASH)  # per call: codecs are not thread-safe
            frame = codec.encode(request)
            deadline = self._clock.monotonic() + timeout_s
            not_ready: str | None = None
            while True:
                reply = self._attempt(addr, endpoint, frame, codec, deadline, stop)
                if isinstance(reply, ErrorMsg) and reply.code is ErrorCode.NOT_READY:
                    not_ready = reply.message
                    self._pause(min(retry_interval_s, deadline - self._clock.monotonic()), stop)
                elif isinstance(reply, ErrorMsg):
                    raise RegistryRefused(
                        f"prefill registry at {addr} refused to {what}:"
                        f" {reply.code.value}: {reply.message}",
                        reply.code,
                    )
                elif reply is not None:
                    return reply
                if self._clock.monotonic() >= deadline:
                    raise BootstrapTimeout(self._timeout_message(addr, what, timeout_s, not_ready))
        finally:
            with self._idle:
                self._calls -= 1
                self._idle.notify_all()

    def _attempt(
        self,
        addr: str,
        endpoint: str,
        frame: bytes,
        codec: FrameCodec,
        deadline: float,
        stop: threading.Event | None,
    ) -> Message | None:
        """Send once on a fresh socket and wait for the reply; None if none came in time."""
        sock = self._ctx.context.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            if self._auth is not None:
                self._auth.make_client(sock)
            try:
                sock.connect(endpoint)
                # Not connected yet: ZMQ keeps the frame on the new pipe and sends it once
                # the connection is up (ZMQ retries the connect every 100 ms meanwhile).
                sock.send(frame, zmq.NOBLOCK)
            except zmq.ZMQError as e:
                raise InvalidAddress(f"cannot connect to a registry at {addr!r}: {e}") from e
            end = min(deadline, self._clock.monotonic() + self._attempt_timeout_s)
            while True:
                self._check_cancelled(stop)
                left = end - self._clock.monotonic()
                if left <= 0:
                    return None
                if sock.poll(max(1, int(min(left, POLL_S) * 1000)), zmq.POLLIN):
                    data = sock.recv(zmq.NOBLOCK)
                    break
        finally:
            sock.close(linger=0)
        try:
            return codec.decode(data)
        except WireError as e:
            # Keep the type (a version skew stays a ProtocolVersionMismatch), add the address.
            raise type(e)(f"reply of the prefill registry at {addr}: {e}") from e

    def _pause(self, seconds: float, stop: threading.Event | None) -> None:
        end = self._clock.monotonic() + seconds
        while (left := end - self._clock.monotonic()) > 0:
            self._check_cancelled(stop)
            self._closed.wait(min(left, POLL_S))
        self._check_cancelled(stop)

    def _check_cancelled(self, stop: threading.Event | None) -> None:
        if self._closed.is_set() or (stop is not None and stop.is_set()):
            raise MessengerClosed("registry call cancelled: the client is shutting down")

    @staticmethod
    def _timeout_message(addr: str, what: str, timeout_s: float, not_ready: str | None) -> str:
        if not_ready is not None:
            return (
                f"prefill registry at {addr} was not ready to {what} within {timeout_s} s"
                f" ({not_ready}): a prefill rank failed to start or to register"
            )
        return (
            f"no answer from a prefill registry at {addr} within {timeout_s} s (to {what}):"
            f" check that the prefill server is up and that {addr} is its bootstrap address"
            " (--disaggregation-bootstrap-port), and that both use the same cluster secret"
            " (--pd-auth-secret-file)"
        )
