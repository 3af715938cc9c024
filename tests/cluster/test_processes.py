"""Local server processes: the ports they get."""

from __future__ import annotations

from sgl_pd.cluster.processes import _EPHEMERAL_RANGE, free_ports


def test_server_ports_come_from_below_the_ephemeral_range() -> None:
    """A port the kernel may give an outgoing connection meanwhile would make a server's
    bind fail a minute later; ours never come from that range."""
    low = int(_EPHEMERAL_RANGE.read_text().split()[0]) if _EPHEMERAL_RANGE.exists() else 32768
    ports = free_ports(20)
    assert len(set(ports)) == 20
    if low > 21000:
        assert all(p < low for p in ports)
