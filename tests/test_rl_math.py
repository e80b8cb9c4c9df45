"""rl.py's math against hand computations: GRPO, RLOO and REINFORCE advantages, the clipped policy and value losses,
the loss aggregations, k3 KL, GAE, the KL penalty folded into rewards."""

import contextlib
import math
from types import SimpleNamespace

import pytest
import torch

import rl
from parallel import Objective
from rl import (
    ALGOS,
    RLConfig,
    aggregate,
    gae,
    group_advantages,
    kl_k3,
    kl_rewards,
    leave_one_out,
    masked_mean,
    surrogate,
    value_loss,
    whiten,
)


def test_group_advantages_with_and_without_the_std():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 0.0, 0.0, 1.0])
    plain = group_advantages(rewards, 4, scale=False)  # Dr. GRPO
    torch.testing.assert_close(plain, torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0, 2, -1, -1, 0]))
    scaled = group_advantages(rewards, 4)
    std1, std3 = math.sqrt(4 * 0.25 / 3), math.sqrt((4 + 1 + 1 + 0) / 3)  # unbiased: n - 1 = 3
    expected = [x / (std1 + 1e-4) for x in (0.5, -0.5, -0.5, 0.5)]
    expected += [0.0] * 4 + [x / (std3 + 1e-4) for x in (2.0, -1.0, -1.0, 0.0)]
    torch.testing.assert_close(scaled, torch.tensor(expected))  # a group of equal rewards: 0, not NaN
    for scale, want in ((False, plain), (True, scaled)):  # as --algo grpo computes them, --scale-rewards or not
        got = ALGOS["grpo"].advantages({"scores": rewards}, RLConfig(samples=4, scale_rewards=scale), 1)["adv"]
        torch.testing.assert_close(got, want)


def policy_loss(logp, old, adv, mask, denom=None):
    """rl_loss's policy term for --loss-agg token, and the clipped share."""
    loss, clipped = surrogate(logp, old, adv)
    return aggregate(loss, mask, "token", denom), masked_mean(clipped.float(), mask)


def test_clipped_policy_loss_at_known_ratios():
    # one token per case: (ratio, advantage) -> the surrogate -min(r A, clip(r) A) with eps = 0.2
    cases = [(1.1, 1.0, -1.1), (1.5, 1.0, -1.2), (1.5, -1.0, 1.5), (0.5, -1.0, 0.8), (0.5, 1.0, -0.5), (0.9, -2.0, 1.8)]
    ratio = torch.tensor([[r for r, _, _ in cases]])
    old = torch.zeros_like(ratio)
    adv = torch.tensor([[a for _, a, _ in cases]])
    mask = torch.ones_like(ratio)
    for i, (_, _, want) in enumerate(cases):
        one = torch.zeros_like(mask)
        one[0, i] = 1
        loss, clipped = policy_loss(ratio.log(), old, adv, one)
        assert abs(loss.item() - want) < 1e-6, (i, loss.item(), want)
        assert clipped.item() == (i in (1, 3))  # r A was above the clipped term only there
    loss, clipped = policy_loss(ratio.log(), old, adv, mask)
    assert abs(loss.item() - sum(w for _, _, w in cases) / 6) < 1e-6 and abs(clipped.item() - 2 / 6) < 1e-6


def test_policy_loss_is_a_token_mean_over_the_batch_and_clipped_tokens_get_no_gradient():
    logp = torch.log(torch.tensor([[1.5, 1.0, 1.0], [1.0, 0.0, 0.0]]).clamp(min=1e-9)).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = torch.tensor([1.0, -1.0])  # per sequence
    loss, _ = policy_loss(logp, torch.zeros(2, 3), adv, mask)
    # tokens: -1.2 (clipped), -1, -1, then +1: 4 tokens, not a mean of the two rows' means
    assert abs(loss.item() - (-1.2 - 1 - 1 + 1) / 4) < 1e-6
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.25, -0.25], [0.25, 0.0, 0.0]]))
    fixed, _ = policy_loss(logp.detach(), torch.zeros(2, 3), adv, mask, denom=8.0)  # Dr. GRPO's constant
    assert abs(fixed.item() - (-1.2 - 1 - 1 + 1) / 8) < 1e-6


