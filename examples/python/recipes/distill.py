#!/usr/bin/env python3
"""Distil a larger Hugging Face Llama teacher into a smaller student with
fusedce.torch.linear_distill: the student's and the teacher's final hidden states and their
output layers go in, the [tokens, vocab] logits of either model are never held whole.

    PYTHONPATH=bindings/python FUSEDCE_LIBRARY=build/libfusedce.so \\
        python examples/python/recipes/distill.py [--device cpu|cuda] [--steps 8]

Both models are randomly initialised from transformers' LlamaConfig (vocabulary 32000, hidden
256 for the student and 512 for the teacher, two layers each: tiny, so that the recipe runs on
a CPU in well under a minute). The teacher is frozen; each step runs it under torch.no_grad()
for its final hidden states (``model.model(...)``: the decoder before the output layer), runs
the student the same way, and minimises

    T² · linear_distill(h_student, student.lm_head.weight, h_teacher, teacher.lm_head.weight,
                        divergence, temperature=T, target=labels)
    + hard_weight · linear_cross_entropy(h_student, student.lm_head.weight, labels, shift=1)

(the T² of Hinton's distillation, which fusedce leaves to the caller; the hard next-token loss
is off by default). Padding positions carry the label -100, so linear_distill does not count
them. By default one batch is seen every step (tokens from a small part of the vocabulary), so
the loss printed per step must fall: the script exits with status 1 otherwise;
``--fresh-batches`` draws a new batch each step instead (no check). On CUDA the models run
under bfloat16 autocast (the teacher in bfloat16); on the CPU in float32.
With a real teacher, load it with ``AutoModelForCausalLM.from_pretrained`` instead: only the
two hidden-state calls and the two ``lm_head.weight`` matter here (the vocabularies must match).
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "bindings", "python"))
import fusedce.torch as fce  # noqa: E402

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:  # the recipe needs transformers
    sys.exit(f"distill.py needs transformers (pip install transformers): {e}")


def llama(hidden: int, heads: int, vocab: int, layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=heads, max_position_embeddings=512,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def batch(gen: torch.Generator, batch_size: int, seq: int, tokens: int, device):
    """Token ids [B, T] drawn from the first ``tokens`` ids (a tiny corpus, so that a few steps
    see the same tokens again), the attention mask and the labels (-100 on padding): each
    sequence keeps a random length of at least half of T."""
    ids = torch.randint(0, tokens, (batch_size, seq), generator=gen)
    lengths = torch.randint(seq // 2, seq + 1, (batch_size,), generator=gen)
    mask = torch.arange(seq)[None, :] < lengths[:, None]
    labels = torch.where(mask, ids, torch.full_like(ids, -100))
    return ids.to(device), mask.long().to(device), labels.to(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--corpus-tokens", type=int, default=256,
                    help="the batches draw their tokens from the first this many ids")
    ap.add_argument("--fresh-batches", action="store_true",
                    help="a new batch every step (default: one batch seen every step, so that "
                         "the loss of a few steps must fall)")
    ap.add_argument("--divergence", default="forward_kl",
                    choices=["forward_kl", "reverse_kl", "jsd"])
    ap.add_argument("--beta", type=float, default=0.5, help="JSD's β")
    ap.add_argument("--temperature", type=float, default=2.0)
    ap.add_argument("--hard-weight", type=float, default=0.0,
                    help="weight of the next-token cross-entropy added to the distillation")
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: no CUDA device visible to torch")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    teacher = llama(512, 8, args.vocab, 2, seed=1).to(device, dtype).eval().requires_grad_(False)
    # a peaked teacher: a random output layer scaled up so that its softmax is far from uniform
    with torch.no_grad():
        teacher.lm_head.weight.mul_(4.0)
    student = llama(256, 4, args.vocab, 2, seed=2).to(device)
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(0)
    T = args.temperature
    n_student = sum(p.numel() for p in student.parameters())
    n_teacher = sum(p.numel() for p in teacher.parameters())
    print(f"student {n_student / 1e6:.1f}M parameters, teacher {n_teacher / 1e6:.1f}M, "
          f"vocabulary {args.vocab}, {args.batch}x{args.seq} tokens a step, {args.device}, "
          f"divergence {args.divergence}, T = {T}")
    print(f"{'step':>4} {'loss':>10} {'distill':>10} {'hard':>8} {'s/step':>7}")
    losses = []
    fixed = batch(gen, args.batch, args.seq, args.corpus_tokens, device)
    for step in range(args.steps):
        ids, mask, labels = (batch(gen, args.batch, args.seq, args.corpus_tokens, device)
                             if args.fresh_batches else fixed)
        t0 = time.perf_counter()
        with torch.no_grad():
            h_teacher = teacher.model(input_ids=ids, attention_mask=mask).last_hidden_state
        with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
            h_student = student.model(input_ids=ids, attention_mask=mask).last_hidden_state
            kd = fce.linear_distill(h_student, student.lm_head.weight, h_teacher,
                                    teacher.lm_head.weight, divergence=args.divergence,
                                    beta=args.beta, temperature=T, target=labels)
            loss = T * T * kd
            hard = torch.zeros(())
            if args.hard_weight:
                hard = fce.linear_cross_entropy(h_student.reshape(-1, h_student.shape[-1]),
                                                student.lm_head.weight, labels.reshape(-1),
                                                shift_seq_len=args.seq, shift=1)
                loss = loss + args.hard_weight * hard
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        losses.append(float(loss.detach()))
        print(f"{step:>4} {losses[-1]:>10.4f} {float(kd.detach()):>10.4f} "
              f"{float(hard.detach()):>8.3f} {dt:>7.2f}")
    if not args.fresh_batches and len(losses) > 1 and not losses[-1] < losses[0]:
        print(f"the loss did not fall ({losses[0]:.4f} -> {losses[-1]:.4f})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
