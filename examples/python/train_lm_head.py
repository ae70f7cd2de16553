#!/usr/bin/env python3
"""Train a tiny language model a few steps two ways and compare: the unfused way
(logits = lm_head(h); F.cross_entropy over the shifted logits) and fusedce's
linear_cross_entropy (the logits only piece by piece within a workspace budget; causal shift without a copy).

    PYTHONPATH=bindings/python FUSEDCE_LIBRARY=build/libfusedce.so \
        python examples/python/train_lm_head.py [--device cpu|cuda] [--steps 20] [--compile]

Both runs start from the same weights and see the same batches, so their losses should agree
step by step; the table shows them side by side with the time per step, and on CUDA the peak
memory of each (torch.cuda.max_memory_allocated). On CPU the peak is not measured; the size of
the logits the unfused way holds is printed instead.

Without torch (it cannot be imported, or --framework numpy) the same kind of LM head is trained
on NumPy arrays with the CPU backend: the hidden states are a fixed random embedding of the
tokens (they are not trained), the head is a weight W [V, D] and a bias [V] (--no-bias drops it),
and plain SGD updates them from the gradients fusedce.core.linear_ce returns in the same call as
the loss. A fixed set of sequences following next = (7 * current + 3) mod V is seen every step
(full-batch gradient descent on a convex loss, so the loss must go down). The same training is
run the unfused way in NumPy (logits [N, V] materialised, softmax, their gradient) beside it;
the table compares the two, and the memory line sets the workspace bytes the fused call used
against the N x V float32 logits and their gradient that the unfused way holds.

    PYTHONPATH=bindings/python FUSEDCE_LIBRARY=build/libfusedce.so \
        python examples/python/train_lm_head.py --framework numpy [--steps 20] [--no-bias]

Either path exits with status 1 when the fusedce run's loss did not decrease.
"""

import argparse
import os
import sys
import time

import numpy as np

try:
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    TORCH_IMPORT_ERROR = None
except ImportError as e:  # no torch: only the NumPy path (--framework numpy) can run
    torch = nn = F = None
    TORCH_IMPORT_ERROR = e

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "bindings", "python"))
from fusedce.core import linear_ce, linear_ce_workspace_size  # noqa: E402

if torch is not None:
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


# ===================================================================== NumPy path ====
# No torch: the head alone, on NumPy arrays and the CPU backend. hidden [N, D] is a fixed random
# embedding of the tokens; W [V, D] and bias [V] are trained with plain SGD.

def np_data(args):
    """A fixed batch of sequences following next = (7 * current + 3) mod V from random starts,
    and the fixed random embedding E [V, D] (unit variance, like a normed hidden state)."""
    rng = np.random.default_rng(1)
    cols = [rng.integers(0, args.vocab, size=(args.batch, 1), dtype=np.int64)]
    for _ in range(args.seq - 1):
        cols.append((7 * cols[-1] + 3) % args.vocab)
    tokens = np.concatenate(cols, axis=1)                                      # [B, T] int64
    embed = rng.standard_normal((args.vocab, args.dim), dtype=np.float32)      # [V, D]
    return tokens, embed


def np_init(args):
    """The head's initial weights, like nn.Linear's: U(-1/sqrt(D), 1/sqrt(D)); bias 0."""
    rng = np.random.default_rng(0)
    bound = 1.0 / np.sqrt(args.dim)
    weight = rng.uniform(-bound, bound, size=(args.vocab, args.dim)).astype(np.float32)
    bias = None if args.no_bias else np.zeros(args.vocab, dtype=np.float32)
    return weight, bias


def np_unfused_step(hidden, weight, bias, tokens, with_grad=True):
    """The unfused way: logits [N, V] materialised, log-softmax, and their gradient [N, V];
    the causal shift through an explicit shifted copy of the targets (-100 = ignored)."""
    b, t = tokens.shape
    targets = np.full((b, t), -100, dtype=np.int64)
    targets[:, :-1] = tokens[:, 1:]
    targets = targets.reshape(-1)
    valid = targets != -100
    count = max(int(valid.sum()), 1)
    logits = hidden @ weight.T                                                 # [N, V]
    if bias is not None:
        logits += bias
    m = logits.max(axis=1, keepdims=True)
    p = np.exp(logits - m)
    s = p.sum(axis=1, keepdims=True)
    lse = (m + np.log(s))[:, 0]
    rows = np.nonzero(valid)[0]
    loss = float((lse[rows] - logits[rows, targets[rows]]).sum(dtype=np.float64) / count)
    if not with_grad:
        return loss, None, None
    grad = p / s                                                               # [N, V]
    grad[rows, targets[rows]] -= 1.0
    grad[~valid] = 0.0
    grad /= count
    grad_weight = grad.T @ hidden
    grad_bias = grad.sum(axis=0) if bias is not None else None
    return loss, grad_weight, grad_bias


def np_fused_step(hidden, weight, bias, tokens, workspace, with_grad=True):
    """fusedce.core.linear_ce: loss and the gradients of weight and bias in one call, the causal
    shift done by shift_seq_len (no shifted copy), logits held only piece by piece. The hidden
    states are not trained here, so their gradient is not asked for."""
    b, t = tokens.shape
    want = (("weight", "bias") if bias is not None else ("weight",)) if with_grad else False
    r = linear_ce(hidden, weight, tokens.reshape(-1), bias, shift_seq_len=t, return_grad=want,
                  workspace=workspace, check_targets=True)
    return float(r.loss), r.grad_weight, r.grad_bias


