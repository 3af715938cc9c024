"""Reading servers' logs: idle-pool lines (one state per scheduler process), and which
warnings a healthy server logs."""

from __future__ import annotations

from pathlib import Path

from sgl_pd.cluster.logs import EXPECTED_WARNINGS, last_pool_state, pool_states

LINES = """\
[2026-12-02 16:43:38 TP0] sgl_pd pool idle: used 0 tokens, available 32768, evictable 0 (no leak)
[2026-12-02 16:43:38 TP1] sgl_pd pool idle: used 5 tokens, available 32763, evictable 0 (no leak)
[2026-12-02 16:43:39 TP0] sgl_pd pool idle: used 3 tokens, available 32765, evictable 0 (no leak)
[2026-12-02 16:43:40 DP1 TP1] sgl_pd pool idle: used 0 tokens, available 32768, evictable 0 (LEAK)
"""


def test_each_rank_keeps_its_last_line(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(LINES)
    assert pool_states(log) == {"TP0": (3, True), "TP1": (5, True), "DP1 TP1": (0, False)}
    assert last_pool_state(log) == (8, False)


def test_a_single_rank_server_without_a_tag(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("[2026-12-02 16:43:38] sgl_pd pool idle: used 0 tokens, available 9 (no leak)\n")
    assert pool_states(log) == {"": (0, True)}
    assert last_pool_state(log) == (0, True)
    log.write_text("nothing yet\n")
    assert last_pool_state(log) is None


def test_idle_needs_a_line_from_every_rank_and_nothing_in_use(tmp_path: Path) -> None:
    from sgl_pd.cluster.local import Server
    from sgl_pd.cluster.logs import pools_idle
    from sgl_pd.cluster.processes import ManagedProcess

    log = tmp_path / "server.log"
    server = Server("http://x", ManagedProcess("s", ["python", "--tp", "2"], log))
    tp0 = "[2026-12-02 16:43:38 TP0] sgl_pd pool idle: used 0 tokens, available 9 (no leak)\n"
    tp1 = "[2026-12-02 16:43:38 TP1] sgl_pd pool idle: used {} tokens, available 9 (no leak)\n"
    for text, idle in ((tp0, False), (tp0 + tp1.format(4), False), (tp0 + tp1.format(0), True)):
        log.write_text(text)
        assert pools_idle({"s": server}, {"s": pool_states(log)}) is idle


def test_a_client_abort_reported_by_sglang_is_expected_and_other_transfer_failures_are_not() -> (
    None
):
    prefix = "2026-12-06 04:16:09,959 pid 30812 WARNING sglang.srt.disaggregation.prefill: "
    decode = "Decode handshake failed for request rank=1 with exception KV of request 37 from h:1"
    request = "for request rank=0 req.bootstrap_room=37 with exception KV transfer of request 37"
    lines = {
        f"{prefix}Prefill bootstrap failed {request} failed: decoder aborted: client": True,
        f"{prefix}Prefill transfer failed {request} failed: decoder aborted: client": True,
        f"{prefix}Prefill transfer failed {request} failed: decoder aborted: timeout": False,
        f"{prefix}Prefill transfer failed {request} failed: peer lost": False,
        # a router's copy its decoder prefilled itself, aborted while it waited
        f"{prefix}Prefill bootstrap failed {request} failed: aborted by the prefill scheduler": (
            True
        ),
        f"{prefix}{decode} did not arrive: aborted by the decode scheduler": True,
        f"{prefix}{decode} did not arrive: peer lost": False,
    }
    for line, expected in lines.items():
        assert any(p.search(line) for p in EXPECTED_WARNINGS) == expected, line
