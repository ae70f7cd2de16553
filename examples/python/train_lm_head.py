#!/usr/bin/env python3
"""Train a tiny language model a few steps two ways and compare: the unfused way
(logits = lm_head(h); F.cross_entropy over the shifted logits) and fusedce's
linear_cross_entropy (the logits never exist whole; causal shift without a copy).

    PYTHONPATH=bindings/python FUSEDCE_LIBRARY=build/libfusedce.so \
        python examples/python/train_lm_head.py [--device cpu|cuda] [--steps 20] [--compile]

Both runs start from the same weights and see the same batches, so their losses should agree
step by step; the table shows them side by side with the time per step, and on CUDA the peak
memory of each (torch.cuda.max_memory_allocated). On CPU the peak is not measured; the size of
the logits the unfused way holds is printed instead.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "bindings", "python"))
from fusedce.torch import linear_cross_entropy  # noqa: E402


class TinyLM(nn.Module):
    """Embedding, one residual MLP, a norm and the head: enough to learn next = f(current)."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def hidden(self, tokens):
        x = self.embed(tokens)
        return self.norm(x + self.mlp(x))


def unfused_loss(model, tokens):
    logits = model.lm_head(model.hidden(tokens))                       # [B, T, V] materialised
    v = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, v).float(), tokens[:, 1:].reshape(-1))


def fused_loss(model, tokens):
    b, t = tokens.shape
    h = model.hidden(tokens).reshape(b * t, -1)
    return linear_cross_entropy(h, model.lm_head.weight, tokens.reshape(-1), shift_seq_len=t)


def batches(args, device):
    """Sequences following next = (7 * current + 3) mod V from a random start."""
    g = torch.Generator().manual_seed(1)
    for _ in range(args.steps):
        cols = [torch.randint(0, args.vocab, (args.batch, 1), generator=g)]
        for _ in range(args.seq - 1):
            cols.append((7 * cols[-1] + 3) % args.vocab)
        yield torch.cat(cols, dim=1).to(device)


def train(name, loss_fn, args, device):
    torch.manual_seed(0)
    model = TinyLM(args.vocab, args.dim).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    step_fn = torch.compile(loss_fn) if args.compile else loss_fn
    amp = device.type == "cuda" and not args.no_amp
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for tokens in batches(args, device):
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = step_fn(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # (a sync: fine for a demo)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return losses, times, peak


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--compile", action="store_true", help="torch.compile the loss step")
    p.add_argument("--no-amp", action="store_true", help="no bf16 autocast on CUDA")
    args = p.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    big = device.type == "cuda"  # CPU defaults stay small so that `make test` is quick
    args.batch = args.batch or (8 if big else 4)
    args.seq = args.seq or (1024 if big else 64)
    args.dim = args.dim or (512 if big else 64)
    args.vocab = args.vocab or (65536 if big else 2003)

    n = args.batch * args.seq
    print(f"device {device}, {args.steps} steps, batch {args.batch} x seq {args.seq} = {n} "
          f"tokens, hidden {args.dim}, vocab {args.vocab}"
          + (", bf16 autocast" if big and not args.no_amp else "")
          + (", torch.compile" if args.compile else ""))
    runs = {}
    for name, fn in (("unfused", unfused_loss), ("fusedce", fused_loss)):
        runs[name] = train(name, fn, args, device)

    print(f"{'step':>4}  {'unfused loss':>12}  {'fusedce loss':>12}  {'unfused ms':>10}  "
          f"{'fusedce ms':>10}")
    (lu, tu, pu), (lf, tf, pf) = runs["unfused"], runs["fusedce"]
    for i in range(args.steps):
        print(f"{i:>4}  {lu[i]:>12.5f}  {lf[i]:>12.5f}  {tu[i] * 1e3:>10.2f}  {tf[i] * 1e3:>10.2f}")
    mib = 2 ** 20
    if pu is not None:
        print(f"peak memory: unfused {pu / mib:.1f} MiB, fusedce {pf / mib:.1f} MiB "
              f"({(pu - pf) / mib:+.1f} MiB saved)")
    else:
        print(f"peak memory: not measured on CPU; the unfused way holds logits of "
              f"{n * args.vocab * 4 / mib:.1f} MiB (float32) and their gradient, fusedce never "
              "does")
    drift = max(abs(a - b) for a, b in zip(lu, lf))
    print(f"largest loss difference between the two runs: {drift:.2e}")
    if not (lf[-1] < lf[0]):
        print("error: the fusedce run did not learn", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
