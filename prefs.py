"""The preference stage: a Bradley–Terry reward model or DPO, trained on preference pairs, each an objective for
parallel.train_step on the engine (no loop of its own), with held-out pairwise accuracy and a task's.

    python tasks.py --task addition --pairs && python prefs.py --preset rm-demo    # a reward model, CPU seconds
    python prefs.py --preset dpo-demo                                          # DPO from the half-trained SFT model
    python prefs.py --init-from out/sft/ckpt_002000.pt    # DPO on UltraFeedback from sft.py's GPT-2 (the defaults)

A row is a pair in one of three schemas:
    text           {"prompt", "chosen", "rejected"}: the replies as text (or TRL's [{"role": "assistant", ...}]); the
                   prompt as text, a list of messages, or a transcript ending "\\n\\nAssistant:" (Dahoas/rm-static)
    conversations  HuggingFaceH4/ultrafeedback_binarized (splits train_prefs, test_prefs): chosen and rejected are
                   whole conversations [{"role", "content"}, ...] that end with the assistant's reply
    transcripts    Anthropic/hh-rlhf (splits train, test): chosen and rejected only, "\\n\\nHuman: ...\\n\\nAssistant:
                   ..." each; their shared prefix up to its last "\\n\\nAssistant:" is the prompt
Each side renders as the prompt's conversation plus its reply; the mask covers the reply's tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import engine
import stage
from chat_format import CHAT_VOCAB, RowStream, check_messages, render
from common import EOT, LOCAL, all_sum, first_on_each_node, flag, run_and_exit
from datarows import DataError, load_rows, row_errors, split_rows, val_note
from engine import Context, Eval, Run
from generate import evaluating
from parallel import Objective, check_flags, rewards, sequence_logprobs
from stage import StageArgs, TaskEvalArgs

ASSISTANT = "\n\nAssistant:"
TURN = re.compile(r"\n\n(Human|Assistant):")
ROLES = {"Human": "user", "Assistant": "assistant"}
SPLITS = ("train_prefs", "test_prefs")  # the train and val split of a dataset without train and test (UltraFeedback)
Metrics = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------------------------------------------------
# Rows: read, parse, render


def turns(transcript: str) -> list[dict]:
    """A "\\n\\nHuman: ...\\n\\nAssistant: ..." transcript's messages; a ValueError for text before its first turn."""
    pieces = TURN.split(transcript)
    if pieces[0].strip():  # a transcript starts with its first turn
        raise ValueError(f"the transcripts start with {pieces[0][:40]!r}, text before their first '\\n\\nHuman:' turn")
    # only the space after "Human:" / "Assistant:" goes, as TRL's hh-rlhf script cuts them: the text is the data
    return [{"role": ROLES[r], "content": c.removeprefix(" ")} for r, c in zip(pieces[1::2], pieces[2::2], strict=True)]


def split_transcripts(chosen: str, rejected: str) -> tuple[list[dict], str, str]:
    """Two hh-rlhf transcripts -> (the prompt's messages, chosen reply, rejected reply)."""
    cut = chosen.rfind(ASSISTANT, 0, len(os.path.commonprefix([chosen, rejected])))
    if cut < 0:
        raise ValueError("no 'prompt' field, and chosen and rejected are not Human/Assistant transcripts that share "
                         "a prompt")
    return turns(chosen[:cut]), *(side[cut + len(ASSISTANT):].removeprefix(" ") for side in (chosen, rejected))


