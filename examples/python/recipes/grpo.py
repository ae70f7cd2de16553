#!/usr/bin/env python3
"""GRPO / PPO-style policy-gradient steps with an entropy bonus and a KL penalty, the per-token
log-probs and entropy from fusedce (docs/recipes.md).

    PYTHONPATH=bindings/python FUSEDCE_LIBRARY=build/libfusedce.so \
        python examples/python/recipes/grpo.py [--device cpu|cuda] [--steps 5] [--dtype float32]

A tiny randomly initialised Llama is the policy; a frozen copy of it the reference. The rollouts
are random: --prompts prompts, --group responses each (random tokens of random length, right-
padded, a response mask), and a toy verifiable reward per response (the fraction of its tokens
with an even id). Advantages are normalised within each prompt's group (GRPO):

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)      for every token of response i

The log-probs of the rollouts under the policy that produced them (old_logp) and under the
reference (ref_logp) come from no-grad passes; then --steps optimizer steps on that batch, each
minimising the masked token mean of

    ratio = exp(logp - old_logp)
    pg    = -min(ratio * A, clip(ratio, 1 - eps_clip, 1 + eps_clip) * A)         (PPO clip)
    kl    = exp(ref_logp - logp) - (ref_logp - logp) - 1                          (k3 estimator)
    loss  = pg + kl_coef * kl - ent_coef * H

with logp and H, the entropy of the policy's next-token distribution, from fusedce on the final
hidden state and lm_head.weight (examples/python/recipes/_logprobs.py). On the first step the
loss and its gradients are also computed from plain torch (log_softmax of the whole logits,
Categorical(logits).entropy()) and the differences printed.
"""

import sys

import torch

from _logprobs import (base_parser, frozen_copy, fused_token_stats, masked_mean,
                       random_sequences, tiny_llama, train)


def parse(argv):
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=2, help="prompts in the batch (default 2)")
    p.add_argument("--group", type=int, default=4, help="responses per prompt (default 4)")
    p.add_argument("--clip", type=float, default=0.2, help="PPO clip epsilon (default 0.2)")
    p.add_argument("--ent-coef", type=float, default=0.01, help="entropy bonus (default 0.01)")
    p.add_argument("--kl-coef", type=float, default=0.04,
                   help="KL penalty to the frozen reference; 0 drops the reference (default 0.04)")
    return p.parse_args(argv)


def group_advantages(rewards, group, eps=1e-4):
    """GRPO: each reward normalised by the mean and std of its prompt's group."""
    r = rewards.view(-1, group)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + eps)).view(-1)


def grpo_objective(policy, ids, mask, adv, old_logp, ref_logp, args):
    """objective(stats_fn) -> (loss, per-token tensors), with stats_fn fusedce's or torch's."""
    def objective(stats_fn):
        logp, ent = stats_fn(policy, ids)
        ratio = torch.exp(logp - old_logp)
        a = adv[:, None]
        pg = -torch.min(ratio * a, ratio.clamp(1 - args.clip, 1 + args.clip) * a)
        per_token = pg - args.ent_coef * ent
        kl = torch.zeros_like(logp)
        if ref_logp is not None:
            kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
            per_token = per_token + args.kl_coef * kl
        loss = masked_mean(per_token, mask)
        return loss, {"logp": logp, "entropy": ent, "kl": kl, "ratio": ratio}
    return objective


def main(argv=None):
    args = parse(argv)
    policy = tiny_llama(args)
    ref = frozen_copy(policy) if args.kl_coef > 0 else None

    gen = torch.Generator().manual_seed(args.seed + 1)
    ids, resp = random_sequences(args.prompts * args.group, args, gen)
    p = args.prompt_len  # the responses of a group answer the same prompt
    ids[:, :p] = ids[::args.group, :p].repeat_interleave(args.group, dim=0)
    rewards = ((ids % 2 == 0) & resp).sum(1).float() / resp.sum(1)
    adv = group_advantages(rewards, args.group)
    mask = resp[:, 1:]  # log-prob t scores token t + 1: the response's tokens
    with torch.no_grad():
        old_logp, _ = fused_token_stats(policy, ids, entropy=False)
        ref_logp = fused_token_stats(ref, ids, entropy=False)[0] if ref is not None else None
    objective = grpo_objective(policy, ids, mask, adv, old_logp, ref_logp, args)
    print(f"GRPO: {args.prompts} prompts x {args.group} responses, {ids.shape[1]} tokens, "
          f"vocab {args.vocab}, hidden {args.hidden}, {args.device} {args.dtype}; "
          f"rewards mean {rewards.mean().item():.3f}")

    def report(stats):
        return {"entropy": masked_mean(stats["entropy"], mask).item(),
                "kl": masked_mean(stats["kl"], mask).item(),
                "clipped": masked_mean(((stats["ratio"] - 1).abs() > args.clip).float(),
                                       mask).item()}
    return train(policy, objective, args, report)


if __name__ == "__main__":
    main(sys.argv[1:])