def test_k3_kl_closed_form_and_unbiased_on_samples():
    logp, ref = torch.tensor([0.0, math.log(0.5), math.log(0.25)]), torch.tensor([0.0, 0.0, math.log(0.5)])
    torch.testing.assert_close(kl_k3(logp, ref), torch.tensor([0.0, 1 - math.log(2), 1 - math.log(2)]))
    # on tokens drawn from the policy its mean is KL(p || q)
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.4, 0.4, 0.2])
    draws = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    estimate = kl_k3(p.log()[draws], q.log()[draws]).mean().item()
    exact = (p * (p / q).log()).sum().item()
    assert abs(estimate - exact) < 3e-3 and exact > 0.1


def test_gae_against_a_hand_computation_with_a_forced_token_and_padding():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.1, 5.0, 0.2, 1.0, 7.0]])  # 5.0 and 7.0 sit on masked tokens: ignored
    values = torch.tensor([[0.5, 9.0, 0.4, 0.3, 9.0]])
    mask = torch.tensor([[1, 0, 1, 1, 0]])  # a forced token at 1, padding at 4
    adv, ret = gae(rewards, values, mask, gamma, lam)
    d3 = 1.0 - 0.3  # last sampled token: no next value
    d2 = 0.2 + gamma * 0.3 - 0.4
    d0 = 0.1 + gamma * 0.4 - 0.5  # its next sampled token is 2, past the forced one
    a3, a2 = d3, d2 + gamma * lam * d3
    a0 = d0 + gamma * lam * a2
    torch.testing.assert_close(adv, torch.tensor([[a0, 0.0, a2, a3, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, 0.0, a2 + 0.4, a3 + 0.3, 0.0]]))
    # gamma = lam = 1: the advantage is the reward-to-go minus the value
    adv1, _ = gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv1, torch.tensor([[1.3 - 0.5, 0.0, 1.2 - 0.4, 1.0 - 0.3, 0.0]]))
    # --algo ppo: GAE with its --gamma and --lam on kl_rewards' rewards (--beta), whitened over the sampled tokens
    logp, ref, score = torch.tensor([[-1.0, -2.0, -0.5, -0.3, 0.0]]), torch.tensor([[-1.5, -2.0, -1.0, -0.2, 0.0]]), 2.0
    batch = {"mask": mask, "old_logp": logp, "ref_logp": ref, "scores": torch.tensor([score]), "old_values": values}
    out = ALGOS["ppo"].advantages(batch, RLConfig(algo="ppo", samples=1, gamma=gamma, lam=lam, beta=0.1), 1)
    want, ret = gae(kl_rewards(torch.tensor([score]), logp, ref, mask, 0.1), values, mask, gamma, lam)
    torch.testing.assert_close(out["adv"], whiten(want, mask))
    torch.testing.assert_close(out["returns"], ret)


def test_clipped_value_loss():
    old = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    values = torch.tensor([[1.1, 2.0, 0.0, 1.5]])
    returns = torch.tensor([[0.0, 3.0, 0.0, 1.5]])
    loss, clipped = value_loss(values, old, returns, torch.tensor([[1, 1, 1, 0]]))
    # v_clipped = [1.1, 1.2, 0.8]: max((v-R)^2, (vc-R)^2) = [1.21, max(1, 3.24), max(0, 0.64)]
    assert abs(loss.item() - 0.5 * (1.21 + 3.24 + 0.64) / 3) < 1e-6
    assert abs(clipped.item() - 2 / 3) < 1e-6


