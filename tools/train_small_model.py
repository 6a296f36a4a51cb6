"""Train the small Qwen2-architecture test model (tests/data/small-py) on the Python standard library's
source with torch, for code completion, fill-in-the-middle and a little chat, and write it as a full HF
directory (bf16 safetensors, tokenizer with Qwen2.5-Coder's special tokens, ChatML template).

Why: random weights give nearly tied logits, so a greedy token match between the GPU runtime and the
numpy reference would measure noise; a trained model has realistic top-1 margins, and the README's demo
and the serving work need a model that writes plausible Python and can fill a middle.

Two steps, so that the GPU machine only trains:
    prepare: corpus -> byte-level BPE (vocab 2048, the special tokens at ids 0..8) -> token arrays + chat
             examples in DATA/ (CPU, deterministic for a fixed corpus);
    train:   DATA/ -> model in OUT/ (CUDA if present, bf16 autocast, AdamW, warmup + cosine), with the run's
             facts and log in OUT/training.json.

Corpus: every .py file of one CPython's Lib/ (the test suites included, idlelib and site-packages not);
every 20th file of Lib/ without the test suites (sorted order) is held out for the validation loss.
training.json records the corpus's Python version, file count, bytes and sha256.

Training rows (seq + 1 tokens each) are drawn with probabilities --mix plain:fim:chat:edit:
    plain: a window of the file stream (files joined by <|endoftext|>);
    fim:   fill-in-the-middle examples packed into the row, in prefix-suffix-middle order
           <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>{middle}<|endoftext|>, cut from one
           file; half split at line starts (middle: 1-10 whole lines), half at any token (1-128 tokens);
    chat:  ChatML conversations (the tokenizer's own template): a request naming a stdlib function with
           its docstring's summary, answered by the function's source in a ```python block;
    edit:  the code-edit workload's format (nanoqwen/bench/edits.py): a function, an instruction to write it
           again with one change, the changed copy, <|endoftext|>; from the files of the chat examples but
           textwrap.py, the workload's source.
Then each token that ends in a newline (`):\n`) is split with probability --split-newlines (`):` `\n`):
without that, a prompt that stops before its newline ("def fibonacci(n):") ends in a token the model
never saw followed by anything but text on the same line.

Shape (head_dim 128 and GQA 7:1 like the 7B; hidden 256; untied lm_head; vocab 2048): --layers and
--intermediate; 3 x 512 (3.81M parameters, 7.6 MB) edged out 4 x 256 (3.94M) in the same run, val loss
1.557 vs 1.563 nats/token. The committed model (tests/data/small-py/training.json holds both runs' facts
and logs): on one H200, both shapes side by side for 210 s each, without newline splits (the first run
predates the option: --split-newlines 0 repeats it), then the 3 x 512 continued on a 2-core CPU with them:
    python tools/train_small_model.py prepare --out /tmp/model-data          # CPython 3.11.7's Lib/
    python tools/train_small_model.py train --data /tmp/model-data --budget-s 210 --split-newlines 0 \
        --out /tmp/gpu-out/a3                                                 # GPU: val loss 1.557
    python tools/train_small_model.py train --init /tmp/gpu-out/a3 --data /tmp/model-data --lr 6e-4 \
        --warmup 10 --batch 8 --seq 512 --budget-s 840 --eval-every 100 --eval-batches 8 \
        --log-every 10 --out tests/data/small-py                             # CPU: 523 steps
(its tokenizer and corpus the ones `prepare` makes today: the edit examples came later). The code-edit
workload's model, tests/data/small-py-edit (bench/edits.EDIT_MODEL), is small-py taught the edit format too,
on the same 2-core CPU (its training.json holds every run's facts and logs):
    python tools/train_small_model.py train --init tests/data/small-py --data /tmp/model-data --lr 6e-4 \
        --warmup 10 --batch 4 --seq 1024 --mix 0.4 0.3 0.05 0.25 --budget-s 1080 --eval-every 100 \
        --eval-batches 8 --log-every 10 --out /tmp/small-py-edit                # periodic edit copy loss 0.236 -> 0.067
    python tools/train_small_model.py train --init /tmp/small-py-edit --data /tmp/model-data --lr 4e-4 \
        --warmup 10 --batch 4 --seq 1024 --mix 0.35 0.25 0.05 0.35 --budget-s 1000 --eval-every 100 \
        --eval-batches 8 --log-every 10 --out tests/data/small-py-edit          # 0.046 at step 700 of 734
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import platform
import re
import sys
import sysconfig
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np

from nanoqwen import testmodels
from nanoqwen.dims import ModelDims

SPECIAL = {t: i for i, t in enumerate(testmodels.SPECIAL_TOKENS)}
EOT, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX = (SPECIAL[t] for t in ("<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>",
                                                                "<|fim_suffix|>"))
# A line unit is a line and the blank lines after it. Qwen2's pre-tokenizer never merges across the start
# of a non-blank line, so encoding the units one by one gives the file's own tokens, with line starts known.
LINE_UNITS = re.compile(r"(?<=\n)(?=[^\r\n])")
CHAT_REQUESTS = ("Write a Python function `{name}({args})`: {summary}",
                 "write a python function {name} that does this: {summary}",
                 "{summary} Write it in Python as `{name}`.")


def dims(vocab: int, layers: int, intermediate: int) -> ModelDims:
    return ModelDims(hidden=256, layers=layers, heads=7, kv_heads=1, head_dim=128, intermediate=intermediate,
                     vocab=vocab, max_positions=4096, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False)


# ---------------------------------------------------------------- prepare (CPU)

def encode_files(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens: files joined and each ended by <|endoftext|>, file start offsets, line-unit start offsets)."""
    units, owner = [], []
    for f, text in enumerate(texts):
        parts = LINE_UNITS.split(text)
        units += parts
        owner += [f] * len(parts)
    tokens, file_starts, line_starts, pos, prev = [], [], [], 0, -1
    for f, enc in zip(owner, tok.encode_batch(units, add_special_tokens=False)):
        if f != prev:
            if prev >= 0:
                tokens.append([EOT])
                pos += 1
            file_starts.append(pos)
            prev = f
        line_starts.append(pos)
        tokens.append(enc.ids)
        pos += len(enc.ids)
    tokens.append([EOT])
    return (np.concatenate([np.asarray(t, np.uint16) for t in tokens]), np.asarray(file_starts, np.int64),
            np.asarray(line_starts, np.int64))