def parse_pair(row: dict) -> tuple[list[dict], str, str]:
    """(prompt messages, chosen reply, rejected reply) of a row in any of the three schemas; a ValueError if bad."""
    if missing := [key for key in ("chosen", "rejected") if row.get(key) is None]:
        sft = (": a row with 'messages' is a conversation, sft.py's data; a pair is {\"prompt\", \"chosen\", "
               "\"rejected\"} (tasks.py --pairs writes them)") * ("messages" in row)
        raise ValueError(f"missing field {missing[0]!r}{sft}")
    if row.get("margin") is not None:
        raise ValueError("a 'margin' field, which prefs.py's losses do not take (TRL's RewardTrainer subtracts it from "
                         "the reward gap): drop the field to train without it")
    prompt, chosen, rejected = row.get("prompt"), row["chosen"], row["rejected"]
    whole = []  # conversations whose last messages are the replies
    if isinstance(prompt, str) and TURN.match(prompt) and prompt.endswith(ASSISTANT):  # rm-static's: HH's prompt
        prompt = turns(prompt[:-len(ASSISTANT)])  # the replies lose the space after "Assistant:", as HH's own do
        chosen, rejected = (r.removeprefix(" ") if isinstance(r, str) else r for r in (chosen, rejected))
    elif isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if isinstance(chosen, list) and isinstance(rejected, list):  # whole conversations, or TRL's replies to a prompt
        if isinstance(prompt, list) and chosen and isinstance(chosen[0], dict) and chosen[0].get("role") == "assistant":
            chosen, rejected = prompt + chosen, prompt + rejected  # TRL's: the prompt apart
        if chosen[:-1] != rejected[:-1]:
            raise ValueError("chosen and rejected continue different conversations")
        prompt, whole = chosen[:-1], [chosen, rejected]
        chosen, rejected = (m[-1].get("content") if m and isinstance(m[-1], dict) and m[-1].get("role") == "assistant"
                            else None for m in (chosen, rejected))
    elif prompt is None and isinstance(chosen, str) and isinstance(rejected, str):
        prompt, chosen, rejected = split_transcripts(chosen, rejected)
    if not (isinstance(prompt, list) and isinstance(chosen, str) and isinstance(rejected, str)):
        raise ValueError("expected the prompt as text or messages, chosen and rejected as text or conversations that "
                         "end with the assistant's reply as a string, not a list of parts")
    for messages in whole if chosen.strip() and rejected.strip() else []:  # a blank reply: render_pairs drops it
        check_messages(messages, "assistant")  # the replies' other fields (tool calls, reasoning); last, as above
    return prompt, chosen, rejected


def render_pairs(rows: Any, name: str, T: int) -> tuple[list[list[np.ndarray]], np.ndarray, int, int]:
    """Each pair's [chosen ids, rejected ids], their replies' first positions (n, 2), and the counts of pairs dropped:
    a side longer than T tokens (cut, it would score another reply or none); a tie or an empty reply (hub sets hold
    a few, which prefer nothing: TRL's and OpenRLHF's users filter them)."""
    ids, starts, dropped, moot = [], [], 0, 0
    for i, row in rows:
        with row_errors(name, i):
            prompt, *replies = parse_pair(row)
            if replies[0] == replies[1] or not all(reply.strip() for reply in replies):
                moot += 1
                continue
            sides = [render([*prompt, {"role": "assistant", "content": reply}]) for reply in replies]
        if max(len(side) for side, _ in sides) > T:
            dropped += 1
            continue
        ids.append([np.array(side, dtype=np.uint16) for side, _ in sides])
        starts.append([len(mask) - mask[::-1].index(0) for _, mask in sides])  # after the last 0: the reply
    return ids, np.array(starts, dtype=np.int64).reshape(-1, 2), dropped, moot


# ----------------------------------------------------------------------------------------------------------------------
# Loader


class PairLoader(RowStream):
    """Batches of B pairs for one rank, with fineweb.TokenLoader's interface (chat_format.RowStream's position).
    `source` is a path, glob or hub name, or a list of rows. "val" is held out as chat_format's conversations are: a
    file's or glob's every VAL_EVERY-th row ("train" the others), a directory's or hub dataset's test split (else
    test_prefs, as UltraFeedback's); another split is read whole."""

    sides = 2  # sequences per item, for the header's tokens per step

    def __init__(self, source: str | list[dict], split: str, B: int, T: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, device: str | torch.device = "cpu", shuffle: bool = True):
        if isinstance(source, list):
            name, rows = f"<{len(source)} rows>", enumerate(source)
        elif split in ("train", "val"):
            name, rows = str(source), split_rows(source, split, SPLITS)
        else:
            name, rows = str(source), enumerate(load_rows(source, split))
        self.ids, self.starts, dropped, moot = render_pairs(rows, name, T)
        self._stream(name, split, B, T, rank, world_size, seed, device, shuffle, len(self.ids),
                     [side for pair in self.ids for side in pair])
        self.num_pairs = len(self.ids)
        if self.num_windows == 0:
            raise DataError(f"{name} {split}: {self.num_pairs} pairs of at most T = {T} tokens ({dropped} longer, "
                            f"{moot} ties or empty dropped), fewer than B = {B}; lower --batch-size, raise "
                            "--seq-len or add pairs")
        if rank == 0:
            print(f"{name} {split}: {self.num_pairs:,} pairs; {dropped:,} with a side over {T} tokens and {moot:,} "
                  "ties or empty replies dropped" + val_note(name, split))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids int64, mask bool), each (2B, T) on the loader's device: B chosen rows, then the same pairs' B rejected
        rows, padded with EOT on the right; the mask is True on each reply's tokens."""
        pairs = self.next_items()
        ids, mask = np.full((2 * self.B, self.T), EOT, dtype=np.int64), np.zeros((2 * self.B, self.T), dtype=bool)
        for row, (side, p) in enumerate((side, p) for side in (0, 1) for p in pairs):  # the B chosen rows first
            seq = self.ids[p][side]
            ids[row, :len(seq)], mask[row, self.starts[p, side]:len(seq)] = seq, True
        return torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device)


