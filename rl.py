"""Online RL of a chat model on a task's prompts, on the engine: GRPO by default, RLOO, nanochat-style REINFORCE, or PPO
with a value head and GAE, each an entry of ALGOS; rewards from the task's checker, your functions or a reward model.

Each step samples --samples replies to each of --prompts prompts, scores them and updates the policy in --ppo-epochs
passes of --minibatches optimizer steps. The math comes first: per-token tensors are (B, T) over the chosen tokens;
`mask` is 1 on those the policy sampled, 0 on the prompt, tool outputs and padding.

    python rl.py                                   # GRPO from out/sft-demo-1200/ckpt_001200.pt on addition, CPU minutes
    python rl.py --algo ppo --out-dir out/rl-ppo
    python rl.py --task examples/subtraction.py:Subtraction --reward examples/subtraction.py:exact --init-from CKPT
    torchrun --standalone --nproc_per_node=2 rl.py --init-from CKPT --task gsm8k --reward-model RM_CKPT
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from collections.abc import Callable
from typing import Annotated, Any

import torch
from torch import Tensor

import common
import engine
import stage
import tasks
from chat_format import ASSISTANT_END, BOS, CHAT_VOCAB, REPLY_STOPS, is_chat, render_prompt, reply_text
from common import LOCAL, all_sum, flag, get_tokenizer, is_reward_model, load_checkpoint, provenance, run_and_exit
from engine import Context, Run
from generate import Rollout, calculator, evaluating, full_precision, generate
from model import GPT, GPTConfig
from parallel import Objective, check_counts, check_flags, frozen_copy, last_index, rewards, spread, train_step
from trackers import RunLog

# ----------------------------------------------------------------------------------------------------------------------
# The math


def masked_mean(x: Tensor, mask: Tensor, denom: float | None = None) -> Tensor:
    """Sum of x over the mask / the mask's count (or `denom`, e.g. the token count of all micro-batches)."""
    return (x * mask).sum() / (denom if denom is not None else mask.sum().clamp(min=1))


def aggregate(x: Tensor, mask: Tensor, how: str = "token", denom: float | Tensor | None = None) -> Tensor:
    """x over the masked tokens, as TRL's loss types: every token alike (token: its dapo; dr_grpo with a constant
    denom), or each row's mean alike (sequence: its grpo). denom: tokens, or rows for sequence, of all micro-batches."""
    if how == "sequence":
        return (x * mask).sum(-1).div(mask.sum(-1).clamp(min=1)).sum() / (denom if denom is not None else len(x))
    return masked_mean(x, mask, denom)


def group_advantages(rewards: Tensor, group: int, scale: bool = True, eps: float = 1e-4) -> Tensor:
    """GRPO: rewards (B,) minus their group's mean (groups of `group` rows), over its std + eps with `scale`."""
    grouped = rewards.view(-1, group)
    advantages = grouped - grouped.mean(1, keepdim=True)
    return (advantages / (grouped.std(1, keepdim=True) + eps) if scale else advantages).view(-1)


def leave_one_out(rewards: Tensor, group: int) -> Tensor:
    """RLOO: each reward (B,) minus the mean of the other rewards in its group of `group` rows."""
    grouped = rewards.view(-1, group)
    return (grouped - (grouped.sum(1, keepdim=True) - grouped) / (group - 1)).view(-1)


def surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps: float | None = 0.2) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate per token, -min(r A, clip(r, 1 +- eps) A), advantages (B,) or (B, T), and where the
    clip bound; eps None is the plain -r A, whose gradient on-policy (r = 1) is REINFORCE's -A grad log p."""
    ratio, adv = torch.exp(logp - old_logp), advantages[:, None] if advantages.dim() == 1 else advantages
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - eps, 1 + eps) * adv if eps is not None else unclipped
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token KL(policy || reference), k3: exp(d) - d - 1, d = ref_logp - logp; unbiased on sampled tokens, >= 0."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1


def kl_rewards(scores: Tensor, logp: Tensor, ref_logp: Tensor, mask: Tensor, coef: float) -> Tensor:
    """PPO's per-token rewards (B, T): -coef * (logp - ref_logp) per sampled token, plus the score (B,) on the last."""
    rewards = -coef * (logp - ref_logp) * mask
    return rewards.scatter_add(1, last_index(mask)[:, None], scores[:, None].to(rewards.dtype))


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """GAE on the masked tokens, each bootstrapping from the next masked one's value: (advantages, returns)."""
    advantages = torch.zeros_like(values)
    running, next_value = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])
    for t in reversed(range(values.size(1))):
        m = mask[:, t].bool()
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(m, delta + gamma * lam * running, running)
        next_value = torch.where(m, values[:, t], next_value)
        advantages[:, t] = running * m
    return advantages, (advantages + values) * mask


def whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, total: Callable[[Tensor], Tensor] = lambda t: t) -> Tensor:
    """x at mean 0, std 1 over the masked entries (unbiased, as TRL's masked_whiten); `total` sums over the ranks."""
    count = total(mask.sum()).clamp(min=1)
    mean = total((x * mask).sum()) / count
    var = total(((x - mean) ** 2 * mask).sum()) / (count - 1).clamp(min=1)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float = 0.2, denom: float | None = None) -> tuple[Tensor, Tensor]:
    """Clipped value loss 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip in old_values +- clip: (loss, clipped share)."""
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    plain, far = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * masked_mean(torch.maximum(plain, far), mask, denom), masked_mean((far > plain).float(), mask).detach()


# ----------------------------------------------------------------------------------------------------------------------
# The algorithms: how each turns a batch's scores into advantages, and what its update keeps


def ppo(batch: dict[str, Tensor], cfg: RLConfig, world: int) -> dict[str, Tensor]:
    """Per-token rewards (the score, less the KL to the start), GAE on the value head's values, whitened."""
    mask, old = batch["mask"], batch["old_logp"]
    adv, returns = gae(kl_rewards(batch["scores"], old, batch.get("ref_logp", old), mask, cfg.beta),
                       batch["old_values"], mask, cfg.gamma, cfg.lam)
    return {"adv": whiten(adv, mask, total=lambda t: all_sum(t, world)), "returns": returns}


@dataclasses.dataclass(frozen=True)
class Algo:
    advantages: Callable[[dict[str, Tensor], Any, int], dict[str, Tensor]]
    flags: tuple[str, ...] = ("clip",)  # its own flags (clip: it clips the ratio); another's, changed, is refused
    critic: bool = False  # a value head on the trunk, --beta in its rewards; else a group baseline (--samples >= 2)


ALGOS = {"grpo": Algo(lambda b, cfg, _: {"adv": group_advantages(b["scores"], cfg.samples, cfg.scale_rewards)},
                      ("clip", "scale_rewards")),
         "rloo": Algo(lambda b, cfg, _: {"adv": leave_one_out(b["scores"], cfg.samples)}),
         "reinforce": Algo(lambda b, cfg, _: {"adv": group_advantages(b["scores"], cfg.samples, scale=False)}, ()),
         "ppo": Algo(ppo, ("clip", "gamma", "lam", "vf_coef"), critic=True)}
LOSS_AGG = ("token", "sequence", "dr_grpo")


# ----------------------------------------------------------------------------------------------------------------------
# The stage: config, prompts and rewards, one RL step, evaluations, setup


