"""Server processes on this machine: free ports, readiness with a timeout, certain cleanup.

Every process is started in its own session (process group) so stopping it also stops
the scheduler and detokenizer processes SGLang forks.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sgl_pd.errors import SglPdError


class ServerStartError(SglPdError):
    """A server exited or did not become ready in time; the message quotes its log."""


# Servers started here listen on ports from below the kernel's ephemeral range. A port
# the kernel may hand out in the minute a server takes to start - to any outgoing
# connection, even a readiness probe that connects to itself, or to a bind on port 0 -
# would make the server's own bind fail. Mooncake picks its ports in 12000-17000, and
# SGLang its torch.distributed port in 22000-29999 (checked free when the server starts,
# bound a minute later): a port handed out here in that range could be taken by a
# server starting beside it (seen: EADDRINUSE on a decoder's dist port, which a prefill
# server's registry had just bound).
SERVER_PORTS = range(17000, 22000)
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _server_port_candidates() -> list[int]:
    try:
        ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    ports = [p for p in SERVER_PORTS if p < ephemeral_low]
    random.shuffle(ports)
    return ports


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


# Ports this process handed out lately: a port is free when chosen but taken only once
# its server binds it, so a later call - another thread's, starting servers side by
# side - must not choose it again meanwhile.
_handed_out: collections.OrderedDict[int, None] = collections.OrderedDict()
_handed_out_lock = threading.Lock()
_HANDED_OUT_KEPT = 4096


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """Distinct free ports outside the ephemeral range (the kernel's own choice when
    that range leaves none), all held open until chosen so no two are the same, and
    none that this process handed out lately."""
    with _handed_out_lock, contextlib.ExitStack() as stack:
        ports: list[int] = []
        for port in _server_port_candidates():
            if len(ports) == count:
                break
            if port in _handed_out:
                continue
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            try:
                s.bind((host, port))
            except OSError:
                continue
            ports.append(port)
        while len(ports) < count:
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(int(s.getsockname()[1]))
        for port in ports:
            _handed_out[port] = None
        while len(_handed_out) > _HANDED_OUT_KEPT:
            _handed_out.popitem(last=False)
        return ports


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# seconds a server's process group gets to end after SIGTERM before SIGKILL (SGLang's
# launcher takes a few: its scheduler's exit makes it look for stuck processes first)
STOP_GRACE_S = 10.0


@dataclass
class ManagedProcess:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            self.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
        )
        log.close()  # the child holds its own descriptor

    def wait_http_ready(self, url: str, timeout_s: float, *, probe_timeout_s: float = 2.0) -> None:
        """Polls ``url`` until it answers 200, each probe waiting up to `probe_timeout_s`
        seconds; raises with the log tail on exit or after `timeout_s` seconds."""
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerStartError(
                    f"{self.name} exited with code {self.process.returncode} before it was "
                    f"ready; last lines of {self.log_path}:\n{_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(url, timeout=probe_timeout_s) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        raise ServerStartError(
            f"{self.name} was not ready at {url} after {timeout_s:.0f} s; last lines of "
            f"{self.log_path}:\n{_tail(self.log_path)}"
        )

    def kill(self) -> None:
        """SIGKILL to the whole process group at once, as a crash would end it."""
        assert self.process is not None, "start() first"
        self.kill_group(reap_s=30)

    def pause(self) -> None:
        """SIGSTOP to the whole process group: alive, connections still accepted, but
        nothing runs (a frozen host, a stalled VM) until `resume`."""
        assert self.process is not None, "start() first"
        _signal_group(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None, "start() first"
        _signal_group(self.process.pid, signal.SIGCONT)

    def restart(self, log_suffix: str) -> None:
        """Starts the same command again, logging to `<log>.<log_suffix>`; the caller
        waits for readiness. The old log stays for reading."""
        self.log_path = self.log_path.with_name(f"{self.log_path.name}.{log_suffix}")
        self.start()

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Stops the whole process group: SIGTERM, then SIGKILL after ``grace_s``."""
        stop_all([self], grace_s)

    def running(self) -> bool:
        """Some process of the group still runs."""
        if self.process is None:
            return False
        self.process.poll()  # reaps the leader: as a zombie it would keep the group "alive"
        return self.process.poll() is None or _group_alive(self.process.pid)

    def terminate(self) -> None:
        """SIGTERM to the group (woken first: a paused group cannot stop)."""
        if self.process is not None:
            _signal_group(self.process.pid, signal.SIGCONT)
            _signal_group(self.process.pid, signal.SIGTERM)

    def kill_group(self, reap_s: float = 5.0) -> None:
        """SIGKILL to whatever of the group still runs, and the leader reaped (waiting
        up to `reap_s`)."""
        if self.process is not None:
            _signal_group(self.process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=reap_s)


def stop_all(processes: Sequence[ManagedProcess], grace_s: float = STOP_GRACE_S) -> None:
    """Stops every process group at once: SIGTERM to all, then SIGKILL to whatever still
    runs after ``grace_s`` - one grace period for all, not one each."""
    running = [p for p in processes if p.running()]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(p.running() for p in running):
        time.sleep(0.2)
    for p in running:
        if p.running():  # (a group that ended is not signalled: its id may be reused)
            p.kill_group()


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def managed(processes: Sequence[ManagedProcess]) -> Iterator[Sequence[ManagedProcess]]:
    """Stops every process on exit, all at once, whatever happened inside -
    a SIGTERM to this process included (Python's default would end it at once, leaving
    the servers running)."""
    restore = exit_on_sigterm()
    try:
        yield processes
    finally:
        try:
            stop_all(list(reversed(processes)))
        finally:
            restore()


def exit_on_sigterm() -> Callable[[], None]:
    """Makes SIGTERM raise SystemExit (so `finally` blocks run) while the returned
    function is not called; only from the main thread and if nobody handles it yet."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)


def python_module_argv(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
