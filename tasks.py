"""Tasks: problems as conversations plus a checker of the model's reply, for SFT data and evals, preference pairs and
RL rewards: the built-in ones, and a user's own, loaded from FILE.py:NAME (or module:NAME) wherever a task is taken.

A task is any object with (duck-typed: a user's file need not import this project)
    examples(split) -> [{"messages": [..., user, assistant], "answer": str}]   split "train" or "test"; the last
                       message is the reference reply (an SFT row), the ones before it the prompt
    check(reply, answer) -> bool                  whether a reply's text is right
and optionally
    reward(prompt, reply, answer) -> float        RL's reward (default: 1.0 if check, else 0.0); prompt is the messages
    wrong(answer, rng) -> str                     a wrong reply, for preference pairs (tasks.py --pairs)
rl.py's --reward FILE.py:FN[,FILE.py:FN2] takes functions fn(prompt, reply, answer) -> float in the task's place, or
TRL's reward functions as written, fn(prompts, completions, **kwargs) -> list (one reply a call; kwargs: its row's).

    gsm8k          openai/gsm8k "main" (train/test): word problems; the reference's <<expr=result>> calculator notes
                   become tool calls and outputs; the answer is the number after ####
    arc-easy       allenai/ai2_arc ARC-Easy (train/validation/test): multiple choice, answered with a letter
    arc-challenge  the same for ARC-Challenge
    mmlu           cais/mmlu "all" (auxiliary_train/validation/dev/test): 57 subjects, 4 choices, the same way
    humaneval      openai/openai_humaneval (test): code that passes its tests in sandbox.py (not a security boundary)
    addition       made here, offline: "What is 4 7 + 3 8?" -> "8 5", digits spaced so that each is one token; train
                   and test are disjoint by a hash of the pair

ChatCORE (chat_core), nanochat's score of a chat model: the tasks' accuracies centered by chance (1/4 for multiple
choice, 0 otherwise) and averaged; multiple choice scored by its letters' logits (choose), the rest by greedy replies.

Usage (train and test splits as JSONL conversations for sft.py; --pairs: preference pairs, for prefs.py; --eval):
    python tasks.py --task addition --pairs                # -> data/addition/, data/addition_pairs/
    python tasks.py --task examples/subtraction.py:Subtraction --out-dir data/subtraction
    python tasks.py --task gsm8k=gsm8k/main       # a local copy: a directory of the hub's train and test files
    python tasks.py --eval out/sft/ckpt_002000.pt --limit 500    # ChatCORE over ARC, MMLU, GSM8K and HumanEval
    python tasks.py --eval out/sft/ckpt_002000.pt --tasks mmlu=mmlu_test.parquet   # a local file in the hub's schema
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import inspect
import json
import numbers
import os
import random
import re
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import common
import sandbox
from chat_format import BOS, CHAT_VOCAB, REPLY_STOPS, check_messages, render_prompt, reply_text
from common import get_tokenizer, own_process_group, parse_config, run_and_exit, setup_distributed, user_errors
from core import centered, summed
from datarows import load_rows, row_errors
from generate import calculator, evaluating, full_precision, generate
from model import GPT, GPTConfig


def conversation(user: str, reply: Any, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}], "answer": answer}


class Task:
    """A hub dataset, each row made a conversation by the subclass's example(row); `baseline`: chance's accuracy."""

    hub, config, splits, baseline, source, fields = "", None, ("train", "test"), 0.0, "", ()  # source: NAME=FILE's copy

    def examples(self, split: str) -> list[dict]:
        """The split's problems, or `source`'s: a local file in the hub's schema (all of it), or a directory's split."""
        if not (source := self.source) and split not in self.splits:
            raise ValueError(f"{self.hub} has splits {', '.join(self.splits)}, not {split!r}")
        rows = load_rows(source or self.hub, split, None if source else self.config)
        if missing := " or ".join(repr(f) for f in self.fields if f not in rows[0]):  # a local copy in another schema
            raise ValueError(f"{source} {split}: rows lack {missing} ({self.hub}'s schema: {', '.join(self.fields)})")
        example, out = guarded(self.example, f"reading it as {self.hub}"), []
        for i, row in enumerate(rows):  # a bad row (a local copy's) in one line naming it, not example()'s traceback
            with row_errors(source or self.hub, i):
                out.append(example(row))
        return out


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")  # a trailing period is not part of it


class GSM8K(Task):
    hub, config, fields = "openai/gsm8k", "main", ("question", "answer")

    def example(self, row: dict) -> dict:
        parts = []
        for k, piece in enumerate(re.split(r"<<([^>]*)>>", row["answer"])):  # odd pieces: the calculator notes
            expr, _, result = piece.rpartition("=")
            if k % 2 and expr and result:
                parts += [{"type": "tool", "text": expr}, {"type": "output", "text": result}]
            elif piece and not k % 2:
                parts.append({"type": "text", "text": piece})
        return conversation(row["question"], parts, row["answer"].rsplit("####", 1)[1].strip().replace(",", ""))

    def check(self, reply: str, answer: str) -> bool:
        """The number after the reply's last ####, else its last number, equals the answer (commas aside)."""
        numbers = NUMBER.findall(reply.rsplit("####", 1)[-1])
        return bool(numbers) and float(numbers[0 if "####" in reply else -1].replace(",", "")) == float(answer)


