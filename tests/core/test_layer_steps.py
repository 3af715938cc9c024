"""`core.layer_steps`: a forward's steps in model order, KV layers and state layers."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_pd.core.layer_steps import LayerSteps


@st.composite
def _models(draw: st.DrawFn) -> tuple[list[int], set[int]]:
    """A model's layers, each KV, state, or neither (a layer no step reports)."""
    kinds = draw(st.lists(st.sampled_from("ksn"), min_size=1, max_size=40))
    kv = [i for i, k in enumerate(kinds) if k == "k"]
    state = {i for i, k in enumerate(kinds) if k == "s"}
    return kv, state


@given(_models(), st.data())
def test_any_split_of_the_steps_hands_over_each_layer_once_in_order(
    model: tuple[list[int], set[int]], data: st.DataObject
) -> None:
    """However the streamer's reads cut the forward into ranges, the KV ranges tile
    0..num_kv_layers in order and the state layers come each once."""
    kv, state = model
    steps = LayerSteps.of(kv, state)
    assert len(steps) == len(kv) + len(state) and steps.num_kv_layers == len(kv)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(steps)))) | {0, len(steps)})
    kv_seen: list[int] = []
    state_seen: list[int] = []
    for a, b in itertools.pairwise(cuts):
        kv_seen.extend(steps.kv_layers(range(a, b)))
        state_seen.extend(sorted(steps.state_layers(range(a, b))))
    assert kv_seen == list(range(len(kv)))
    assert state_seen == sorted(state)
    assert steps.state_model_layers == state


def test_a_state_layer_reports_before_the_kv_layer_after_it() -> None:
    """Qwen3-Next's shape: three linear-attention layers, then a full-attention one."""
    steps = LayerSteps.of([3, 7], [0, 1, 2, 4, 5, 6])
    assert steps.model_layers == tuple(range(8))
    assert steps.kv_layers(range(0, 3)) == range(0, 0)
    assert steps.kv_layers(range(3, 4)) == range(0, 1)
    assert steps.state_layers(range(2, 5)) == {2, 4}
    assert steps.kv_layers(range(4, 8)) == range(1, 2)


def test_without_state_a_step_is_a_kv_layer() -> None:
    steps = LayerSteps.kv_only(4)
    assert steps.kv_layers(range(1, 3)) == range(1, 3) and not steps.state_layers(range(4))


def test_kv_layers_out_of_model_order_are_refused() -> None:
    with pytest.raises(ValueError, match="ascend"):
        LayerSteps.of([3, 1], [])