def chat_examples(texts: list[str], chat_tok) -> list[list[int]]:
    """One conversation per documented public function or method (source <= 1500 characters)."""
    out = []
    for text in texts:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes in old sources
            try:
                tree = ast.parse(text)
            except (SyntaxError, ValueError):
                continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            src = ast.get_source_segment(text, node, padded=True)
            if not doc or not src or len(src) > 1500:
                continue
            summary = doc.strip().split("\n\n")[0].replace("\n", " ")
            args = ", ".join(a.arg for a in node.args.args if a.arg not in ("self", "cls"))
            request = CHAT_REQUESTS[len(out) % len(CHAT_REQUESTS)].format(name=node.name, args=args,
                                                                          summary=summary)
            messages = [{"role": "user", "content": request},
                        {"role": "assistant", "content": f"```python\n{textwrap.dedent(src).rstrip()}\n```"}]
            out.append(chat_tok.encode_chat(messages, add_generation_prompt=False) + [EOT])
    return out


def edit_examples(texts: list[str], tok) -> tuple[list[list[int]], list[int]]:
    """The code-edit workload's examples (nanoqwen/bench/edits.py: a function, an instruction to write it
    again with one change, the changed copy), every change of every function of at most 1200 characters,
    and where each one's changed copy starts (its first token that the prompt alone does not end with)."""
    from nanoqwen.bench.edits import KINDS, edit, functions
    from nanoqwen.runtime.token_trie import common_prefix
    out, starts = [], []
    for text in texts:
        for fn in functions(text, max_chars=1200):
            for kind in KINDS:
                prompt, answer = edit(*fn, kind)
                ids, head = tok.encode(prompt + answer), tok.encode(prompt)
                out.append(ids + [EOT])
                starts.append(common_prefix(ids, head))
    return out, starts


