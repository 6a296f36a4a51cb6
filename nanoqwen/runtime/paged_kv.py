"""Paged KV cache (docs/architecture.md, "Paged KV cache").

Per layer one K pool and one V pool, fp16 ``[num_pages, kv_heads, page_size, head_dim]``: the page of one
KV head is one contiguous ``page_size * head_dim * 2``-byte block (4 KB at head_dim 128), the unit the
attention producer warp bulk-copies. One device page table ``int32 [table_len]`` (logical page -> physical
page) is shared by all layers and heads. A request holds its pages for ``prompt + max_new_tokens``
before decoding starts, so a captured graph never needs the host to extend the table; entries past the
reservation hold -1 (a kernel reading one faults loudly instead of reading another page).

``KVLayout``, ``PagePool`` and ``PageTable`` are pure host logic (testable without CUDA); ``PagedKVCache``
owns the device memory through ``driver.DeviceBuffer``. Which sequence holds which pages is the prefix
cache's business (runtime/prefix_cache.py): the device table shows the running request's pages."""

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
    def for_model(cls, dims: ModelDims, cfg: Config, max_tokens: int, pool_tokens: int | None = None) -> "KVLayout":
        """A layout holding ``max_tokens`` tokens of one sequence (capped at the model's max_positions) in
        a pool of ``pool_tokens`` (default: that one sequence; more keeps several for prefix reuse)."""
        if cfg.kv_cache.dtype != "fp16":
            raise KVCacheError(f"config kv_cache.dtype: only fp16 is implemented, got {cfg.kv_cache.dtype!r}")
        page = cfg.kv_cache.page_size
        tokens = min(int(max_tokens), dims.max_positions)
        if tokens <= 0:
            raise KVCacheError(f"KV cache: max_tokens must be positive, got {max_tokens}")
        pool = tokens if pool_tokens is None else int(pool_tokens)
        if pool < tokens:
            raise KVCacheError(f"KV cache: a pool of {pool} tokens cannot hold one sequence of {tokens}")
        return cls(layers=dims.layers, kv_heads=dims.kv_heads, head_dim=dims.head_dim, page_size=page,
                   num_pages=_ceil_div(pool, page), max_positions=dims.max_positions)

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

    def check_tokens(self, total_tokens: int) -> int:
        """The pages one sequence of ``total_tokens`` positions maps; KVCacheError when it cannot fit
        the model's positions or the page table."""
        if total_tokens <= 0:
            raise KVCacheError(f"KV cache: a request needs at least one token, got {total_tokens}")
        if total_tokens > self.max_positions:
            raise KVCacheError(f"KV cache: prompt + max_new_tokens = {total_tokens} exceeds the model's "
                               f"max_position_embeddings ({self.max_positions})")
        need = self.pages_for(total_tokens)
        if need > self.table_len:
            raise KVCacheError(f"KV cache: prompt + max_new_tokens = {total_tokens} tokens exceed the cache "
                               f"capacity of {self.capacity_tokens} tokens ({self.num_pages} pages of "
                               f"{self.page_size}); allocate a larger cache")
        return need

    def element_offset(self, physical_page: int, kv_head: int, slot: int) -> int:
        """fp16-element offset of (page, head, slot, 0) inside a pool: the kernels' address formula."""
        return ((physical_page * self.kv_heads + kv_head) * self.page_size + slot) * self.head_dim


class PagePool:
    """The free physical pages of one pool, as a stack: ``order`` is the initial order (default ascending,
    ``take`` hands out order[0] first); tests pass a shuffled one so that kernels must follow the table.
    The prefix cache (runtime/prefix_cache.py) and ``PageTable`` draw from it."""

    def __init__(self, num_pages: int, order=None):
        free = np.arange(num_pages) if order is None else np.asarray(order)
        if sorted(free.tolist()) != list(range(num_pages)):
            raise KVCacheError(f"page order must be a permutation of 0..{num_pages - 1}")
        self.num_pages = num_pages
        self._free = [int(p) for p in free[::-1]]

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        """``n`` free pages; raises KVCacheError, taking nothing, when fewer are free."""
        if n > len(self._free):
            raise KVCacheError(f"KV cache: {n} pages needed, {len(self._free)} of {self.num_pages} free")
        return [self._free.pop() for _ in range(n)]

    def give(self, pages) -> None:
        """Return pages (the ones given back first are handed out last)."""
        self._free.extend(int(p) for p in pages)


