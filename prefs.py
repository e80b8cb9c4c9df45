"""Preference pairs and the two objectives trained on them, a Bradley–Terry reward model and DPO: each is an
objective for parallel.train_step on the engine (no loop of its own), plus held-out pairwise accuracy.

A row is a pair in one of three schemas:
    text           {"prompt", "chosen", "rejected"}: the replies as text; the prompt as text or a list of messages
    conversations  HuggingFaceH4/ultrafeedback_binarized (splits train_prefs, test_prefs): chosen and rejected are
                   whole conversations [{"role", "content"}, ...] that end with the assistant's reply
    transcripts    Anthropic/hh-rlhf (splits train, test): chosen and rejected only, "\\n\\nHuman: ...\\n\\nAssistant:
                   ..." each; their shared prefix up to its last "\\n\\nAssistant:" is the prompt
Each side renders as the prompt's conversation plus its reply; the mask covers the reply's tokens.
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from chat_format import RowStream, load_rows, render, split_rows
from common import EOT
from fineweb import DataError

ASSISTANT = "\n\nAssistant:"
TURN = re.compile(r"\n\n(Human|Assistant):")
ROLES = {"Human": "user", "Assistant": "assistant"}
HELD_OUT = {"HuggingFaceH4/ultrafeedback_binarized": ("train_prefs", "test_prefs")}  # a hub dataset's split names
Metrics = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------------------------------------------------
# Rows: read, parse, render


def read_rows(source: str, split: str) -> Any:
    """(index, row) of `split`'s rows; "val" is held out as chat_format's conversations are: a single file's every
    VAL_EVERY-th row ("train" the others), a directory's or hub dataset's test split (UltraFeedback's test_prefs)."""
    if split not in ("train", "val"):
        return list(enumerate(load_rows(source, split)))
    return list(split_rows(source, split, HELD_OUT.get(source, ("train", "test"))))


def split_transcripts(chosen: str, rejected: str) -> tuple[list[dict], str, str]:
    """Two hh-rlhf transcripts -> (the prompt's messages, chosen reply, rejected reply)."""
    cut = chosen.rfind(ASSISTANT, 0, len(os.path.commonprefix([chosen, rejected])))
    if cut < 0:
        raise ValueError("no 'prompt' field, and chosen and rejected are not Human/Assistant transcripts that share "
                         "a prompt")
    pieces = TURN.split(chosen[:cut])
    prompt = [{"role": ROLES[r], "content": c.strip()} for r, c in zip(pieces[1::2], pieces[2::2], strict=True)]
    return prompt, chosen[cut + len(ASSISTANT):].strip(), rejected[cut + len(ASSISTANT):].strip()


def parse_pair(row: dict) -> tuple[list[dict], str, str]:
    """(prompt messages, chosen reply, rejected reply) of a row in any of the three schemas; a ValueError if bad."""
    for key in ("chosen", "rejected"):
        if row.get(key) is None:
            raise ValueError(f"missing field {key!r}")
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    if isinstance(chosen, list) and isinstance(rejected, list):  # whole conversations
        if chosen[:-1] != rejected[:-1]:
            raise ValueError("chosen and rejected continue different conversations")
        prompt = chosen[:-1]
        chosen, rejected = (m[-1].get("content") if m and isinstance(m[-1], dict) else None for m in (chosen, rejected))
    elif prompt is None and isinstance(chosen, str) and isinstance(rejected, str):
        prompt, chosen, rejected = split_transcripts(chosen, rejected)
    elif isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not (isinstance(prompt, list) and isinstance(chosen, str) and isinstance(rejected, str)):
        raise ValueError("expected the prompt as text or messages, chosen and rejected as text or conversations")
    for name, reply in (("chosen", chosen), ("rejected", rejected)):
        if not reply.strip():
            raise ValueError(f"the {name} reply is empty")
    if chosen == rejected:
        raise ValueError("chosen == rejected: the pair prefers nothing")
    return prompt, chosen, rejected


def render_pairs(rows: Any, name: str, T: int) -> tuple[list[list[np.ndarray]], np.ndarray, int]:
    """Each pair's [chosen ids, rejected ids], their replies' first positions (n, 2), and the count of pairs dropped
    because a side is longer than T tokens (cut, it would score another reply or none)."""
    ids, starts, dropped = [], [], 0
    for i, row in rows:
        try:
            prompt, *replies = parse_pair(row)
            sides = [render([*prompt, {"role": "assistant", "content": reply}]) for reply in replies]
        except ValueError as e:
            raise DataError(f"{name} row {i}: {e}") from None
        if max(len(side) for side, _ in sides) > T:
            dropped += 1
            continue
        ids.append([np.array(side, dtype=np.uint16) for side, _ in sides])
        starts.append([len(mask) - mask[::-1].index(0) for _, mask in sides])  # after the last 0: the reply
    return ids, np.array(starts, dtype=np.int64).reshape(-1, 2), dropped


def synthetic_pairs(task: Any, split: str, n: int, seed: int = 0) -> list[dict]:
    """n rows from a task's problems, its reference reply chosen over a wrong one, seeded. The task gives
    examples(split, n=, seed=) -> [{"messages": [..., assistant], "answer"}] and wrong(answer, rng) -> a wrong reply."""
    rng = random.Random(seed)
    return [{"prompt": ex["messages"][:-1], "chosen": ex["messages"][-1]["content"],
             "rejected": task.wrong(ex["answer"], rng)} for ex in task.examples(split, n=n, seed=seed)]


# ----------------------------------------------------------------------------------------------------------------------
# Loader


class PairLoader(RowStream):
    """Batches of B pairs for one rank, with fineweb.TokenLoader's interface (chat_format.RowStream's position).
    `source` is a path or hub name (see read_rows), or a list of rows."""

    def __init__(self, source: str | list[dict], split: str, B: int, T: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, device: str | torch.device = "cpu", shuffle: bool = True):
        name = f"<{len(source)} rows>" if isinstance(source, list) else str(source)
        rows = list(enumerate(source)) if isinstance(source, list) else read_rows(source, split)
        self.ids, self.starts, dropped = render_pairs(rows, name, T)
        self._stream(name, split, B, T, rank, world_size, seed, device, shuffle, len(self.ids),
                     sum(len(side) for pair in self.ids for side in pair))
        self.num_pairs = len(self.ids)
        if self.num_windows == 0:
            raise DataError(f"{name} {split}: {self.num_pairs} pairs of at most T = {T} tokens ({dropped} longer "
                            f"dropped), fewer than B = {B}; lower --batch-size, raise --seq-len or add pairs")
        if rank == 0:
            print(f"{name} {split}: {self.num_pairs:,} pairs; {dropped:,} with a side over {T} tokens dropped")

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int64, mask bool), each (2B, T) on the loader's device: B chosen rows, then the same pairs' B rejected
        rows, padded with EOT on the right; the mask is True on each reply's tokens."""
        pairs = self.next_items()
        ids, mask = np.full((2 * self.B, self.T), EOT, dtype=np.int64), np.zeros((2 * self.B, self.T), dtype=bool)
        for side in (0, 1):
            for j, p in enumerate(pairs):
                seq, row = self.ids[p][side], side * self.B + j
                ids[row, :len(seq)], mask[row, self.starts[p, side]:len(seq)] = seq, True
        return torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device)

    def check_vocab(self, vocab_size: int) -> None:
        """Stop now if the model has too few embedding rows for the ids: on CUDA an id past them asserts."""
        if (top := max(int(side.max()) for pair in self.ids for side in pair)) >= vocab_size:
            raise DataError(f"{self.name} renders token ids up to {top}, but the model has only {vocab_size} "
                            "embedding rows; start from a model with more")