def test_kl_penalty_folded_into_rewards_and_whiten():
    logp = torch.tensor([[-1.0, -2.0, -1.0, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0, 0.0], [-0.5, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    out = kl_rewards(torch.tensor([2.0, -1.0]), logp, ref, mask, coef=0.1)
    torch.testing.assert_close(out, torch.tensor([[-0.05, 0.1, 2.0, 0.0], [0.05, -1.0, 0.0, 0.0]]))
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    w = whiten(x, torch.tensor([[1, 1, 1, 0]]))
    # TRL's masked_whiten: mean 2, unbiased variance (1 + 0 + 1) / (3 - 1) = 1, the masked entry 0
    torch.testing.assert_close(w, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    # one token: n - 1 = 0 is taken as 1, so 0 (TRL's masked_whiten: 0 * 1/0, NaN)
    assert whiten(torch.tensor([[5.0, 7.0]]), torch.tensor([[1, 0]])).tolist() == [[0.0, 0.0]]


def test_rloo_and_reinforce_baselines_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 0.0, 0.0, 1.0])
    # each reward minus the mean of the other three in its group of 4
    want = torch.tensor([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3, 3 - 1 / 3, 0 - 4 / 3, 0 - 4 / 3, 1 - 1])
    torch.testing.assert_close(leave_one_out(rewards, 4), want)
    torch.testing.assert_close(leave_one_out(rewards, 4), group_advantages(rewards, 4, scale=False) * 4 / 3)
    batch, cfg = {"scores": rewards}, RLConfig(samples=4, algo="reinforce")
    torch.testing.assert_close(ALGOS["rloo"].advantages(batch, RLConfig(samples=4, algo="rloo"), 1)["adv"], want)
    torch.testing.assert_close(ALGOS["reinforce"].advantages(batch, cfg, 1)["adv"],
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 2, -1, -1, 0]))  # the group's mean, no std
    assert cfg.minibatches == 1 and "clip" not in ALGOS["reinforce"].flags and RLConfig(algo="rloo").minibatches == 2