class PageTable:
    """One sequence's logical -> physical page map over a ``PagePool`` of the whole layout (the kernel
    tests' sequences; the runtime keeps its page lists in the prefix cache)."""

    def __init__(self, layout: KVLayout, order=None):
        self.layout = layout
        self.pool = PagePool(layout.num_pages, order)
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
        need = lay.check_tokens(total_tokens)
        if need - self.mapped_pages > self.pool.free:
            raise KVCacheError(f"KV cache: prompt + max_new_tokens = {total_tokens} tokens exceed the cache "
                               f"capacity of {lay.capacity_tokens} tokens ({lay.num_pages} pages of "
                               f"{lay.page_size}); allocate a larger cache")
        if need > self.mapped_pages:
            self.table[self.mapped_pages:need] = self.pool.take(need - self.mapped_pages)
        self.mapped_pages = max(self.mapped_pages, need)
        return self.table

    def release(self) -> None:
        """Return every page of the sequence to the pool."""
        self.pool.give(self.table[:self.mapped_pages])
        self.table[:] = UNMAPPED
        self.mapped_pages = 0

    def locate(self, pos: int) -> tuple[int, int]:
        """(physical page, slot) of position ``pos``: where rope_append writes it."""
        if not 0 <= pos < self.reserved_tokens:
            raise KVCacheError(f"KV cache: position {pos} is outside the reservation "
                               f"(0..{self.reserved_tokens - 1})")
        return int(self.table[pos // self.layout.page_size]), pos % self.layout.page_size


class PagedKVCache:
    """Device K/V pools of every layer and the device page table the kernels read. ``load(pages)`` points
    the table at one sequence's pages (its logical page i is ``pages[i]``), ordered on ``stream`` from a
    pinned mirror (``table``): call it between requests, never while a step that reads it may run."""

    def __init__(self, layout: KVLayout):
        from . import driver  # device code only; the layout and table logic above need no CUDA
        self.layout = layout
        self.k = [driver.DeviceBuffer(layout.pool_bytes) for _ in range(layout.layers)]
        self.v = [driver.DeviceBuffer(layout.pool_bytes) for _ in range(layout.layers)]
        self.page_table = driver.DeviceBuffer(layout.table_bytes)
        self._host = driver.HostBuffer(layout.table_bytes)
        self.table = self._host.array(np.int32)
        self.table[:] = UNMAPPED
        self.loaded = None   # the page list ``load`` put in the table
        self._driver = driver

    def load(self, pages: list[int], stream) -> None:
        if len(pages) > self.layout.table_len:
            raise KVCacheError(f"KV cache: {len(pages)} pages exceed the table of {self.layout.table_len}")
        self.table[:] = UNMAPPED
        self.table[:len(pages)] = pages
        self.loaded = pages   # the list object: a sequence's pages are loaded again only when another's were
        d = self._driver
        d.check(d.cu.cuMemcpyHtoDAsync(self.page_table.ptr, self._host.ptr, self.layout.table_bytes, stream.handle),
                "load page table")

    def locate(self, pos: int) -> tuple[int, int]:
        """(physical page, slot) of position ``pos`` in the loaded table."""
        page = int(self.table[pos // self.layout.page_size]) if 0 <= pos < self.layout.capacity_tokens else -1
        if page == UNMAPPED:
            raise KVCacheError(f"KV cache: position {pos} is on no loaded page")
        return page, pos % self.layout.page_size

    def k_ptr(self, layer: int) -> int:
        return self.k[layer].ptr

    def v_ptr(self, layer: int) -> int:
        return self.v[layer].ptr

    def free(self) -> None:
        for buf in (*self.k, *self.v, self.page_table, self._host):
            buf.free()
