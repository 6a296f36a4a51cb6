"""Train the small Qwen2-architecture test model on the Python standard library's source (torch, CPU) and
write it as a full HF directory (bf16 safetensors, tokenizer, ChatML template) under tests/data/small-py/.

Why: random weights give nearly tied logits, so a greedy token match between the GPU runtime and the
numpy reference would measure noise. A trained model has realistic top-1 margins.

Shape: hidden 256, 3 layers, 7 query heads + 1 KV head of head_dim 128 (GQA 7:1 like the 7B), intermediate
512, vocab 2048 (byte-level BPE trained on the same corpus), untied lm_head: ~3.8M parameters, ~7.6 MB.

Training stops at --steps or after --budget-s seconds, whichever comes first; the cosine learning-rate
schedule follows whichever is further along, so a slow (shared) CPU gets a complete schedule in its budget.
The step count actually reached is recorded in training.json (a continued run nests its predecessors'
records under "init"). The committed model was made in four runs on a 2-core CPU that other jobs shared (hence the small step
counts); val loss 5.25, 4.35, 3.44, then 2.97 nats/token:
    P=/tmp/venvtest/bin/python; T=tools/train_small_model.py
    $P $T --steps 2000 --budget-s 780 --batch 8 --out /tmp/small-py-1
    $P $T --init /tmp/small-py-1 --steps 2000 --budget-s 600 --batch 8 --lr 2e-3 --seed 1 --out /tmp/small-py-2
    $P $T --init /tmp/small-py-2 --steps 3000 --budget-s 420 --batch 16 --lr 2e-3 --seed 2 --out /tmp/small-py-3
    $P $T --init /tmp/small-py-3 --steps 3000 --budget-s 900 --batch 16 --lr 1.5e-3 --seed 3 --out tests/data/small-py
On an idle machine a single run does better: $P $T --steps 700 --batch 16 --budget-s 900
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from nanoqwen import testmodels
from nanoqwen.dims import ModelDims


def small_dims(vocab: int) -> ModelDims:
    return ModelDims(hidden=256, layers=3, heads=7, kv_heads=1, head_dim=128, intermediate=512, vocab=vocab,
                     max_positions=4096, rope_theta=1e6, rms_eps=1e-6, tie_embeddings=False)


def token_stream(tok, texts: list[str]) -> np.ndarray:
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.int64)


def batches(stream: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(stream) - seq - 1, size=batch)
        x = np.stack([stream[s:s + seq + 1] for s in starts])
        yield torch.from_numpy(x)


@torch.no_grad()
def evaluate(model, stream, batch, seq, n) -> float:
    model.eval()
    rng = np.random.default_rng(1234)
    it = batches(stream, batch, seq, rng)
    losses = [model(input_ids=(x := next(it))[:, :-1], labels=x[:, :-1].clone()).loss.item() for _ in range(n)]
    model.train()
    return float(np.mean(losses))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=testmodels.SMALL_PY_DIR)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--budget-s", type=float, default=780.0, help="wall-clock training budget (seconds)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", type=Path, help="continue from this HF dir (a previous run's output)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    paths = testmodels.stdlib_sources()
    # every 20th file (in sorted order) is held out for the validation loss
    train_p = [p for i, p in enumerate(paths) if i % 20]
    val_p = [p for i, p in enumerate(paths) if i % 20 == 0]
    tok = testmodels.train_tokenizer(testmodels.read_sources(paths), args.vocab)
    train = token_stream(tok, testmodels.read_sources(train_p))
    val = token_stream(tok, testmodels.read_sources(val_p))
    print(f"corpus: {len(train_p)} train files ({len(train)} tokens), {len(val_p)} val files ({len(val)} tokens)")

    dims = small_dims(tok.get_vocab_size())
    if args.init:
        model = Qwen2ForCausalLM.from_pretrained(args.init, dtype=torch.float32, attn_implementation="sdpa")
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**dims.to_hf_config(), attn_implementation="sdpa"))
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M")
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup = 30
    it = batches(train, args.batch, args.seq, np.random.default_rng(args.seed))
    t0 = time.time()
    step = 0
    while (done := max(step / args.steps, (time.time() - t0) / args.budget_s)) < 1.0:
        step += 1
        lr = args.lr * min(1.0, step / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * done)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = next(it)
        loss = model(input_ids=x[:, :-1], labels=x[:, :-1].clone()).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 25 == 0 or step == 1:
            print(f"step {step} loss {loss.item():.3f} lr {lr:.2e} ({time.time() - t0:.0f}s)", flush=True)
    train_loss = evaluate(model, train, args.batch, args.seq, 20)
    val_loss = evaluate(model, val, args.batch, args.seq, 20)
    print(f"final: train loss {train_loss:.3f}, val loss {val_loss:.3f} (nats/token), {time.time() - t0:.0f}s")

    # a continued run keeps the record of the runs it continues
    previous = json.loads((args.init / "training.json").read_text()) if args.init else None
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    testmodels.write_hf_dir(args.out, dims, weights, tokenizer=tok)
    (args.out / "training.json").write_text(json.dumps(
        {"steps": step, "budget_s": args.budget_s, "batch": args.batch, "seq": args.seq, "lr": args.lr, "seed": args.seed,
         "train_tokens": int(len(train)), "val_tokens": int(len(val)), "train_loss": round(train_loss, 4),
         "val_loss": round(val_loss, 4), "seconds": round(time.time() - t0),
         "init": previous}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
