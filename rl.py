"""Online RL on the engine: GRPO by default, PPO with a value head and GAE.

The math comes first, pure functions on tensors. Every per-token tensor is (B, T) and aligned with the tokens the
policy chose; `mask` is 1 on the tokens it sampled and 0 on the prompt, the tool outputs forced in and the padding.
"""

from __future__ import annotations

import torch

# ----------------------------------------------------------------------------------------------------------------------
# The math


def masked_mean(x: torch.Tensor, mask: torch.Tensor, denom: float | None = None) -> torch.Tensor:
    """Sum of x over the mask / the mask's count (or `denom`, e.g. the token count of all micro-batches)."""
    return (x * mask).sum() / (denom if denom is not None else mask.sum().clamp(min=1))


def group_advantages(rewards: torch.Tensor, group: int, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's std (unbiased, + eps) with `scale`; without it,
    Dr. GRPO's plain difference. rewards (B,) holds B / group groups of `group` consecutive samples of one prompt."""
    grouped = rewards.view(-1, group)
    advantages = grouped - grouped.mean(1, keepdim=True)
    if scale:
        advantages = advantages / (grouped.std(1, keepdim=True) + eps)
    return advantages.view(-1)


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                eps: float = 0.2, denom: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate -min(r A, clip(r, 1 - eps, 1 + eps) A), r = exp(logp - old_logp), averaged per token
    over the batch's masked tokens; advantages (B,) per sequence or (B, T) per token. Returns (loss, clipped share)."""
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages
    unclipped, clipped = ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv
    loss = masked_mean(-torch.minimum(unclipped, clipped), mask, denom)
    return loss, masked_mean((clipped < unclipped).float(), mask).detach()


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy || reference) by the k3 estimator, exp(d) - d - 1 with d = ref_logp - logp: unbiased on
    tokens the policy sampled, never negative."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def kl_rewards(scores: torch.Tensor, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor,
               coef: float) -> torch.Tensor:
    """PPO's per-token rewards (B, T): -coef * (logp - ref_logp) on each sampled token, plus the sequence's score
    (B,) on its last one."""
    rewards = -coef * (logp - ref_logp) * mask
    last = mask.size(1) - 1 - mask.flip(1).int().argmax(1)
    return rewards.scatter_add(1, last[:, None], scores[:, None].to(rewards.dtype))


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over the masked tokens: a forced or padded token is skipped, so each sampled
    token bootstraps from the value of the next sampled one (0 after the last). Returns (advantages, returns)."""
    advantages = torch.zeros_like(values)
    running, next_value = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])
    for t in reversed(range(values.size(1))):
        m = mask[:, t].bool()
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(m, delta + gamma * lam * running, running)
        next_value = torch.where(m, values[:, t], next_value)
        advantages[:, t] = running * m
    return advantages, (advantages + values) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """x shifted and scaled to mean 0 and std 1 over the masked entries (PPO's advantages)."""
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.2, denom: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss 0.5 * max((v - R)^2, (v_clipped - R)^2), v_clipped within old_values +- clip, per
    token over the masked ones. Returns (loss, clipped share)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    plain, far = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * masked_mean(torch.maximum(plain, far), mask, denom), masked_mean((far > plain).float(), mask).detach()