class MultipleChoice(Task):
    """Questions with lettered choices; the reply is the letter. Examples carry their "letters" for choose()."""

    baseline = 0.25  # nanochat's chance for ARC and MMLU alike (a few ARC questions have 3 or 5 choices)

    @staticmethod
    def render(question: str, texts: list[str], answer: int) -> dict:
        letters = "ABCDEFGH"[:len(texts)]
        choices = "".join(f"{letter}. {text}\n" for letter, text in zip(letters, texts, strict=True))
        prompt = f"{question}\n{choices}Answer with the letter of the correct choice."
        return {**conversation(prompt, letters[answer], letters[answer]), "letters": list(letters)}

    def check(self, reply: str, answer: str) -> bool:
        """The reply's first standalone letter A-H is the answer (a reply opening with the article "A" reads as A)."""
        return re.findall(r"\b([A-H])\b", reply)[:1] == [answer]


class ARC(MultipleChoice):
    hub, splits, fields = "allenai/ai2_arc", ("train", "validation", "test"), ("question", "choices", "answerKey")

    def __init__(self, config: str = "ARC-Easy"):
        self.config = config

    def example(self, row: dict) -> dict:
        """Choices relabelled A, B, C, ... (a few questions are labelled 1, 2, 3, 4)."""
        return self.render(row["question"], row["choices"]["text"], row["choices"]["label"].index(row["answerKey"]))


class MMLU(MultipleChoice):
    hub, config, splits = "cais/mmlu", "all", ("auxiliary_train", "validation", "dev", "test")
    fields = ("question", "choices", "answer")

    def example(self, row: dict) -> dict:
        return self.render(row["question"], row["choices"], int(row["answer"]))


class HumanEval(Task):
    hub, config, splits = "openai/openai_humaneval", "openai_humaneval", ("test",)
    fields = ("prompt", "canonical_solution", "test", "entry_point")

    def example(self, row: dict) -> dict:  # the answer: JSON of what check() runs the reply's code with
        return conversation(row["prompt"], row["prompt"] + row["canonical_solution"], sandbox.humaneval_answer(row))

    def check(self, reply: str, answer: str) -> bool:
        return sandbox.humaneval_passed(reply, answer)


class Addition(Task):
    """a + b for two-digit numbers (10-99); the sum is spaced too, most significant first."""

    def examples(self, split: str) -> list[dict]:
        """The split's distinct problems, in a seeded order. Test holds a tenth of the pairs, by a hash of the
        unordered pair: a + b and b + a share a split."""
        if split not in self.splits or self.source:
            raise ValueError(f"addition is made here, with splits train and test and no source; got {split!r}"
                             + f" and {self.source}" * bool(self.source))
        pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)
                 if (zlib.crc32(f"{min(a, b)}+{max(a, b)}".encode()) % 10 == 0) == (split == "test")]
        random.Random(0).shuffle(pairs)
        spaced = lambda k: " ".join(str(k))
        return [conversation(f"What is {spaced(a)} + {spaced(b)}?", spaced(a + b), str(a + b)) for a, b in pairs]

    def check(self, reply: str, answer: str) -> bool:
        """The reply's first number, spaced or not ("8 5", "85."), is the answer."""
        return [found.replace(" ", "") for found in re.findall(r"\d(?: ?\d)*", reply)[:1]] == [answer]

    def wrong(self, answer: str, rng: random.Random) -> str:
        """A wrong reply for a preference pair: one digit off by one."""
        return " ".join(str(int(answer) + rng.choice([d for d in (-10, -1, 1, 10) if int(answer) + d >= 0])))


