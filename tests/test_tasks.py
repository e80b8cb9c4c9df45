"""tasks.py: each checker on right, wrong and reformatted replies; conversions from rows in the hub's schema (read from
local files through the same datasets call); the synthetic task's disjoint splits and wrong answers; the CLI's files."""

import contextlib
import copy
import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch

import chat_format as cf
import core
import tasks
from common import get_tokenizer

ROOT = Path(__file__).resolve().parent.parent

WENG = {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                    "How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = "
                  "$<<0.2*50=10>>10.\n#### 10"}  # openai/gsm8k main, train row 1
ARC_ROW = {"id": "x", "question": "Which gas do plants take in?", "answerKey": "3",
           "choices": {"text": ["oxygen", "helium", "carbon dioxide", "neon"], "label": ["1", "2", "3", "4"]}}


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))


@pytest.mark.parametrize("reply, right", [
    ("#### 1,000", True), ("The answer is 1000.", True), ("1,000.", True), ("$1,000", True), ("1000.0", True),
    ("first 999, then 1000", True),  # the last number counts
    ("#### 1000 since 3 + 4 = 7", True),  # the number after #### counts
    ("#### 999, no:\n#### 1000", True),  # the last #### counts
    ("#### 999", False), ("1000 or maybe 999", False), ("#### 10000", False), ("no number", False), ("", False),
])
def test_gsm8k_checker(reply, right):
    assert tasks.GSM8K().check(reply, "1000") is right
    assert tasks.task_reward(tasks.GSM8K(), "gsm8k")([], reply, "1000") == float(right)


def test_gsm8k_checker_reads_negatives_and_decimals():
    assert tasks.GSM8K().check("She owes -5 dollars.", "-5") and not tasks.GSM8K().check("She owes 5.", "-5")
    assert tasks.GSM8K().check("#### 2.50", "2.5")


def test_gsm8k_reference_becomes_calculator_parts_its_reply_text_passes():
    example = tasks.GSM8K().example(WENG)
    assert example["answer"] == "10"
    assert example["messages"][1]["content"] == [
        {"type": "text", "text": "Weng earns 12/60 = $"}, {"type": "tool", "text": "12/60"},
        {"type": "output", "text": "0.2"},
        {"type": "text", "text": "0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $"},
        {"type": "tool", "text": "0.2*50"}, {"type": "output", "text": "10"}, {"type": "text", "text": "10.\n#### 10"}]
    ids, mask = cf.render(example["messages"])
    reply = ids[ids.index(cf.ASSISTANT_START) + 1:]
    assert cf.reply_text(reply) == "Weng earns 12/60 = $0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = " \
                                   "$10.\n#### 10"
    assert tasks.GSM8K().check(cf.reply_text(reply), example["answer"])
    assert sum(mask) == len(reply) - 2 - 2 * 3  # all learned but the two outputs: their markers and one token each


def test_gsm8k_answer_drops_commas_and_a_note_is_split_at_its_last_equals_sign():
    row = {"question": "q", "answer": "So <<x=2*500=1000>>1000 in all<<7=>>.\n#### 1,000"}
    example = tasks.GSM8K().example(row)
    assert example["answer"] == "1000"  # as check() compares it: float("1,000") would raise
    assert example["messages"][1]["content"] == [
        {"type": "text", "text": "So "}, {"type": "tool", "text": "x=2*500"}, {"type": "output", "text": "1000"},
        {"type": "text", "text": "1000 in all"}, {"type": "text", "text": ".\n#### 1,000"}]  # <<7=>>, no result: out


def test_gsm8k_reads_a_local_jsonl_in_the_hub_schema(tmp_path):
    path = tmp_path / "gsm8k_test.jsonl"
    path.write_text(json.dumps(WENG) + "\n" + json.dumps({"question": "2 + 3?", "answer": "2 + 3 = 5\n#### 5"}) + "\n")
    examples = tasks.load_task(f"gsm8k={path}").examples("test")
    assert [e["answer"] for e in examples] == ["10", "5"]
    assert examples[1]["messages"][1]["content"] == [{"type": "text", "text": "2 + 3 = 5\n#### 5"}]


@pytest.mark.parametrize("name, row, why", [
    ("gsm8k", {"question": "q", "answer": "she has 3"}, "IndexError: list index out of range"),  # no ####
    ("arc-easy", {**ARC_ROW, "choices": {"text": ["a", "b"]}}, "KeyError: 'label'"),
    ("arc-easy", {**ARC_ROW, "answerKey": "5"}, "ValueError: '5' is not in list"),
    ("mmlu", {"question": "q", "choices": ["a", "b"], "answer": 2}, "IndexError: string index out of range"),
])
def test_a_bad_row_of_a_local_copy_is_one_line_naming_it(tmp_path, name, row, why):
    # a traceback from example(), or (GSM8K without ####) a float() error at the first check naming no file
    path = write_rows(tmp_path / "t.jsonl", [MMLU_ROWS[0] if name == "mmlu" else GSM8K_ROWS[0] if name == "gsm8k"
                                              else ARC_ROW, row])
    task = tasks.load_task(f"{name}={path}")
    with pytest.raises(ValueError, match=rf"^{path} row 1 \(0-based, [^)]*\): reading it as .* raised {why}"):
        task.examples("test")


@pytest.mark.parametrize("reply, right", [
    ("C", True), ("C.", True), ("(C)", True), ("The answer is C", True), ("C, not B", True),
    ("Definitely C", True), ("Because of B, C", False),  # a capital inside a word is no letter
    ("B", False), ("B, not C", False), ("c", False), ("carbon dioxide", False), ("", False),
])
def test_arc_checker_reads_the_first_letter(reply, right):
    assert tasks.ARC().check(reply, "C") is right


def test_arc_relabels_numbered_choices_as_letters():
    example = tasks.ARC().example(ARC_ROW)
    assert example["answer"] == "C" and example["messages"][1]["content"] == "C"
    assert example["messages"][0]["content"] == ("Which gas do plants take in?\nA. oxygen\nB. helium\n"
                                                 "C. carbon dioxide\nD. neon\nAnswer with the letter of the correct "
                                                 "choice.")


