"""Paged KV cache (docs/architecture.md, "Paged KV cache").

Per layer one K pool and one V pool, fp16 ``[num_pages, kv_heads, page_size, head_dim]``: the page of one
KV head is one contiguous ``page_size * head_dim * 2``-byte block (4 KB at head_dim 128), the unit the
attention producer warp bulk-copies. One device page table ``int32 [table_len]`` (logical page -> physical
page) is shared by all layers and heads. A request reserves its pages for ``prompt + max_new_tokens``
before decoding starts, so a captured graph never needs the host to extend the table; entries past the
reservation hold -1 (a kernel reading one faults loudly instead of reading another page).

``KVLayout`` and ``PageTable`` are pure host logic (testable without CUDA); ``PagedKVCache`` owns the
device memory through ``driver.DeviceBuffer``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import NanoqwenError
from ..config import Config
from ..dims import ModelDims

FP16_BYTES = 2
UNMAPPED = -1


class KVCacheError(NanoqwenError):
    pass


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int            # physical pages per pool
    max_positions: int        # the model's max_position_embeddings (RoPE tables cover 0..max_positions-1)

    def __post_init__(self):
        for name in ("layers", "kv_heads", "head_dim", "page_size", "num_pages", "max_positions"):
            if getattr(self, name) <= 0:
                raise KVCacheError(f"KV layout: {name} must be positive, got {getattr(self, name)}")
        if self.page_bytes % 16:
            raise KVCacheError(f"KV layout: a page ({self.page_bytes} B = kv_cache.page_size x head_dim x 2) "
                               f"must be a multiple of 16 bytes for cp.async.bulk")

    @classmethod
    def for_model(cls, dims: ModelDims, cfg: Config, max_tokens: int) -> "KVLayout":
        """A layout holding ``max_tokens`` tokens (capped at the model's max_positions)."""
        if cfg.kv_cache.dtype != "fp16":
            raise KVCacheError(f"config kv_cache.dtype: only fp16 is implemented, got {cfg.kv_cache.dtype!r}")
        page = cfg.kv_cache.page_size
        tokens = min(int(max_tokens), dims.max_positions)
        if tokens <= 0:
            raise KVCacheError(f"KV cache: max_tokens must be positive, got {max_tokens}")
        return cls(layers=dims.layers, kv_heads=dims.kv_heads, head_dim=dims.head_dim, page_size=page,
                   num_pages=_ceil_div(tokens, page), max_positions=dims.max_positions)

    @property
    def page_bytes(self) -> int:
        """One KV head's page: the bulk-copy unit."""
        return self.page_size * self.head_dim * FP16_BYTES

    @property
    def pool_shape(self) -> tuple[int, int, int, int]:
        return (self.num_pages, self.kv_heads, self.page_size, self.head_dim)

    @property
    def pool_bytes(self) -> int:
        """One K (or V) pool of one layer."""
        return self.num_pages * self.kv_heads * self.page_bytes

    @property
    def table_len(self) -> int:
        """Logical pages one sequence can have: bounded by the pool and by max_positions."""
        return min(self.num_pages, _ceil_div(self.max_positions, self.page_size))

    @property
    def table_bytes(self) -> int:
        return self.table_len * 4

    @property
    def total_bytes(self) -> int:
        """Device memory the cache needs: K and V pools of every layer plus the page table."""
        return 2 * self.layers * self.pool_bytes + self.table_bytes

    @property
    def capacity_tokens(self) -> int:
        return min(self.table_len * self.page_size, self.max_positions)

    def pages_for(self, tokens: int) -> int:
        return _ceil_div(tokens, self.page_size)

    def element_offset(self, physical_page: int, kv_head: int, slot: int) -> int:
        """fp16-element offset of (page, head, slot, 0) inside a pool: the kernels' address formula."""
        return ((physical_page * self.kv_heads + kv_head) * self.page_size + slot) * self.head_dim


class PageTable:
    """Host side of the page table: a free list of physical pages and the logical -> physical map of the
    one running sequence (batch 1). ``order`` is the free list's initial order (default ascending); tests
    pass a shuffled one so that kernels must follow the table."""

    def __init__(self, layout: KVLayout, order=None):
        self.layout = layout
        free = np.arange(layout.num_pages) if order is None else np.asarray(order)
        if sorted(free.tolist()) != list(range(layout.num_pages)):
            raise KVCacheError(f"PageTable order must be a permutation of 0..{layout.num_pages - 1}")
        self._free = [int(p) for p in free[::-1]]   # a stack: pop() hands out order[0] first
        self.table = np.full(layout.table_len, UNMAPPED, dtype=np.int32)
        self.mapped_pages = 0

    @property
    def reserved_tokens(self) -> int:
        return min(self.mapped_pages * self.layout.page_size, self.layout.max_positions)

    def reserve(self, total_tokens: int) -> np.ndarray:
        """Map pages for positions 0..total_tokens-1 (prompt + max_new_tokens) and return the table.
        Growing an existing reservation keeps its pages; raises KVCacheError, changing nothing, when the
        request does not fit the model's positions or the cache."""
        lay = self.layout
        if total_tokens <= 0:
            raise KVCacheError(f"KV cache: a request needs at least one token, got {total_tokens}")
        if total_tokens > lay.max_positions:
            raise KVCacheError(f"KV cache: prompt + max_new_tokens = {total_tokens} exceeds the model's "
                               f"max_position_embeddings ({lay.max_positions})")
        need = lay.pages_for(total_tokens)
        if need > lay.table_len or need - self.mapped_pages > len(self._free):
            raise KVCacheError(f"KV cache: prompt + max_new_tokens = {total_tokens} tokens exceed the cache "
                               f"capacity of {lay.capacity_tokens} tokens ({lay.num_pages} pages of "
                               f"{lay.page_size}); allocate a larger cache")
        for logical in range(self.mapped_pages, need):
            self.table[logical] = self._free.pop()
        self.mapped_pages = max(self.mapped_pages, need)
        return self.table

    def release(self) -> None:
        """Return every page of the sequence to the free list (first-freed pages are reused first)."""
        for logical in range(self.mapped_pages):
            self._free.append(int(self.table[logical]))
        self.table[:] = UNMAPPED
        self.mapped_pages = 0

    def locate(self, pos: int) -> tuple[int, int]:
        """(physical page, slot) of position ``pos``: where rope_append writes it."""
        if not 0 <= pos < self.reserved_tokens:
            raise KVCacheError(f"KV cache: position {pos} is outside the reservation "
                               f"(0..{self.reserved_tokens - 1})")
        return int(self.table[pos // self.layout.page_size]), pos % self.layout.page_size


class PagedKVCache:
    """Device K/V pools of every layer and the device page table (a mirror of ``pages.table``).
    ``reserve``/``release`` copy the table synchronously: call them while no decode graph is running."""

    def __init__(self, layout: KVLayout, order=None):
        from . import driver  # device code only; the layout and table logic above need no CUDA
        self._driver = driver
        self.layout = layout
        self.pages = PageTable(layout, order)
        self.k = [driver.DeviceBuffer(layout.pool_bytes) for _ in range(layout.layers)]
        self.v = [driver.DeviceBuffer(layout.pool_bytes) for _ in range(layout.layers)]
        self.page_table = driver.DeviceBuffer(layout.table_bytes)
        self._sync_table()

    def _sync_table(self) -> None:
        self.page_table.upload(self.pages.table)

    def reserve(self, total_tokens: int) -> None:
        self.pages.reserve(total_tokens)
        self._sync_table()

    def release(self) -> None:
        self.pages.release()
        self._sync_table()

    def k_ptr(self, layer: int) -> int:
        return self.k[layer].ptr

    def v_ptr(self, layer: int) -> int:
        return self.v[layer].ptr

    def free(self) -> None:
        for buf in (*self.k, *self.v, self.page_table):
            buf.free()