@dataclasses.dataclass
class RLConfig(engine.RunArgs):
    """Online RL of a chat model (an sft.py checkpoint) on a task: GRPO, RLOO, REINFORCE or PPO, on the engine."""

    init_from: Annotated[str, LOCAL] = "out/sft-demo-1200/ckpt_001200.pt"  # the policy's start: a chat checkpoint
    # the prompts, checker and evals: gsm8k, arc-easy, arc-challenge, mmlu, humaneval (test only) or addition (NAME=DIR:
    # a local copy in the hub's schema), or your own, FILE.py:NAME or module:NAME
    task: str = "addition"
    reward: str = ""  # FILE.py:FN[,FILE.py:FN2]: fn(prompt, reply, answer) -> float, or TRL GRPO's, in the task's place
    reward_weights: tuple[float, ...] = ()  # --reward's weights, comma separated (default: 1 each)
    reward_model: Annotated[str, LOCAL] = ""  # score replies with this reward model (prefs.py --objective reward)
    missing_eos_penalty: float = 0.0  # off the score of a reply cut before a stop token, TRL's (0: scored as ended)
    algo: str = "grpo"  # grpo, rloo (leave-one-out baseline), reinforce (mean baseline, no clip) or ppo (value head)
    loss_agg: str = "token"  # the policy loss over tokens, as TRL's: token (its dapo), sequence (its grpo) or dr_grpo
    prompts: int = 32  # prompts per step, all ranks together
    samples: int = 4  # replies sampled per prompt (the group of GRPO, RLOO and REINFORCE)
    rollout_batch: int = 8  # prompts per generate() call, each call with its own seed: ranks take whole calls
    max_new_tokens: int = 16  # reply length cap: rollouts, pass@k and held-out accuracy alike (tasks.py --eval: 512)
    temperature: float = 0.7  # sampling temperature of the rollouts and pass@k; the policy's log-probs use it too
    ppo_epochs: int = 1  # passes over each step's rollouts
    minibatches: int | None = None  # optimizer steps per pass, rows split evenly (None: 1 for reinforce, else 2)
    clip: float = 0.2  # the ratio's clip range (PPO's value clip too)
    scale_rewards: bool = True  # GRPO: divide by the group's std, TRL's group (false: the plain difference, its none)
    beta: float | None = None  # KL to the start: a k3 loss term (None: 0, off), PPO's reward penalty (None: 0.05)
    gamma: float = 1.0  # PPO: discount
    lam: float = 0.95  # PPO: GAE lambda
    vf_coef: float = 0.5  # PPO: the value loss's weight
    eval_limit: int = 256  # held-out problems per evaluation
    pass_k: int = 8  # pass@k: replies sampled per held-out problem (0 = no pass@k)
    # RunArgs's flags with RL's defaults
    max_steps: int = 800  # RL steps
    max_lr: float = 3e-4  # the learning rate after warmup
    # Adam's first steps move every weight by about the lr whatever its gradient: RL's noisy ones would wreck the policy
    warmup_steps: int = 10  # linear warmup of the learning rate
    lr_schedule: str = "linear"  # then linear decay to min_lr_frac * max_lr at --max-steps (or cosine, constant, wsd)
    min_lr_frac: float = 0.0  # the schedule decays to this times --max-lr
    weight_decay: float = 0.0  # decoupled weight decay
    eval_every: int = 100  # held-out greedy accuracy and pass@k every N steps (and at the end); 0 = at the end only
    ckpt_every: int = 50  # checkpoint every N steps (and at the end); 0 = only at the end
    out_dir: Annotated[str, LOCAL] = "out/rl"  # checkpoints, log.jsonl and profiler traces go here

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.algo not in ALGOS or self.loss_agg not in LOSS_AGG:
            raise ValueError(f"--algo must be one of {', '.join(ALGOS)} and --loss-agg one of {', '.join(LOSS_AGG)}; "
                             f"got {self.algo!r} and {self.loss_agg!r} (TRL's dapo is token, its grpo sequence)")
        tasks.parse_spec(self.task)
        algo = ALGOS[self.algo]
        self.minibatches = self.minibatches or (2 if "clip" in algo.flags else 1)  # one on-policy step, unclipped
        self.beta = self.beta if self.beta is not None else 0.05 if algo.critic else 0.0
        others, default = {f for a in ALGOS.values() for f in a.flags} - set(algo.flags), RLConfig.__dataclass_fields__
        if unused := sorted(f for f in others if getattr(self, f) != default[f].default):
            raise ValueError(f"--algo {self.algo} does not use --{flag(unused[0])}: drop it")
        check_counts(self, "prompts samples rollout_batch max_new_tokens ppo_epochs minibatches eval_limit".split())
        calls = self.rollout_batch * self.samples
        check_flags([
            (not (self.reward and self.reward_model), "--reward and --reward-model each score the replies: pass one"),
            (bool(self.reward) or not self.reward_weights, "--reward-weights weigh --reward's functions: add it"),
            (all(map(math.isfinite, self.reward_weights)), f"--reward-weights must be finite: {self.reward_weights}"),
            (algo.critic or self.samples >= 2,
             f"--algo {self.algo} scores each reply against its group's: --samples must be >= 2 (or --algo ppo)"),
            ("clip" in algo.flags or self.ppo_epochs * self.minibatches <= 1, f"--algo {self.algo} is on-policy: one "
             "optimizer step per batch of rollouts (--ppo-epochs 1 --minibatches 1)"),
            (not (self.prompts % self.rollout_batch or calls % self.minibatches),
             f"--prompts ({self.prompts}) must be a multiple of --rollout-batch ({self.rollout_batch}), and "
             f"--minibatches ({self.minibatches}) must divide a call's --rollout-batch x --samples = {calls} replies"),
            (self.temperature > 0 and self.parallel != "fsdp",  # FSDP's forwards are collectives: generation hangs
             f"RL samples its replies: --temperature must be > 0 and --parallel ddp or zero1 (FSDP cannot generate); "
             f"got --temperature {self.temperature} --parallel {self.parallel}"),
            # float32's range: past it a score or the loss is inf, and the NaN that follows was blamed on --max-lr
            (all(0 <= v <= tasks.FLOAT32_MAX for v in (self.beta, self.pass_k, self.vf_coef, self.missing_eos_penalty))
             and self.clip > 0 and 0 < self.gamma <= 1 and 0 <= self.lam <= 1, "--beta, --pass-k, --vf-coef and "
             "--missing-eos-penalty must be >= 0 and within float32's range, --clip > 0, --gamma in (0, 1] and --lam "
             "in [0, 1]")])


