"""What the RL recipes share: a tiny randomly initialised Llama, per-token log-probs and entropy
from fusedce (the logits never whole) or from plain torch (the logits whole, for the check), the
masked token mean, and the first-step parity check of a loss and its gradients.

The per-token quantities come from the model's final hidden state and its lm_head weight:

    h = model.model(input_ids).last_hidden_state                        [B, T, D]
    out = linear_cross_entropy(h, model.lm_head.weight, input_ids, shift=1,
                               reduction="none", return_entropy=True)
    log p(x[t+1] | x[..t]) = -out.loss[:, t],  H_t = out.entropy[:, t]  for t < T - 1

``shift=1`` scores row t against token t + 1 without a copy; the last position of each sequence
has no next token (its loss is 0), so it is dropped.
"""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "bindings", "python"))
from fusedce.torch import linear_cross_entropy  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="the model's parameters and activations (default float32)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW's learning rate (default 1e-5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--response-len", type=int, default=24,
                   help="the longest response; each is 1 to this many tokens, then padding")
    return p


def tiny_llama(args):
    """A randomly initialised LlamaForCausalLM of the arguments' size, on their device/dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=args.prompt_len + args.response_len,
                         use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    return LlamaForCausalLM(config).to(device=args.device, dtype=DTYPES[args.dtype])


def frozen_copy(model):
    """The reference policy: the same weights, no gradients, in eval mode."""
    import copy
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


def random_sequences(n, args, gen):
    """n sequences of a random prompt and a random response of random length, right-padded with
    token 0: (input_ids [n, T], response_mask [n, T] with 1 on the response's tokens)."""
    p, r = args.prompt_len, args.response_len
    ids = torch.randint(1, args.vocab, (n, p + r), generator=gen)
    lengths = torch.randint(1, r + 1, (n,), generator=gen)
    mask = torch.zeros(n, p + r, dtype=torch.bool)
    for i, n_resp in enumerate(lengths.tolist()):
        mask[i, p:p + n_resp] = True
        ids[i, p + n_resp:] = 0
    return ids.to(args.device), mask.to(args.device)


def fused_token_stats(model, input_ids, entropy=True):
    """fusedce: per-token log-probs of the next tokens [B, T-1] and (entropy=True) the entropy
    of each of those predictions [B, T-1], float32, differentiable, from the final hidden state
    and lm_head.weight; the [B·T, V] logits exist only a chunk at a time."""
    hidden = model.model(input_ids=input_ids).last_hidden_state
    out = linear_cross_entropy(hidden, model.lm_head.weight, input_ids, shift=1,
                               reduction="none", return_entropy=entropy)
    if not entropy:
        return -out[:, :-1], None
    return -out.loss[:, :-1], out.entropy[:, :-1]


def torch_token_stats(model, input_ids, entropy=True):
    """The same from plain torch: the whole logits, log_softmax and Categorical's entropy."""
    logits = model(input_ids=input_ids).logits[:, :-1].float()
    logp = F.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    ent = torch.distributions.Categorical(logits=logits).entropy() if entropy else None
    return logp, ent


def masked_mean(x, mask):
    """The mean of x over the positions where mask is set (the token mean of a batch)."""
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1)


def _grads(model):
    return torch.cat([p.grad.reshape(-1).float() for p in model.parameters()
                      if p.grad is not None])


def parity_check(model, objective):
    """Runs ``objective(stats_fn)`` -> (loss, {name: tensor}) once with torch_token_stats and
    once with fused_token_stats, back-propagating each; prints the largest difference of each
    named tensor and the relative error ||g_fused - g_torch|| / ||g_torch|| of the gradient of
    all parameters. Leaves the fused gradients in the parameters' .grad (the caller's first
    optimizer step uses them) and returns (fused loss, fused tensors, {name: difference}).
    """
    model.zero_grad(set_to_none=True)
    loss_t, ref = objective(torch_token_stats)
    loss_t.backward()
    g_t = _grads(model)
    model.zero_grad(set_to_none=True)
    loss_f, got = objective(fused_token_stats)
    loss_f.backward()
    g_f = _grads(model)
    diffs = {}
    for name in ref:
        diffs[f"{name}_max_diff"] = (got[name].detach().float() - ref[name].detach().float()
                                     ).abs().max().item()
    diffs["loss_diff"] = abs(loss_f.item() - loss_t.item())
    diffs["grad_rel_err"] = ((g_f - g_t).norm() / g_t.norm().clamp(min=1e-30)).item()
    print("parity with plain torch (first step): " +
          ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
    return loss_f, got, diffs


class Timer:
    """Wall time of the run, synchronising CUDA when it reads the clock."""

    def __init__(self, device):
        self.cuda = str(device).startswith("cuda")
        self.start = self.now()

    def now(self):
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def elapsed(self):
        return self.now() - self.start


def train(policy, objective, args, report):
    """--steps AdamW steps of ``objective(fused_token_stats)`` on the policy, the first one
    checked against plain torch (parity_check). ``report(stats)`` -> {name: float}: what to
    print after each step beside the loss. Returns {name: [value per step]} for the loss and
    what report gave, the parity check's differences and the wall time in seconds."""
    timer = Timer(args.device)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    result = {}
    for step in range(args.steps):
        if step == 0:
            loss, stats, diffs = parity_check(policy, objective)
            result.update(diffs)
        else:
            opt.zero_grad(set_to_none=True)
            loss, stats = objective(fused_token_stats)
            loss.backward()
        opt.step()
        logged = {"loss": loss.item(), **report(stats)}
        print(f"step {step}: " + "  ".join(f"{k} {v:.5g}" for k, v in logged.items()))
        for name, value in logged.items():
            result.setdefault(name, []).append(value)
    result["seconds"] = timer.elapsed()
    print(f"{args.steps} steps in {result['seconds']:.1f} s (the first step's torch pass "
          "included)")
    return result
