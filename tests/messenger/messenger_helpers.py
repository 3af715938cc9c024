"""Shared builders for the messenger tests, and the body of the spawned prefill rank."""

from __future__ import annotations

import socket

from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.regions import Region
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.wire import FrameCodec, RegisterShard, Role, ShardRegistration

HOST = "127.0.0.1"
LAYOUT = KvLayout.gqa(
    num_layers=2,
    num_kv_heads=4,
    head_dim=64,
    page_size=16,
    elem_bytes=2,
    page_layout=PageLayout.HND,
)
CODEC_HASH = LAYOUT.compat_hash()


def registration(rank: int, tp: int, instance: int, inbox: str = "") -> ShardRegistration:
    return ShardRegistration(
        role=Role.PREFILL,
        rank=rank,
        scheme=ShardingScheme(tp),
        session=f"{HOST}:{17000 + rank}",
        inbox=inbox or f"tcp://{HOST}:{18000 + rank}",
        instance=instance,
        layout=LAYOUT,
        num_pages=64,
        kv_regions=tuple(Region(i << 20, 1 << 20) for i in range(LAYOUT.num_regions)),
        layer_group_size=1,
    )


def register_msg(
    rank: int, tp: int, instance: int, inbox: str = "", layout_hash: int = CODEC_HASH
) -> RegisterShard:
    frame = FrameCodec(layout_hash).encode(registration(rank, tp, instance, inbox))
    return RegisterShard(rank=rank, tp_size=tp, instance=instance, registration=frame)


def free_port() -> int:
    """A port nothing listens on right now (another process may take it; tests accept that)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def register_in_child(addr: str, msg: RegisterShard) -> None:
    """Runs in a spawned process: one prefill rank registering with its server's registry."""
    from sgl_pd.messenger.registry import RegistryClient

    with RegistryClient("child-rank") as client:
        client.register(addr, msg, timeout_s=20.0)