def prepare(args):
    from nanoqwen.tokenizer import Tokenizer

    t0 = time.time()
    root = Path(args.stdlib or sysconfig.get_paths()["stdlib"])
    paths = testmodels.stdlib_sources(root, tests=True)
    val_set = set(testmodels.stdlib_sources(root)[::20])
    train_p = [p for p in paths if p not in val_set]
    val_p = sorted(val_set)
    texts = testmodels.read_sources(paths)
    digest = hashlib.sha256()
    for p, t in zip(paths, texts):
        digest.update(str(p.relative_to(root)).encode() + b"\0" + t.encode() + b"\0")
    tok = testmodels.train_tokenizer(texts, args.vocab)
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    (args.out / "tokenizer_config.json").write_text(json.dumps(testmodels.tokenizer_config(), indent=2) + "\n")
    by_path = dict(zip(paths, texts))
    train = encode_files(tok, [by_path[p] for p in train_p])
    val = encode_files(tok, [by_path[p] for p in val_p])
    for p, s in zip(val_p, val[1]):
        whole = tok.encode(by_path[p], add_special_tokens=False).ids
        assert whole == val[0][s:s + len(whole)].tolist(), f"{p}: line-unit encoding differs from the file's"
    ours = Tokenizer(args.out)   # the tokenizer just written, as the runtime loads it

    def library(files) -> list[Path]:   # the standard library's own code, without its test suites
        return [p for p in files if "test" not in p.relative_to(root).parts]
    chats = chat_examples([by_path[p] for p in library(train_p)], ours)
    chat = np.concatenate([np.asarray(c, np.uint16) for c in chats])

    # the edit workload's source (bench/edits.EDIT_SOURCE, CPython's textwrap.py) teaches no edits
    def edit_tokens(files) -> tuple[list, np.ndarray, np.ndarray]:
        examples, starts = edit_examples([by_path[p] for p in library(files) if p.name != "textwrap.py"], ours)
        return examples, np.concatenate([np.asarray(e, np.uint16) for e in examples]), np.asarray(starts, np.int64)
    edits, edit, _ = edit_tokens(train_p)
    _, val_edit, val_edit_answers = edit_tokens(val_p)
    np.savez(args.out / "corpus.npz", train=train[0], train_files=train[1], train_lines=train[2],
             val=val[0], val_files=val[1], val_lines=val[2], chat=chat, edit=edit,
             val_edit=val_edit, val_edit_answers=val_edit_answers)
    facts = {"python": args.python or platform.python_version(), "stdlib": str(root), "files": len(paths),
             "bytes": sum(len(t.encode()) for t in texts), "sha256": digest.hexdigest(),
             "train_files": len(train_p), "val_files": len(val_p), "train_tokens": int(len(train[0])),
             "val_tokens": int(len(val[0])), "val_bytes": sum(len(by_path[p].encode()) for p in val_p),
             "chat_examples": len(chats), "chat_tokens": int(len(chat)), "edit_examples": len(edits),
             "edit_tokens": int(len(edit)), "val_edit_tokens": int(len(val_edit)), "vocab": tok.get_vocab_size()}
    (args.out / "corpus.json").write_text(json.dumps(facts, indent=2) + "\n")
    print(json.dumps(facts), f"({time.time() - t0:.0f}s)")


# ---------------------------------------------------------------- train (GPU)