def test_without_a_clip_the_gradient_is_reinforces():
    logp = torch.log(torch.tensor([[0.5, 0.2], [0.3, 0.9]])).requires_grad_()
    adv, mask = torch.tensor([2.0, -1.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, clipped = surrogate(logp, logp.detach(), adv, eps=None)  # on-policy: the ratio is 1
    aggregate(loss, mask).backward()
    torch.testing.assert_close(logp.grad, -adv[:, None] * mask / 3)  # -A d log p, over the 3 tokens
    assert not clipped.any()


def test_loss_aggregations_as_trl_names_them():
    x = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert aggregate(x, mask, "token").item() == pytest.approx((1 + 2 + 3 + 4) / 4)  # TRL's dapo: every token alike
    assert aggregate(x, mask, "sequence").item() == pytest.approx((2 + 4) / 2)  # TRL's grpo: every row's mean alike
    assert aggregate(x, mask, "dr_grpo", denom=2 * 4).item() == pytest.approx(10 / 8)  # rows x the longest reply
    # the denominators of all micro-batches and ranks: this one's share of the whole
    assert aggregate(x, mask, "sequence", denom=4).item() == pytest.approx(6 / 4)


# rl_loss and update on a policy of one weight against hand computations: the k3 term, each --loss-agg's denominators

P0 = 0.75  # Tilt's p(token 0) at theta = log 3; d log p / d theta is 1 - P0 for token 0, -P0 for token 1
REPLIES = [[0, 0, 1], [1], [0, 1, 0, 0], [0, 0], [1, 1], [0, 1, 1, 0, 1], [0], [1, 0, 0]]  # sampled tokens per row
ADV = [1.0, -0.5, 2.0, -1.5, 0.5, 1.5, -2.0, 0.25]
SHIFT, REF, MAX_NEW = 0.1, math.log(0.5), 6  # old_logp = logp - SHIFT (ratio e^0.1, unclipped); ref_logp = log 0.5


class Tilt(torch.nn.Module):
    """A policy over 2 tokens: logits [theta, 0] at each position asked for (`at`), whatever the context."""

    def __init__(self):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.tensor(math.log(P0 / (1 - P0))))

    def forward(self, idx, values=False, at=None):
        n = int(at.sum())
        logits = torch.stack([self.theta.expand(n), self.theta.new_zeros(n)], -1)
        return logits, (self.theta * 0).expand(n) if values else None


def rl_batch(rows):
    """REPLIES[rows] after a one-token prompt, padded: ids, mask (1 on the reply), advantages, old and ref log-probs."""
    width = max(len(REPLIES[i]) for i in rows)
    ids, mask = torch.zeros(len(rows), 1 + width, dtype=torch.long), torch.zeros(len(rows), width)
    for j, i in enumerate(rows):
        ids[j, 1:1 + len(REPLIES[i])], mask[j, :len(REPLIES[i])] = torch.tensor(REPLIES[i]), 1
    logp = torch.where(ids[:, 1:] == 0, math.log(P0), math.log(1 - P0)) * mask
    return {"ids": ids, "mask": mask, "adv": torch.tensor([ADV[i] for i in rows]), "old_logp": (logp - SHIFT) * mask,
            "ref_logp": REF * mask}


def by_hand(rows, how, beta):
    """(loss, d loss / d theta) of rl_loss over REPLIES[rows], by hand: per token -r A + beta k3, k3 = e^d - d - 1 at
    d = ref - logp, aggregated as `how` says over these rows (of all ranks)."""
    r, loss, grad = math.exp(SHIFT), 0.0, 0.0
    tokens = sum(len(REPLIES[i]) for i in rows)
    for i in rows:
        row_loss = row_grad = 0.0
        for tok in REPLIES[i]:
            d = REF - math.log(P0 if tok == 0 else 1 - P0)
            row_loss += -r * ADV[i] + beta * (math.exp(d) - d - 1)
            row_grad += (-r * ADV[i] + beta * (1 - math.exp(d))) * ((1 - P0) if tok == 0 else -P0)
        n = {"token": tokens, "sequence": len(REPLIES[i]) * len(rows), "dr_grpo": len(rows) * MAX_NEW}[how]
        loss, grad = loss + row_loss / n, grad + row_grad / n
    return loss, grad


def test_the_grpo_loss_adds_beta_times_k3_to_each_token():
    model, mb = Tilt(), rl_batch([0, 1])  # 3 + 1 tokens
    for beta in (0.0, 0.2):
        cfg = RLConfig(beta=beta, temperature=1.0, max_new_tokens=MAX_NEW)
        out = rl.rl_loss(model, mb | {"denom": torch.tensor(4.0), "tokens": torch.tensor(4.0)}, cfg, 1)
        out["loss"].backward()
        loss, grad = by_hand([0, 1], "token", beta)
        assert out["loss"].item() == pytest.approx(loss, rel=1e-6) and out["clip_frac"].item() == 0
        assert model.theta.grad.item() == pytest.approx(grad, rel=1e-6)
        model.theta.grad = None
    # the k3 term by itself: two tokens 0 (d = log 2/3) and two 1 (d = log 2), over the 4 tokens
    assert by_hand([0, 1], "token", 0.2)[0] - by_hand([0, 1], "token", 0.0)[0] == pytest.approx(
        0.2 * (2 * (2 / 3 - math.log(2 / 3) - 1) + 2 * (2 - math.log(2) - 1)) / 4)
    # PPO's KL is in its rewards (kl_rewards), not in its loss: no k3 term with its --beta
    ppo_mb = mb | {"denom": torch.tensor(4.0), "tokens": torch.tensor(4.0), "old_values": torch.zeros(2, 3),
                   "returns": torch.zeros(2, 3), "adv": mb["adv"][:, None] * mb["mask"]}
    out = rl.rl_loss(model, ppo_mb, RLConfig(algo="ppo", samples=1, beta=0.2, temperature=1.0), 1)
    assert out["loss"].item() == pytest.approx(by_hand([0, 1], "token", 0.0)[0], rel=1e-6)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("how", ["token", "sequence", "dr_grpo"])
def test_update_divides_each_minibatch_as_its_loss_agg_says_over_every_rank(how, world, monkeypatch):
    """--minibatches 2 over 8 rows of 1 to 5 tokens (minibatch k: rows k, k + 2, ...), on one rank or split over two
    (the first four rows on rank 0): each optimizer step's loss and gradient (the ranks' mean, as DDP's) are the hand
    values over its rows of every rank: token / the minibatch's tokens, sequence / its rows, dr_grpo / rows x 6."""
    cfg = RLConfig(loss_agg=how, beta=0.1, temperature=1.0, max_new_tokens=MAX_NEW, grad_clip=0.0)
    shares = [list(range(8))] if world == 1 else [[0, 1, 2, 3], [4, 5, 6, 7]]
    batches = [rl_batch(rows) for rows in shares]
    counts = [torch.stack([b["mask"][k::2].sum() for k in range(2)]) for b in batches]
    losses, grads = torch.zeros(2), torch.zeros(2)
    for rank, batch in enumerate(batches):
        others = sum(c for j, c in enumerate(counts) if j != rank)  # all_sum: this rank's token counts plus the other's
        monkeypatch.setattr(rl, "all_sum", lambda t, w, others=others: t + others)
        model, seen, outs = Tilt(), [], []  # each optimizer step's gradient and rl_loss on this rank
        model.theta.register_hook(lambda g, seen=seen: seen.append(g.item()))
        built = SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), scaler=None,
                                autocast=contextlib.nullcontext())  # lr 0: both steps see theta = log 3
        objective = Objective(lambda m, mb, outs=outs: outs.append(rl.rl_loss(m, mb, cfg, world)) or outs[-1])
        totals = rl.update(built, objective, batch, cfg, world)
        step_losses = torch.tensor([out["loss"].item() for out in outs])
        assert len(seen) == 2 and totals["loss"].item() == pytest.approx(step_losses.mean().item(), rel=1e-6)
        losses, grads = losses + step_losses / world, grads + torch.tensor(seen) / world
    for k in range(2):
        loss, grad = by_hand(list(range(k, 8, 2)), how, 0.1)
        assert losses[k].item() == pytest.approx(loss, rel=1e-5) and grads[k].item() == pytest.approx(grad, rel=1e-5)


