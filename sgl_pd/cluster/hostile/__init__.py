"""Hostile input against a running PD cluster's listeners: the prefill registry (bootstrap
port), the prefill rank's inbox and the decode rank's inbox.

Shared by `benchmarks/bench_hostile.py` and `tests/e2e/test_pd_hostile.py`:

- strangers (`run_strangers`): without the cluster secret, random bytes, damaged frames
  and valid frames of every message type, over raw TCP (a ZMTP greeting of any mechanism,
  then anything), plain ZMQ sockets and CURVE sockets keyed by another secret. Nothing may
  come back: each socket counts what it receives, and every reply address in those frames
  names our `Witness` inbox, which counts what arrives there.
- a member (`run_member`): holds the secret, so its frames reach the handlers. Hypothesis
  draws well-framed messages with hostile bodies: forged aborts, errors, chunk notices and
  drain acks for random and for real request ids, transfer requests with out-of-range
  indices, giant and escape-filled strings, forged registrations, random bodies; then
  heartbeats naming thousands of endpoints and frames over the size limits.

How the servers took it is read from the outside only (`check_cluster`): /health, their
processes, the greedy tokens of real requests, and their logs.

Modules: `targets` (finding the listeners, building frames for them), `strangers` (phase
a), `bodies` (what the member phase draws), `member` (phase b), `checks` (how the servers
took it).
"""

from sgl_pd.cluster.hostile.bodies import Campaign, RealRooms
from sgl_pd.cluster.hostile.checks import (
    Checked,
    LiveTraffic,
    check_cluster,
    gone_pids,
    health_status,
    log_findings,
    log_sizes,
    process_tree,
)
from sgl_pd.cluster.hostile.member import (
    HEARTBEAT_ENDPOINTS,
    MemberSockets,
    heartbeat_flood,
    run_member,
    send_oversized,
)
from sgl_pd.cluster.hostile.strangers import Tally, run_strangers
from sgl_pd.cluster.hostile.targets import Targets, Witness, find_targets

__all__ = [
    "HEARTBEAT_ENDPOINTS",
    "Campaign",
    "Checked",
    "LiveTraffic",
    "MemberSockets",
    "RealRooms",
    "Tally",
    "Targets",
    "Witness",
    "check_cluster",
    "find_targets",
    "gone_pids",
    "health_status",
    "heartbeat_flood",
    "log_findings",
    "log_sizes",
    "process_tree",
    "run_member",
    "run_strangers",
    "send_oversized",
]