class Rows:
    """Training or evaluation rows of seq + 1 tokens drawn from the prepared corpus (see the module doc)."""

    def __init__(self, data: dict, split: str, seq: int, rng: np.random.Generator, splits=None, split_p=0.0):
        self.tokens, self.files, self.lines = data[split], data[split + "_files"], data[split + "_lines"]
        self.file_ends = np.append(self.files[1:] - 1, len(self.tokens) - 1)  # each file's <|endoftext|>
        self.chat, self.edit = data["chat"], data["val_edit" if split == "val" else "edit"]
        self.chat_starts = np.concatenate([[0], np.flatnonzero(self.chat == EOT) + 1])
        self.edit_starts = np.concatenate([[0], np.flatnonzero(self.edit == EOT) + 1])
        self.seq, self.rng = seq, rng
        self.splits, self.split_p = splits or {}, split_p
        self.split_ids = np.fromiter(self.splits, np.int64)

    def plain(self) -> np.ndarray:
        s = self.rng.integers(0, len(self.tokens) - self.seq - 1)
        return self.tokens[s:s + self.seq + 1].astype(np.int64)

    def fim_example(self) -> tuple[np.ndarray, int]:
        """One FIM example from a window of one file starting at a line, and the index where its middle
        starts."""
        rng, t, lines = self.rng, self.tokens, self.lines
        while True:
            p = rng.integers(len(t))
            start = lines[np.searchsorted(lines, p, "right") - 1]
            f = np.searchsorted(self.files, p, "right") - 1
            end = min(self.file_ends[f], start + rng.integers(64, self.seq * 3 // 4))
            inner = lines[np.searchsorted(lines, start, "right"):np.searchsorted(lines, end)]
            if rng.random() < 0.5 and len(inner) >= 2:  # whole lines: where a user's cursor usually is
                i = rng.integers(len(inner) - 1)
                a, b = inner[i], inner[min(i + rng.integers(1, 11), len(inner) - 1)]
            elif end - start >= 8:
                a = rng.integers(start + 1, end - 1)
                b = min(end, a + rng.integers(1, 129))
            else:
                continue
            head = [FIM_PREFIX, *t[start:a], FIM_SUFFIX, *t[b:end], FIM_MIDDLE]
            return np.asarray(head + [*t[a:b], EOT], np.int64), len(head)

    def chat_example(self) -> np.ndarray:
        i = self.rng.integers(len(self.chat_starts) - 1)
        return self.chat[self.chat_starts[i]:self.chat_starts[i + 1]].astype(np.int64)

    def edit_example(self) -> np.ndarray:
        i = self.rng.integers(len(self.edit_starts) - 1)
        return self.edit[self.edit_starts[i]:self.edit_starts[i + 1]].astype(np.int64)

    def packed(self, example) -> np.ndarray:
        parts, n = [], 0
        while n < self.seq + 1:
            parts.append(example())
            n += len(parts[-1])
        return np.concatenate(parts)[:self.seq + 1]

    def row(self, mix) -> np.ndarray:
        kind = self.rng.choice(len(mix), p=mix)
        row = self.plain() if kind == 0 else self.packed(lambda: self.fim_example()[0]) if kind == 1 \
            else self.packed(self.chat_example) if kind == 2 else self.packed(self.edit_example)
        return self.split_newlines(row) if self.split_p else row

    def split_newlines(self, row: np.ndarray) -> np.ndarray:
        """Split some tokens that end in a newline (`):\n` -> `):` `\n`), as a prompt that stops before its
        newline is encoded, so that the model continues such a prompt as it would the whole token."""
        hits = np.flatnonzero(np.isin(row, self.split_ids) & (self.rng.random(len(row)) < self.split_p))
        parts, prev = [], 0
        for h in hits:
            parts += [row[prev:h], self.splits[int(row[h])]]
            prev = h + 1
        return np.concatenate(parts + [row[prev:]])[:self.seq + 1]


def newline_splits(tokenizer_path: Path) -> dict[int, np.ndarray]:
    """token id -> the ids of its text without its trailing newlines, then of the newlines, for every token
    made of non-space characters and newlines."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    out = {}
    for i in range(len(testmodels.SPECIAL_TOKENS), tok.get_vocab_size()):
        if m := re.fullmatch(r"(\S+)(\n+)", tok.decode([i])):
            out[i] = np.asarray(tok.encode(m[1]).ids + tok.encode(m[2]).ids, np.int64)
    return out


def batches(data, seq, batch, mix, seed, splits, split_p, workers):
    """An endless stream of [batch, seq + 1] int64 tensors, built in a DataLoader worker."""
    import torch

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            rows = Rows(data, "train", seq, np.random.default_rng([seed, info.id if info else 0]), splits, split_p)
            while True:
                yield torch.from_numpy(np.stack([rows.row(mix) for _ in range(batch)]))

    return torch.utils.data.DataLoader(Stream(), batch_size=None, num_workers=workers, pin_memory=True,
                                       persistent_workers=True, prefetch_factor=8)


def evaluate(model, data, seq, device, n, batch=8) -> dict:
    """Validation: plain loss (nats/token and bits/byte of held-out files), FIM loss on middle tokens and the
    edit loss on the changed copies of held-out files' edit examples."""
    import torch
    import torch.nn.functional as F

    model.eval()
    rows = Rows(data, "val", seq, np.random.default_rng(1234))
    plain, fim_sum, fim_n = [], 0.0, 0
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        for _ in range(n):
            x = torch.from_numpy(np.stack([rows.plain() for _ in range(batch)])).to(device)
            logits = model(input_ids=x[:, :-1]).logits.float()
            plain.append(F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).item())
        for _ in range(n * batch // 2):
            ex, m = rows.fim_example()
            x = torch.from_numpy(ex[:seq + 1]).to(device)[None]
            logits = model(input_ids=x[:, :-1]).logits.float()[0, m - 1:]
            fim_sum += F.cross_entropy(logits, x[0, m:], reduction="sum").item()
            fim_n += x.shape[1] - m
        edit_sum, edit_n = 0.0, 0
        for i in range(min(n * batch // 2, len(rows.edit_starts) - 1)):   # the first ones: the same every time
            ex, m = rows.edit[rows.edit_starts[i]:rows.edit_starts[i + 1]], int(data["val_edit_answers"][i])
            if m >= seq:
                continue
            x = torch.from_numpy(ex[:seq + 1].astype(np.int64)).to(device)[None]
            logits = model(input_ids=x[:, :-1]).logits.float()[0, m - 1:]
            edit_sum += F.cross_entropy(logits, x[0, m:], reduction="sum").item()
            edit_n += x.shape[1] - m
    model.train()
    loss = float(np.mean(plain))
    bytes_per_token = data["val_bytes"] / len(data["val"])
    return {"val_loss": round(loss, 4), "val_bits_per_byte": round(loss / math.log(2) / bytes_per_token, 4),
            "val_fim_middle_loss": round(fim_sum / fim_n, 4), "val_edit_copy_loss": round(edit_sum / edit_n, 4)}


def train(args):
    import torch
    import torch.nn.functional as F
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    corpus = json.loads((args.data / "corpus.json").read_text())
    data = dict(np.load(args.data / "corpus.npz")) | {"val_bytes": corpus["val_bytes"]}
    mix = np.asarray(args.mix, float) / sum(args.mix)
    if args.init:
        d = ModelDims.from_hf_dir(args.init)
        model = Qwen2ForCausalLM.from_pretrained(args.init, dtype=torch.float32, attn_implementation="sdpa")
    else:
        d = dims(corpus["vocab"], args.layers, args.intermediate)
        model = Qwen2ForCausalLM(Qwen2Config(**d.to_hf_config(), attn_implementation="sdpa")).float()
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() == 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    log = []

    def say(line):
        log.append(line)
        print(line, flush=True)

    say(f"{n_params / 1e6:.3f}M parameters ({d.layers} layers, intermediate {d.intermediate}) on {device}; "
        f"corpus: Python {corpus['python']} Lib/, {corpus['train_tokens']} train tokens")
    it = iter(batches(data, args.seq, args.batch, mix, args.seed, newline_splits(args.data / "tokenizer.json"),
                      args.split_newlines, 4 if device.type == "cuda" else 1))
    t0 = time.time()
    step, best = 0, (math.inf, 0, None)

    def score(ev: dict) -> float:   # what "best" means: the plain loss, plus the edit loss when edits are taught
        return ev["val_loss"] + (ev["val_edit_copy_loss"] if mix[3] else 0.0)
    while (done := max(step / args.steps, (time.time() - t0) / args.budget_s)) < 1.0:
        step += 1
        lr = args.lr * min(1.0, step / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = next(it).to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == 1:
            say(f"step {step} loss {loss.item():.3f} lr {lr:.2e} ({time.time() - t0:.0f}s)")
        if step % args.eval_every == 0:
            ev = evaluate(model, data, args.seq, device, args.eval_batches // 4)
            say(f"step {step} eval {json.dumps(ev)}")
            if score(ev) < best[0]:  # many epochs over a small corpus: keep the best, not the last
                best = (score(ev), step, {k: v.detach().clone() for k, v in model.state_dict().items()})
    seconds, last_step = time.time() - t0, step
    if score(evaluate(model, data, args.seq, device, args.eval_batches // 4)) > best[0]:
        model.load_state_dict(best[2])
        step = best[1]
    final = evaluate(model, data, args.seq, device, args.eval_batches)
    say(f"final: step {step} of {last_step} ({step * args.batch * args.seq} tokens, {seconds:.0f}s): "
        f"{json.dumps(final)}")

    # a continued run keeps the record of the run it continues
    previous = json.loads((args.init / "training.json").read_text()) if args.init else None
    weights = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
    testmodels.write_hf_dir(args.out, d, weights, tokenizer_dir=args.data)
    (args.out / "training.json").write_text(json.dumps(
        {"command": " ".join(["python", "tools/train_small_model.py", *sys.argv[1:]]),
         "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
         "parameters": n_params, "steps": last_step, "kept_step": step, "batch": args.batch, "seq": args.seq, "lr": args.lr,
         "warmup": args.warmup, "mix_plain_fim_chat_edit": args.mix, "seed": args.seed, "seconds": round(seconds),
         "tokens_seen": step * args.batch * args.seq, "split_newlines": args.split_newlines, "corpus": corpus}
        | final | {"log": log, "init": previous}, indent=2) + "\n")
    print(f"wrote {args.out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="corpus -> tokenizer, token arrays and chat examples (CPU)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stdlib", type=Path, help="a CPython Lib/ directory (default: this interpreter's)")
    p.add_argument("--python", help="the version of that Lib/, recorded (default: this interpreter's)")
    p.add_argument("--vocab", type=int, default=2048)
    t = sub.add_parser("train", help="prepared data -> HF model directory")
    t.add_argument("--data", type=Path, required=True)
    t.add_argument("--out", type=Path, default=testmodels.SMALL_PY_DIR)
    t.add_argument("--layers", type=int, default=3)
    t.add_argument("--intermediate", type=int, default=512)
    t.add_argument("--steps", type=int, default=100000)
    t.add_argument("--budget-s", type=float, default=210.0, help="wall-clock training budget (seconds)")
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--seq", type=int, default=2048)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup", type=int, default=200)
    t.add_argument("--mix", type=float, nargs=4, default=[0.55, 0.40, 0.05, 0.0],
                   metavar=("PLAIN", "FIM", "CHAT", "EDIT"))
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--split-newlines", type=float, default=0.1, metavar="P",
                   help="probability of splitting each token that ends in a newline (see Rows.split_newlines)")
    t.add_argument("--init", type=Path, help="continue from this HF directory (a previous run's output)")
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--eval-every", type=int, default=500)
    t.add_argument("--eval-batches", type=int, default=64, help="final evaluation; periodic ones use a quarter")
    args = ap.parse_args()
    prepare(args) if args.cmd == "prepare" else train(args)


if __name__ == "__main__":
    main()
