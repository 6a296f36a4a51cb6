"""MODEL argument -> a .nanoqwen file (which stores its own tokenizer).

A Hugging Face directory is packed on the fly into ``<cache>/models/<name>-<key16>/model.nanoqwen``; the
key hashes the checkpoint's content (config.json and every file the weights come from), the quant settings
and the format version, so an edited checkpoint or a new format repacks, and an unchanged one is reused.
Hashing multi-GB shards takes seconds, so each file's digest is memoized under (path, size, mtime)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from dataclasses import asdict
from pathlib import Path

from . import NanoqwenError, interrupt
from .config import Config, cache_root, default
from .nqfile import VERSION as FORMAT_VERSION
from .tokenizer import FILES as TOKENIZER_FILES
from .progress import Progress
from .safefile import FileError, kind, lookup

class ModelError(NanoqwenError):
    pass


def _file_digest(path: Path, memo: dict) -> str:
    st = path.stat()
    tag = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    if tag not in memo:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(16 << 20):
                h.update(chunk)
        memo[tag] = h.hexdigest()
    return memo[tag]


def content_key(hf_dir: Path, cfg: Config) -> str:
    memo_path = cache_root(cfg.codegen) / "models" / "digests.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    memo = memo if isinstance(memo, dict) else {}  # a corrupt memo is a miss, never a crash
    files = sorted(p for p in hf_dir.iterdir()  # the weights and every file the packed file stores
                   if p.is_file() and (p.suffix in (".safetensors", ".json") or p.name in TOKENIZER_FILES))
    h = hashlib.sha256(json.dumps([asdict(cfg.quant), FORMAT_VERSION], sort_keys=True).encode())
    for p in files:
        h.update(f"{p.name}\0{_file_digest(p, memo)}\0".encode())
    memo_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = memo_path.with_suffix(f".{os.getpid()}.tmp")  # concurrent runs each replace it whole
    tmp.write_text(json.dumps(memo))
    tmp.replace(memo_path)
    return h.hexdigest()


def resolve(model: str | Path, cfg: Config | None = None, log=print) -> Path:
    """The .nanoqwen file for MODEL: the file itself, or a HF directory's packed file (packed now if the
    cache has none). ``log`` gets one line when packing happens."""
    from .hf import HFCheckpoint
    from .pack import pack_hf, total_source_bytes

    cfg = cfg or default()
    model = Path(model)
    if is_file(model):
        return model
    if not os.path.lexists(model / "config.json"):
        raise ModelError(f"{model}: not a Hugging Face model directory (no config.json)")
    entry = cache_root(cfg.codegen) / "models" / f"{model.resolve().name}-{content_key(model, cfg)[:16]}"
    packed = entry / "model.nanoqwen"
    if not packed.exists():   # the packer writes a temporary and renames: an existing file is complete
        ckpt = HFCheckpoint(model)
        with new_entry(entry):
            log(f"packing {model} -> {packed}")
            bar = Progress(total_source_bytes(ckpt, cfg), "pack")
            pack_hf(ckpt, packed, progress=bar, cfg=cfg)
            bar.close()
    return packed


def is_file(model: str | Path) -> bool:
    """True for a regular file, False for a directory; anything else (missing, a symlink loop, a FIFO, a device,
    a denied lookup) is a ModelError saying what it is."""
    try:
        mode = lookup(model)
    except FileError as e:
        raise ModelError(f"{e} (MODEL is a .nanoqwen file or a HF directory)") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ModelError(f"{model}: not a regular file ({kind(mode)}); MODEL is a .nanoqwen file or a HF directory")
    return stat.S_ISREG(mode)


@contextlib.contextmanager
def new_entry(entry: Path):
    """Creates cache directory ``entry`` for a pack into it, and removes it again if the pack fails or is
    interrupted (when it made it and it is empty: the packer's temporary is already gone), so no empty entry
    stays behind."""
    made = not entry.exists()
    if made:
        interrupt.register(entry)  # a signal removes it too (after the packer's temporary inside it)
    entry.mkdir(parents=True, exist_ok=True)
    try:
        yield entry
    except BaseException:
        if made:
            with contextlib.suppress(OSError):
                entry.rmdir()
        raise
    finally:
        interrupt.unregister(entry)