# ----------------------------------------------------------------------------------------------------------------------
# Objectives: Bradley–Terry reward model and DPO


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor) -> Metrics:
    """Mean -log sigmoid(chosen - rejected), the share of pairs ranked right (ties are wrong), the mean margin."""
    margin = chosen - rejected
    return {"loss": -F.logsigmoid(margin).mean(), "accuracy": (margin > 0).float().mean(), "margin": margin.mean()}


DPO_LOSSES = {"sigmoid": lambda c, r, n, beta: -F.logsigmoid(c - r),  # TRL's loss_types, on the rewards c, r of dpo
              "ipo": lambda c, r, n, beta: ((c / n[0] - r / n[1]) / beta - 1 / (2 * beta)) ** 2,  # n: reply lengths
              "hinge": lambda c, r, n, beta: F.relu(1 - (c - r))}  # c - r is beta times TRL's logits


def dpo(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
        ref_rejected: torch.Tensor, beta: float = 0.1, loss: str = "sigmoid", tokens: tuple | None = None) -> Metrics:
    """DPO_LOSSES[loss] of the implicit rewards beta * log(policy / reference), and Bradley–Terry's accuracy, margin."""
    chosen, rejected = beta * (policy_chosen - ref_chosen), beta * (policy_rejected - ref_rejected)
    return {**bradley_terry(chosen, rejected), "loss": DPO_LOSSES[loss](chosen, rejected, tokens, beta).mean(),
            "chosen_reward": chosen.mean(), "rejected_reward": rejected.mean()}


def reward_model_metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], logprob: bool = False) -> Metrics:
    """A PairLoader batch's Bradley–Terry metrics for a reward model (`logprob`: see rewards)."""
    return bradley_terry(*rewards(model, *batch, logprob).chunk(2))


def dpo_metrics(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], ref: nn.Module, beta: float = 0.1,
                sft: float = 0.0, loss: str = "sigmoid") -> Metrics:
    """A PairLoader batch's DPO metrics against the frozen reference `ref`; with `sft` the loss adds that times the
    chosen replies' mean token NLL (RPO, TRL's rpo_alpha): on pairs one token apart DPO alone lowers both sides."""
    with torch.no_grad():
        reference = sequence_logprobs(ref, *batch)
    chosen, rejected = sequence_logprobs(model, *batch).chunk(2)
    tokens = batch[1][:, 1:].sum(1).chunk(2)  # each reply's (chosen, rejected): ipo's means and the sft term's
    out = dpo(chosen, rejected, *reference.chunk(2), beta, loss, tokens)
    if sft:
        out["nll"] = -chosen.sum() / tokens[0].sum()
        out["loss"] = out["loss"] + sft * out["nll"]
    return out


