"""Real Mooncake over TCP: with a bind host, the engine's listeners serve only its interface.

Each case runs in a spawned process, so the sockets seen are that engine's alone (Mooncake
keeps its listeners until the process ends). The sockets are read from the kernel here,
not through the engine's own report.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
from typing import Any

import pytest

pytest.importorskip("mooncake.engine")

import psutil

Q_TIMEOUT_S = 60.0  # seconds to wait for a child's report
IFNAMSIZ = 16  # bytes of an interface name, NUL included
NOBODYS_ADDRESS = "203.0.113.77"  # TEST-NET-3: no interface here owns it


def _listening() -> list[tuple[str, int, str | None]]:
    """(address, port, pinned interface) of every TCP socket this process listens on."""
    found = []
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status != psutil.CONN_LISTEN:
            continue
        with socket.socket(fileno=os.dup(c.fd)) as s:
            raw = s.getsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, IFNAMSIZ)
        found.append((c.laddr.ip, c.laddr.port, raw.split(b"\0", 1)[0].decode() or None))
    return sorted(found)


def _run_engines(bind_host: str | None, out: Any) -> None:
    """Child: two engines bound as asked, one write between them, then a report."""
    import numpy as np

    from sgl_pd.transfer import TransportConfig, Writes
    from sgl_pd.transfer.mooncake import MooncakeTransferEngine

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("sgl_pd.transfer.mooncake").addHandler(Keep(logging.WARNING))
    config = TransportConfig(hostname="127.0.0.1", bind_host=bind_host)
    rx = MooncakeTransferEngine(config)
    tx = MooncakeTransferEngine(config)
    try:
        dst = np.zeros(1 << 16, dtype=np.uint8)  # (65536,) bytes
        src = np.arange(1 << 16, dtype=np.uint64).astype(np.uint8)  # (65536,) bytes
        rx.register(int(dst.ctypes.data), dst.nbytes)
        tx.register(int(src.ctypes.data), src.nbytes)
        tx.write(
            rx.session_id, Writes.of([int(src.ctypes.data)], [int(dst.ctypes.data)], [1 << 16])
        )
        out.put(
            {
                "sockets": _listening(),
                "reported": [
                    (li.address, li.port, li.device) for li in (*rx.listeners, *tx.listeners)
                ],
                "rpc_ports": [int(e.session_id.rsplit(":", 1)[1]) for e in (rx, tx)],
                "copied": bool((dst == src).all()),
                "warnings": warnings,
            }
        )
    finally:
        tx.close()
        rx.close()


def _in_child(bind_host: str | None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_run_engines, args=(bind_host, out), daemon=True)
    proc.start()
    try:
        return dict(out.get(timeout=Q_TIMEOUT_S))
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def _loopback_interface() -> str:
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == "127.0.0.1" for a in addrs):
            return str(name)
    pytest.skip("no interface carries 127.0.0.1")


def test_loopback_bind_keeps_every_listener_on_loopback() -> None:
    lo = _loopback_interface()
    report = _in_child("127.0.0.1")
    sockets = report["sockets"]
    assert {port for _, port, _ in sockets} >= set(report["rpc_ports"])
    for address, port, device in sockets:
        on_loopback = address.startswith("127.") or address == "::1"
        assert on_loopback or device == lo, (
            f"port {port} listens on {address} for every interface: {sockets}"
        )
    assert sorted(report["reported"]) == sockets
    assert report["copied"], "a write between two loopback-pinned engines failed"
    assert report["warnings"] == []


def test_without_bind_host_mooncake_listens_everywhere() -> None:
    # documents Mooncake's own binding, which the pinning above works around
    report = _in_child(None)
    assert report["sockets"]
    assert all(device is None for _, _, device in report["sockets"])
    assert report["copied"]
    assert report["warnings"] == []


def test_bind_host_owned_by_no_interface_is_reported() -> None:
    report = _in_child(NOBODYS_ADDRESS)
    assert all(device is None for _, _, device in report["sockets"])
    assert len(report["warnings"]) == 2  # one per engine
    for warning in report["warnings"]:
        assert NOBODYS_ADDRESS in warning
        assert "every interface" in warning
        assert "firewall" in warning
