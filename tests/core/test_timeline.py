"""Timelines from stamps: every stage inside its root, ids from the room alone."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sgl_pd.core.timeline import (
    BOOTSTRAP,
    CHUNK,
    HAND_OFF,
    TRANSFER,
    decode_timeline,
    prefill_timeline,
    room_trace_ids,
)

stamp = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@given(st.integers(min_value=0, max_value=(1 << 63) - 1))
def test_room_ids_are_valid_and_the_same_on_every_host(room: int) -> None:
    trace_id, span_id = room_trace_ids(room)
    assert 0 < trace_id < 1 << 128 and 0 < span_id < 1 << 64
    assert room_trace_ids(room) == (trace_id, span_id)
    assert room_trace_ids(room + 1)[0] != trace_id


@given(stamp, stamp, stamp, stamp, st.lists(st.tuples(stamp, stamp), max_size=5))
def test_every_prefill_stage_lies_within_its_root(
    seen: float, ready: float, first: float, end: float, chunks: list[tuple[float, float]]
) -> None:
    timeline = prefill_timeline(
        room=1,
        rank=0,
        seen_s=seen,
        ready_s=ready,
        first_write_s=first,
        end_s=end,
        chunks=[(i, a, b) for i, (a, b) in enumerate(chunks)],
    )
    assert [s.name for s in timeline.children].count(CHUNK) == len(chunks)
    for stage in timeline.children:
        assert timeline.root.start_s <= stage.start_s <= stage.end_s <= timeline.root.end_s


def test_a_stage_never_reached_is_left_out() -> None:
    prefill = prefill_timeline(
        room=1, rank=0, seen_s=1.0, ready_s=None, first_write_s=None, end_s=2.0, chunks=[]
    )
    assert prefill.children == () and (prefill.root.start_s, prefill.root.end_s) == (1.0, 2.0)
    decode = decode_timeline(
        room=1, rank=0, seen_s=1.0, found_s=1.1, requested_s=1.2, complete_s=None, end_s=3.0,
        error="aborted",
    )  # fmt: skip
    assert [s.name for s in decode.children] == [BOOTSTRAP]
    assert "error='aborted'" in decode.log_fields()
    done = decode_timeline(
        room=1, rank=0, seen_s=None, found_s=None, requested_s=1.2, complete_s=2.0, end_s=2.5
    )
    assert [s.name for s in done.children][-1] == HAND_OFF
    assert TRANSFER not in {s.name for s in done.children}
