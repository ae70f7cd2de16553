#!/usr/bin/env python3
"""DPO steps from per-token log-probs, the log-probs from fusedce (docs/recipes.md).

    PYTHONPATH=bindings/python FUSEDCE_LIBRARY=build/libfusedce.so \
        python examples/python/recipes/dpo.py [--device cpu|cuda] [--steps 5] [--dtype float32]

A tiny randomly initialised Llama is the policy, a frozen copy of it the reference. The data are
--pairs preference pairs of random token sequences: one prompt, a chosen and a rejected response
(random tokens of random length, right-padded, a response mask each). Chosen and rejected run as
one batch; each sequence's log-prob is the sum of its response tokens' log-probs:

    logp(y | x) = sum_t mask_t * log p(y_t | x, y_<t)
    margin      = (logp_pi(y_w) - logp_ref(y_w)) - (logp_pi(y_l) - logp_ref(y_l))
    loss        = mean over pairs of -log sigmoid(beta * margin)

The reference's sums come from one no-grad pass; the policy's from fusedce on its final hidden
state and lm_head.weight every step (examples/python/recipes/_logprobs.py). On the first step the
sums, the loss and its gradients are also computed from plain torch (log_softmax of the whole
logits) and the differences printed.
"""

import sys

import torch
import torch.nn.functional as F

from _logprobs import (base_parser, frozen_copy, fused_token_stats, random_sequences, tiny_llama,
                       train)


def parse(argv):
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=4, help="preference pairs (default 4)")
    p.add_argument("--beta", type=float, default=0.1, help="DPO beta (default 0.1)")
    return p.parse_args(argv)


def preference_batch(args, gen):
    """[chosen; rejected]: 2·pairs sequences whose pair i shares its prompt with pair i + pairs."""
    ids, mask = random_sequences(2 * args.pairs, args, gen)
    ids[args.pairs:, :args.prompt_len] = ids[:args.pairs, :args.prompt_len]
    return ids, mask


def sequence_logps(stats_fn, model, ids, mask):
    """Per sequence, the sum of its response tokens' log-probs (float32 [n])."""
    logp, _ = stats_fn(model, ids, entropy=False)
    return (logp * mask).sum(dim=1)


def dpo_loss(policy_logps, ref_logps, pairs, beta):
    """The sigmoid DPO loss of [chosen; rejected] sequence log-probs, and the margins."""
    ratios = policy_logps - ref_logps
    margin = ratios[:pairs] - ratios[pairs:]
    return -F.logsigmoid(beta * margin).mean(), margin


def main(argv=None):
    args = parse(argv)
    policy = tiny_llama(args)
    ref = frozen_copy(policy)

    gen = torch.Generator().manual_seed(args.seed + 1)
    ids, resp = preference_batch(args, gen)
    mask = resp[:, 1:]  # log-prob t scores token t + 1: the response's tokens
    with torch.no_grad():
        ref_logps = sequence_logps(fused_token_stats, ref, ids, mask)

    def objective(stats_fn):
        logps = sequence_logps(stats_fn, policy, ids, mask)
        loss, margin = dpo_loss(logps, ref_logps, args.pairs, args.beta)
        return loss, {"seq_logp": logps, "margin": margin}

    print(f"DPO: {args.pairs} pairs, {ids.shape[1]} tokens, vocab {args.vocab}, hidden "
          f"{args.hidden}, {args.device} {args.dtype}, beta {args.beta}")

    def report(stats):
        margin = stats["margin"].detach()
        return {"margin": margin.mean().item(), "accuracy": (margin > 0).float().mean().item()}
    return train(policy, objective, args, report)


if __name__ == "__main__":
    main(sys.argv[1:])
