"""Work of a request that grows with its size (tokenizing, detokenizing) runs on a small thread pool, so
the event loop keeps answering /health, /metrics, queue refusals and running streams meanwhile. The
tokenizer's batch calls release the GIL (nanoqwen.tokenizer), so the loop is not starved either; each
request's text is bounded by ``limits.check_text`` before it gets here."""

from __future__ import annotations

import asyncio
import functools
import json
from concurrent.futures import ThreadPoolExecutor

# two threads: a long tokenization does not hold up a short one, and the engine thread keeps a core
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="nanoqwen-tokenize")


async def run(fn, *args):
    """``fn(*args)`` on the pool; its exception (an APIError, say) is raised here."""
    return await asyncio.get_running_loop().run_in_executor(_POOL, functools.partial(fn, *args))


def json_list(items: list, slice_len: int = 4096) -> str:
    """``json.dumps(items)`` a slice at a time: the C encoder holds the GIL for a whole call, and a
    megabytes-long list in one call would stall the event loop."""
    parts = (json.dumps(items[i:i + slice_len], ensure_ascii=False)[1:-1] for i in range(0, len(items), slice_len))
    return "[" + ",".join(parts) + "]"
