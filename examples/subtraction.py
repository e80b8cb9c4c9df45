"""Your own task: two-digit subtraction, a file of its own that never imports the project.

A task is a class with examples(split) -> [{"messages": [user, assistant], "answer": str}], check(reply, answer) ->
bool and, for preference pairs, wrong(answer, rng) -> str. A reward is any function (prompt, reply, answer) -> float,
where prompt is the list of messages before the reply. Digits are spaced so that each is one GPT-2 token:
"What is 8 4 - 2 7?" -> "5 7".
"""

import random
import re
import zlib

PROBLEM = re.compile(r"What is ([\d ]+) - ([\d ]+)\?")
NUMBER = re.compile(r"\d(?: ?\d)*")  # a number, spaced or not: "5 7", "57"


def spaced(n: int) -> str:
    return " ".join(str(n))


def first_number(reply: str) -> str:
    found = NUMBER.search(reply)
    return found.group().replace(" ", "") if found else ""


class Subtraction:
    """a - b for two-digit a >= b; a tenth of the pairs, chosen by a hash of the pair, is the test split."""

    def examples(self, split: str) -> list[dict]:
        if split not in ("train", "test"):
            raise ValueError(f"subtraction has splits train and test, not {split!r}")
        pairs = [(a, b) for a in range(10, 100) for b in range(10, a + 1)
                 if (zlib.crc32(f"{a}-{b}".encode()) % 10 == 0) == (split == "test")]
        random.Random(0).shuffle(pairs)
        return [{"messages": [{"role": "user", "content": f"What is {spaced(a)} - {spaced(b)}?"},
                              {"role": "assistant", "content": spaced(a - b)}], "answer": str(a - b)}
                for a, b in pairs]

    def check(self, reply: str, answer: str) -> bool:
        """The reply's first number is the answer."""
        return first_number(reply) == answer

    def wrong(self, answer: str, rng: random.Random) -> str:
        """A wrong reply for a preference pair: one digit off by one."""
        value = int(answer) + rng.choice([d for d in (-10, -1, 1, 10) if int(answer) + d >= 0])
        return spaced(value)


def truth(prompt: list[dict]) -> str:
    """a - b, computed from the last user message: a reward need not trust the answer column."""
    a, b = (int(x.replace(" ", "")) for x in PROBLEM.search(prompt[-1]["content"]).groups())
    return str(a - b)


def exact(prompt: list[dict], reply: str, answer: str) -> float:
    """1.0 if the reply's first number is a - b, else 0.0."""
    return float(first_number(reply) == truth(prompt))


def digits(prompt: list[dict], reply: str, answer: str) -> float:
    """Partial credit: the share of a - b's digits that the reply's first number has right, aligned from the units
    (a reply of the wrong length scores on the digits it shares, over the longer length)."""
    want, got = truth(prompt)[::-1], first_number(reply)[::-1]
    return sum(w == g for w, g in zip(want, got, strict=False)) / max(len(want), len(got), 1)
