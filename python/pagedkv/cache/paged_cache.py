"""PagedKVCache: per-layer K and V (or latent) block tensors on one device."""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence

import torch

from pagedkv import checks, ops
from pagedkv.cache.spec import KVCacheSpec
from pagedkv.errors import InvalidArgumentError

__all__ = ["PagedKVCache", "zeros_kv"]

_FP8_NAN_BITS = 0x7F  # float8_e4m3fn and float8_e5m2 both read 0x7F as NaN
# Codes the quantizer never writes (it stores -127..127, int4 -7..7): a poisoned int row reads
# as out of range, and its NaN scale makes it NaN.
_POISON_BITS = {torch.int8: -128, torch.uint8: 0x88, torch.float8_e4m3fn: _FP8_NAN_BITS,
                torch.float8_e5m2: _FP8_NAN_BITS}
_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _advise_huge_pages(t: torch.Tensor) -> bool:
    """Asks Linux to back the whole 2 MiB pages inside ``t``'s memory with transparent huge
    pages (the "madvise" THP mode; a no-op under "never"). Call it before the memory is first
    written. Returns whether the request was accepted."""
    if not sys.platform.startswith("linux"):
        return False
    begin = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if end <= begin:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(begin, end - begin, _MADV_HUGEPAGE) == 0


def zeros_kv(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu", *,
             pin_memory: bool = False) -> torch.Tensor:
    """A zeroed tensor for K/V blocks. On the CPU (unpinned) its memory is backed by huge pages
    where Linux allows it: attention reads blocks scattered over the whole cache, and with 4 KiB
    pages nearly every block costs a TLB miss (decode attention runs about 10% faster here)."""
    device = torch.device(device)
    t = torch.empty(tuple(shape), dtype=dtype, device=device,
                    pin_memory=pin_memory and device.type == "cpu")
    if device.type == "cpu" and not pin_memory:
        _advise_huge_pages(t)
    return t.zero_()


