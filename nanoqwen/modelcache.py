"""MODEL argument -> a .nanoqwen file plus the directory holding its tokenizer.

A Hugging Face directory is packed on the fly into ``<cache>/models/<name>-<key16>/model.nanoqwen``; the
key hashes the checkpoint's content (config.json and every file the weights come from), the quant settings
and the format version, so an edited checkpoint or a new format repacks, and an unchanged one is reused.
The tokenizer and config files are copied beside the packed file, so a cache entry is self-contained.
Hashing multi-GB shards takes seconds, so each file's digest is memoized under (path, size, mtime)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from . import NanoqwenError
from .config import Config, default
from .nqfile import VERSION as FORMAT_VERSION
from .paths import cache_root
from .tokenizer import FILES as TOKENIZER_FILES
from .progress import Progress

SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


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


def resolve(model: str | Path, tokenizer: str | Path | None = None, cfg: Config | None = None,
            log=print) -> tuple[Path, Path | None]:
    """(.nanoqwen path, tokenizer dir or None). ``log`` gets one line when packing happens."""
    from .hf import HFCheckpoint
    from .pack import pack_hf, total_source_bytes

    cfg = cfg or default()
    if tokenizer and not (Path(tokenizer) / "tokenizer.json").is_file():
        raise ModelError(f"--tokenizer {tokenizer}: no tokenizer.json in that directory")
    model = Path(model)
    if model.is_file():
        tok_dir = Path(tokenizer) if tokenizer else model.parent
    elif model.is_dir():
        if not (model / "config.json").exists():
            raise ModelError(f"{model}: not a Hugging Face model directory (no config.json)")
        tok_dir = Path(tokenizer) if tokenizer else model
        entry = cache_root(cfg.codegen) / "models" / f"{model.resolve().name}-{content_key(model, cfg)[:16]}"
        packed = entry / "model.nanoqwen"
        if not packed.exists():
            ckpt = HFCheckpoint(model)
            entry.mkdir(parents=True, exist_ok=True)
            for name in SIDE_FILES:  # first: the packed file's atomic rename is what completes an entry
                if (model / name).exists():
                    shutil.copyfile(model / name, entry / name)
            log(f"packing {model} -> {packed}")
            bar = Progress(total_source_bytes(ckpt, cfg), "pack")
            pack_hf(ckpt, packed, progress=bar, cfg=cfg)
            bar.close()
        model = packed
    else:
        raise ModelError(f"{model}: no such file or directory (MODEL is a .nanoqwen file or a HF directory)")
    if not (tok_dir / "tokenizer.json").exists():
        tok_dir = None
    return model, tok_dir