def aligned_bytes(nbytes, align=16):
    """A 1-D uint8 buffer of nbytes at an address aligned as the C ABI wants."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes]


def np_train(step_fn, args, hidden, tokens):
    """--steps steps of SGD; the losses (before each update, then after the last), times."""
    weight, bias = np_init(args)
    losses, times = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss, gw, gb = step_fn(hidden, weight, bias, tokens)
        weight -= args.lr * gw
        if bias is not None:
            bias -= args.lr * gb
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    final = step_fn(hidden, weight, bias, tokens, with_grad=False)[0]
    return losses, times, final


def main_numpy(args):
    args.batch = args.batch or 4
    args.seq = args.seq or 64
    args.dim = args.dim or 64
    args.vocab = args.vocab or 2003
    if args.lr is None:
        args.lr = 10.0  # SGD on a mean over ~N rows of a linear head: a large step is stable
    n = args.batch * args.seq
    print(f"NumPy path (fusedce.core.linear_ce, CPU backend), {args.steps} steps of SGD "
          f"(lr {args.lr:g}), batch {args.batch} x seq {args.seq} = {n} tokens, hidden "
          f"{args.dim} (fixed random embedding), vocab {args.vocab}, "
          + ("no bias" if args.no_bias else "with bias"))
    tokens, embed = np_data(args)
    hidden = np.ascontiguousarray(embed[tokens.reshape(-1)])                  # [N, D]

    ws_min, ws_opt = linear_ce_workspace_size(n, args.dim, args.vocab, with_grad=True,
                                              backend="cpu", dtype="float32",
                                              target_dtype="int64", shift_seq_len=args.seq)
    workspace = aligned_bytes(ws_min if args.workspace == "min" else ws_opt)  # reused each step

    def fused(h, w, b, y, with_grad=True):
        return np_fused_step(h, w, b, y, workspace, with_grad)

    lu, tu, fu = np_train(np_unfused_step, args, hidden, tokens)
    lf, tf, ff = np_train(fused, args, hidden, tokens)

    print(f"{'step':>5}  {'unfused loss':>12}  {'fusedce loss':>12}  {'unfused ms':>10}  "
          f"{'fusedce ms':>10}")
    for i in range(args.steps):
        print(f"{i:>5}  {lu[i]:>12.5f}  {lf[i]:>12.5f}  {tu[i] * 1e3:>10.2f}  {tf[i] * 1e3:>10.2f}")
    print(f"{'final':>5}  {fu:>12.5f}  {ff:>12.5f}  (after the last update)")

    kib = 2 ** 10
    logits_bytes = n * args.vocab * 4
    unfused_bytes = 2 * logits_bytes
    print(f"memory per step (besides inputs, parameters and their gradients, which both ways "
          f"hold): unfused {unfused_bytes / kib:.1f} KiB = logits {n} x {args.vocab} float32 "
          f"({logits_bytes / kib:.1f} KiB) + their gradient; fusedce workspace "
          f"{workspace.nbytes / kib:.1f} KiB ({workspace.nbytes} bytes, --workspace "
          f"{args.workspace}: minimum {ws_min}, optimal {ws_opt}), "
          f"{unfused_bytes / max(workspace.nbytes, 1):.1f}x less")
    drift = max(abs(a - b) for a, b in zip(lu + [fu], lf + [ff]))
    print(f"largest loss difference between the two runs: {drift:.2e}")
    if not (ff < lf[0]):
        print("error: the fusedce run did not learn", file=sys.stderr)
        sys.exit(1)
    if drift > 1e-3 * max(1.0, abs(lu[0])):
        print("error: the fusedce and unfused losses disagree", file=sys.stderr)
        sys.exit(1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--dim", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default 3e-3 for AdamW on the torch path, 10 for SGD on "
                        "the NumPy path)")
    p.add_argument("--compile", action="store_true", help="torch.compile the loss step")
    p.add_argument("--no-amp", action="store_true", help="no bf16 autocast on CUDA")
    p.add_argument("--framework", default="auto", choices=["auto", "torch", "numpy"],
                   help="torch (fusedce.torch), numpy (fusedce.core on NumPy arrays, CPU "
                        "backend), auto: torch when it can be imported, else numpy")
    p.add_argument("--no-bias", action="store_true", help="NumPy path: a head without bias")
    p.add_argument("--workspace", default="min", choices=["min", "optimal"],
                   help="NumPy path: the workspace size the fused call gets, the minimum "
                        "(default) or the size fusedce calls optimal for speed")
    args = p.parse_args()
    if args.framework == "auto":
        args.framework = "torch" if torch is not None else "numpy"
        if torch is None:
            print(f"torch cannot be imported ({TORCH_IMPORT_ERROR}): running the NumPy path")
    if args.framework == "torch" and torch is None:
        p.error(f"--framework torch: torch cannot be imported ({TORCH_IMPORT_ERROR})")
    if args.framework == "numpy":
        if args.device == "cuda":
            p.error("the NumPy path runs on the CPU backend only (--device cpu)")
        if args.compile or args.no_amp:
            p.error("--compile and --no-amp are options of the torch path")
        if args.steps < 1:
            p.error("--steps must be at least 1")
        return main_numpy(args)
    if args.no_bias or args.workspace != "min":
        p.error("--no-bias and --workspace are options of the NumPy path")
    if args.lr is None:
        args.lr = 3e-3
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