def test_the_logged_clip_fraction_is_over_every_ranks_tokens():
    """Rows 0-1 (4 tokens) on one rank, rows 2-7 (17) on the other; --clip 0.05 < the ratio's e^0.1 - 1 clips the
    tokens of a positive advantage (17 of 21): the record's all_sum / world is 17/21, not the mean of 3/4 and 14/17."""
    cfg = RLConfig(clip=0.05, temperature=1.0, max_new_tokens=MAX_NEW)
    tokens = torch.tensor(21.0)  # update's all_sum of the minibatch's tokens
    shares = [rl_batch(rows) | {"denom": tokens, "tokens": tokens} for rows in ([0, 1], [2, 3, 4, 5, 6, 7])]
    outs = [rl.rl_loss(Tilt(), mb, cfg, 2) for mb in shares]
    assert sum(out["clip_frac"] for out in outs).item() / 2 == pytest.approx(17 / 21, rel=1e-6)


def all_reduce_between_threads(world: int):
    """rl.all_sum as `world` threads, one a rank, see it: each call returns the sum of every thread's tensor."""
    import threading

    barrier, slots = threading.Barrier(world, timeout=30), {}

    def all_sum(t, w):
        assert w == world
        slots[threading.get_ident()] = t.clone()
        barrier.wait()
        total = sum(slots.values())
        barrier.wait()  # every rank has read the slots before any writes its next
        return total

    return all_sum


def test_ppo_whitens_its_advantages_over_every_ranks_tokens(monkeypatch):
    import threading

    torch.manual_seed(0)
    masks = [torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]]), torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])]
    batches = [{"mask": m, "old_logp": -torch.rand(2, 5), "scores": torch.randn(2) + 3 * r,
                "old_values": torch.randn(2, 5)} for r, m in enumerate(masks)]  # the ranks' rewards apart
    cfg = RLConfig(algo="ppo", samples=1)
    whole = ALGOS["ppo"].advantages({k: torch.cat([b[k] for b in batches]) for k in batches[0]}, cfg, 1)["adv"]
    monkeypatch.setattr(rl, "all_sum", all_reduce_between_threads(2))
    out = [None, None]
    ranks = [threading.Thread(target=lambda r=r: out.__setitem__(r, ALGOS["ppo"].advantages(batches[r], cfg, 2)))
             for r in (0, 1)]
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    torch.testing.assert_close(torch.cat([o["adv"] for o in out]), whole)  # one process's whitening of all the rows


