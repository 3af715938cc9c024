"""Local server processes: the ports they get, and that they never outlive their runner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sgl_pd.cluster.processes import _EPHEMERAL_RANGE, free_ports


def test_server_ports_come_from_below_the_ephemeral_range() -> None:
    """A port the kernel may give an outgoing connection meanwhile would make a server's
    bind fail a minute later; ours never come from that range."""
    low = int(_EPHEMERAL_RANGE.read_text().split()[0]) if _EPHEMERAL_RANGE.exists() else 32768
    ports = free_ports(20)
    assert len(set(ports)) == 20
    if low > 21000:
        assert all(p < low for p in ports)


def test_a_terminated_runner_still_stops_its_servers(tmp_path: Path) -> None:
    """SIGTERM to a script holding servers (a benchmark stopped by `kill` or a CI
    timeout) stops the servers too: none is left running."""
    pid_file = tmp_path / "child.pid"
    script = f"""
import time, pathlib, sys
from sgl_pd.cluster.processes import ManagedProcess, managed
child = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"],
                       pathlib.Path({str(tmp_path / "sleeper.log")!r}))
with managed([child]):
    child.start()
    pathlib.Path({str(pid_file)!r}).write_text(str(child.process.pid))
    time.sleep(600)
"""
    runner = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        child_pid = int(pid_file.read_text())
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child_pid)
    finally:
        runner.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (its parent has not reaped it yet) is gone for our purpose
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"
