"""The steps a prefill forward reports to the layer streamer, in model order (D6-D8).

A model's layers keep their per-token results in two places: the paged KV of its
attention layers (KV layer i is the i-th layer with KV in the main pool), and, on newer
models, per-request state besides those pages - a sliding-window layer's window pages
(SGLang's hybrid SWA pool), a linear-attention layer's conv and recurrent state (its
Mamba pool). A forward finishes them in model order, each when the layer's output
projection ran. Layer-wise streaming reports every such layer as one step, so that the
KV of an attention layer and the state of the other layers both go while the next
layers compute: the state of the last chunk's layers (final only then) goes with the
last chunk, layer by layer.

`LayerSteps` numbers those layers 0.. in model order and answers, for a range of steps
the forward finished, which KV layers and which state layers (model layer ids) they
cover. A layer with state that no step reports (its output projection was not found)
has its state written after the forward, with the request's metadata.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSteps:
    """Step i reports model layer `model_layers[i]` (ascending); the j-th step of
    `kv_steps` (ascending) is KV layer j."""

    model_layers: tuple[int, ...]
    kv_steps: tuple[int, ...]  # the steps that are KV layers, ascending

    @classmethod
    def of(cls, kv_model_layers: Sequence[int], state_model_layers: Iterable[int]) -> LayerSteps:
        """Steps for the KV layers at model layers `kv_model_layers` (KV order, which is
        model order) and the layers with state at `state_model_layers`. A layer with both
        (none SGLang builds) is one step, counted as a KV layer."""
        kv = list(kv_model_layers)
        if kv != sorted(set(kv)):
            raise ValueError(f"KV layers must ascend in model order, got {kv}")
        layers = sorted(set(kv) | set(state_model_layers))
        kv_set = set(kv)
        return cls(tuple(layers), tuple(i for i, m in enumerate(layers) if m in kv_set))

    @classmethod
    def kv_only(cls, num_kv_layers: int) -> LayerSteps:
        """A model with no state layers reported: step i is KV layer i."""
        return cls.of(range(num_kv_layers), ())

    def __len__(self) -> int:
        return len(self.model_layers)

    @property
    def num_kv_layers(self) -> int:
        return len(self.kv_steps)

    def kv_layers(self, steps: range) -> range:
        """The KV layers among `steps` (contiguous: KV layers follow model order)."""
        kv = self.kv_steps
        return range(bisect.bisect_left(kv, steps.start), bisect.bisect_left(kv, steps.stop))

    def state_layers(self, steps: range) -> frozenset[int]:
        """The model layer ids of the state layers among `steps`."""
        kv = self.kv_steps
        last = min(steps.stop, len(self.model_layers))
        return frozenset(
            self.model_layers[i] for i in range(steps.start, last) if not _contains(kv, i)
        )

    @property
    def state_model_layers(self) -> frozenset[int]:
        """Every state layer a step reports."""
        return self.state_layers(range(len(self.model_layers)))


def _contains(ascending: tuple[int, ...], value: int) -> bool:
    at = bisect.bisect_left(ascending, value)
    return at < len(ascending) and ascending[at] == value
