"""Staging ranges never overlap, stay inside the area, and all come back."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_pd.core.errors import PlanError
from sgl_pd.core.staging_space import ALIGN, StagingSpace


@given(
    capacity=st.integers(0, 64 * ALIGN),
    steps=st.lists(st.tuples(st.booleans(), st.integers(1, 16 * ALIGN)), max_size=60),
)
def test_held_ranges_are_disjoint_and_all_come_back(
    capacity: int, steps: list[tuple[bool, int]]
) -> None:
    space = StagingSpace(capacity)
    held: dict[int, int] = {}
    for give, nbytes in steps:
        if give and held:
            offset = min(held)
            space.give_back(offset)
            del held[offset]
            continue
        offset = space.take(nbytes)
        if offset is None:
            continue
        size = -(-nbytes // ALIGN) * ALIGN
        assert offset % ALIGN == 0 and offset + size <= space.capacity
        assert all(offset + size <= o or o + n <= offset for o, n in held.items())
        held[offset] = size
    assert space.used == sum(held.values())
    for offset in list(held):
        space.give_back(offset)
    assert space.used == 0
    assert space.take(space.capacity) == (0 if space.capacity else None)


def test_a_range_is_given_back_once() -> None:
    space = StagingSpace(4 * ALIGN)
    offset = space.take(ALIGN)
    assert offset == 0 and not space.fits(5 * ALIGN) and space.fits(4 * ALIGN)
    space.give_back(offset)
    with pytest.raises(PlanError):
        space.give_back(offset)
