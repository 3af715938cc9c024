"""KV cache geometry: what one shard's pool looks like in memory, down to the byte.

Memory model (shared by the planner and the engine glue): a shard owns one contiguous
*region* per (layer, part), part being K or V (GQA/MHA) or the one latent vector (MLA).
A region holds `num_pages` pages of `page_size` token slots for the shard's `local_heads`:

    NHD: (num_pages, page_size, local_heads, head_dim)   tokens outer, heads inner
    HND: (num_pages, local_heads, page_size, head_dim)   heads outer, tokens inner

MLA is the one-head case: head_dim = kv_lora_rank + rope_dim and every TP rank holds the
same latent (one "head"), so NHD and HND coincide. Byte offsets below are inside a region.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

from sgl_pd.core.errors import LayoutError


class AttnKind(enum.Enum):
    GQA = "gqa"  # K and V per layer, heads shardable over TP (MHA is GQA with all heads)
    MLA = "mla"  # one latent vector per layer and token, replicated on every TP rank


class PageLayout(enum.Enum):
    NHD = "nhd"  # (pages, page_size, heads, head_dim)
    HND = "hnd"  # (pages, heads, page_size, head_dim)


class KvPart(enum.Enum):
    K = "k"
    V = "v"
    LATENT = "latent"


@dataclass(frozen=True)
class KvLayout:
    """Model-wide KV geometry, the same on prefillers and decoders (its hash is checked)."""

    kind: AttnKind
    num_layers: int
    num_kv_heads: int  # model-wide KV heads (GQA); 1 for MLA
    head_dim: int  # elements per (token, head); MLA: kv_lora_rank + rope_dim
    page_size: int  # tokens per page
    elem_bytes: int  # bytes per element (2 for bf16)
    page_layout: PageLayout
    kv_lora_rank: int = 0  # MLA only
    rope_dim: int = 0  # MLA only

    @classmethod
    def gqa(
        cls,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        elem_bytes: int,
        page_layout: PageLayout,
    ) -> KvLayout:
        return cls(
            AttnKind.GQA, num_layers, num_kv_heads, head_dim, page_size, elem_bytes, page_layout
        )

    @classmethod
    def mla(
        cls,
        *,
        num_layers: int,
        kv_lora_rank: int,
        rope_dim: int,
        page_size: int,
        elem_bytes: int,
        page_layout: PageLayout,
    ) -> KvLayout:
        return cls(
            AttnKind.MLA,
            num_layers,
            1,
            kv_lora_rank + rope_dim,
            page_size,
            elem_bytes,
            page_layout,
            kv_lora_rank,
            rope_dim,
        )

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "elem_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"KvLayout.{name} must be a positive int, got {value!r}")
        if self.kind is AttnKind.MLA:
            if self.num_kv_heads != 1:
                raise LayoutError(f"MLA has one latent per token; num_kv_heads={self.num_kv_heads}")
            if self.kv_lora_rank < 1 or self.rope_dim < 0:
                raise LayoutError("MLA needs kv_lora_rank >= 1 and rope_dim >= 0")
            if self.head_dim != self.kv_lora_rank + self.rope_dim:
                raise LayoutError(
                    f"MLA head_dim {self.head_dim} != kv_lora_rank {self.kv_lora_rank}"
                    f" + rope_dim {self.rope_dim}"
                )
        elif self.kv_lora_rank or self.rope_dim:
            raise LayoutError("kv_lora_rank / rope_dim are MLA fields; leave them 0 for GQA")

    # -- parts and regions -------------------------------------------------------------

    @property
    def parts(self) -> tuple[KvPart, ...]:
        return (KvPart.LATENT,) if self.kind is AttnKind.MLA else (KvPart.K, KvPart.V)

    @property
    def num_regions(self) -> int:
        return self.num_layers * len(self.parts)

    def region_index(self, layer: int, part: KvPart) -> int:
        """Index of the (layer, part) region in a shard's region table: layer-major."""
        if not 0 <= layer < self.num_layers:
            raise LayoutError(f"layer {layer} outside [0, {self.num_layers})")
        try:
            return layer * len(self.parts) + self.parts.index(part)
        except ValueError:
            raise LayoutError(f"{part} is not a part of a {self.kind.value} layout") from None

    # -- sizes ---------------------------------------------------------------------------

    @property
    def row_bytes(self) -> int:
        """Bytes of one (token, head) vector."""
        return self.head_dim * self.elem_bytes

    def page_bytes(self, local_heads: int) -> int:
        """Bytes of one page of one region holding `local_heads` heads."""
        return self.page_size * local_heads * self.row_bytes

    def region_bytes(self, num_pages: int, local_heads: int) -> int:
        return num_pages * self.page_bytes(local_heads)

    def pool_shape(self, num_pages: int, local_heads: int) -> tuple[int, int, int, int]:
        """Element shape of one region."""
        if self.page_layout is PageLayout.NHD:
            return (num_pages, self.page_size, local_heads, self.head_dim)
        return (num_pages, local_heads, self.page_size, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers, parts and heads of the model (one replica)."""
        return self.num_layers * len(self.parts) * self.num_kv_heads * self.row_bytes

    # -- byte spans ---------------------------------------------------------------------

    def spans(
        self,
        page: int,
        local_heads: int,
        heads: tuple[int, int],
        tokens: tuple[int, int] | None = None,
    ) -> tuple[tuple[int, int], ...]:
        """Byte spans (offset, nbytes) inside a region of (page, local head range, token range).

        `heads` = [lo, hi) in the shard's local head numbering, `tokens` = [lo, hi) slots
        of the page (default: the whole page). Contiguous pieces are merged, so the length
        of the result is the number of writes such a block needs: HND gives one span per
        head (one in all when the token range is the whole page), NHD one per token slot
        (one in all when the head range is all local heads).
        """
        h_lo, h_hi = heads
        t_lo, t_hi = (0, self.page_size) if tokens is None else tokens
        if not (0 <= h_lo < h_hi <= local_heads and 0 <= t_lo < t_hi <= self.page_size):
            raise LayoutError(f"bad block heads={heads} tokens={tokens} of {local_heads} heads")
        if page < 0:
            raise LayoutError(f"page id {page} is negative")
        row, size, nh, nt = self.row_bytes, self.page_size, h_hi - h_lo, t_hi - t_lo
        if self.page_layout is PageLayout.HND:
            if nt == size:  # whole page: the heads follow each other
                return ((((page * local_heads + h_lo) * size) * row, nh * size * row),)
            return tuple(
                (((page * local_heads + h) * size + t_lo) * row, nt * row)
                for h in range(h_lo, h_hi)
            )
        if nh == local_heads:  # all heads: the token slots follow each other
            return ((((page * size + t_lo) * local_heads) * row, nt * nh * row),)
        return tuple(
            (((page * size + t) * local_heads + h_lo) * row, nh * row) for t in range(t_lo, t_hi)
        )

    # -- grouping and compatibility -------------------------------------------------------

    def layer_groups(self, group_size: int) -> tuple[range, ...]:
        """Consecutive layer ranges of `group_size` layers (the last may be shorter)."""
        if group_size < 1:
            raise LayoutError(f"layer group size must be >= 1, got {group_size}")
        return tuple(
            range(lo, min(lo + group_size, self.num_layers))
            for lo in range(0, self.num_layers, group_size)
        )

    def compat_hash(self) -> int:
        """64-bit hash of every field; equal on two servers iff their pools are compatible."""
        text = (
            f"{self.kind.value}|{self.num_layers}|{self.num_kv_heads}|{self.head_dim}|"
            f"{self.page_size}|{self.elem_bytes}|{self.page_layout.value}|"
            f"{self.kv_lora_rank}|{self.rope_dim}"
        )
        return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")
