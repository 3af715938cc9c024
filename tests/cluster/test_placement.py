"""Local servers get their own cores and a matching torch thread count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sgl_pd.cluster.local import Placement, place_servers


def test_servers_split_the_cores_in_contiguous_blocks() -> None:
    assert place_servers(2, [0, 1]) == [Placement((0,)), Placement((1,))]
    assert place_servers(1, [0, 1]) == [Placement((0, 1))]
    assert place_servers(3, range(8)) == [
        Placement((0, 1, 2)),
        Placement((3, 4, 5)),
        Placement((6, 7)),
    ]


def test_more_servers_than_cores_take_one_core_each_in_turn() -> None:
    assert place_servers(3, [4, 2]) == [Placement((2,)), Placement((4,)), Placement((2,))]


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="num_servers"):
        place_servers(0, [0])
    with pytest.raises(ValueError, match="no CPU cores"):
        place_servers(1, [])


def test_the_default_is_the_cores_this_process_may_use() -> None:
    mine = sorted(os.sched_getaffinity(0))
    assert place_servers(1) == [Placement(tuple(mine))]


def test_a_placed_process_runs_on_its_cores_with_matching_threads() -> None:
    placement = Placement((min(os.sched_getaffinity(0)),))
    probe = "import os; print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"
    out = subprocess.run(
        placement.wrap([sys.executable, "-c", probe]),
        env={**os.environ, **placement.env()},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.split() == [f"[{placement.cpus[0]}]", "1"]