@torch.no_grad()
def evaluate_pairs(model: nn.Module, loader: PairLoader, batches: int, metrics_fn: Callable[[nn.Module, Any], Metrics],
                   autocast: contextlib.AbstractContextManager, world_size: int) -> dict[str, float]:
    """Mean metrics over the split's first `batches` batches, all ranks together, each batch once (the turns of
    engine.val_loss: every rank runs as many forwards, a turn past `batches` is left out)."""
    loader.reset()
    total, names = 0.0, []
    with evaluating(model):
        for turn in range(-(-batches // world_size)):
            with autocast:
                out = metrics_fn(model, loader.next_batch())
            keep = float(turn * world_size + loader.rank < batches)
            names, total = list(out), total + torch.stack([v.float() for v in out.values()]) * keep
    return {name: value / batches for name, value in zip(names, all_sum(total, world_size).tolist(), strict=True)}


# ----------------------------------------------------------------------------------------------------------------------
# The stage: config and presets, evaluations, setup (the objective)


@dataclass
class PrefsConfig(TaskEvalArgs, StageArgs):
    """Train a reward model (--objective reward) or a policy by DPO (--objective dpo) on preference pairs, from a
    chat model. Flags override the chosen --preset; every GPTConfig field is a flag too. --batch-size and
    --total-batch-size count pairs' positions: a step reads both sides, twice the tokens."""

    # pairs: a file or glob of files (every 20th row is val, --eval-every 0 too), or a directory or hub name (its
    # train and test splits, else train_prefs and test_prefs: ultrafeedback_binarized's)
    data: Annotated[str, LOCAL] = "HuggingFaceH4/ultrafeedback_binarized"
    objective: str = "dpo"  # reward (a Bradley-Terry reward model: a value head on the model) or dpo
    reward_logprob: bool = False  # reward: the score adds the mean log-prob of the reply (parallel.rewards)
    dpo_beta: float = 0.1  # DPO's beta: how far the implicit reward may pull the policy from its reference
    dpo_loss: str = "sigmoid"  # DPO's loss, TRL's loss_type: sigmoid (DPO's), ipo (per-token log-ratios) or hinge
    dpo_sft: float = 0.0  # DPO's loss adds this times the chosen replies' token NLL (RPO; TRL's rpo_alpha)
    # with no --preset, GPT-2 124M on UltraFeedback (64 pairs a step, TRL's 8 a GPU on 8), not pretraining's schedule
    max_steps: int = 955  # optimizer steps (about one epoch of ultrafeedback_binarized's 61,135 train pairs)
    max_lr: float | None = None  # peak learning rate (None: TRL's, 1e-6 for dpo, 1e-4 for reward)
    total_batch_size: int = 65536
    batch_size: int = 8
    lr_schedule: str = "linear"
    min_lr_frac: float = 0.0
    warmup_steps: int = 20
    eval_every: int = 100
    eval_tokens: int = 524288
    ckpt_every: int = 250
    out_dir: Annotated[str, LOCAL] = "out/prefs"

    def __post_init__(self) -> None:
        reward, dpo = self.objective == "reward", self.objective == "dpo"
        if self.max_lr is None:
            self.max_lr = 1e-4 if reward else 1e-6
        super().__post_init__()
        check_flags([((reward or dpo) and self.dpo_loss in DPO_LOSSES and self.dpo_sft >= 0, "--objective must be "
                      f"reward or dpo, --dpo-loss one of {', '.join(DPO_LOSSES)} and --dpo-sft >= 0; got "
                      f"{self.objective!r}, {self.dpo_loss!r} and {self.dpo_sft}"),
                     (0 < self.dpo_beta < float("inf"), f"--dpo-beta must be a positive number; got {self.dpo_beta}"),
                     (not reward or self.arch.setdefault("value_head", True) is True,
                      "--objective reward trains a value head: drop --value-head false"),
                     (not dpo or not self.arch.get("value_head"), "--objective dpo trains no value head: drop "
                      "--value-head true"),
                     (not dpo or bool(self.init_from), "--objective dpo moves a model away from its starting weights, "
                      "its reference: pass --init-from a fine-tuned model (a random one prefers nothing)"),
                     (not dpo or self.parallel != "fsdp",
                      "--objective dpo keeps a whole frozen reference on every rank: use ddp or zero1")])
        # the other objective's flags (--task: a reward model's logits don't reply) and the lm loss's speed options
        other = {"reward": ("dpo_beta", "dpo_loss", "dpo_sft", "task"), "dpo": ("reward_logprob",)}[self.objective]
        unused = [f for f in other if getattr(self, f) != PrefsConfig.__dataclass_fields__[f].default]
        if unused := unused + [f for f in ("loss_chunk", "fused_ce") if self.arch.get(f)]:
            raise ValueError(f"--objective {self.objective} does not use --{flag(unused[0])}: drop it")


# the chat demo's pairs (tasks.py --pairs), one to a 24-token row, and the schedule both demos share
DEMO = {"data": "data/addition_pairs", "seq_len": 24, "total_batch_size": 384, "batch_size": 16, "warmup_steps": 10,
        "lr_schedule": "linear", "min_lr_frac": 0.0, "eval_every": 50, "eval_tokens": 6144, "ckpt_every": 0}
PRESETS: dict[str, Callable[[], PrefsConfig]] = {
    # from the SFT model; the reward model's score adds the reply's mean log-prob (a head alone learns no sums), and a
    # small lr keeps Bradley-Terry from wrecking it
    "rm-demo": functools.partial(PrefsConfig, **DEMO, init_from="out/sft-demo/ckpt_002400.pt", objective="reward",
                                 reward_logprob=True, max_lr=1e-4, max_steps=300, out_dir="out/rm-demo"),
    # DPO starts where RL does, from the half-trained SFT model; the SFT term keeps it from lowering both replies
    "dpo-demo": functools.partial(PrefsConfig, **DEMO, init_from="out/sft-demo-1200/ckpt_001200.pt", objective="dpo",
                                  dpo_sft=1.0, max_lr=3e-4, max_steps=200, task="addition", task_every=50,
                                  task_limit=256, out_dir="out/dpo-demo")}


def pair_evals(cfg: PrefsConfig, setup: stage.Setup, metrics: Objective) -> list[Eval]:
    """The held-out pairs' loss, the share ranked right and the mean margin; DPO's each side's reward (and sft term)."""
    if setup.val_loader is None:
        return []
    built, ctx, windows = setup.built, setup.ctx, stage.val_windows(cfg, setup.val_loader, setup.ctx.master)

    def val(step: int) -> dict[str, Any]:
        pairs = evaluate_pairs(built.model, setup.val_loader, windows, metrics.metrics_fn, built.autocast, ctx.world)
        setup.log.say(f"step {step:6d} | val loss {pairs['loss']:.4f} | pairs ranked right {pairs['accuracy']:.4f}")
        return {f"val_{name}": value for name, value in pairs.items()}  # DPO's: its rewards and sft term too, as TRL

    return [Eval("val", cfg.eval_every, val)]


def setup(cfg: PrefsConfig, ctx: Context) -> Run:
    """The Run: the pairs, the objective (DPO's with its reference), the model (a reward model's with a head), evals."""
    # a split's preference pairs for `data`'s rank among its data-parallel world (stage.Setup's)
    loader = lambda split, data: PairLoader(cfg.data, split, cfg.batch_size, cfg.seq_len, data.rank, data.world,
                                            cfg.seed, data.device, shuffle=split == "train")
    setup = stage.Setup(cfg, ctx, loader, chat=True, vocab=CHAT_VOCAB)
    # train_step's objective: DPO's against its start loaded again (a resume's: its run's), or Bradley-Terry's
    reference, metrics = None, functools.partial(reward_model_metrics, logprob=cfg.reward_logprob)
    if cfg.objective == "dpo":  # a node that cannot load it stops all (a resume's policy loaded no --init-from)
        ref = first_on_each_node(lambda: stage.load_init(setup.cfg, CHAT_VOCAB), ctx.local_rank, ctx.world)
        ref = ref.to(ctx.device).eval().requires_grad_(False)
        metrics = functools.partial(dpo_metrics, ref=ref, beta=cfg.dpo_beta, sft=cfg.dpo_sft, loss=cfg.dpo_loss)
        # left out (a checkpoint's then unchanged): dropout, off in eval mode, and the loss's options (it computes none)
        unused = ("dropout", "loss_chunk", "fused_ce")
        reference = stage.Reference(engine.weights_digest(ref), setup.cfg.init_from, "took its DPO reference from",
                                    {k: v for k, v in dataclasses.asdict(ref.config).items() if k not in unused})
    # every rank's reference, as its model: a resume's is each node's --init-from (a LOCAL path) and flags
    setup.build(lambda: {"DPO reference": reference and (reference.digest, reference.config)},
                parts={"reference": reference})
    pairs = Objective(metrics, summarised=("accuracy", "margin"))
    step_fn = stage.lm_step(setup.cfg, setup.built, setup.next_batch, setup.grad_accum, setup.guard, ctx, pairs)
    return setup.run(step_fn, pair_evals(cfg, setup, pairs) + stage.task_evals(cfg, setup))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return stage.main(PrefsConfig, argv, PRESETS, setup, __doc__)


if __name__ == "__main__":
    run_and_exit(main, stage.exit_code)