def evaluate(model: Any, task: Task, problems: list[dict], rank: int = 0, world: int = 1, max_new_tokens: int = 512,
             batch: int = 64) -> dict:
    """{"acc", "n"}: greedy accuracy of the replies to `problems` (the calculator on; max_new_tokens: GSM8K's 512, as
    chat_core's); rank r answers every world-th problem, the counts summed over ranks."""
    mine = problems[rank::world]

    def count(right: int = 0) -> int:
        for i in range(0, len(mine), batch):
            chunk = mine[i:i + batch]
            replies = generate(model, [render_prompt(p["messages"][:-1]) for p in chunk], max_new_tokens,
                               temperature=0.0, stop_ids=REPLY_STOPS, vocab=CHAT_VOCAB, calculator=calculator())
            with full_precision(model.lm_head.weight.device):  # a task's own check, outside the replies' autocast
                right += sum(bool(task.check(reply_text(r.tokens), p["answer"])) for r, p in zip(replies, chunk,
                                                                                                    strict=True))
        return right

    right = common.same_verdict(count, world, common.ResumableError)  # one rank's check() raising stops every rank
    return summed(right, len(mine), model.lm_head.weight.device, world)


@torch.no_grad()
def choose(model: Any, problems: list[dict], rank: int = 0, world: int = 1, batch: int = 32) -> dict:
    """{"acc", "n"} of nanochat's categorical eval: right when, after the prompt (its last block_size tokens), the
    answer's letter has the highest logit of the problem's letters. Ranks share the problems as evaluate's do."""
    mine, right, device, block = problems[rank::world], 0, model.lm_head.weight.device, model.config.block_size
    token = {letter: get_tokenizer().encode_ordinary(letter)[0] for letter in "ABCDEFGH"}  # each letter is one token
    for i in range(0, len(mine), batch):
        chunk = mine[i:i + batch]
        prompts = [render_prompt(p["messages"][:-1])[-block:] for p in chunk]
        width = max(len(p) for p in prompts)
        tokens = torch.tensor([p + [BOS] * (width - len(p)) for p in prompts], device=device)
        last = torch.arange(width, device=device) == torch.tensor([len(p) - 1 for p in prompts], device=device)[:, None]
        logits, _ = model(tokens, at=last)  # (rows, V): each row's answer position
        for row, p in zip(logits, chunk, strict=True):
            right += p["letters"][row[[token[letter] for letter in p["letters"]]].argmax().item()] == p["answer"]
    return summed(right, len(mine), device, world)


def accuracy(model: Any, task: Any, problems: list[dict], rank: int = 0, world: int = 1,
             autocast: contextlib.AbstractContextManager | None = None, max_new_tokens: int = 512) -> dict:
    """A task's {"acc", "n"} wherever it is scored: multiple choice by its letters (choose), the rest by replies."""
    with evaluating(model), autocast or contextlib.nullcontext():  # bf16 on a GPU, as rl.py's evaluate runs
        if isinstance(task, MultipleChoice):
            return choose(model, problems, rank, world)
        return evaluate(model, task, problems, rank, world, max_new_tokens)


def held_out(task: Any, problems: list[dict], limit: int = 0) -> list[dict]:
    """The first `limit` problems (0: all) scored: a hub dataset's in nanochat's order (seed 42), others as given."""
    order = np.random.default_rng(42).permutation(len(problems)) if getattr(task, "hub", "") else range(len(problems))
    return [problems[i] for i in order[:limit or None]]