class PromptSampler:
    """The task's train problems, each epoch in a seeded order; `served` is the position (a checkpointed part)."""

    def __init__(self, problems: list[dict], seed: int):
        self.problems, self.seed, self.served, self.order = problems, seed, 0, (-1, [])
        self.digest = stage.digest(problems)[:16]  # once: a task's problems can be many

    def peek(self, n: int) -> list[dict]:
        """The n problems after the `served` ones, the same on every rank (a step serves them once it scored them)."""
        out = []
        for i in range(self.served, self.served + n):
            epoch, k = divmod(i, len(self.problems))
            if self.order[0] != epoch:
                self.order = epoch, random.Random(f"{self.seed}:{epoch}").sample(self.problems, len(self.problems))
            out.append(self.order[1][k])
        return out

    def state_dict(self) -> dict[str, int | str]:
        return {"served": self.served, "problems": len(self.problems), "seed": self.seed, "task_digest": self.digest}

    def load_state_dict(self, state: dict[str, int | str]) -> None:
        check_flags((state.get(key, mine) == mine, f"cannot resume the prompt stream: {key}={state.get(key)} in the "
                     f"checkpoint but {mine} here; resume with the same --task and --seed (and a task whose "
                     "examples('train') gives the same rows each run: seed its draws), or start a new run")
                    for key, mine in self.state_dict().items() if key != "served")
        self.served = int(state["served"])