def test_the_step_record_is_over_every_ranks_rollouts(monkeypatch):
    import threading

    masks = [torch.tensor([[1, 1, 0], [1, 0, 0]]), torch.tensor([[1, 1, 1], [0, 0, 0]])]  # 3 + 3 sampled tokens
    batches = [{"mask": m, "scores": torch.tensor(s), "ids": torch.zeros(2, 4, dtype=torch.long),
                "old_logp": torch.zeros(2, 3), "ref_logp": torch.full((2, 3), math.log(2)),  # k3: 1 - ln 2 a token
                "entropy": torch.tensor(e)} for m, s, e in
               ((masks[0], [2.0, 0.0], [[0.5, 0.5, 9.0], [1.0, 9.0, 9.0]]),
                (masks[1], [4.0, 0.0], [[2.0, 2.0, 2.0], [9.0, 9.0, 9.0]]))]
    cfg, out = RLConfig(ppo_epochs=2), [None, None]
    monkeypatch.setattr(rl, "all_sum", all_reduce_between_threads(2))
    ranks = [threading.Thread(target=lambda r=r: out.__setitem__(r, rl.summary(
        batches[r], {"loss": torch.tensor(0.2 * (r + 1))}, 2.0, 4.0, cfg, 2))) for r in (0, 1)]  # 2 s, 4 s
    for t in ranks:
        t.start()
    for t in ranks:
        t.join()
    want = {"loss": pytest.approx(0.3), "tokens": 16, "reward": 1.5, "reward_std": pytest.approx(2.75 ** 0.5),
            "kl": pytest.approx(1 - math.log(2)), "entropy": pytest.approx(8 / 6), "length": 1.5,
            "rollout_tok_s": 3.0, "update_tok_s": 8.0}  # rewards 2, 0, 4, 0; 6 sampled of 4 rows; 2 x 8 ids, 2 passes
    assert out[0] == out[1] == want


def test_ppos_loss_adds_vf_coef_times_the_value_loss_over_every_ranks_tokens():
    """Tilt's values are 0 (and so are the old ones): the clipped value loss is 0.5 R^2 a token, summed over the 4
    sampled tokens here and divided by the 10 of every rank's minibatch (mb["tokens"]), times --vf-coef (not 0.5)."""
    mb, returns = rl_batch([0, 1]), torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])  # 9.0: off the mask
    tokens = torch.tensor(10.0)
    ppo_mb = mb | {"denom": tokens, "tokens": tokens, "old_values": torch.zeros(2, 3), "returns": returns,
                   "adv": mb["adv"][:, None] * mb["mask"]}
    out = rl.rl_loss(Tilt(), ppo_mb, RLConfig(algo="ppo", samples=1, vf_coef=0.25, temperature=1.0), 2)
    vloss = 0.5 * (1 + 4 + 9 + 16) / 10
    policy = by_hand([0, 1], "token", 0.0)[0] * 4 / 10  # by_hand divides by these rows' 4 tokens
    assert out["value_loss"].item() == pytest.approx(2 * vloss, rel=1e-6)  # times world, as the loss
    assert out["loss"].item() == pytest.approx(2 * (policy + 0.25 * vloss), rel=1e-6)


def test_the_policys_log_probs_and_entropy_are_at_the_sampling_temperature():
    """Tilt's logits [log 3, 0] at temperature 0.5 are [2 log 3, 0]: p(token 0) = 9/10, as generate() sampled them."""
    mb = rl_batch([0, 1])  # tokens 0, 0, 1 and 1
    stats = rl.token_stats(Tilt(), mb["ids"], mb["mask"], temperature=0.5)
    p = 0.9
    want = torch.tensor([[math.log(p), math.log(p), math.log(1 - p)], [math.log(1 - p), 0.0, 0.0]])
    torch.testing.assert_close(stats["old_logp"], want)
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    torch.testing.assert_close(stats["entropy"], torch.tensor([[entropy] * 3, [entropy, 0.0, 0.0]]))


def test_ppo_epochs_make_as_many_passes_over_the_minibatches():
    """--ppo-epochs 2 --minibatches 2: four optimizer steps, the second pass again minibatch 0 then 1 (lr 0: the same
    gradients), and the record's loss the mean of the four."""
    cfg = RLConfig(ppo_epochs=2, beta=0.0, temperature=1.0, max_new_tokens=MAX_NEW, grad_clip=0.0)
    model, seen, outs = Tilt(), [], []
    model.theta.register_hook(lambda g: seen.append(g.item()))
    built = SimpleNamespace(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), scaler=None,
                            autocast=contextlib.nullcontext())
    objective = Objective(lambda m, mb: outs.append(rl.rl_loss(m, mb, cfg, 1)) or outs[-1])
    totals = rl.update(built, objective, rl_batch(list(range(8))), cfg, 1)
    want = [by_hand(list(range(k, 8, 2)), "token", 0.0) for k in (0, 1)] * 2
    assert seen == pytest.approx([grad for _, grad in want], rel=1e-5)
    assert totals["loss"].item() == pytest.approx(sum(loss for loss, _ in want) / 4, rel=1e-5)