def longest_prompt(problems: list[dict]) -> int:
    """The most tokens a problem's prompt takes, rendered as generate() gets it (0 for no problems)."""
    return max((len(render_prompt(p["messages"][:-1])) for p in problems), default=0)


def check_prompts(named: dict[str, tuple[Any, list[dict]]], context: int, flag: str, fix: str) -> None:
    """A ValueError naming the first task scored by replies whose prompt leaves no room for a reply in `context` tokens
    (generate() would refuse or cut it, naming no task); multiple choice crops, as choose does."""
    for name, (task, problems) in named.items():
        if not isinstance(task, MultipleChoice) and (longest := longest_prompt(problems)) >= context:
            raise ValueError(f"{flag} {name}: a prompt takes {longest} tokens, {fix}")


def chat_core(model: Any, named: dict[str, tuple[Any, list[dict]]], rank: int = 0, world: int = 1,
              autocast: contextlib.AbstractContextManager | None = None, max_new_tokens: int = 512) -> dict:
    """{"results": {name: accuracy}, "centered_results": {name: centered by the task's chance}, "chatcore": their
    mean} over the tasks given, each (task, problems): nanochat's ChatCORE over those tasks. Every rank calls it."""
    results = {name: accuracy(model, task, problems, rank, world, autocast, max_new_tokens)["acc"]
               for name, (task, problems) in named.items()}
    centered_results = {name: centered(acc, getattr(named[name][0], "baseline", 0.0)) for name, acc in results.items()}
    return {"results": results, "centered_results": centered_results,
            "chatcore": sum(centered_results.values()) / len(centered_results)}


TASKS = {"gsm8k": GSM8K, "arc-easy": lambda: ARC("ARC-Easy"), "arc-challenge": lambda: ARC("ARC-Challenge"),
         "mmlu": MMLU, "humaneval": HumanEval, "addition": Addition}


# ----------------------------------------------------------------------------------------------------------------------
# A user's own task and rewards: FILE.py:NAME or module:NAME


def parse_spec(spec: str, flag: str = "--task") -> tuple[str, str]:
    """(NAME, FILE) of a built-in's NAME=FILE, else (spec, ''); a ValueError unless spec is '' or names a task."""
    name, eq, source = spec.partition("=") if spec.partition("=")[0] in TASKS else (spec, "", "")
    if name and name not in TASKS and ":" not in name:
        raise ValueError(f"{flag} must be one of {', '.join(TASKS)}, or FILE.py:NAME or module:NAME for your own; "
                         f"got {spec!r}")
    if eq and not source:  # gsm8k=$DIR with DIR unset: the hub's, silently
        raise ValueError(f"{flag} {spec}: no path after '=' (NAME=FILE or NAME=DIR: a local copy)")
    return name, source