# ----------------------------------------------------------------------------------------------------------------------
# Objectives: Bradley–Terry reward model and DPO


def token_logprobs(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(N, T-1) fp32 log-probabilities of ids[:, 1:], each given the ids before it."""
    return logprobs_of(model(ids[:, :-1])[0], ids[:, 1:])


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 log-probabilities of targets (...) under logits (..., V)."""
    return -F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), reduction="none").view(targets.shape)


def spread(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(M,) values at the M True positions of a (N, T) bool mask, in order -> (N, T), 0 elsewhere."""
    return x.new_zeros(mask.shape).masked_scatter(mask, x)


def sequence_logprobs(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(N,) log-probability of each row's masked tokens (its reply), summed; the head runs on those positions only."""
    scored = mask[:, 1:].bool()
    return spread(logprobs_of(model(ids[:, :-1], at=scored)[0], ids[:, 1:][scored]), scored).sum(-1)


def last_index(mask: torch.Tensor) -> torch.Tensor:
    """(N,) each row's last True position."""
    return mask.size(1) - 1 - mask.flip(1).int().argmax(1)


def rewards(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, logprob: bool = False) -> torch.Tensor:
    """(N,) the value head's output at each row's last reply token (a GPT with config.value_head); with `logprob`
    plus the model's mean log-probability of the reply's tokens, so that the zero-initialised head starts from what
    the language model knows and corrects it: a head alone must first learn to check the reply from one position."""
    last = last_index(mask)[:, None]
    if not logprob:
        return model(ids, values=True, return_logits=False)[1].gather(1, last).squeeze(1)
    scored = mask[:, 1:].bool()
    before = F.pad(scored, (0, 1))  # the positions whose logits score a reply token
    at = before.scatter(1, last, True)  # and the last one, whose value is read: the head runs on these only
    logits, values = model(ids, values=True, at=at)
    logp = logprobs_of(logits[before[at]], ids[:, 1:][scored])
    return spread(values, at).gather(1, last).squeeze(1) + spread(logp, scored).sum(-1) / scored.sum(-1).clamp(min=1)


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor) -> Metrics:
    """Mean -log sigmoid(chosen - rejected), the share of pairs ranked right (ties are wrong), the mean margin."""
    margin = chosen - rejected
    return {"loss": -F.logsigmoid(margin).mean(), "accuracy": (margin > 0).float().mean(), "margin": margin.mean()}


