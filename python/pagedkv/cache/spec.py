"""KVCacheSpec: the shape and dtypes of a model's KV cache, and the sizes that follow from them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedkv import checks
from pagedkv.cache.formats import CacheFormat, cache_format
from pagedkv.errors import InvalidArgumentError

__all__ = ["CACHE_DTYPES", "FP8_DTYPES", "KVCacheGroup", "KVCacheSpec", "check_window",
           "kv_cache_groups"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, *FP8_DTYPES)
"""The torch dtypes of the unscaled and per-tensor fp8 formats (every format:
``pagedkv.cache.formats.FORMATS``)."""


def check_window(value: object, name: str) -> int | None:
    """A sliding window: None (full attention) or a positive number of tokens."""
    return None if value is None else checks.positive(value, name, checks.INT32_MAX)


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers that share block tables: one attention kind (``window`` None: full attention,
    else a sliding window of that many tokens) and the layer indices of the group."""

    window: int | None
    layers: tuple[int, ...]

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a decoding sequence of ``num_tokens`` tokens holds in this group (the manager's
        count once its last token is appended): all under full attention; under a window, from
        the block of token ``num_tokens - window`` (the oldest key its last query attends) on."""
        last = -(-num_tokens // block_size)
        if self.window is None or num_tokens <= self.window:
            return last
        return last - (num_tokens - self.window) // block_size


def kv_cache_groups(windows: Sequence[int | None]) -> tuple[int, tuple[KVCacheGroup, ...]]:
    """Layers grouped by attention kind as the hybrid manager pages them: ``(layers per
    group, groups)``. Every group has the same number of layers, so that every group's block
    (a page of its layers) has the same bytes and one pool serves them all. The group size is
    the fewest layers of one kind (the "1" of an n:1 interleave), or the most when the kinds are
    within 25% of each other (fewer padded slots); a kind's layers are cut into groups of that
    size, its last group maybe short (its page keeps the unused slots). One kind: one group."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    counts = [len(layers) for layers in kinds.values()]
    size = max(counts) if max(counts) < 1.25 * min(counts) else min(counts)
    groups = tuple(KVCacheGroup(window, tuple(layers[i:i + size]))
                   for window, layers in kinds.items() for i in range(0, len(layers), size))
    return size, groups


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape and dtypes of a paged KV cache.

    Per layer, K and V are each ``[num_blocks, num_kv_heads, block_size, head_size]``; a latent
    (MLA) cache has one tensor per layer instead, ``[num_blocks, block_size, head_size]``.

    Args:
        num_layers: attention layers that own a KV cache.
        num_kv_heads: key/value heads per layer (fewer than query heads under GQA/MQA).
        head_size: elements per head.
        block_size: tokens per block.
        dtype: the model's activation dtype (what ``reshape_and_cache`` receives).
        cache_dtype: how the cache stores rows (``pagedkv.cache.formats``): a torch dtype
            (``torch.float8_*``: fp8 with float32 ``k_scale``/``v_scale`` per layer), or a
            format name or ``CacheFormat``: ``"int8"``, ``"int4"``,
            ``"fp8_e4m3_per_token_head"``... with a float32 scale per (token, head) in
            side tensors (``PagedKVCache.layer_args``). ``None`` means the same as ``dtype``.
            A name of a plain or per-tensor format is kept as its torch dtype, a token-scaled
            one as its canonical name.
        sliding_windows: per layer, None (full attention) or the layer's sliding window in
            tokens; None (the default) means every layer attends in full. Layers fall into
            ``kv_cache_groups``; a pool block is one page of ``page_layers`` layers
            (``bytes_per_block``), which a group's block tables use for its own layers.
        latent: a multi-head latent attention (MLA) cache: one row of ``head_size`` elements per
            token and layer (DeepSeek's ``kv_lora_rank + rope_dim``, 512 + 64), shared by every
            query head, in place of K and V. ``num_kv_heads`` must be 1 and there are no
            sliding windows.

    Example:
        >>> spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
        >>> spec.bytes_per_token  # 2 (K and V) x 32 x 8 x 128 x 2 bytes
        131072
        >>> KVCacheSpec(61, 1, 576, 64, torch.bfloat16, latent=True).bytes_per_token  # 61 x 576 x 2
        70272
        >>> KVCacheSpec(32, 8, 128, 16, torch.bfloat16, "int8").bytes_per_token  # 2x32x8x(128+4)
        67584
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype = torch.float16
    cache_dtype: torch.dtype | str | CacheFormat | None = None
    sliding_windows: tuple[int | None, ...] | None = None
    latent: bool = False
    format: CacheFormat = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            value = checks.positive(getattr(self, name), f"KVCacheSpec.{name}", checks.INT32_MAX)
            object.__setattr__(self, name, value)  # a numpy or 0-d tensor int as a Python int
        if not isinstance(self.latent, bool):
            raise InvalidArgumentError(
                f"KVCacheSpec.latent must be a bool, got {type(self.latent).__name__}")
        if self.latent and self.num_kv_heads != 1:
            raise InvalidArgumentError(
                f"KVCacheSpec.num_kv_heads must be 1 for a latent cache (one row per token, "
                f"shared by every head), got {self.num_kv_heads}")
        if self.latent and self.head_size % 2:
            raise InvalidArgumentError(
                f"KVCacheSpec.head_size must be even for a latent cache (its rows are copied "
                f"as two halves), got {self.head_size}")
        if self.latent and self.sliding_windows is not None:
            raise InvalidArgumentError(
                "KVCacheSpec.sliding_windows must be None for a latent cache")
        if self.sliding_windows is not None:
            windows = tuple(check_window(w, f"KVCacheSpec.sliding_windows[{i}]")
                            for i, w in enumerate(self.sliding_windows))
            if len(windows) != self.num_layers:
                raise InvalidArgumentError(
                    f"KVCacheSpec.sliding_windows must hold one entry per layer "
                    f"({self.num_layers}), got {len(windows)}")
            object.__setattr__(self, "sliding_windows", windows)
        self._set_format()

    def _set_format(self) -> None:
        given = self.cache_dtype
        fmt = cache_format(self.dtype if given is None else given,
                           "KVCacheSpec.dtype" if given is None else "KVCacheSpec.cache_dtype")
        if given is None and fmt.token_scaled:
            raise InvalidArgumentError(
                f"KVCacheSpec.dtype must be the model's float dtype, got {self.dtype}; give a "
                f"quantized format as cache_dtype")
        if fmt.token_scaled and self.latent:
            raise InvalidArgumentError(
                f"KVCacheSpec.cache_dtype {fmt.name} has a scale per (token, head), which the "
                f"latent (MLA) ops do not read; a latent cache takes a float or fp8 dtype")
        fmt.stored_width(self.head_size)  # int4 needs an even head_size
        if given is not None:
            object.__setattr__(self, "cache_dtype", fmt.name if fmt.token_scaled else fmt.storage)
        object.__setattr__(self, "format", fmt)

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype of the cache tensors (``format.storage``: int4 is uint8)."""
        return self.format.storage

    @property
    def is_fp8(self) -> bool:
        """True when the cache stores fp8 with one k/v scale per layer (``k_scales``)."""
        return self.format.tensor_scaled

    @property
    def token_scaled(self) -> bool:
        """True when each row has its own scale (int8, int4, fp8 per token-head)."""
        return self.format.token_scaled

    @property
    def element_size(self) -> int:
        """Bytes per element of the cache tensors (int4: 1, holding two elements)."""
        return torch.empty((), dtype=self.kv_dtype).element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (a token of one head, or one latent row), its scale included."""
        return self.format.row_bytes(self.head_size)

    @property
    def block_shape(self) -> tuple[int, ...]:
        """``(num_kv_heads, block_size, width)``: one block of one layer's K (or V), ``width``
        the stored row (``head_size``; int4: ``head_size / 2``); ``(block_size, head_size)``
        for a latent cache."""
        if self.latent:
            return (self.block_size, self.head_size)
        return (self.num_kv_heads, self.block_size, self.format.stored_width(self.head_size))

    @property
    def scale_shape(self) -> tuple[int, int] | None:
        """``(num_kv_heads, block_size)``: one block of one layer's K (or V) row scales;
        None unless the format is token-scaled."""
        return (self.num_kv_heads, self.block_size) if self.token_scaled else None

    @property
    def tensors_per_layer(self) -> int:
        """Cache tensors of a layer: K and V (2), or the latent (1)."""
        return 1 if self.latent else 2

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V (or the latent) for one token over all layers (every layer
        attending in full), the rows' scales included."""
        return self.tensors_per_layer * self.num_layers * self.num_kv_heads * self.row_bytes

    @property
    def kv_cache_groups(self) -> tuple[KVCacheGroup, ...]:
        """The layers grouped by attention kind (``kv_cache_groups``); one group of all layers
        without sliding windows."""
        return kv_cache_groups(self.sliding_windows or (None,) * self.num_layers)[1]

    @property
    def group_windows(self) -> tuple[int | None, ...]:
        """Each group's window (None: full attention): ``BlockManager(groups=...)``."""
        return tuple(group.window for group in self.kv_cache_groups)

    @property
    def page_layers(self) -> int:
        """Layers in one page (a pool block): the layers of a group; all without windows."""
        return kv_cache_groups(self.sliding_windows or (None,) * self.num_layers)[0]

    def page_slot(self, layer: int) -> tuple[int, int]:
        """``(group, slot)`` of a layer: its group's index and its place in the group's page."""
        for index, group in enumerate(self.kv_cache_groups):
            if layer in group.layers:
                return index, group.layers.index(layer)
        raise InvalidArgumentError(f"layer must be in [0, {self.num_layers}), got {layer!r}")

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one pool block, K and V (or the latent) and their row scales: one page of
        ``page_layers`` layers (all layers without sliding windows)."""
        return (self.tensors_per_layer * self.page_layers * self.num_kv_heads * self.row_bytes
                * self.block_size)

    def hybrid_kv_bytes(self, seq_len: int, batch: int = 1) -> int:
        """Bytes the hybrid manager holds for ``batch`` sequences of ``seq_len`` tokens while
        they decode: every group's blocks (``KVCacheGroup.blocks_held``), one page each."""
        blocks = sum(g.blocks_held(seq_len, self.block_size) for g in self.kv_cache_groups)
        return blocks * self.bytes_per_block * batch

    def kv_cache_bytes(self, seq_len: int, batch: int = 1) -> int:
        """Contiguous cache bytes: 2 (K and V; 1 latent) x layers x kv_heads x seq_len x batch
        x bytes per row (``row_bytes``)."""
        return self.bytes_per_token * seq_len * batch

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens of one sequence."""
        return -(-num_tokens // self.block_size)

    def num_blocks_for(self, memory_bytes: int) -> int:
        """How many whole pool blocks (``bytes_per_block``) fit in ``memory_bytes``."""
        return max(0, int(memory_bytes) // self.bytes_per_block)