@functools.cache
def _run_file(path: Path) -> Any:
    """FILE.py run once per process, as an import would be, however its path is written (--task and --reward alike)."""
    sys.path.append(str(path.parent))  # its own modules beside it import, as when it runs as a script
    spec = importlib.util.spec_from_file_location(f"user_{path.stem}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # a dataclass in it looks itself up there
    spec.loader.exec_module(module)
    return module


def load_object(spec: str, flag: str) -> Any:
    """NAME of FILE.py:NAME or module:NAME, or a one-line ValueError naming the file and the name."""
    where, _, name = spec.rpartition(":")
    if not name or not (where.endswith(".py") or all(map(str.isidentifier, where.split(".")))):  # a path without .py
        raise ValueError(f"{flag} {spec}: expected FILE.py:NAME or module:NAME")
    try:
        path, from_file = Path(where).expanduser(), where.endswith(".py")  # else `where` is an importable module's name
        if from_file and not path.is_file():
            raise FileNotFoundError(f"no such file {where}")
        module = _run_file(path.resolve()) if from_file else importlib.import_module(where)
        return getattr(module, name)
    except AttributeError:
        raise ValueError(f"{flag} {spec}: {where} has no {name!r}") from None
    except (Exception, SystemExit) as e:  # the user's file: missing, a syntax error, a failed import, an exit
        raise ValueError(f"{flag} {spec}: cannot load {where} ({type(e).__name__}: {e})".replace("\n", " ")) from None


def load_task(spec: str, train: bool = False) -> Any:
    """A built-in task by name (NAME=FILE: on a local copy), or FILE.py:NAME that follows the protocol above: a class
    (made here) or an instance. `train`: the caller reads the train and test splits, which a copy's directory holds."""
    name, source = parse_spec(spec)
    if name in TASKS:
        task = TASKS[name]()
        task.source = source
        if train and source and not Path(source).expanduser().is_dir():
            raise ValueError(f"--task {spec}: {source} is not a directory, and this reads train and test: pass a "
                             "directory with both (train.jsonl and test.jsonl, or the hub's parquet files)")
        return task
    made = load_object(spec, "--task")
    task = guarded(made, f"--task {spec}: {spec.rpartition(':')[2]}()")() if isinstance(made, type) else made
    if missing := [m for m in ("examples", "check") if not callable(getattr(task, m, None))]:
        raise ValueError(f"--task {spec}: {type(task).__name__} has no {' or '.join(missing)} method; a task gives "
                         "examples(split) and check(reply, answer) (tasks.py's docstring)")
    return UserTask(task, spec)


def guarded(fn: Callable[..., Any], name: str, verdict: bool = False) -> Callable[..., Any]:
    """fn, whose exceptions (a user's code: any kind) become one-line ValueErrors naming it; with `verdict`, so does a
    return other than True or False (numpy's, 1 or 0 too): a check() without `return` was scored wrong, silently."""
    def call(*args: Any) -> Any:
        try:
            out = fn(*args)
            wrong = verdict and out not in (True, False)  # a tensor of many values raises here, named as fn's
        except Exception as e:
            raise ValueError(f"{name} raised {type(e).__name__}: {e}".replace("\n", " ")) from None
        if wrong:
            raise ValueError(f"{name} returned {out!r:.60}, not True/False"
                             + ": does it end with `return`?" * (out is None))
        return out

    return call


class UserTask:
    """A user's task as load_task gives it: examples, check and wrong raise one line naming them; rows are checked."""

    def __init__(self, task: Any, spec: str):
        self.task, self.spec = task, spec
        self.check = guarded(task.check, f"--task {spec}: check()", verdict=True)
        if callable(getattr(task, "wrong", None)):
            self.wrong = guarded(task.wrong, f"--task {spec}: wrong()")

    @property
    def __class__(self) -> type:  # isinstance sees the user's class: a MultipleChoice subclass is scored by choose
        return type(self.task)

    def __getattr__(self, name: str) -> Any:  # reward and the user's own attributes
        return getattr(self.task, name)

    def __reduce__(self) -> tuple:  # copy and pickle wrap again: the faked __class__ and __getattr__ defeat theirs
        return UserTask, (self.task, self.spec)

    def examples(self, *args: Any) -> list[dict]:
        what = f"--task {self.spec}: examples({args[0]!r})"
        out = guarded(self.task.examples, f"--task {self.spec}: examples()")(*args)
        if not isinstance(out, list):
            raise ValueError(f"{what} returned a {type(out).__name__}, not a list of rows")
        if not out:  # RL samples from it, evaluations divide by its length
            raise ValueError(f"{what} gave no rows")
        need = ("messages", "answer", "letters") if isinstance(self.task, MultipleChoice) else ("messages", "answer")
        for i, row in enumerate(out):
            with row_errors(what, i):
                if not isinstance(row, dict) or not set(need) <= row.keys():  # "letters": what choose() scores by
                    raise ValueError(f"expected a dict with {' and '.join(map(repr, need))}, got {row!r:.60}")
                check_messages(row["messages"], "assistant")
                if not isinstance(a := row["answer"], str):  # check() compared text to 20: wrong every time, silently
                    raise ValueError(f"'answer' is {a!r:.40} ({type(a).__name__}), not a str: return str(...) of it")
        return out


Reward = Callable[..., float]  # (prompt, reply, answer, row=None): row, the problem, is a TRL function's columns
FLOAT32_MAX = torch.finfo(torch.float32).max  # rl.py holds rewards in float32: 1e39 would be inf there


def checked(terms: list[tuple[str, Callable[..., Any], float]]) -> Reward:
    """The sum of weight * fn(prompt, reply, answer) over (name, fn, weight), or a one-line ValueError naming them: one
    raised or gave a non-number, or the sum is not finite in rl.py's float32; `last`: each --reward FN's own value."""
    calls = [(name, guarded(fn, name), w, getattr(fn, "columns", 0)) for name, fn, w in terms]
    fns = [name.rsplit(":", 1)[-1] for name, _, _ in terms]  # reward/FN, or FN_1, FN_2 if alike (f, f, f_1 clash)
    keys = [f"reward/{fn}" + f"_{fns[:i + 1].count(fn)}" * (fns.count(fn) > 1) for i, fn in enumerate(fns)]
    if clash := [(name, key) for (name, _, _), key in zip(terms, keys, strict=True) if keys.count(key) > 1]:
        raise ValueError(f"{' and '.join(name for name, _ in clash)} would log as one {clash[0][1]}; rename one")

    def reward(prompt: list[dict], reply: str, answer: str, row: dict | None = None) -> float:
        got = []
        for name, call, w, columns in calls:  # a TRL function gets the problem's row: its columns are TRL's kwargs
            value = call(prompt, reply, answer, *[row or {"answer": answer}][:columns])
            value = value.item() if getattr(value, "ndim", None) == 0 else value  # a 0-d tensor or array: its number
            if not isinstance(value, numbers.Real) or not abs(value) <= FLOAT32_MAX:  # 10**400 too: float() would raise
                raise ValueError(f"{name} returned {value!r:.60}, not a finite float32 number")
            got.append((name, w, float(value)))
        reward.last = {key: v for key, (name, _, v) in zip(keys, got, strict=True) if name.startswith("--reward ")}
        if not abs(total := sum(w * v for _, w, v in got)) <= FLOAT32_MAX:  # NaN fails it too
            said = ", ".join(f"{name} returned {v}" + f" (weight {w:g})" * (w != 1) for name, w, v in got)
            raise ValueError(f"{said}: the reward, {total}, is not a finite float32 number")
        return total

    return reward


def task_reward(task: Any, spec: str) -> Reward:
    """The task's own reward(prompt, reply, answer), or 1.0 for a reply check() passes and 0.0 otherwise."""
    if fn := getattr(task, "reward", None):
        return checked([(f"--task {spec}'s reward", fn, 1.0)])
    return lambda prompt, reply, answer, row=None: float(bool(task.check(reply, answer)))  # UserTask's names itself


def load_rewards(specs: str, weights: tuple[float, ...] = ()) -> Reward:
    """--reward FILE.py:FN[,FILE.py:FN2]: the functions' sum, weighted by --reward-weights (1 each by default)."""
    if not all(names := [s.strip() for s in specs.strip().removesuffix(",").split(",")]):  # a,,b: not a and b
        raise ValueError(f"--reward {specs!r} has an item that names no function; pass FILE.py:FN[,FILE.py:FN2]")
    weights = weights or (1.0,) * len(names)
    if len(weights) != len(names):
        raise ValueError(f"--reward-weights gives {len(weights)} weight{'s' * (len(weights) != 1)} for {len(names)} "
                         f"--reward function{'s' * (len(names) != 1)}")
    found = [(name, load_object(name, "--reward"), w) for name, w in zip(names, weights, strict=True)]
    if bad := next((name for name, fn, _ in found if not callable(fn)), None):
        raise ValueError(f"--reward {bad} is not a function; a reward is fn(prompt, reply, answer) -> float")
    return checked([(f"--reward {name}", one_reply(fn), w) for name, fn, w in found])


def one_reply(fn: Callable[..., Any]) -> Callable[..., Any]:
    """fn, or a TRL GRPOTrainer reward fn(prompts, completions, **columns) -> [float | None] (it has `completions`),
    called on one reply in TRL's conversational form, the problem's keys but `messages` its columns; None counts 0."""
    try:  # any callable, as TRL takes (an instance, a partial, a method); one of **kwargs alone has only TRL's keywords
        kinds = {name: p.kind for name, p in inspect.signature(fn).parameters.items()}
    except (TypeError, ValueError):  # a builtin without a signature
        return fn
    if "completions" not in kinds and set(kinds.values()) != {inspect.Parameter.VAR_KEYWORD}:
        return fn
    def trl(prompt: list[dict], reply: str, answer: str, row: dict) -> Any:
        columns = {k: [v] for k, v in row.items() if k != "messages"}  # our prompt and reference reply: not a column
        out = fn(prompts=[prompt], completions=[[{"role": "assistant", "content": reply}]], **columns)
        out = asyncio.run(out) if inspect.iscoroutine(out) else out  # TRL awaits an async one
        out = list(out) if getattr(out, "ndim", 0) == 1 else out  # a tensor or array: TRL takes them too
        return (0.0 if out[0] is None else out[0]) if isinstance(out, list | tuple) and len(out) == 1 else out

    trl.columns = 1
    return trl


def synthetic_pairs(task: Any, split: str, n: int = 0, seed: int = 0) -> list[dict]:
    """Up to n (0: all) rows of a task's problems, its reference reply chosen over a wrong one (task.wrong, seeded)."""
    rng, pairs = random.Random(seed), []
    for i, ex in enumerate(task.examples(split)[:n or None]):
        chosen, rejected = ex["messages"][-1]["content"], task.wrong(ex["answer"], rng)
        with row_errors(f"--pairs {split}", i):  # prefs.py would drop a tie unnamed: say wrong() made it
            if not (isinstance(chosen, str) and isinstance(rejected, str) and rejected.strip() and rejected != chosen
                    and not task.check(rejected, ex["answer"])):
                raise ValueError(f"wrong({ex['answer']!r}) gave {rejected!r:.40} for the reference reply "
                                 f"{chosen!r:.40}: a pair needs a second text that check() marks wrong")
        pairs.append({"prompt": ex["messages"][:-1], "chosen": chosen, "rejected": rejected})
    return pairs


@dataclass
class TasksConfig:
    """tasks.py's flags, as the module docstring's usage gives them (--eval runs under torchrun too)."""

    task: str = "addition"  # gsm8k, arc-easy, arc-challenge, mmlu, humaneval, addition, or FILE.py:NAME or module:NAME
    out_dir: str = ""  # where to write them ('' = data/<task>)
    limit: int = 0  # at most this many examples per split (0 = all); with --eval, per task, as tasks.held_out picks
    pairs: bool = False  # also write preference pairs (the reference reply over wrong(answer, rng)) to <out_dir>_pairs/
    seed: int = 0  # seeds the wrong replies
    eval: str = ""  # a checkpoint to score on --tasks, instead of writing files: a .pt of this project, or an HF export
    tasks: str = "arc-easy,arc-challenge,mmlu,gsm8k,humaneval"  # with --eval: NAME or NAME=FILE (a hub-schema copy)
    split: str = "test"  # with --eval: the split scored
    max_new_tokens: int = 512  # with --eval: the longest reply of a task scored by its replies (gsm8k)
    device: str = "auto"  # with --eval: auto (cuda if available, else cpu), cpu, cuda, cuda:N

    def __post_init__(self) -> None:
        if not self.limit >= 0:
            raise ValueError(f"--limit must be >= 0 (0: all); got {self.limit}")
        if self.eval:
            task_list(self.tasks, "--tasks")
            if self.task != TasksConfig.task:  # sft.py's and rl.py's flag: ignored, the default --tasks were scored
                raise ValueError(f"--eval scores --tasks, not --task: pass --tasks {self.task}")
        if self.pairs and not callable(getattr(load_task(self.task), "wrong", None)):
            raise ValueError(f"--pairs needs a task that makes wrong replies (wrong(answer, rng)), not {self.task}")


def task_list(specs: str, flag: str = "--task") -> dict[str, str]:
    """A comma list of tasks as {label: spec}, each spec as load_task takes it; a built-in NAME=FILE is labelled NAME,
    a user's FILE.py:NAME too. Empty or repeated items are refused (a repeat would drop the first)."""
    listed: dict[str, str] = {}
    for spec in map(str.strip, specs.split(",")):
        name = parse_spec(spec, flag)[0]
        if not name:
            raise ValueError(f"{flag} {specs}: an empty item; list each task once")
        if (label := name.rpartition(":")[2]) in listed:
            what = f"{label} twice; list each task once" if parse_spec(listed[label])[0] == name else \
                f"two tasks named {label}: results go by the name; rename one"
            raise ValueError(f"{flag} {specs}: {what}")
        listed[label] = spec
    return listed


def named_tasks(specs: str, split: str, limit: int = 0) -> dict[str, tuple[Any, list[dict]]]:
    """task_list's tasks, each with its `split`'s held-out problems (`limit` of them, 0: all)."""
    loaded = {label: load_task(spec) for label, spec in task_list(specs).items()}  # a typo, before any download
    return {label: (task, held_out(task, task.examples(split), limit)) for label, task in loaded.items()}


def score_tasks(cfg: TasksConfig) -> dict:
    """--eval: the checkpoint's accuracy on each task and their ChatCORE, printed by rank 0."""
    with own_process_group(), user_errors(OSError, ValueError, RuntimeError):  # ValueError: fineweb.DataError too
        rank, _, world, device = setup_distributed(cfg.device)
        path = Path(cfg.eval).expanduser()  # an HF directory (an export) loads as chat.py's --init-from does
        model = GPT.load(*((None, str(path)) if (path / "config.json").is_file() else (str(path), None)))
        model = model.pad_vocab(GPTConfig().vocab_size).to(device)  # HF GPT-2's 50,257 rows: room for the chat tokens
        named = named_tasks(cfg.tasks, cfg.split, cfg.limit)
        bs = model.config.block_size
        check_prompts(named, bs, "--tasks", f"the model's whole context ({bs}) or more; score another task")
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
        result = chat_core(model, named, rank, world, autocast, cfg.max_new_tokens)  # a user's check may raise
    if rank == 0:
        for name, acc in result["results"].items():
            print(f"{name}: accuracy {acc:.4f}, centered {result['centered_results'][name]:.4f} "
                  f"({len(named[name][1])} problems)")
        print(f"ChatCORE {result['chatcore']:.4f} over {', '.join(named)}")
    return result


def main(argv: list[str] | None = None) -> dict | None:
    cfg = parse_config(TasksConfig, argv, doc=__doc__)
    if cfg.eval:
        return score_tasks(cfg)
    try:  # every row first: a split that cannot be made leaves nothing written
        out = Path(cfg.out_dir or f"data/{parse_spec(cfg.task)[0].rpartition(':')[2].lower()}")
        task, files = load_task(cfg.task, train=True), {}  # a copy must be a dir; then inodes: macOS's GSM8K is gsm8k
        if (source := parse_spec(cfg.task)[1]) and out.is_dir() and out.samefile(Path(source).expanduser()):
            raise ValueError(f"--task {cfg.task}: {out} is the copy it reads; pass another --out-dir")
        pairs = Path(os.path.abspath(out) + "_pairs")  # beside, not inside: a directory is one dataset of one schema
        for split in ("train", "test"):
            files[out / f"{split}.jsonl"] = task.examples(split)[:cfg.limit or None], "conversations"
            if cfg.pairs:
                files[pairs / f"{split}.jsonl"] = synthetic_pairs(task, split, cfg.limit, cfg.seed), "preference pairs"
        texts = {path: "".join(json.dumps(row) + "\n" for row in rows) for path, (rows, _) in files.items()}
        for path, (rows, what) in files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(texts[path])
            print(f"{path}: {len(rows):,} {cfg.task} {what}")
    except ValueError as e:  # fineweb.DataError too
        raise SystemExit(f"error: {e}") from None
    except TypeError as e:  # json.dumps: a value JSON has no form for (a numpy number, say)
        raise SystemExit(f"error: --task {cfg.task}: a row cannot be written as JSON ({e})") from None
    except OSError as e:
        raise SystemExit(f"error: cannot write {e.filename} ({e.strerror}); pass another --out-dir") from None


if __name__ == "__main__":
    import tasks  # this file as a module: a user's task that imports it subclasses the classes main's isinstance sees

    run_and_exit(tasks.main)  # under torchrun: no interpreter finalization after the collectives