def dpo(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor, beta: float = 0.1) -> Metrics:
    """DPO (sigmoid) from sequence log-probs: Bradley–Terry on the implicit rewards beta * log(policy / reference)."""
    chosen, rejected = beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected)
    return {**bradley_terry(chosen, rejected), "chosen_reward": chosen.mean(), "rejected_reward": rejected.mean()}


def reward_model_metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], logprob: bool = False) -> Metrics:
    """A PairLoader batch's Bradley–Terry metrics for a reward model (`logprob`: see rewards)."""
    return bradley_terry(*rewards(model, *batch, logprob).chunk(2))


def dpo_metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], ref: nn.Module, beta: float = 0.1,
                sft: float = 0.0) -> Metrics:
    """A PairLoader batch's DPO metrics against the frozen reference `ref`; with `sft` the loss adds that times the
    chosen replies' mean token NLL (RPO, TRL's rpo_alpha): on pairs one token apart DPO alone lowers both sides."""
    with torch.no_grad():
        reference = sequence_logprobs(ref, *batch)
    chosen, rejected = sequence_logprobs(model, *batch).chunk(2)
    out = dpo(chosen, rejected, *reference.chunk(2), beta)
    if sft:
        out["nll"] = -chosen.sum() / batch[1][:len(chosen), 1:].sum()
        out["loss"] = out["loss"] + sft * out["nll"]
    return out


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of the starting weights without gradients, in eval mode: DPO's reference, RL's KL anchor."""
    return copy.deepcopy(model).eval().requires_grad_(False)


class PairObjective:
    """train_step's objective(model, batch) -> loss from metrics_fn (reward_model_metrics, or dpo_metrics with its
    ref and beta bound); `last` keeps the last micro-batch's metrics, detached, for the step's log record."""

    def __init__(self, metrics_fn: Callable[[nn.Module, Any], Metrics]):
        self.metrics_fn, self.last = metrics_fn, {}

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        out = self.metrics_fn(model, batch)
        self.last = {k: v.detach() for k, v in out.items()}
        return out["loss"]


@torch.no_grad()
def evaluate_pairs(model: nn.Module, loader: PairLoader, batches: int, metrics_fn: Callable[[nn.Module, Any], Metrics],
                   autocast: contextlib.AbstractContextManager, world_size: int) -> dict[str, float]:
    """Mean metrics over the split's first `batches` batches, all ranks together, each batch once (the turns of
    engine.val_loss: every rank runs as many forwards, a turn past `batches` is left out)."""
    model.eval()
    loader.reset()
    total, names = None, []
    for turn in range(-(-batches // world_size)):
        batch = loader.next_batch()
        with autocast:
            out = metrics_fn(model, batch)
        keep = float(turn * world_size + loader.rank < batches)
        names, values = list(out), torch.stack([v.float() for v in out.values()]) * keep
        total = values if total is None else total + values
    if world_size > 1:
        dist.all_reduce(total)
    model.train()
    return {name: value / batches for name, value in zip(names, total.tolist(), strict=True)}