def rollouts(model: GPT, problems: list[dict], samples: int, seed: int, cfg: RLConfig, rank: int,
             world: int) -> list[tuple[dict, list[int], Rollout]]:
    """This rank's (problem, prompt ids, reply) for `samples` replies to each problem, in a row: generate() call c of
    --rollout-batch problems runs on rank c % world, seeded seed + c: any number of ranks samples the same replies."""
    device, out = model.lm_head.weight.device, []
    for c in range(rank, -(-len(problems) // cfg.rollout_batch), world):
        chunk = problems[c * cfg.rollout_batch:(c + 1) * cfg.rollout_batch]
        prompts = [render_prompt(p["messages"][:-1]) for p in chunk for _ in range(samples)]
        replies = generate(model, prompts, cfg.max_new_tokens, temperature=cfg.temperature, stop_ids=REPLY_STOPS,
                           vocab=CHAT_VOCAB, calculator=calculator(),
                           generator=torch.Generator(device).manual_seed(seed + c))
        out += zip([p for p in chunk for _ in range(samples)], prompts, replies, strict=True)
    return out


def pack(rows: list[tuple[list[int], list[int]]], device: torch.device) -> tuple[Tensor, Tensor]:
    """(ids, mask) rows right-padded into (N, T) tensors."""
    T = max(len(ids) for ids, _ in rows)
    ids = torch.tensor([ids + [BOS] * (T - len(ids)) for ids, _ in rows], device=device)
    return ids, torch.tensor([mask + [0] * (T - len(mask)) for _, mask in rows], device=device, dtype=torch.float32)


def score(share: list[tuple[dict, list[int], Rollout]], reward: tasks.Reward | None, rm: GPT | None,
          device: torch.device) -> dict[str, Tensor]:
    """ids (N, T), the mask of sampled targets ids[:, 1:] (N, T-1), and scores: the reward functions' (they see the
    prompt's messages, the reply's text, the answer and the problem: TRL's columns) or the reward model's."""
    ids, mask = pack([(prompt + r.tokens, [0] * (len(prompt) - 1) + r.mask) for _, prompt, r in share], device)
    if rm is None:  # with each --reward function's own values, as tasks.checked's `last` names them (reward/FN)
        with full_precision(device):  # a user's function, as tasks.evaluate's check
            got = [(reward(p["messages"][:-1], reply_text(r.tokens), p["answer"], p), getattr(reward, "last", {}))
                   for p, _, r in share]
        own = {key: torch.tensor([last[key] for _, last in got], device=device) for key in got[0][1]}
        return {"ids": ids, "mask": mask[:, :-1], "scores": torch.tensor([s for s, _ in got], device=device), **own}
    bs, enc = rm.config.block_size, get_tokenizer()  # rendered as chat_format.render does, an empty reply too
    replies = [enc.encode_ordinary(reply_text(r.tokens)) + [ASSISTANT_END] for _, _, r in share]
    rows = [((p + o)[-bs:], ([0] * len(p) + [1] * len(o))[-bs:]) for (_, p, _), o in zip(share, replies, strict=True)]
    return {"ids": ids, "mask": mask[:, :-1], "scores": rewards(rm, *pack(rows, device), rm.reward_logprob).float()}


def policy_forward(model: torch.nn.Module, ids: Tensor, mask: Tensor, temperature: float,
                   values: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
    """The policy, the model at the sampling temperature (as TRL's: the rollouts are its own samples), its head on the N
    sampled tokens only: (log-probs (B, T) of ids[:, 1:], the (N, V) log-softmax, values (B, T) or None), 0 off mask."""
    m = mask.bool()
    logits, value = model(ids[:, :-1], values=values, at=m)
    logp = (logits.float() / temperature).log_softmax(-1)
    chosen = logp.gather(-1, ids[:, 1:][m][:, None]).squeeze(-1)
    return spread(chosen, m), logp, None if value is None else spread(value, m)


@torch.no_grad()
def token_stats(model: GPT, ids: Tensor, mask: Tensor, temperature: float = 1.0, values: bool = False,
                rows: int = 32) -> dict[str, Tensor]:
    """old_logp, entropy (and old_values) at sampled targets, eval mode, whole vocabulary (unlike generate()'s)."""
    out = []
    with evaluating(model):
        for chunk, m in zip(ids.split(rows), mask.split(rows), strict=True):
            logp, full, value = policy_forward(model, chunk, m, temperature, values)
            out.append(dict(old_logp=logp, entropy=spread(-(full.exp() * full).sum(-1), m.bool()), old_values=value))
    return {key: torch.cat([each[key] for each in out]) for key in out[0] if out[0][key] is not None}


def prepare(batch: dict[str, Tensor], raw: GPT, ref: GPT | None, cfg: RLConfig, world: int) -> dict[str, Tensor]:
    """Add what the update needs: the policy's old log-probs (and values), the reference's, the advantages."""
    ids, mask, algo = batch["ids"], batch["mask"], ALGOS[cfg.algo]
    batch |= token_stats(raw, ids, mask, cfg.temperature, algo.critic)
    if ref is not None:
        batch["ref_logp"] = token_stats(ref, ids, mask, cfg.temperature)["old_logp"]
    return batch | algo.advantages(batch, cfg, world)


def rl_loss(model: torch.nn.Module, mb: dict[str, Tensor], cfg: RLConfig, world: int) -> dict[str, Tensor]:
    """A minibatch's loss times world: DDP's mean over the ranks is then the loss over every rank's rows (mb["denom"]
    counts their tokens, or their rows for --loss-agg sequence)."""
    mask, denom, algo = mb["mask"], mb["denom"], ALGOS[cfg.algo]
    logp, _, values = policy_forward(model, mb["ids"], mask, cfg.temperature, algo.critic)
    per_token, clipped = surrogate(logp, mb["old_logp"], mb["adv"], cfg.clip if "clip" in algo.flags else None)
    if "ref_logp" in mb and not algo.critic:  # PPO's KL is in its rewards
        per_token = per_token + cfg.beta * kl_k3(logp, mb["ref_logp"])
    loss = aggregate(per_token, mask, cfg.loss_agg, denom)
    out = {"clip_frac": masked_mean(clipped.float(), mask, mb["tokens"]).detach() * world}  # all ranks' tokens
    if values is not None:
        vloss, _ = value_loss(values, mb["old_values"], mb["returns"], mask, cfg.clip, mb["tokens"])
        loss, out["value_loss"] = loss + cfg.vf_coef * vloss, vloss.detach() * world
    return {"loss": loss * world, **out}


def update(built: Any, objective: Objective, batch: dict[str, Tensor], cfg: RLConfig, world: int) -> dict[str, Tensor]:
    """--ppo-epochs passes of --minibatches optimizer steps (minibatch k: rows k, k + M, ...): the mean metrics."""
    M, steps, totals = cfg.minibatches, cfg.ppo_epochs * cfg.minibatches, {}
    tokens = all_sum(torch.stack([batch["mask"][k::M].sum() for k in range(M)]), world)
    rows = len(batch["mask"]) // M * world
    denom = {"token": tokens, "sequence": [rows] * M, "dr_grpo": [rows * cfg.max_new_tokens] * M}[cfg.loss_agg]
    for _ in range(cfg.ppo_epochs):
        for k in range(M):
            mb = {key: value[k::M] for key, value in batch.items()} | {"denom": denom[k], "tokens": tokens[k]}
            loss, norm = train_step(built.model, built.optimizer, lambda mb=mb: mb, 1, built.autocast, cfg.grad_clip,
                                    scaler=built.scaler, objective=objective)
            for name, value in {"loss": loss, "grad_norm": norm, **objective.last}.items():
                totals[name] = totals.get(name, 0.0) + value.float() / steps
    return totals


def summary(batch: dict[str, Tensor], totals: dict[str, Tensor], rollout_s: float, update_s: float, cfg: RLConfig,
            world: int) -> dict[str, Any]:
    """The step's record over every rank's rollouts (one all-reduce): the update's means, reward, KL, entropy, tok/s."""
    mask, r, old, has_ref = batch["mask"], batch["scores"], batch["old_logp"], "ref_logp" in batch
    kl = (kl_k3(old, batch.get("ref_logp", old)) * mask).sum()  # 0 without a reference (and not logged)
    sums = torch.stack([r.new_tensor(len(r)), r.sum(), (r * r).sum(), mask.sum(), (batch["entropy"] * mask).sum(),
                        kl, r.new_tensor(batch["ids"].numel()), *totals.values()]).double()
    n, r1, r2, sampled, entropy, kl, tokens, *means = all_sum(sums, world).tolist()
    return {**{name: value / world for name, value in zip(totals, means, strict=True)}, "tokens": int(tokens),
            "reward": (mean := r1 / n), "reward_std": max(0.0, r2 / n - mean**2) ** 0.5,
            **({"kl": kl / sampled} if has_ref else {}), "entropy": entropy / sampled, "length": sampled / n,
            "rollout_tok_s": sampled / rollout_s, "update_tok_s": tokens * cfg.ppo_epochs / update_s}


def rl_step(cfg: RLConfig, raw: GPT, built: Any, ref: GPT | None, reward: tasks.Reward, rm: GPT | None,
            sampler: PromptSampler, log: RunLog, ctx: Context) -> Callable[[int], dict[str, Any]]:
    """engine.Run's step_fn: roll out, score (by the reward model if any), update; record the whole batch's figures."""
    objective = Objective(lambda model, mb: rl_loss(model, mb, cfg, ctx.world))

    def step_fn(step: int) -> dict[str, Any]:
        t0, seed = time.time(), int(torch.randint(2**62, ()))  # the global RNG's, alike on every rank: an exact resume
        with built.autocast:  # the forwards before the update: rollouts, a reward model's, the old log-probs
            share = rollouts(raw, sampler.peek(cfg.prompts), cfg.samples, seed, cfg, ctx.rank, ctx.world)
            batch = common.same_verdict(lambda: score(share, reward, rm, ctx.device), ctx.world, common.ResumableError)
            cut = torch.tensor([r.tokens[-1] not in REPLY_STOPS for _, _, r in share], device=ctx.device)  # no stop met
            batch["scores"] -= cfg.missing_eos_penalty * cut  # TRL's: else a reward model scores a cut reply as ended
            sampler.served += cfg.prompts  # once scored: a reward that raises leaves the last step's state to save
            t1, lr = time.time(), engine.set_lr(built.optimizer, step, cfg)
            batch = prepare(batch, raw, ref, cfg, ctx.world)
        totals = update(built, objective, batch, cfg, ctx.world)  # and each --reward function's mean, as summary's
        totals |= {key: values.mean() for key, values in batch.items() if key.startswith("reward/")}
        record = {**summary(batch, totals, t1 - t0, time.time() - t1, cfg, ctx.world), "lr": lr}
        if step % cfg.log_every == 0:
            log.say(f"step {step:6d} | reward {record['reward']:.3f} +- {record['reward_std']:.3f} | entropy "
                    f"{record['entropy']:.3f} | clip {record['clip_frac']:.3f} | length {record['length']:.1f} | "
                    f"rollouts {record['rollout_tok_s']:,.0f} tok/s | updates {record['update_tok_s']:,.0f} tok/s")
        return record

    return step_fn


def task_eval(cfg: RLConfig, raw: GPT, task: Any, problems: list[dict], autocast: Any, log: RunLog,
              ctx: Context) -> engine.Eval:
    """Held-out greedy accuracy (tasks.evaluate) and pass@k by a generator of its own (the training's RNG untouched)."""

    def evaluate(step: int) -> dict[str, Any]:
        with autocast:
            result = tasks.evaluate(raw, task, problems, ctx.rank, ctx.world, cfg.max_new_tokens)
            if cfg.pass_k:
                share = rollouts(raw, problems, cfg.pass_k, cfg.seed + 1_000_003 * step, cfg, ctx.rank, ctx.world)
                with full_precision(ctx.device):  # a task's own check
                    right = common.same_verdict(lambda: [task.check(reply_text(r.tokens), p["answer"])  # all ranks stop
                                                         for p, _, r in share], ctx.world, common.ResumableError)
                solved = sum(any(right[i:i + cfg.pass_k]) for i in range(0, len(right), cfg.pass_k))
                result[f"pass@{cfg.pass_k}"] = all_sum(torch.tensor(float(solved)), ctx.world).item() / len(problems)
        passed = f", pass@{cfg.pass_k} {result[f'pass@{cfg.pass_k}']:.4f}" if cfg.pass_k else ""
        log.say(f"step {step:6d} | {cfg.task} accuracy {result['acc']:.4f}{passed} ({result['n']} held out)")
        return result

    return engine.Eval("task", cfg.eval_every, evaluate)


def load_reward_model(cfg: RLConfig, problems: list[dict]) -> GPT:
    """The frozen reward model, or a one-line refusal of one that cannot score these replies."""
    path, ckpt = cfg.reward_model, load_checkpoint(cfg.reward_model, mmap=True)
    mc, trained, n_vocab = ckpt["model_config"], ckpt.get("train_config", {}), get_tokenizer().n_vocab
    longest = tasks.longest_prompt(problems) + cfg.max_new_tokens + 1  # and its end
    what = "a PPO policy, whose value head is a critic" if "algo" in trained else "a language model"
    check_flags([(is_reward_model(ckpt), f"--reward-model {path} is {what}, not a reward model: train "
                  "one with prefs.py --objective reward"),
                 (mc.get("vocab_size", 0) >= n_vocab, f"--reward-model {path} has {mc.get('vocab_size')} embedding "
                  f"rows, fewer than the GPT-2 tokenizer's {n_vocab} ids the replies are scored in: it reads another "
                  "tokenizer's ids; train it on this project's GPT-2 tokens"),
                 (mc.get("block_size", 0) >= longest, f"--reward-model {path} reads {mc.get('block_size')} tokens, and "
                  f"a prompt with a reply of --max-new-tokens {cfg.max_new_tokens} takes {longest}: lower "
                  "--max-new-tokens or train the reward model with a longer --seq-len")])
    rm = frozen_copy(GPT.from_checkpoint(ckpt, dropout=0.0))
    rm.reward_logprob = bool(trained.get("reward_logprob"))  # scored as it was trained
    return rm


def load(cfg: RLConfig) -> tuple[Any, tasks.Reward, GPT, list[dict], list[dict], GPT | None]:
    """The task, the reward, the policy, the train and held-out problems and the reward model, or a one-line refusal."""
    task = tasks.load_task(cfg.task, train=not cfg.eval_only)  # --eval-only scores one split: a FILE will do
    reward = tasks.load_rewards(cfg.reward, cfg.reward_weights) if cfg.reward else tasks.task_reward(task, cfg.task)
    stage.check_not_run_dir(cfg.init_from, "sft.py")  # a missing start, named as the flag that gives it
    # a reward model refused, a PPO critic dropped where none is trained, HF GPT-2's rows padded for the chat tokens
    raw = GPT.load(cfg.init_from, None, value_head=ALGOS[cfg.algo].critic, dropout=0.0).pad_vocab(GPTConfig.vocab_size)
    train_problems, test_problems, bs = task.examples("train"), task.examples("test"), raw.config.block_size
    longest = tasks.longest_prompt(train_problems + test_problems)
    check_flags([(longest < bs, f"--task {cfg.task}: a prompt takes {longest} tokens, the policy's whole context {bs}: "
                  "no room for a reply (a 1-token one at most)")])
    rm = load_reward_model(cfg, train_problems) if cfg.reward_model else None
    return task, reward, raw, train_problems, tasks.held_out(task, test_problems, cfg.eval_limit), rm


def setup(cfg: RLConfig, ctx: Context) -> Run:
    """The Run: the policy, its frozen reference and its rewards, the prompt stream, the resumed checkpoint and log."""
    torch.manual_seed(cfg.seed)  # the same on every rank: each step's rollout seed is drawn from it
    checkpointer = engine.Checkpointer(cfg, ctx.rank, ctx.world, provenance(ctx.device, ctx.world), chat=True)
    cfg = engine.resumed_start(cfg, found := checkpointer.find(), ctx)  # the policy and its KL anchor load from it
    # a node that cannot read a file (--init-from, --reward-model, a task's or reward's .py) stops every rank
    task, reward, raw, train_problems, test_problems, rm = common.same_verdict(lambda: load(cfg), ctx.world)
    if found:
        saved = found[1].get("train_config", {}).get("algo", cfg.algo)
        check_flags([(saved == cfg.algo, f"--resume {found[0]} was trained with --algo {saved}, " + (
            f"and --eval-only builds the policy (PPO's with a value head) by --algo: pass --algo {saved}"
            if cfg.eval_only else f"whose optimizer state this run's --algo {cfg.algo} cannot take: pass --algo "
            f"{saved}, or start a new run from its weights with --init-from {found[0]}"))])
        stage.check_resume(found, cfg)
    engine.agree_fingerprint(lambda: {"command": engine.command_of(cfg), "model": raw.config,  # --init-from's options
                                      "weights": engine.weights_digest(raw),
                                      "--reward-model": rm and (engine.weights_digest(rm), rm.config),  # + options
                                      "--task data": stage.digest([train_problems, test_problems])},  # each node's
                             ctx.rank, ctx.world, f"--init-from {cfg.init_from}")
    if (cfg.prompts // cfg.rollout_batch) % ctx.world:
        raise ValueError(f"--prompts {cfg.prompts} make {cfg.prompts // cfg.rollout_batch} generate() calls of "
                         f"--rollout-batch {cfg.rollout_batch}, not a multiple of the {ctx.world} ranks: each must get "
                         f"as many; pass --prompts {cfg.rollout_batch * ctx.world} or a multiple")
    raw, rm = raw.to(ctx.device), rm.to(ctx.device) if rm else None
    ref = frozen_copy(raw) if cfg.beta > 0 else None
    parts = {"sampler": PromptSampler(train_problems, cfg.seed), "reference": ref and stage.Reference(
        engine.weights_digest(ref.transformer), cfg.init_from, "was anchored (--beta) to")}
    built, start = stage.build_and_resume(raw, parts, cfg, ctx, checkpointer, found)
    log = engine.open_log(cfg, raw, built, ctx, checkpointer, found, start)
    if not cfg.eval_only:  # which scores the weights once: no rollouts, and maybe not --init-from's weights
        log.say(f"{cfg.algo}: {cfg.prompts} prompts x {cfg.samples} replies per step ({cfg.prompts // ctx.world} x "
                f"{cfg.samples} rows a rank, {ctx.world} ranks) from --init-from {cfg.init_from}")
    if ctx.master and not found and not is_chat(cfg.init_from):  # R1-Zero's start: allowed
        log.say(f"warning: --init-from {cfg.init_from} is not a chat model (sft.py makes one): its replies will not "
                "follow the chat format at first", file=sys.stderr)
    return Run(cfg=cfg, ctx=ctx, step_fn=rl_step(cfg, raw, built, ref, reward, rm, parts["sampler"], log, ctx),
               evals=[task_eval(cfg, raw, task, test_problems, built.autocast, log, ctx)], raw=raw,
               trainable=built, checkpointer=checkpointer, log=log, parts=parts, start_step=start, resumed=bool(found))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The command line (or a list of flags): parse, set up, train. A user error is one line and SystemExit(1)."""
    return stage.main(RLConfig, argv, {}, setup, __doc__)


if __name__ == "__main__":
    run_and_exit(main, stage.exit_code)
