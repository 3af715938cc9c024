"""Local servers get their own cores and a matching torch thread count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sgl_pd.cluster.local import Placement, place_servers, scheduler_ranks


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


def test_ranks_of_a_multi_rank_server_get_cores_of_their_own() -> None:
    # enough cores: servers in proportion to their ranks, one block per rank inside
    assert place_servers(2, [0, 1, 2, 3], ranks=[2, 2]) == [
        Placement((0, 1), ((0,), (1,))),
        Placement((2, 3), ((2,), (3,))),
    ]
    assert place_servers(2, range(8), ranks=[2, 1]) == [
        Placement((0, 1, 2, 3, 4), ((0, 1, 2), (3, 4))),
        Placement((5, 6, 7), ((5, 6, 7),)),
    ]
    # fewer cores than ranks: servers stay apart, a server's ranks share its cores
    assert place_servers(2, [0, 1], ranks=[2, 1]) == [
        Placement((0,), ((0,), (0,))),
        Placement((1,), ((1,),)),
    ]
    assert place_servers(1, [0, 1], ranks=[2]) == [Placement((0, 1), ((0,), (1,)))]
    tp2, tp1 = place_servers(1, [0, 1], ranks=[2])[0], place_servers(1, [0, 1])[0]
    assert tp2.env() == {"OMP_NUM_THREADS": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    assert tp1.env() == {"OMP_NUM_THREADS": "2", "SGLANG_CPU_OMP_THREADS_BIND": "0,1"}
    shared = place_servers(2, [0, 1], ranks=[2, 2])[0]
    assert shared.env() == {"OMP_NUM_THREADS": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|0"}


def test_scheduler_processes_are_counted_from_sglangs_flags() -> None:
    assert scheduler_ranks(["--model-path", "m"]) == 1
    assert scheduler_ranks(["--tp", "2"]) == scheduler_ranks(["--tp-size=2"]) == 2
    assert scheduler_ranks(["--tp", "2", "--dp", "2"]) == 4
    assert scheduler_ranks(["--tp", "2", "--dp", "2", "--enable-dp-attention"]) == 2


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="num_servers"):
        place_servers(0, [0])
    with pytest.raises(ValueError, match="no CPU cores"):
        place_servers(1, [])
    with pytest.raises(ValueError, match="rank count"):
        place_servers(2, [0], ranks=[1])


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