class PagedKVCache:
    """The K and V caches of every layer, ``[num_blocks, num_kv_heads, block_size, head_size]``.

    A spec with sliding windows is paged as the hybrid manager pages it: ``spec.page_layers``
    K and V tensors, one per slot of a page, and layer i reads and writes the tensor of its slot
    in its group (``spec.page_slot``). Block b belongs to one group at a time (the manager's
    tables), so in slot s it holds that group's layer s; the copies, swaps and fills of a block
    move its whole page. Without windows every layer has its own tensors, as before.

    Args:
        spec: shape and dtypes.
        num_blocks: blocks per layer (block 0 included, whether or not a manager reserves it).
        device: where the tensors live.
        combined_kv: store each layer as one ``[num_blocks, 2, num_kv_heads, block_size,
            head_size]`` tensor and expose K and V as views of it.
        pin_memory: pin CPU tensors (for asynchronous swaps with a GPU). Unpinned CPU caches
            are backed by huge pages where Linux allows it (see ``zeros_kv``).

    fp8 caches get ``k_scales``/``v_scales``: one float32 one-element tensor per layer, 1.0 by
    default; set them in place before writing.

    Token-scaled formats (``spec.token_scaled``: int8, int4, fp8 per token-head) get
    ``key_cache_scales``/``value_cache_scales``: per layer (or page slot) like K and V, float32
    ``[num_blocks, num_kv_heads, block_size]``, the scale of each row, written by
    ``reshape_and_cache`` (with ``combined_kv``, K/V views of one ``[num_blocks, 2,
    num_kv_heads, block_size]`` tensor). ``layer_args(i)`` gives a layer's caches and scales
    as the ops' keyword arguments; copies, swaps and fills move the scales with their rows.

    A latent spec (``spec.latent``, MLA) has one ``[num_blocks, block_size, head_size]`` tensor
    per layer, ``latent_caches`` (``latent(i)``), and no K and V lists; fp8 latents take
    ``k_scales`` as their scales. Copies, swaps and fills move whole rows as for K and V.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device | str = "cpu",
        *,
        combined_kv: bool = False,
        pin_memory: bool = False,
    ) -> None:
        num_blocks = checks.positive(num_blocks, "num_blocks", checks.INT32_MAX)
        self.spec, self.num_blocks, self.device = spec, num_blocks, torch.device(device)
        pin = pin_memory and self.device.type == "cpu"
        shape = (num_blocks, *spec.block_shape)
        self.key_caches: list[torch.Tensor] = []
        self.value_caches: list[torch.Tensor] = []
        self.latent_caches: list[torch.Tensor] = []
        self._slots = [spec.page_slot(layer)[1] for layer in range(spec.num_layers)]
        if spec.latent:
            if combined_kv:
                raise InvalidArgumentError("combined_kv must be False for a latent cache")
            self.latent_caches = [zeros_kv(shape, spec.kv_dtype, self.device, pin_memory=pin)
                                  for _ in range(spec.num_layers)]
        for _ in range(0 if spec.latent else spec.page_layers):
            if combined_kv:
                kv = zeros_kv((num_blocks, 2, *spec.block_shape), spec.kv_dtype, self.device,
                              pin_memory=pin)
                key, value = kv[:, 0], kv[:, 1]
            else:
                key, value = (zeros_kv(shape, spec.kv_dtype, self.device, pin_memory=pin)
                              for _ in range(2))
            self.key_caches.append(key)
            self.value_caches.append(value)
        self.key_cache_scales: list[torch.Tensor] = []
        self.value_cache_scales: list[torch.Tensor] = []
        for _ in range(spec.page_layers if spec.token_scaled else 0):
            key, value = self._row_scales(combined_kv, pin)
            self.key_cache_scales.append(key)
            self.value_cache_scales.append(value)
        self.k_scales = self._scales() if spec.is_fp8 else None
        self.v_scales = self._scales() if spec.is_fp8 and not spec.latent else None

    @classmethod
    def from_memory(
        cls, spec: KVCacheSpec, memory_bytes: int, device: torch.device | str = "cpu", **kwargs
    ) -> PagedKVCache:
        """A cache with as many blocks as fit in ``memory_bytes``."""
        return cls(spec, spec.num_blocks_for(memory_bytes), device, **kwargs)

    def _row_scales(self, combined: bool, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A page slot's K and V row scales, ``[num_blocks, num_kv_heads, block_size]``."""
        shape = (self.num_blocks, *self.spec.scale_shape)
        if combined:
            kv = zeros_kv((self.num_blocks, 2, *self.spec.scale_shape), torch.float32,
                          self.device, pin_memory=pin)
            return kv[:, 0], kv[:, 1]
        key, value = (zeros_kv(shape, torch.float32, self.device, pin_memory=pin)
                      for _ in range(2))
        return key, value

    def _scales(self) -> list[torch.Tensor]:
        return [torch.ones(1, dtype=torch.float32, device=self.device)
                for _ in range(self.spec.num_layers)]

    @property
    def nbytes(self) -> int:
        """Bytes held by the K and V tensors and their row scales (``num_blocks`` pages of
        ``spec.page_layers``)."""
        return self.num_blocks * self.spec.bytes_per_block

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every block tensor: K then V, or the latents; then the K and V row scales."""
        return [*self.key_caches, *self.value_caches, *self.latent_caches,
                *self.key_cache_scales, *self.value_cache_scales]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache)`` of one layer (its page slot's tensors)."""
        if self.spec.latent:
            raise InvalidArgumentError("a latent cache has no K and V: use latent(index)")
        slot = self._slots[index]
        return self.key_caches[slot], self.value_caches[slot]

    def layer_scales(self, index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(key_cache_scales, value_cache_scales)`` of one layer (its page slot's), ``[num_blocks,
        num_kv_heads, block_size]``; ``(None, None)`` unless the format is token-scaled."""
        self.layer(index)
        if not self.spec.token_scaled:
            return None, None
        slot = self._slots[index]
        return self.key_cache_scales[slot], self.value_cache_scales[slot]

    def layer_args(self, index: int) -> dict[str, torch.Tensor | None]:
        """One layer's cache as the keyword arguments ``reshape_and_cache`` and
        ``paged_attention`` share: ``key_cache``, ``value_cache``, ``k_scale``, ``v_scale``
        (per-tensor fp8), ``key_cache_scales``, ``value_cache_scales`` (token-scaled formats);
        the scales a format does not use are None."""
        key_cache, value_cache = self.layer(index)
        key_scales, value_scales = self.layer_scales(index)
        return {"key_cache": key_cache, "value_cache": value_cache,
                "k_scale": self.k_scales[index] if self.k_scales else None,
                "v_scale": self.v_scales[index] if self.v_scales else None,
                "key_cache_scales": key_scales, "value_cache_scales": value_scales}

    def latent(self, index: int) -> torch.Tensor:
        """The ``[num_blocks, block_size, head_size]`` latent cache of one layer (MLA)."""
        if not self.spec.latent:
            raise InvalidArgumentError("latent() needs a latent spec (KVCacheSpec.latent)")
        checks.count(index, "index", self.spec.num_layers - 1)
        return self.latent_caches[index]

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy block src to dst in every layer, K and V, with one ``pagedkv.ops.copy_blocks``
        (and one more for the row scales, as rows of one float32 each).
        A latent row travels as two halves, one in each of the op's lists (one head each), so
        that one launch copies every byte once."""
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.int64).to(self.device)
        if self.spec.latent:
            rows = [cache.unsqueeze(1) for cache in self.latent_caches]
            half = self.spec.head_size // 2
            ops.copy_blocks([r[..., :half] for r in rows], [r[..., half:] for r in rows],
                            mapping)
        else:
            ops.copy_blocks(self.key_caches, self.value_caches, mapping)
        if self.key_cache_scales:
            ops.copy_blocks([s.unsqueeze(-1) for s in self.key_cache_scales],
                            [s.unsqueeze(-1) for s in self.value_cache_scales], mapping)

    def fill_blocks(self, block_ids: Sequence[int]) -> None:
        """Fill blocks with NaN in every layer (fp8: the 0x7F NaN bit pattern), row scales
        included; int8 and int4 rows, which have no NaN, with codes the quantizer never writes
        (-128, two -8 nibbles), read as NaN through their NaN scales."""
        if not block_ids:
            return
        index = torch.tensor(block_ids, dtype=torch.int64).to(self.device)
        for cache in self.tensors:
            bits = _POISON_BITS.get(cache.dtype)
            if bits is None:
                cache.index_fill_(0, index, float("nan"))
            else:
                cache.view(torch.int8 if bits < 0 else torch.uint8).index_fill_(0, index, bits)

    def swap_to(self, dst: PagedKVCache, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy block s of this cache to block d of ``dst`` for each (s, d): all layers, K and V
        and their row scales, with ``pagedkv.ops.swap_blocks`` (device <-> CPU, or within one
        device)."""
        if not pairs:
            return
        mapping = torch.tensor(pairs, dtype=torch.int64)
        for src_layer, dst_layer in zip(self.tensors, dst.tensors, strict=True):
            ops.swap_blocks(src_layer, dst_layer, mapping)