def test_arc_reads_a_local_parquet_in_the_hub_schema(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {**ARC_ROW, "answerKey": "B", "choices": {"text": ["a", "b", "c"], "label": ["A", "B", "C"]}}
    pq.write_table(pa.Table.from_pylist([ARC_ROW, row]), tmp_path / "arc.parquet")
    examples = tasks.load_task(f"arc-challenge={tmp_path / 'arc.parquet'}").examples("test")
    assert [e["answer"] for e in examples] == ["C", "B"]
    assert [e["letters"] for e in examples] == [list("ABCD"), list("ABC")]  # what choose() compares: 3 here
    with pytest.raises(ValueError, match="allenai/ai2_arc has splits train, validation, test, not 'val'"):
        tasks.ARC().examples("val")


def test_addition_splits_are_disjoint_seeded_and_cover_every_pair():
    add = tasks.Addition()
    train, test = add.examples("train"), add.examples("test")
    assert len(train) + len(test) == 90 * 90 and 0.08 < len(test) / 8100 < 0.12
    pair = lambda e: frozenset(e["messages"][0]["content"].removeprefix("What is ").rstrip("?").split(" + "))
    assert not {pair(e) for e in train} & {pair(e) for e in test}  # a + b and b + a too
    first = add.examples("train")[0]
    assert first["messages"] == [{"role": "user", "content": "What is 4 1 + 3 4?"},
                                 {"role": "assistant", "content": "7 5"}] and first["answer"] == "75"


@pytest.mark.parametrize("reply, right", [
    ("1 2 3", True), ("123", True), ("1 2 3.", True), ("The sum is 1 2 3", True),
    ("1 2 4", False), ("1 2", False), ("1 2 3 4", False), ("12 3 and 4", True), ("x", False), ("", False),
])
def test_addition_checker(reply, right):
    assert tasks.Addition().check(reply, "123") is right


def test_addition_wrong_answers_fail_the_checker():
    add, rng = tasks.Addition(), random.Random(0)
    reward = tasks.task_reward(add, "addition")
    for example in add.examples("test")[:200]:
        wrong = add.wrong(example["answer"], rng)
        assert reward(example["messages"][:1], wrong, example["answer"]) == 0.0
        assert reward(example["messages"][:1], example["messages"][1]["content"], example["answer"]) == 1.0
        assert abs(int(wrong.replace(" ", "")) - int(example["answer"])) in (1, 10)
        assert wrong == " ".join(wrong.replace(" ", ""))  # spaced as the reference: a pair differs in its digits alone


def test_cli_writes_into_the_current_directory_its_pairs_beside_it(tmp_path, monkeypatch):
    (tmp_path / "mine").mkdir()
    monkeypatch.chdir(tmp_path / "mine")  # --out-dir . was a traceback: '.' has no name to put _pairs after
    tasks.main(["--task", "addition", "--out-dir", ".", "--limit", "3", "--pairs"])
    assert [len((tmp_path / d / "test.jsonl").read_text().splitlines()) for d in ("mine", "mine_pairs")] == [3, 3]
    (tmp_path / "link").symlink_to(tmp_path / "mine")  # a link's pairs go beside the link, as its name says
    tasks.main(["--task", "addition", "--out-dir", "../link", "--limit", "2", "--pairs"])
    assert len((tmp_path / "link_pairs" / "test.jsonl").read_text().splitlines()) == 2


def test_cli_writes_splits_the_conversation_loader_reads(tmp_path, capsys):
    tasks.main(["--task", "addition", "--out-dir", str(tmp_path), "--limit", "100"])
    assert [len((tmp_path / f"{s}.jsonl").read_text().splitlines()) for s in ("train", "test")] == [100, 100]
    val = cf.ConversationLoader(str(tmp_path), "val", 2, 127)  # the directory's test.jsonl
    answers = [json.loads(line)["answer"] for line in (tmp_path / "test.jsonl").read_text().splitlines()]
    assert sum(len(a) == 3 for a in answers) == 64
    # 13 tokens (BOS, user_start, 8 of prompt, user_end, assistant_start, assistant_end) and 1 per digit of the sum
    assert val.tokens == 100 * 13 + 64 * 3 + 36 * 2
    # 64 three-digit sums of 16 tokens fill 8 rows of 128 exactly; 36 of 15 tokens fit 8 per row: 5 rows more
    assert "100 conversations in 13 rows of 128 tokens, 6.0% padding" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------------------------
# your own task and rewards, from FILE.py:NAME

USER_TASK = '''import random


class Doubling:
    """a user's task: it imports nothing from the project"""

    def examples(self, split):
        numbers = range(10, 30) if split == "train" else range(30, 34)
        return [{"messages": [{"role": "user", "content": f"Double {k}?"},
                              {"role": "assistant", "content": str(2 * k)}], "answer": str(2 * k)} for k in numbers]

    def check(self, reply, answer):
        return reply.strip() == answer

    def wrong(self, answer, rng):
        return str(int(answer) + rng.choice([-1, 1]))


class Solved(Doubling):  # a column beside answer, as TRL's datasets carry (its accuracy_reward reads `solution`)
    def examples(self, split):
        return [{**row, "solution": row["answer"], "level": 2} for row in super().examples(split)]


class NoChecker:
    def examples(self, split):
        return []


class Lazy(Doubling):
    def examples(self, split):
        return (row for row in super().examples(split))


class Unanswered(Doubling):
    def examples(self, split):
        return [{"messages": row["messages"]} for row in super().examples(split)]


class Unmessaged(Doubling):  # was a KeyError traceback: only 'answer' was looked for
    def examples(self, split):
        return [{"conversation": [], "answer": "1"}]


class Strict(Doubling):
    def check(self, reply, answer):
        raise KeyError("no such field")


class Silent(Doubling):  # no return: every reply scored wrong, in silence
    def check(self, reply, answer):
        reply.strip() == answer


doubling = Doubling()  # an instance, not a class


def near(prompt, reply, answer):  # reads the prompt, not the answer
    k = int(prompt[-1]["content"].split()[1].rstrip("?"))
    return 1.0 if reply.strip() == str(2 * k) else 0.5 if reply.strip().isdigit() else 0.0


def raises(prompt, reply, answer):
    raise KeyError("no such field")


def text(prompt, reply, answer):
    return "1"


def nan(prompt, reply, answer):
    return float("nan")


ANSWER = 42


class Copying(Doubling):  # its wrong reply is the right one
    def wrong(self, answer, rng):
        return answer


class Spacing(Doubling):  # its wrong reply is the right one with a space, which check() accepts
    def wrong(self, answer, rng):
        return answer + " "


class Numpy(Doubling):  # a numpy string is a str; a numpy number in a row of its own is fine in memory, not JSON
    def examples(self, split):
        import numpy
        return [{**row, "answer": numpy.str_(row["answer"]), "level": numpy.int64(1)}
                for row in super().examples(split)]


class Integer(Doubling):  # check() compared text to an int: 0% accuracy, 0 reward, a zero loss, silently
    def examples(self, split):
        return [{**row, "answer": int(row["answer"])} for row in super().examples(split)]


def tensor(prompt, reply, answer):
    import torch
    return torch.tensor(0.25)
'''


def flaky_task(n: int) -> str:
    """USER_TASK and Flaky, whose check() raises on its n-th call (0: never): its reward scores rl.py's rollouts, so
    only evaluations call check()."""
    return USER_TASK + f'''
import itertools

calls = itertools.count(1)


class Flaky(Doubling):
    def reward(self, prompt, reply, answer):
        return float(len(reply))

    def check(self, reply, answer):
        if next(calls) == {n}:
            raise KeyError("boom")
        return super().check(reply, answer)
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "doubling.py"
    path.write_text(USER_TASK)
    return path


def test_a_users_task_loads_from_its_file_and_makes_data_and_pairs(user_file, tmp_path, capsys):
    task = tasks.load_task(f"{user_file}:Doubling")
    assert [e["answer"] for e in task.examples("test")] == ["60", "62", "64", "66"]
    made = tasks.load_task(f"{user_file}:doubling")  # an instance at the file's top level, as a class is
    assert made.task is tasks.load_object(f"{user_file}:doubling", "--task")
    assert made.examples("test") == task.examples("test")
    reward = tasks.task_reward(task, "x")  # no reward(): check() as 1.0 or 0.0
    assert reward([], "60", "60") == 1.0 and reward([], "61", "60") == 0.0
    out = tmp_path / "data" / "doubling"
    tasks.main(["--task", f"{user_file}:Doubling", "--out-dir", str(out), "--pairs", "--seed=1"])
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    pairs = [json.loads(row) for row in (tmp_path / "data" / "doubling_pairs" / "test.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and rows[0]["messages"][1]["content"] == "20" and rows[0]["answer"] == "20"
    # one off, as --seed=1 draws them (the default seed 0 draws 61, 63, 63, 67: --seed was read by nothing unnoticed)
    assert [(p["chosen"], p["rejected"]) for p in pairs] == [("60", "59"), ("62", "61"), ("64", "65"), ("66", "65")]
    assert cf.ConversationLoader(str(out), "val", 1, 16).tokens == sum(len(cf.render(
        json.loads(line)["messages"])[0]) for line in (out / "test.jsonl").read_text().splitlines())


def test_rewards_see_the_prompt_and_sum_by_weight(user_file):
    prompt = [{"role": "user", "content": "Double 21?"}]
    one = tasks.load_rewards(f"{user_file}:near")
    assert (one(prompt, "42", "ignored"), one(prompt, "40", "ignored"), one(prompt, "no", "")) == (1.0, 0.5, 0.0)
    both = tasks.load_rewards(f"{user_file}:near,{user_file}:near", (2.0, -0.5))
    assert both(prompt, "40", "") == 2.0 * 0.5 - 0.5 * 0.5
    with pytest.raises(ValueError) as e:  # was inf in rl.py's float32 scores, then a NaN loss blamed on --max-lr
        tasks.load_rewards(f"{user_file}:near,{user_file}:near", (1e40, 1.0))(prompt, "42", "")
    assert str(e.value) == (f"--reward {user_file}:near returned 1.0 (weight 1e+40), --reward {user_file}:near "
                            "returned 1.0: the reward, 1e+40, is not a finite float32 number")
    other = user_file.with_name("other.py")  # two files' functions named alike: each logged, not the last alone
    other.write_text("def near(prompt, reply, answer):\n    return -3.0\n")
    (two := tasks.load_rewards(f"{user_file}:near,{other}:near,{user_file}:tensor"))(prompt, "40", "")
    assert two.last == {"reward/near_1": 0.5, "reward/near_2": -3.0, "reward/tensor": 0.25}
    (third := user_file.with_name("third.py")).write_text("def near_1(prompt, reply, answer):\n    return 9.0\n")
    with pytest.raises(ValueError, match=f"^--reward {user_file}:near and --reward {third}:near_1 would log as one "
                       "reward/near_1; rename one$"):  # its own name is the first near's key: that value was dropped
        tasks.load_rewards(f"{user_file}:near,{user_file}:near,{third}:near_1")


TRL_REWARDS = """
def accuracy(completions, answer, **kwargs):
    return [1.0 if c[0]["content"].strip() == a else 0.0 for c, a in zip(completions, answer)]

def brevity(prompts, completions, **kwargs):  # None: not this prompt's, as TRL's rewards say
    return [None if "skip" in p[-1]["content"] else -len(c[0]["content"]) for p, c in zip(prompts, completions)]

async def later(completions, **kwargs):
    return [0.25 for _ in completions]

def two(completions, **kwargs):
    return [1.0, 2.0]

seen = []

def solved(completions, solution, **kwargs):  # TRL's accuracy_reward reads the dataset's `solution` column
    seen.append(sorted([*kwargs, "solution"]))
    return [float(c[0]["content"].strip() == s) for c, s in zip(completions, solution)]
"""


def test_trls_reward_functions_load_as_written(tmp_path):
    # a GRPOTrainer reward fn(prompts, completions, **kwargs) -> list was called as fn(prompt, reply, answer): a
    # TypeError; each is now called on one reply, in TRL's conversational form, its None counted 0 as TRL's nansum
    (path := tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    reward = tasks.load_rewards(f"{path}:accuracy,{path}:brevity,{path}:later", (1.0, 0.5, 1.0))
    assert reward([{"role": "user", "content": "Double 21?"}], "42", "42") == 1.0 + 0.5 * -2 + 0.25 == 0.25
    assert reward.last == {"reward/accuracy": 1.0, "reward/brevity": -2.0, "reward/later": 0.25}
    assert reward([{"role": "user", "content": "skip: 21?"}], " 41", "42") == 0.0 + 0.5 * 0 + 0.25
    assert reward.last == {"reward/accuracy": 0.0, "reward/brevity": 0.0, "reward/later": 0.25}
    with pytest.raises(ValueError) as e:  # a list for other completions than the one given
        tasks.load_rewards(f"{path}:two")([{"role": "user", "content": "hi"}], "x", "y")
    assert str(e.value) == f"--reward {path}:two returned [1.0, 2.0], not a finite float32 number"


def test_a_trl_reward_gets_the_problems_keys_as_its_columns(tmp_path):
    # only `answer` was passed: a TRL reward reading another column (its accuracy_reward's `solution`) raised
    (path := tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    reward, seen = tasks.load_rewards(f"{path}:solved"), tasks.load_object(f"{path}:seen", "--reward")
    row = {"messages": [{"role": "user", "content": "Double 21?"}, {"role": "assistant", "content": "42"}],
           "answer": "42", "solution": "42", "level": 2}
    assert (reward(row["messages"][:1], " 42", "42", row), reward(row["messages"][:1], "41", "42", row)) == (1.0, 0.0)
    assert seen == [["answer", "level", "prompts", "solution"]] * 2  # every key but messages (prompt and reference)
    with pytest.raises(ValueError) as e:  # no row: the answer alone, and TRL's own message for the missing column
        reward(row["messages"][:1], "42", "42")
    assert str(e.value) == (f"--reward {path}:solved raised TypeError: solved() missing 1 required positional "
                            "argument: 'solution'")


TRL_CALLABLES = """
import functools, torch

class Scorer:  # TRL takes any callable: a class instance, a bound method, a partial
    def __call__(self, prompts, completions, **kwargs):
        return [len(completions[0][0]["content"]) / 10]

    def method(self, prompts, completions, **kwargs):
        return [len(completions[0][0]["content"]) / 100]

instance, bound = Scorer(), Scorer().method
scaled = functools.partial(lambda prompts, completions, scale, **kwargs: [scale], scale=2.0)

def columns(**kwargs):  # TRL calls by keyword: kwargs alone hold prompts and completions
    return [len(kwargs["completions"][0][0]["content"]) / 1000]

def tensor(prompts, completions, **kwargs):  # TRL's torch.tensor(...) of the list takes a tensor or an array too
    return torch.tensor([0.5])
"""


def test_trl_reward_callables_and_kwargs_alone_are_called_as_trl_calls_them(tmp_path):
    # detected only for a plain function: an instance, a partial or a method was called as fn(prompt, reply, answer),
    # `completions` given the reply's str; fn(**kwargs) raised a TypeError; a returned tensor was refused
    (path := tmp_path / "trl_callables.py").write_text(TRL_CALLABLES)
    reward = tasks.load_rewards(",".join(f"{path}:{fn}" for fn in ("instance", "bound", "scaled", "columns", "tensor")))
    assert reward([{"role": "user", "content": "hi"}], "abcde", "5") == 0.5 + 0.05 + 2.0 + 0.005 + 0.5
    assert reward.last == {"reward/instance": 0.5, "reward/bound": 0.05, "reward/scaled": 2.0,
                           "reward/columns": 0.005, "reward/tensor": 0.5}


def test_a_tasks_own_reward_replaces_its_check_and_rewards_weigh_1_each_by_default(user_file):
    class Graded(tasks.Addition):  # a task's reward(prompt, reply, answer): RL's reward, not check()'s 1.0 or 0.0
        def reward(self, prompt, reply, answer):
            return 0.5 if self.check(reply, answer) else -1.0

    reward = tasks.task_reward(Graded(), "graded")
    assert (reward([], "7 5", "75"), reward([], "7 6", "75")) == (0.5, -1.0)
    both = tasks.load_rewards(f"{user_file}:near,{user_file}:near")  # no --reward-weights: 1 each, summed
    assert both([{"role": "user", "content": "Double 21?"}], "40", "") == 0.5 + 0.5


def test_a_reward_sum_of_nan_is_refused():
    with pytest.raises(ValueError, match=r"^a returned 1e\+30 \(weight 1e\+300\), b returned 1e\+30 \(weight "
                                         r"-1e\+300\): the reward, nan, is not a finite float32 number$"):
        tasks.checked([("a", lambda *_: 1e30, 1e300), ("b", lambda *_: 1e30, -1e300)])([], "", "")  # inf - inf


def test_a_task_file_under_a_directory_with_a_colon_loads_and_its_wrong_is_one_line(tmp_path):
    folder = tmp_path / "runs:1"  # the name is after the last colon
    folder.mkdir()
    (folder / "t.py").write_text("import tasks\n\n\nclass T(tasks.Addition):\n    def wrong(self, answer, rng):\n"
                                 "        raise KeyError('no')\n")
    task = tasks.load_task(f"{folder / 't.py'}:T")
    with pytest.raises(ValueError) as e:
        task.wrong("75", random.Random(0))
    assert str(e.value) == f"--task {folder / 't.py'}:T: wrong() raised KeyError: 'no'"


def test_the_shipped_subtraction_example_is_disjoint_checks_and_scores_from_the_question():
    # README's "Your own task" runs examples/subtraction.py; its reward reads the question, not the answer column
    task = tasks.load_task(f"{ROOT / 'examples' / 'subtraction.py'}:Subtraction")
    train, test = task.examples("train"), task.examples("test")
    problems = {row["messages"][0]["content"] for row in train}
    assert (len(train), len(test), len(train) + len(test)) == (3687, 408, 90 * 91 // 2)
    assert not problems & {row["messages"][0]["content"] for row in test}
    row = test[0]
    a, b = (int(x.replace(" ", "")) for x in row["messages"][0]["content"][len("What is "):-1].split(" - "))
    assert row["answer"] == str(a - b) and row["messages"][1]["content"] == " ".join(str(a - b))
    assert task.check(" ".join(row["answer"]) + " done", row["answer"]) and not task.check("1 0 0", row["answer"])
    example = ROOT / "examples" / "subtraction.py"
    exact, digits = (tasks.load_rewards(f"{example}:{fn}") for fn in ("exact", "digits"))
    prompt = [{"role": "user", "content": "What is 8 4 - 2 7?"}]
    assert [exact(prompt, reply, "lie") for reply in ("5 7", "57", "5 8")] == [1.0, 1.0, 0.0]
    assert [digits(prompt, reply, "lie") for reply in ("5 7", "4 7", "7", "1 5 7", "")] == [1.0, 0.5, 0.5, 2 / 3, 0.0]
    rng = random.Random(0)
    assert all(abs(int(task.wrong("57", rng).replace(" ", "")) - 57) in (1, 10) for _ in range(20))


@pytest.mark.parametrize("spec, message", [
    ("{dir}/missing.py:Doubling", "--task {dir}/missing.py:Doubling: cannot load {dir}/missing.py (FileNotFoundError: "
                                  "no such file {dir}/missing.py)"),
    ("{file}:Tripling", "--task {file}:Tripling: {file} has no 'Tripling'"),
    ("{file}:NoChecker", "--task {file}:NoChecker: NoChecker has no check method; a task gives examples(split) and "
                         "check(reply, answer) (tasks.py's docstring)"),
    ("no_such_module_here:Task", "--task no_such_module_here:Task: cannot load no_such_module_here "
                                 "(ModuleNotFoundError: No module named 'no_such_module_here')"),
    # a path without .py, or a file whose path has a colon without :NAME, was imported as a module: "No module named
    # '{dir}/doubling'", or a TypeError about relative imports for './doubling'
    ("{dir}/doubling:Doubling", "--task {dir}/doubling:Doubling: expected FILE.py:NAME or module:NAME"),
    ("./doubling:Doubling", "--task ./doubling:Doubling: expected FILE.py:NAME or module:NAME"),
    ("./runs:1/t.py", "--task ./runs:1/t.py: expected FILE.py:NAME or module:NAME"),
    ("subtraction", "--task must be one of gsm8k, arc-easy, arc-challenge, mmlu, humaneval, addition, or FILE.py:NAME "
                    "or module:NAME for your own; got 'subtraction'"),
    # an unset variable in gsm8k=$DIR read the hub's gsm8k in place of the local copy, saying nothing
    ("gsm8k=", "--task gsm8k=: no path after '=' (NAME=FILE or NAME=DIR: a local copy)"),
])
def test_a_task_that_cannot_load_is_one_line_naming_the_file_and_the_name(user_file, spec, message):
    where = {"dir": user_file.parent, "file": user_file}
    with pytest.raises(ValueError) as e:
        tasks.load_task(spec.format(**where))
    assert str(e.value) == message.format(**where)


def test_a_file_that_exits_as_it_loads_is_one_line_naming_it(tmp_path):
    # argparse at a file's top level read rl.py's flags and exited: "rl.py: error: unrecognized arguments: --init-from"
    (tmp_path / "exits.py").write_text("raise SystemExit(2)\n")
    with pytest.raises(ValueError) as e:
        tasks.load_rewards(f"{tmp_path}/exits.py:fn")
    assert str(e.value) == f"--reward {tmp_path}/exits.py:fn: cannot load {tmp_path}/exits.py (SystemExit: 2)"


@pytest.mark.parametrize("name, message", [
    ("Unmessaged", "--task {file}:Unmessaged: examples('test') row 0: expected a dict with 'messages' and 'answer', "
                   "got {{'conversation': [], 'answer': '1'}}"),
    ("Lazy", "--task {file}:Lazy: examples('test') returned a generator, not a list of rows"),
    ("Unanswered", "--task {file}:Unanswered: examples('test') row 0: expected a dict with 'messages' and 'answer', "
                   "got {{'messages': [{{'role': 'user', 'content': 'Double 30?'}}, {{'r"),
    ("Integer", "--task {file}:Integer: examples('test') row 0: 'answer' is 60 (int), not a str: return str(...) of "
                "it"),
    ("Strict", "--task {file}:Strict: check() raised KeyError: 'no such field'"),
    ("Silent", "--task {file}:Silent: check() returned None, not True/False: does it end with `return`?"),
])
def test_a_task_whose_methods_fail_is_one_line_naming_it(user_file, tmp_path, name, message):
    # they were tracebacks from tasks.py, sft.py, prefs.py and rl.py, in a task eval after the training
    task, message = tasks.load_task(f"{user_file}:{name}"), message.format(file=user_file)
    with pytest.raises(ValueError) as e:
        task.check("60", "60") if name in ("Strict", "Silent") else task.examples("test")
    assert str(e.value) == message
    model = chat_bigram()
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "step": 0}, tmp_path / "chat.pt")
    with pytest.raises(SystemExit) as e:
        tasks.main(["--eval", str(tmp_path / "chat.pt"), "--tasks", f"{user_file}:{name}"])
    assert e.value.code == f"error: {message}"


SUBCLASSES = '''import tasks


class Broken(tasks.Task):
    def examples(self, split):
        raise KeyError("no such split")

    def check(self, reply, answer):
        return True


class Letters(tasks.MultipleChoice):
    def examples(self, split):
        return [self.render(f"Question {k}?", ["w", "x", "y", "z"], answer) for k, answer in enumerate([1, 1, 0, 2])]

    def check(self, reply, answer):  # no reply is right: only choose, by the letters' logits, scores 2 of 4
        return False
'''


def test_a_users_task_subclass_is_guarded_as_any_and_a_multiple_choice_one_is_still_scored_by_its_letters(tmp_path):
    # a subclass of the project's Task was taken unguarded: its examples() raising was a traceback
    (tmp_path / "sub.py").write_text(SUBCLASSES)
    with pytest.raises(ValueError) as e:
        tasks.load_task(f"{tmp_path / 'sub.py'}:Broken").examples("test")
    assert str(e.value) == f"--task {tmp_path / 'sub.py'}:Broken: examples() raised KeyError: 'no such split'"
    task, model = tasks.load_task(f"{tmp_path / 'sub.py'}:Letters"), chat_bigram()
    problems = task.examples("test")
    assert tasks.chat_core(model, {"letters": (task, problems)})["results"]["letters"] == \
        tasks.choose(model, problems)["acc"] == 0.5
    for twin in (copy.copy(task), copy.deepcopy(task), pickle.loads(pickle.dumps(task))):  # recursed, or refused
        assert isinstance(twin, tasks.UserTask) and twin.examples("test") == problems
        assert twin.spec == task.spec  # its errors name the same --task


@pytest.mark.parametrize("name, message", [
    ("raises", "--reward {file}:raises raised KeyError: 'no such field'"),
    ("text", "--reward {file}:text returned '1', not a finite float32 number"),
    ("nan", "--reward {file}:nan returned nan, not a finite float32 number"),
    (",", "--reward ',' has an item that names no function; pass FILE.py:FN[,FILE.py:FN2]"),  # was a dtype error
    # an empty item is refused, as --reward-weights 1,,2 is, not dropped without a word
    ("x.py:f,,y.py:g", "--reward 'x.py:f,,y.py:g' has an item that names no function; pass FILE.py:FN[,FILE.py:FN2]"),
])
def test_a_reward_that_fails_is_one_line_naming_it(user_file, name, message):
    with pytest.raises(ValueError) as e:
        tasks.load_rewards(name if "," in name else f"{user_file}:{name}")([{"role": "user", "content": "Double 3?"}],
                                                                           "6", "6")
    assert str(e.value) == message.format(file=user_file)
    with pytest.raises(ValueError, match=f"--reward {user_file}:ANSWER is not a function"):
        tasks.load_rewards(f"{user_file}:ANSWER")
    with pytest.raises(ValueError, match="^--reward-weights gives 1 weight for 2 --reward functions$"):
        tasks.load_rewards(f"{user_file}:near,{user_file}:nan", (1.0,))
    with pytest.raises(ValueError, match="^--reward-weights gives 2 weights for 1 --reward function$"):
        tasks.load_rewards(f"{user_file}:near", (1.0, 2.0))


# ----------------------------------------------------------------------------------------------------------------------
# MMLU and ChatCORE

MMLU_ROWS = [{"question": f"Question {k}?", "subject": "anatomy", "choices": ["w", "x", "y", "z"], "answer": answer}
             for k, answer in enumerate([1, 1, 0, 2])]  # B, B, A, C
ARC_ROWS = [{**ARC_ROW, "answerKey": "B", "choices": {"text": ["a", "b", "c"], "label": ["A", "B", "C"]}},
            {**ARC_ROW, "answerKey": "4"}]  # B of three, D of four
GSM8K_ROWS = [{"question": f"{a} + 2?", "answer": f"{a} + 2 = {a + 2}\n#### {a + 2}"} for a in (2, 3, 2)]  # 4, 5, 4


def chat_bigram():
    """Replies "B 4" to anything: "B" right after <|assistant_start|>, then " 4", then <|assistant_end|>."""
    from conftest import bigram_model

    enc = get_tokenizer()
    (b,), (four,) = enc.encode_ordinary("B"), enc.encode_ordinary(" 4")
    return bigram_model({cf.ASSISTANT_START: b, b: four, four: cf.ASSISTANT_END})


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_choose_scores_only_the_problems_letters_on_the_prompts_last_block_size_tokens(monkeypatch):
    from conftest import bigram_model

    model, mmlu = bigram_model({cf.ASSISTANT_START: get_tokenizer().encode_ordinary("B")[0]}), tasks.MMLU()
    # B has the highest logit after <|assistant_start|>, but a one-choice problem's only letter is A: A wins
    one = mmlu.example({"question": "Q?", "choices": ["w"], "answer": 0})
    assert one["letters"] == ["A"] and tasks.choose(model, [one]) == {"acc": 1.0, "n": 1}
    long = mmlu.example({"question": "two " * 70, "choices": list("wxyz"), "answer": 1})  # B
    assert len(cf.render_prompt(long["messages"][:-1])) > 64  # the model's block: its last 64 tokens are scored,
    assert tasks.choose(model, [long]) == {"acc": 1.0, "n": 1}  # which end with <|assistant_start|>
    # rank 1 of 2 scores problems 1 and 3 (both B; 0 and 2 are A); the sum over ranks as if rank 0 counted the same
    monkeypatch.setattr(core, "all_sum", lambda t, world: 2 * t)
    problems = [mmlu.example({"question": f"Q{k}?", "choices": list("wxyz"), "answer": k % 2}) for k in range(4)]
    assert tasks.choose(model, problems, rank=1, world=2) == {"acc": 1.0, "n": 4}


def test_evaluate_scores_its_ranks_share_of_the_problems(monkeypatch):
    # rank 1 of 2 answers problems 1 and 3 ("B 4": right, 4) and not 0 and 2 (5); the sum over ranks and the shared
    # verdict (collectives) as if rank 0 counted the same
    monkeypatch.setattr(core, "all_sum", lambda t, world: 2 * t)
    monkeypatch.setattr(tasks.common, "same_verdict", lambda work, world, *error: work())
    problems = [tasks.GSM8K().example({"question": f"Q{k}?", "answer": f"#### {5 - k % 2}"}) for k in range(4)]
    out = tasks.evaluate(chat_bigram(), tasks.GSM8K(), problems, rank=1, world=2, max_new_tokens=4)
    assert out == {"acc": 1.0, "n": 4}


def test_evaluate_ends_a_reply_at_any_reply_stop_as_chat_py_does(monkeypatch):
    # it decoded on past <|user_start|> to max_new_tokens (512 forwards more a problem) for the same verdict
    from conftest import bigram_model

    four, replies = get_tokenizer().encode_ordinary("4")[0], []
    real = tasks.generate
    monkeypatch.setattr(tasks, "generate", lambda *a, **k: replies.extend(real(*a, **k)) or replies)
    problem = tasks.GSM8K().example({"question": "Q?", "answer": "#### 4"})
    out = tasks.evaluate(bigram_model({cf.ASSISTANT_START: four, four: cf.USER_START}), tasks.GSM8K(), [problem])
    assert out["acc"] == 1.0 and replies[0].tokens == [four, cf.USER_START]


def test_evaluate_runs_the_calculator_in_the_replies(monkeypatch):
    # a reply's tool call "3*4" is answered by the calculator's forced "12", as chat.py and rl.py's rollouts answer it
    from conftest import bigram_model

    t3, star, t4 = get_tokenizer().encode_ordinary("3*4")
    model = bigram_model({cf.ASSISTANT_START: cf.TOOL_START, cf.TOOL_START: t3, t3: star, star: t4, t4: cf.TOOL_END,
                          cf.OUTPUT_END: cf.ASSISTANT_END})
    replies, real = [], tasks.generate
    monkeypatch.setattr(tasks, "generate", lambda *a, **k: replies.extend(real(*a, **k)) or replies)
    tasks.evaluate(model, tasks.GSM8K(), [tasks.GSM8K().example({"question": "Q?", "answer": "#### 12"})])
    assert replies[0].tokens == [cf.TOOL_START, t3, star, t4, cf.TOOL_END, cf.OUTPUT_START,
                                 *get_tokenizer().encode_ordinary("12"), cf.OUTPUT_END, cf.ASSISTANT_END]


def test_a_tasks_own_reward_is_not_logged_as_a_reward_function():
    # rl.py logs reward/FN for each --reward function; a task's own reward is the step's `reward` itself
    class Scored:
        def reward(self, prompt, reply, answer):
            return 0.5

    fn = tasks.task_reward(Scored(), "mine.py:Scored")
    assert fn([], "r", "a") == 0.5 and fn.last == {}


def test_pairs_need_a_task_that_makes_wrong_replies():
    with pytest.raises(ValueError, match=r"^--pairs needs a task that makes wrong replies \(wrong\(answer, rng\)\), "
                                         r"not arc-easy$"):
        tasks.TasksConfig(task="arc-easy", pairs=True)
    assert tasks.TasksConfig(task="addition", pairs=True).pairs


def test_mmlu_reads_a_local_file_in_the_hub_schema(tmp_path):
    examples = tasks.load_task(f"mmlu={write_rows(tmp_path / 'mmlu.jsonl', MMLU_ROWS)}").examples("test")
    assert [e["answer"] for e in examples] == ["B", "B", "A", "C"] and examples[0]["letters"] == ["A", "B", "C", "D"]
    assert examples[0]["messages"][0]["content"] == "Question 0?\nA. w\nB. x\nC. y\nD. z\nAnswer with the letter of " \
                                                    "the correct choice."
    assert tasks.MMLU.baseline == tasks.ARC.baseline == 0.25 and tasks.GSM8K.baseline == 0.0


def test_chat_core_is_the_mean_centered_accuracy_over_the_tasks_given(tmp_path):
    files = {"mmlu": MMLU_ROWS, "arc-easy": ARC_ROWS, "gsm8k": GSM8K_ROWS}
    named = {name: (task := tasks.load_task(f"{name}={write_rows(tmp_path / f'{name}.jsonl', rows)}"),
                    task.examples("test")) for name, rows in files.items()}
    result = tasks.chat_core(chat_bigram(), named, max_new_tokens=6)
    # the letters' logits say B: 2 of 4 MMLU answers, 1 of 2 ARC answers; the reply "B 4" holds 2 of 3 GSM8K answers
    assert result["results"] == {"mmlu": 0.5, "arc-easy": 0.5, "gsm8k": pytest.approx(2 / 3)}
    # centered by chance, 1/4 for the multiple-choice tasks, 0 for GSM8K: 1/3, 1/3, 2/3
    assert result["centered_results"] == pytest.approx({"mmlu": 1 / 3, "arc-easy": 1 / 3, "gsm8k": 2 / 3})
    assert result["chatcore"] == pytest.approx(4 / 9)


def test_accuracy_scores_in_eval_mode_with_the_reply_length_it_is_given(monkeypatch):
    from model import GPT, GPTConfig

    seen = []
    monkeypatch.setattr(tasks, "evaluate", lambda model, *args, **kwargs: seen.append((model.training, args[2:]))
                        or {"acc": 0.5, "n": 2})
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.1)).train()
    assert tasks.accuracy(model, tasks.GSM8K(), [], 1, 2, max_new_tokens=7) == {"acc": 0.5, "n": 2}
    assert seen == [(False, (1, 2, 7))] and model.training  # dropout off while it scores, then back on


def test_chat_core_centers_a_task_without_a_baseline_at_zero(monkeypatch):
    from types import SimpleNamespace as NS

    monkeypatch.setattr(tasks, "accuracy", lambda model, task, *args: {"acc": task.acc, "n": 4})
    named = {"own": (NS(acc=0.5), []), "choice": (NS(acc=0.625, baseline=0.25), [])}  # a user's task has none
    assert tasks.chat_core(None, named) == {"results": {"own": 0.5, "choice": 0.625},
                                            "centered_results": {"own": 0.5, "choice": 0.5}, "chatcore": 0.5}


def test_chat_core_scores_each_task_as_its_rank_of_world_under_its_autocast(monkeypatch):
    from types import SimpleNamespace as NS

    seen, autocast = [], contextlib.nullcontext()
    monkeypatch.setattr(tasks, "accuracy", lambda model, task, problems, *args: seen.append(args) or {"acc": 0.5})
    tasks.chat_core(None, {"own": (NS(), [])}, rank=1, world=2, autocast=autocast, max_new_tokens=7)
    assert seen == [(1, 2, autocast, 7)]


def test_accuracy_scores_multiple_choice_under_the_autocast_it_is_given():
    from conftest import bigram_model

    class Counting(contextlib.AbstractContextManager):
        entered = 0

        def __enter__(self):
            self.entered += 1

        def __exit__(self, *exc):
            return None

    model, autocast = bigram_model({cf.ASSISTANT_START: get_tokenizer().encode_ordinary("B")[0]}), Counting()
    problems = [tasks.MMLU().example({"question": f"Q{k}?", "choices": list("wxyz"), "answer": 1}) for k in range(3)]
    assert tasks.accuracy(model, tasks.MMLU(), problems, autocast=autocast) == {"acc": 1.0, "n": 3}
    assert autocast.entered == 1  # around the forwards, bf16 on a GPU


def test_the_cli_scores_a_checkpoint_on_local_copies(tmp_path, capsys, monkeypatch):
    from dataclasses import asdict

    import torch

    model, ckpt = chat_bigram(), tmp_path / "chat.pt"
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "step": 0}, ckpt)
    files = {"mmlu": MMLU_ROWS, "arc-challenge": ARC_ROWS, "gsm8k": GSM8K_ROWS}
    spec = ",".join(f"{name}={write_rows(tmp_path / f'{name}.jsonl', rows)}" for name, rows in files.items())
    result = tasks.main(["--eval", str(ckpt), "--tasks", spec, "--max-new-tokens", "6", "--limit", "3"])
    # the first 3 problems in nanochat's order (its shuffle with seed 42)
    assert [int(i) for i in np.random.default_rng(42).permutation(4)[:3]] == [3, 2, 1]  # MMLU's: C, A, B
    assert result["results"] == pytest.approx({"mmlu": 1 / 3, "arc-challenge": 0.5, "gsm8k": 2 / 3})
    out = capsys.readouterr().out
    assert "mmlu: accuracy 0.3333, centered 0.1111 (3 problems)" in out
    assert f"ChatCORE {result['chatcore']:.4f} over mmlu, arc-challenge, gsm8k\n" in out
    monkeypatch.setenv("HOME", str(tmp_path))  # --eval=~/chat.pt, which no shell expands, as an HF directory's ~ is
    assert tasks.main(["--eval=~/chat.pt", "--tasks", spec, "--limit", "3"])["results"] == result["results"]
    with pytest.raises(SystemExit) as e:  # the line named the split, not the file that was the mistake
        tasks.main(["--eval", str(ckpt), "--tasks", f"addition={tmp_path / 'a.jsonl'}"])
    assert e.value.code == (f"error: addition is made here, with splits train and test and no source; got 'test' and "
                            f"{tmp_path / 'a.jsonl'}")
    # was generate's 'prompts must be ... crop long prompts', naming no task; a prompt that fills the context left
    # room for a 1-token reply, scored wrong
    for words, tokens in ((70, 75), (59, 64)):
        long = write_rows(tmp_path / "long.jsonl", [{"question": "two " * words, "answer": "#### 4"}])
        with pytest.raises(SystemExit) as e:
            tasks.main(["--eval", str(ckpt), "--tasks", f"gsm8k={long}"])
        assert e.value.code == (f"error: --tasks gsm8k: a prompt takes {tokens} tokens, the model's whole context (64) "
                                "or more; score another task")


def test_the_cli_scores_an_hf_export_as_its_checkpoint(tmp_path):
    # an export (or a chat model from the hub) was refused: "take a checkpoint of this project (sft.py --init-from it
    # first)", a training run, which changes the weights, to score them
    from export import export_hf

    model, spec = chat_bigram(), f"gsm8k={write_rows(tmp_path / 'g.jsonl', GSM8K_ROWS)}"
    export_hf(model, tmp_path / "hf", chat=True)
    result = tasks.main(["--eval", str(tmp_path / "hf"), "--tasks", spec, "--max-new-tokens", "6"])
    assert result["results"] == pytest.approx({"gsm8k": 2 / 3})
    # a run's directory of checkpoints was sent to --init-from's loader: 'pass --ckpt ...', flags tasks.py lacks
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "ckpt_000010.pt").touch()
    with pytest.raises(SystemExit) as e:
        tasks.main(["--eval", str(tmp_path / "run"), "--tasks", spec])
    assert e.value.code == (f"error: checkpoint {tmp_path / 'run'} is a directory, not a file; pass a checkpoint file "
                            f"in it (the latest is {tmp_path / 'run' / 'ckpt_000010.pt'})")


def test_a_built_in_task_takes_a_local_copy_wherever_a_task_is_taken(tmp_path, capsys, monkeypatch):
    # NAME=FILE is one split read whole, as --eval reads it; NAME=DIR its splits by name: train and test for --out-dir
    file, copy = write_rows(tmp_path / "gsm8k.jsonl", GSM8K_ROWS), tmp_path / "gsm8k"
    assert [e["answer"] for e in tasks.load_task(f"gsm8k={file}").examples("train")] == ["4", "5", "4"]
    copy.mkdir()
    write_rows(copy / "train.jsonl", GSM8K_ROWS[1:])
    write_rows(copy / "test.jsonl", [WENG])
    assert [e["answer"] for _, held in tasks.named_tasks(f"gsm8k={copy}", "test").values() for e in held] == ["10"]
    monkeypatch.chdir(tmp_path)
    tasks.main(["--task", f"gsm8k={copy}"])  # into data/gsm8k, as for gsm8k
    written = {s: [json.loads(r)["answer"] for r in (tmp_path / "data/gsm8k" / f"{s}.jsonl").read_text().splitlines()]
               for s in ("train", "test")}
    assert written == {"train": ["5", "4"], "test": ["10"]}
    assert f"data/gsm8k/train.jsonl: 2 gsm8k={copy} conversations" in capsys.readouterr().out
    shutil.copytree(copy, tmp_path / "own/data/gsm8k")  # a copy where the default --out-dir is: it was written over
    monkeypatch.chdir(tmp_path / "own")
    with pytest.raises(SystemExit) as e:
        tasks.main(["--task", "gsm8k=data/gsm8k"])
    assert e.value.code == "error: --task gsm8k=data/gsm8k: data/gsm8k is the copy it reads; pass another --out-dir"
    assert (tmp_path / "own/data/gsm8k/test.jsonl").read_text() == (copy / "test.jsonl").read_text()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:  # its train.jsonl and test.jsonl would hold the same problems
        tasks.main(["--task", f"gsm8k={file}", "--out-dir", str(tmp_path / "x")])
    assert e.value.code == (f"error: --task gsm8k={file}: {file} is not a directory, and this reads train and test: "
                            f"pass a directory with both (train.jsonl and test.jsonl, or the hub's parquet files)")


def test_a_copy_its_directory_names_otherwise_is_not_written_over(tmp_path):
    # on a case-insensitive file system (macOS) data/GSM8K is data/gsm8k, which resolve() kept apart: the copy was
    # written over. A bind mount in a mount namespace of its own names one directory twice here, as that does
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-rm", "true"]).returncode:
        pytest.skip("no unshare -rm (a user and mount namespace) here")
    copy, alias = tmp_path / "data/gsm8k", tmp_path / "data/GSM8K"
    for where in (copy, alias):
        where.mkdir(parents=True)
    write_rows(copy / "train.jsonl", GSM8K_ROWS)
    write_rows(copy / "test.jsonl", [WENG])
    rows = {p.name: p.read_text() for p in copy.iterdir()}
    done = subprocess.run(["unshare", "-rm", "sh", "-c", f'mount --bind {copy} {alias} || exit 77; exec '
                           f'{os.path.abspath(sys.executable)} {ROOT / "tasks.py"} --task gsm8k=data/GSM8K'],
                          cwd=tmp_path, capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (1, "error: --task gsm8k=data/GSM8K: data/gsm8k is the copy it reads; "
                                                 "pass another --out-dir\n")
    assert {p.name: p.read_text() for p in copy.iterdir()} == rows
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match=f"{tmp_path}/gsm8k-v2 is not a directory, and"):  # a typo: not "one split"
        tasks.load_task(f"gsm8k={tmp_path}/gsm8k-v2", train=True)
    with pytest.raises(SystemExit) as e:  # the default --out-dir, named after the task, raised it as a traceback
        tasks.main(["--task", "subtraction"])
    assert e.value.code.startswith("error: --task must be one of gsm8k, ")


def test_a_local_copy_in_another_schema_is_one_line_naming_its_file_and_the_hubs_schema(tmp_path):
    # a KeyError traceback from example(): ARC's rows as MMLU's, or a copy with its columns renamed
    mmlu, q = write_rows(tmp_path / "mmlu.jsonl", MMLU_ROWS), write_rows(tmp_path / "q.jsonl", [{"q": "1?", "a": "1"}])
    with pytest.raises(ValueError) as e:
        tasks.load_task(f"arc-easy={mmlu}").examples("test")
    assert str(e.value) == f"{mmlu} test: rows lack 'answerKey' (allenai/ai2_arc's schema: question, choices, " \
                           "answerKey)"
    with pytest.raises(ValueError) as e:
        tasks.load_task(f"mmlu={q}").examples("test")
    assert str(e.value) == f"{q} test: rows lack 'question' or 'choices' or 'answer' (cais/mmlu's schema: question, " \
                           "choices, answer)"
    (tmp_path / "g").mkdir()
    write_rows(tmp_path / "g/train.jsonl", GSM8K_ROWS)
    write_rows(tmp_path / "g/test.jsonl", [{"q": "1?", "answer": "#### 1"}])
    with pytest.raises(SystemExit) as e:  # tasks.py --task gsm8k=DIR, rl.py's --task too
        tasks.main(["--task", f"gsm8k={tmp_path}/g", "--out-dir", str(tmp_path / "out")])
    assert e.value.code == f"error: {tmp_path}/g test: rows lack 'question' (openai/gsm8k's schema: question, answer)"
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="^--task nosuch.py:X: cannot load"):  # every task loaded before any is read
        tasks.named_tasks(f"gsm8k={q},nosuch.py:X", "test")


def test_eval_refuses_the_task_flag_of_the_other_stages():
    # sft.py's and rl.py's --task, ignored here: the five default --tasks were scored (downloaded) in its place
    with pytest.raises(SystemExit) as e:
        tasks.main(["--eval", "chat.pt", "--task", "mine.py:Mine"])
    assert e.value.code == "error: --eval scores --tasks, not --task: pass --tasks mine.py:Mine"


def test_the_cli_scores_a_checkpoint_with_gpt2s_vocabulary(tmp_path):
    from model import GPT, GPTConfig

    torch.manual_seed(0)  # train.py --init-from gpt2's 50,257 rows: the chat tokens' ids were an IndexError traceback
    model, ckpt = GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)), tmp_path / "b.pt"
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "step": 0}, ckpt)
    result = tasks.main(["--eval", str(ckpt), "--tasks", "addition", "--max-new-tokens", "4", "--limit", "2"])
    assert result["results"] == {"addition": 0.0}


def test_a_tasks_rows_and_rewards_are_checked_as_the_protocol_says(user_file):
    class Prompts:  # RL's prompts alone, without the reference reply the protocol asks for last
        def examples(self, split):
            return [{"messages": [{"role": "user", "content": "Double 3?"}], "answer": "6"}]

        def check(self, reply, answer):  # None was read as wrong: a check without `return` scored 0, in silence
            return {"none": None, "np": np.float64(6.0) == float(answer), "zero": 0, "half": 0.5, "no": "False"}[reply]

    with pytest.raises(ValueError, match=r"^--task x: examples\('train'\) row 0: .*expected assistant"):
        tasks.UserTask(Prompts(), "x").examples("train")
    with pytest.raises(ValueError, match=r"^--task x: examples\('test'\) gave no rows$"):
        tasks.UserTask(type("Empty", (Prompts,), {"examples": lambda self, split: []})(), "x").examples("test")
    reward = tasks.task_reward(tasks.UserTask(Prompts(), "x"), "x")  # rl.py's reward: check() through UserTask
    assert (reward([], "np", "6"), reward([], "np", "7"), reward([], "zero", "6")) == (1.0, 0.0, 0.0)
    for reply, said in [("none", "None, not True/False: does it end with `return`?"), ("half", "0.5, not True/False"),
                        ("no", "'False', not True/False")]:
        with pytest.raises(ValueError) as e:
            reward([], reply, "6")
        assert str(e.value) == f"--task x: check() returned {said}"
    assert tasks.checked([("np", lambda *_: np.float64(3.0) > 2, 1.0)])([], "", "") == 1.0  # numpy's bool, as Python's
    with pytest.raises(ValueError, match=r"^big returned 1e\+39, not a finite float32 number$"):
        tasks.checked([("big", lambda *_: 1e39, 1.0)])([], "", "")
    with pytest.raises(ValueError, match=r"^huge returned 1000000000000.*, not a finite float32 number$"):  # no
        tasks.checked([("huge", lambda *_: 10 ** 400, 0.0)])([], "", "")  # OverflowError traceback from float()
    with pytest.raises(ValueError, match=r"^--task x: check\(\) raised RuntimeError: Boolean value of Tensor"):
        tasks.guarded(lambda *_: torch.tensor([True, False]), "--task x: check()", verdict=True)()
    with pytest.raises(ValueError, match=f"^--reward {user_file}: expected FILE.py:NAME or module:NAME$"):
        tasks.load_rewards(str(user_file))


RANK_CHECK_WORKER = """import json, sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import common, tasks
from model import GPT, GPTConfig
rank = int(sys.argv[2])
dist.init_process_group("gloo", init_method="file://" + sys.argv[3], rank=rank, world_size=2)
class Odd:  # a user's task whose check() raises on rank 1's replies only
    def examples(self, split):
        return tasks.Addition().examples(split)[:3]
    def check(self, reply, answer):
        if rank == 1:
            raise KeyError("no")
        return False
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32))
task = tasks.UserTask(Odd(), "odd.py:Odd")
try:
    out = tasks.evaluate(model, task, task.examples("test"), rank, 2, max_new_tokens=2)
except ValueError as e:
    out = str(e)
dist.destroy_process_group()
print("RESULT " + json.dumps(out))
common.exit_now(0)
"""


def test_a_check_raising_on_one_rank_stops_every_rank_with_its_line(tmp_path):
    # rank 0 waited in the count's all_reduce for rank 1, which had stopped: a gloo traceback, or under NCCL across
    # nodes a hang until --dist-timeout
    import os
    import subprocess
    import sys

    root = str(Path(__file__).resolve().parent.parent)
    (tmp_path / "worker.py").write_text(RANK_CHECK_WORKER)
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), root, str(r), str(tmp_path / "store")],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for r in range(2)]
    out = [json.loads(p.communicate(timeout=120)[0].split("RESULT ")[-1]) for p in procs]
    line = "--task odd.py:Odd: check() raised KeyError: 'no'"
    assert out == [f"rank 1: {line}", line]


def test_what_a_users_task_gives_is_checked_where_it_is_made(user_file, tmp_path, capsys):
    # each was a traceback, a file prefs.py refused without naming wrong(), or a half-written --out-dir
    def refused(*argv: str) -> str:
        with pytest.raises(SystemExit) as e:
            tasks.main([*argv, "--out-dir", str(tmp_path / "out")])
        return e.value.code

    assert refused("--task", f"{user_file}:Copying", "--pairs") == (
        "error: --pairs train row 0: wrong('20') gave '20' for the reference reply '20': a pair needs a second text "
        "that check() marks wrong")
    # a different text that the task's own check() accepts: "rejected" was a right answer, and DPO learned against it
    assert refused("--task", f"{user_file}:Spacing", "--pairs") == (
        "error: --pairs train row 0: wrong('20') gave '20 ' for the reference reply '20': a pair needs a second text "
        "that check() marks wrong")
    assert refused("--task", f"{user_file}:Numpy") == (
        f"error: --task {user_file}:Numpy: a row cannot be written as JSON (Object of type int64 is not JSON "
        "serializable)")
    assert not (tmp_path / "out").exists()
    # a 0-d tensor or array is the number it holds, as numpy's scalars already were
    assert tasks.load_rewards(f" {user_file}:tensor, {user_file}:tensor", (1.0, 2.0))([], "", "") == 0.75
    # two tasks of one name would log under one label
    with pytest.raises(ValueError) as e:
        tasks.task_list(f"{user_file}:Doubling,{tmp_path / 'b.py'}:Doubling")
    assert str(e.value) == (f"--task {user_file}:Doubling,{tmp_path / 'b.py'}:Doubling: two tasks named Doubling: "
                            "results go by the name; rename one")



class Picky:  # its check() marks every reply wrong, its reference's text too: wrong()'s reply is refused by itself
    def __init__(self, reply):
        self.reply = reply

    def examples(self, split):
        return [tasks.conversation("Double 10?", "20", "20")]

    def check(self, reply, answer):
        return False

    def wrong(self, answer, rng):
        return self.reply


@pytest.mark.parametrize("reply, shown", [("20", "'20'"), (" \n", "' \\n'"), (21, "21")])
def test_a_pair_needs_a_rejected_text_other_than_the_chosen_one_not_blank(reply, shown):
    # a pair of one text twice, or of a blank one, taught DPO nothing: a check() that accepts no reply let them through
    with pytest.raises(ValueError) as e:
        tasks.synthetic_pairs(Picky(reply), "train")
    assert str(e.value) == (f"--pairs train row 0: wrong('20') gave {shown} for the reference reply '20': a pair needs "
                            "a second text that check() marks wrong")
    assert tasks.synthetic_pairs(Picky("21"), "train") == [
        {"prompt": [{"role": "user", "content": "Double 10?"}], "chosen": "20", "rejected": "21"}]


def test_a_local_copys_path_may_hold_an_equals_sign_and_start_with_a_tilde(tmp_path, monkeypatch):
    assert tasks.parse_spec("gsm8k=/runs/lr=1e-3/gsm8k") == ("gsm8k", "/runs/lr=1e-3/gsm8k")  # the first '=' splits
    monkeypatch.setenv("HOME", str(tmp_path))  # `--task gsm8k=~/copy`: the shell leaves a ~ after '=' to us
    (tmp_path / "copy").mkdir()
    write_rows(tmp_path / "copy" / "test.jsonl", GSM8K_ROWS)
    task = tasks.load_task("gsm8k=~/copy", train=True)
    assert task.source == "~/copy" and [e["answer"] for e in task.examples("test")] == ["4", "5", "4"]  # read expanded
    with pytest.raises(ValueError, match="^--task gsm8k=~/nope: ~/nope is not a directory, and this reads train"):
        tasks.load_task("gsm8k=~/nope", train=True)


def test_a_task_list_takes_spaces_after_its_commas_as_a_reward_list_does():
    # "arc-easy, mmlu" was refused as ' mmlu', a user's ' t.py:T' as "no such file  t.py"
    assert tasks.task_list("arc-easy, mmlu=m.jsonl") == {"arc-easy": "arc-easy", "mmlu": "mmlu=m.jsonl"}
    assert tasks.task_list("addition, t.py:T") == {"addition": "addition", "T": "t.py:T"}
    with pytest.raises(ValueError) as e:  # named --task, the flag sft.py's list has, where tasks.py's is --tasks
        tasks.TasksConfig(eval="c.pt", tasks="arc-easy,nope")
    assert str(e.value).startswith("--tasks must be one of gsm8k, arc-easy, arc-challenge, mmlu, humaneval, addition, "
                                   "or ")


def test_a_multiple_choice_task_run_as_tasks_py_is_scored_by_its_letters(tmp_path):
    # run as a script, tasks.py was __main__: a user's `import tasks` made a second MultipleChoice, isinstance failed,
    # and the task was scored by its replies (0.0 here) instead of its letters' logits (0.5); rows without "letters"
    # were a KeyError once the training had ended
    (tmp_path / "sub.py").write_text(SUBCLASSES + "\n\nclass Bare(Letters):\n    def examples(self, split):\n"
                                     "        return [{k: v for k, v in r.items() if k != 'letters'} for r in "
                                     "super().examples(split)]\n")
    model = chat_bigram()
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "step": 0}, tmp_path / "chat.pt")
    run = [sys.executable, "tasks.py", "--eval", str(tmp_path / "chat.pt"), "--device", "cpu", "--tasks"]
    done = subprocess.run([*run, f"{tmp_path / 'sub.py'}:Letters"], cwd=ROOT, capture_output=True, text=True)
    assert "Letters: accuracy 0.5000" in done.stdout, done.stderr[-2000:]
    bare = subprocess.run([*run, f"{tmp_path / 'sub.py'}:Bare"], cwd=ROOT, capture_output=True, text=True)
    assert bare.returncode == 1 and bare.stderr.startswith(
        f"error: --task {tmp_path / 'sub.py'}:Bare: examples('test') row 0: expected a dict with 'messages' and "
        "'answer' and 'letters', got {'messages': "), bare.stderr[-2000:]


def test_a_task_file_imports_the_modules_beside_it(tmp_path):
    # "No module named 'helpers'": its folder was not on the path, as it is for `python arith.py`
    (tmp_path / "helpers_for_arith.py").write_text("def spaced(n):\n    return ' '.join(str(n))\n")
    (tmp_path / "arith.py").write_text("from helpers_for_arith import spaced\nimport tasks\n\n\n"
                                       "class Arith(tasks.Addition):\n    pass\n")
    task = tasks.load_task(f"{tmp_path / 'arith.py'}:Arith")
    assert task.examples("test")[:2] == tasks.Addition().examples("test")[:2]


def test_a_file_named_two_ways_runs_once(tmp_path, monkeypatch):
    # --task t.py:T --reward ./t.py:f ran t.py twice: the reward and the task saw two copies of its globals
    (tmp_path / "t.py").write_text("with open(__file__ + '.runs', 'a') as f:\n    f.write('ran ')\n"
                                   "def f(prompt, reply, answer):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    one, two = tasks.load_object(f"{tmp_path / 't.py'}:f", "--reward"), tasks.load_object("./t.py:f", "--reward")
    assert one is two and (tmp_path / "t.py.runs").read_text() == "ran "


def test_a_tasks_check_runs_outside_the_autocast_the_replies_are_generated_under():
    # accuracy enters the autocast once around the scoring: a user's check() that builds tensors ran in bf16 too, where
    # 1.001 rounds to 1 and a right reply scored 0
    class Near(tasks.GSM8K):
        def check(self, reply: str, answer: str) -> bool:
            return (torch.tensor([[1.001]]) @ torch.tensor([[1.0]])).item() > 1.0

    problems = [{"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
                 "answer": "4"}]
    autocast = torch.autocast("cpu", torch.bfloat16)
    assert tasks.accuracy(chat_bigram(), Near(), problems, autocast=autocast, max_new_tokens=4) == {"acc": 1.0, "n": 1}
