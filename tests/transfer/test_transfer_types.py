"""Value types, configuration and the import guard: no engine needed."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from sgl_pd.errors import ConfigError, SglPdError
from sgl_pd.transfer import (
    InvalidWrites,
    MooncakeNotInstalled,
    PeerUnreachable,
    TransferError,
    TransferFailed,
    TransportConfig,
    TransportProtocol,
    Writes,
)
from sgl_pd.transfer.regions import RegionTable


def test_writes_of_converts_and_broadcasts() -> None:
    w = Writes.of([1, 2, 3], np.array([10, 20, 30], dtype=np.uint32), 4)
    assert w.dst.dtype == np.int64 and w.nbytes.tolist() == [4, 4, 4]
    assert len(w) == 3 and w.total_bytes == 12
    both = Writes.concat([w, Writes.single(5, 50, 6)])
    assert both.src.tolist() == [1, 2, 3, 5] and both.total_bytes == 18
    assert len(Writes.concat([])) == 0


@pytest.mark.parametrize(
    "cols",
    [
        ([1, 2], [1], [1, 1]),  # lengths differ
        ([1], [1], [0]),  # empty write
        ([-1], [1], [1]),  # negative address
    ],
)
def test_writes_rejects_bad_batches(cols: tuple[list[int], ...]) -> None:
    with pytest.raises(InvalidWrites):
        Writes.of(*cols)


def test_writes_rejects_wrong_dtype() -> None:
    a = np.zeros(2, dtype=np.int32)
    with pytest.raises(InvalidWrites, match="int64"):
        Writes(a, a, a)  # type: ignore[arg-type]


def test_errors_share_the_root() -> None:
    assert issubclass(TransferError, SglPdError)
    e = TransferFailed("h:1", 3, 192, "boom")
    assert (e.peer, e.n_writes, e.nbytes) == ("h:1", 3, 192) and "3 writes" in str(e)
    assert isinstance(PeerUnreachable("h:1", "x"), TransferError)


def test_config_accepts_strings_and_validates_protocol() -> None:
    assert TransportConfig(protocol="RDMA").transport is TransportProtocol.RDMA
    with pytest.raises(ConfigError, match="tcp, rdma, efa"):
        TransportConfig(protocol="ib")
    with pytest.raises(ConfigError, match="without a port"):
        TransportConfig(hostname="10.0.0.1:5000")
    assert TransportConfig(hostname="::1").hostname == "::1"
    with pytest.raises(ConfigError):
        TransportConfig(connect_timeout_s=0)


def test_config_devices() -> None:
    assert TransportConfig().devices_for(3) == ""
    assert TransportConfig(ib_device="mlx5_0, mlx5_1").devices_for(0) == "mlx5_0,mlx5_1"
    cfg = TransportConfig(ib_device='{"0": "mlx5_0", "1": "mlx5_1,mlx5_2"}')
    assert cfg.devices_for(1) == "mlx5_1,mlx5_2"
    with pytest.raises(ConfigError, match="shard 2"):
        cfg.devices_for(2)
    for bad in ("mlx5_0,,mlx5_1", '{"0": 1}', '{"a": "mlx5_0"}', "{oops"):
        with pytest.raises(ConfigError):
            TransportConfig(ib_device=bad)


def test_region_table_outside() -> None:
    t = RegionTable()
    t.add(1000, 100)
    t.add(5000, 10)
    addr = np.array([1000, 1090, 1095, 5000, 999, 3000], dtype=np.int64)
    n = np.array([100, 10, 10, 10, 2, 1], dtype=np.int64)
    assert t.outside(addr, n).tolist() == [2, 4, 5]
    assert t.find(5002, 8) == 5000 and t.find(5002, 9) is None


def test_missing_mooncake_names_the_wheels(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_pd.transfer import mooncake

    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(MooncakeNotInstalled) as info:
        mooncake.load_mooncake()
    assert "mooncake-transfer-engine-non-cuda" in str(info.value)
    assert "`pip install mooncake-transfer-engine`" in str(info.value)


def test_package_import_does_not_load_mooncake() -> None:
    import subprocess

    code = "import sys, sgl_pd.transfer; print('mooncake' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_inflight_limiter() -> None:
    from sgl_pd.transfer.inflight import InflightLimiter

    lim = InflightLimiter(4)
    assert lim.try_acquire("a", 3) and not lim.try_acquire("a", 2) and lim.try_acquire("b", 4)
    assert not lim.acquire("a", 2, timeout_s=0.01)
    lim.release("a", 3)
    assert lim.acquire("a", 4, timeout_s=0.01)
    with pytest.raises(ValueError):
        lim.acquire("a", 5, timeout_s=0.01)


def test_inflight_cap_defaults() -> None:
    assert TransportConfig().inflight_cap == 1024
    assert TransportConfig(protocol="rdma").inflight_cap is None
    assert TransportConfig(protocol="rdma", max_inflight_writes=64).inflight_cap == 64
    with pytest.raises(ConfigError):
        TransportConfig(max_inflight_writes=1)
