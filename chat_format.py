"""The chat format, defined once: conversations to token ids and a loss mask, for SFT, chat.py, the evals and RL.

A conversation is a list of messages {"role", "content"} (the HF chat schema): an optional system message, then user
and assistant in turns, ending with the assistant's. It renders as

    <|endoftext|> [<|system_start|> text <|system_end|>] <|user_start|> text <|user_end|>
    <|assistant_start|> reply <|assistant_end|> <|user_start|> ...

An assistant's content is a string, or a list of parts {"type": "text" | "tool" | "output", "text"}: a calculator call
renders as <|tool_start|> expression <|tool_end|>, its result as <|output_start|> text <|output_end|>. The mask is 1 on
what the model learns to write (the assistant's text and tool calls, and <|assistant_end|>) and 0 on what it is given
(BOS, system, user, <|assistant_start|>, tool outputs, which the engine inserts). The special tokens take the unused
rows 50257-50266 of GPT-2's padded 50,304-row embedding; text goes through encode_ordinary, so no text makes them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common import EOT, get_tokenizer, load_checkpoint, read_json
from datarows import VAL_EVERY, row_errors, row_name, split_rows, val_note
from fineweb import DataError, check_contents, crc32, permutation
from model import GPTConfig

BOS = EOT
SYSTEM_START, SYSTEM_END, USER_START, USER_END, ASSISTANT_START, ASSISTANT_END = range(50257, 50263)
TOOL_START, TOOL_END, OUTPUT_START, OUTPUT_END = range(50263, 50267)
CHAT_VOCAB = 50267  # ids below this may be sampled by a chat model
REPLY_STOPS = [BOS, *range(SYSTEM_START, TOOL_START)]  # any special token but the tool's ends a reply, as in parse
ROLES = {"system": (SYSTEM_START, SYSTEM_END), "user": (USER_START, USER_END),
         "assistant": (ASSISTANT_START, ASSISTANT_END)}
PARTS = {"text": (), "tool": (TOOL_START, TOOL_END), "output": (OUTPUT_START, OUTPUT_END)}
UNRENDERED = ("tool_calls", "reasoning_content", "thinking")  # OpenAI's tool calls, reasoning datasets' thoughts


# ----------------------------------------------------------------------------------------------------------------------
# Render and parse


def check_messages(messages: Any, last: str) -> None:
    """A ValueError naming what is wrong unless `messages` is [system?], user, assistant, ... ending with `last`."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"expected a non-empty list of messages, got {messages!r:.60}")
    system = isinstance(messages[0], dict) and messages[0].get("role") == "system"
    turns = ["system"] * system + ["user", "assistant"] * len(messages)  # the role each message must have
    for i, (message, expected) in enumerate(zip(messages, turns, strict=False)):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} is {message!r:.40}, expected a dict with a role and content")
        if not isinstance(role := message.get("role"), str) or role not in ROLES:  # a list is unhashable: a TypeError
            raise ValueError(f"message {i} has role {role!r}, expected one of system, user, assistant")
        if role != expected:
            raise ValueError(f"message {i} is from {role}, expected {expected} (an optional first system message, "
                             "then user and assistant in turns)")
        if field := next((key for key in UNRENDERED if message.get(key)), None):  # render would train without it
            raise ValueError(f"message {i} ({role}) has {field!r}, which the chat format does not render: move it into "
                             "the content (as text, or a tool call as {'type': 'tool'} parts) or drop the field")
        if message.get("weight") not in (None, 0, 1):  # OpenAI's fine-tuning rows: 0 leaves a reply out of the loss
            raise ValueError(f"message {i} has weight {message['weight']!r}: OpenAI's weight is 0 (not learned) or 1")
        if isinstance(content := message.get("content"), list) and content and role == "assistant":
            for part in content:
                if not (isinstance(part, dict) and str(part.get("type")) in PARTS and isinstance(part.get("text"), str)
                        and part["text"]):
                    raise ValueError(f"message {i} (assistant) has a bad part {part!r}: expected "
                                     "{'type': 'text' | 'tool' | 'output', 'text': a non-empty string}")
        elif not isinstance(content, str):
            raise ValueError(f"message {i} ({role}) has content of type {type(content).__name__}, expected a string"
                             + (" or a list of parts" if role == "assistant" else ""))
        elif not content.strip():  # a blank reply teaches only whitespace; chat.py never sends a blank message
            raise ValueError(f"message {i} ({role}) is empty or only whitespace")
    if messages[-1]["role"] != last:
        raise ValueError(f"the conversation's last message is from {messages[-1]['role']}, expected {last}")


def render(messages: list[dict], last: str = "assistant") -> tuple[list[int], list[int]]:
    """A conversation ending with a `last` message -> (ids, mask), mask 1 on what the assistant learns to write."""
    check_messages(messages, last)
    enc, pieces = get_tokenizer(), [([BOS], 0)]  # (tokens, 1 if the model learns to write them)
    for message in messages:
        (start, end), content = ROLES[message["role"]], message["content"]
        learn = int(message["role"] == "assistant" and message.get("weight") != 0)  # not tool outputs, nor weight 0
        pieces.append(([start], 0))
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        # adjacent text parts are encoded as one text, as export.py's chat template hands them to HF's tokenizer
        for kind, run in itertools.groupby(parts, key=lambda part: part["type"]):
            marks, texts = PARTS[kind], [part["text"] for part in run]
            for text in ["".join(texts)] if kind == "text" else texts:
                pieces.append(([*marks[:1], *enc.encode_ordinary(text), *marks[1:]], learn * (kind != "output")))
        pieces.append(([end], learn))
    return [t for tokens, _ in pieces for t in tokens], [m for tokens, m in pieces for _ in tokens]


def render_prompt(messages: list[dict]) -> list[int]:
    """A conversation ending with a user message -> its ids and <|assistant_start|>: the prompt for the reply."""
    return render(messages, "user")[0] + [ASSISTANT_START]


def parse(ids: Iterable[int]) -> list[dict]:
    """Reply ids (after <|assistant_start|>) -> parts as render takes them, up to any special token but a tool mark."""
    enc, parts, kind, run = get_tokenizer(), [], "text", []
    for t in [*ids, ASSISTANT_END]:
        if t < EOT:
            run.append(t)
            continue
        if run:
            parts.append({"type": kind, "text": enc.decode(run)})
        if t not in (TOOL_START, TOOL_END, OUTPUT_START, OUTPUT_END):
            break
        run, kind = [], {TOOL_START: "tool", OUTPUT_START: "output"}.get(t, "text")
    return parts


def is_chat(ckpt: dict | str) -> bool:
    """A checkpoint (or a path's) fine-tuned on this format (SFT or a stage after): its "chat" entry, else its stage."""
    ckpt = ckpt if isinstance(ckpt, dict) else load_checkpoint(ckpt, mmap=True)
    config = ckpt.get("train_config", {})
    return bool(ckpt.get("chat", config.get("data_kind") in ("chat", "pairs") or "algo" in config))


def exported_chat(directory: str) -> bool:
    """Whether an HF export's chat template (tokenizer_config.json's, or transformers 4.43+'s .jinja) is ours."""
    config, jinja = (Path(directory).expanduser() / name for name in ("tokenizer_config.json", "chat_template.jinja"))
    template = jinja.read_text() if jinja.is_file() else config.is_file() and read_json(config).get("chat_template")
    return "<|assistant_start|>" in str(template)


def reply_text(ids: Iterable[int]) -> str:
    """A reply's text parts, without its tool calls and outputs: what a checker reads."""
    return "".join(part["text"] for part in parse(ids) if part["type"] == "text")


# ----------------------------------------------------------------------------------------------------------------------
# Conversation data: read, pack, load


def read_conversations(source: str, split: str, family: tuple[str, str] = ("", "")) -> Iterator[tuple[int, Any]]:
    """(row index, messages) of the train or val split (split_rows): "messages", ShareGPT's "conversations" or TRL's
    conversational "prompt" and "completion"; a row of another schema is one line naming its columns."""
    for i, row in split_rows(source, split, family=family):
        row = {k: v for k, v in row.items() if v is not None}  # a table's other rows' columns: None (mixed schemas)
        if "messages" in row or "conversations" in row:
            with row_errors(source, i):
                messages = row["messages"] if "messages" in row else sharegpt(row["conversations"])
            yield i, messages
        elif isinstance(row.get("prompt"), list) and isinstance(row.get("completion"), list):
            # as TRL's completion_only_loss: replies in the prompt are given (weight 0), only the completion is learned
            yield i, [{**m, "weight": 0} if isinstance(m, dict) and m.get("role") == "assistant" else m
                      for m in row["prompt"]] + row["completion"]
        else:  # text prompt/completion has no roles to render (load_rows gives objects)
            raise DataError(f"{row_name(source, i)}: no 'messages' or 'conversations' (columns {', '.join(row)}); a "
                            'conversation is {"messages": [{"role": ..., "content": ...}, ...]}, or "prompt" and '
                            '"completion" as lists of such messages: convert other schemas')


def sharegpt(turns: Any) -> Any:
    """ShareGPT's turns {"from", "value"} as messages, renamed as TRL does; a speaker that is no role is a ValueError
    naming "from" (check_messages would name "role", not in the file); anything else is left to check_messages."""
    speakers = {"human": "user", "gpt": "assistant", **{role: role for role in ROLES}}  # FastChat's names, and ours
    for i, t in enumerate(turns if isinstance(turns, list) else []):
        if isinstance(t, dict) and ("from" in t or "role" not in t) and str(t.get("from")) not in speakers:
            said = f"is from {t['from']!r}" if "from" in t else 'has no "from"'  # glaive's function_call, say
            raise ValueError(f"message {i} {said}, expected human, gpt or system (ShareGPT's \"from\")")
    return [{**t, "role": speakers[str(t["from"])], "content": t.get("value")}
            if isinstance(t, dict) and "from" in t else t for t in turns] if isinstance(turns, list) else turns


def pack(lengths: Sequence[int], cap: int) -> list[list[int]]:
    """Best-fit decreasing: indices of conversations of `lengths` (each at most cap) in rows of cap tokens, packed."""
    free: list[list[int]] = [[] for _ in range(cap + 1)]  # free[r]: the open rows with r tokens to spare
    count = np.zeros(cap + 1, dtype=np.int64)
    rows: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[i]
        if len(fits := np.flatnonzero(count[n:])):  # the open row with the least room that it fits
            spare = n + int(fits[0])
            row = free[spare].pop()
            count[spare] -= 1
        else:
            spare, row = cap, len(rows)
            rows.append([])
        rows[row].append(i)
        if spare > n:
            free[spare - n].append(row)
            count[spare - n] += 1
    return rows


def render_rows(source: str, rows: Iterable[tuple[int, Any]], cap: int) -> tuple[list[tuple[Any, Any]], int, int]:
    """(ids, mask) of each row, cut to cap tokens, the truncated count and the dropped count: a cut conversation with
    nothing left to learn is dropped (a batch of only such rows would have a loss of 0/0)."""
    out, truncated, dropped = [], 0, 0
    for index, messages in rows:
        with row_errors(source, index):
            ids, mask = render(messages)
        truncated += len(ids) > cap
        if not any(mask[1:cap]):
            dropped += 1
            continue
        out.append((np.array(ids[:cap], dtype=np.uint16), np.array(mask[:cap], dtype=bool)))
    return out, truncated, dropped


class RowStream:
    """The position of a loader over `count` items (packed rows, preference pairs) for one rank: the items form one
    stream over epochs, shuffled per epoch with the seed or in order; rank r's s-th batch is window s * world_size + r
    of B items, so `step` is the whole position, and a state resumes under another B or world size."""

    def _stream(self, name: str, split: str, B: int, T: int, rank: int, world_size: int, seed: int,
                device: str | torch.device, shuffle: bool, count: int, sequences: list[np.ndarray]) -> None:
        self.name, self.split, self.B, self.T, self.rank, self.world_size, self.seed = \
            name, split, B, T, rank, world_size, seed
        self.device, self.shuffle, self.count = torch.device(device), shuffle, count
        self.tokens, self.crc = sum(map(len, sequences)), crc32(sequences)  # what a resume compares, with the name
        self.top = max((int(ids.max()) for ids in sequences), default=-1)  # the highest token id, for check_vocab
        self.num_windows = count // B  # windows of B items per epoch, all ranks together
        self.reset()

    def check_vocab(self, vocab_size: int) -> None:
        """Stop now if the model has too few embedding rows for the chat tokens: on CUDA an id past them asserts."""
        if self.top >= vocab_size:
            raise DataError(f"{self.name}: the chat format uses token ids up to {self.top}, but the model has only "
                            f"{vocab_size} embedding rows; pass --vocab-size {CHAT_VOCAB} or more (the default: "
                            f"{GPTConfig.vocab_size})")

    def reset(self) -> None:  # back to epoch 0's first batch (for val: the same batches on every call), as fineweb's
        self.step = 0

    def next_items(self) -> np.ndarray:
        """The indices of this rank's next B items."""
        first = (self.step * self.world_size + self.rank) * self.B
        self.step += 1
        epochs, k = np.divmod(np.arange(first, first + self.B), self.count)
        for epoch in np.unique(epochs) if self.shuffle else ():
            k[epochs == epoch] = permutation((self.seed, int(epoch)), self.count)[k[epochs == epoch]]
        return k

    def state_dict(self) -> dict[str, Any]:
        """The position and what it is relative to ("shards", "shard_tokens", "shard_crc32": what the ranks' data check
        reads; the data's name without its directory, as fineweb's: moved, or spelled otherwise, it resumes)."""
        return {"split": self.split, "B": self.B, "T": self.T, "world_size": self.world_size, "seed": self.seed,
                "shuffle": self.shuffle, "shards": [Path(self.name).name], "shard_tokens": [self.tokens],
                "shard_crc32": [self.crc], "items": self.count, "step": self.step}

    def resume_note(self, saved: dict[str, Any]) -> str | None:
        """Where the data goes on when another B or world size cut the stream into other windows (load_state_dict)."""
        if not (skipped := self.resume_skipped):
            return None
        served = saved["step"] * saved["world_size"] * saved["B"]
        return (f"the checkpoint read {saved['world_size']} x {saved['B']} items a micro-step, this run "
                f"{self.world_size} x {self.B}: the data goes on at the next such window, skipping {skipped} "
                f"unserved of epoch {served // self.count}'s {self.count:,} items; none served twice")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state` of a loader over the same data, T and seed, at the first window not served yet."""
        mine = self.state_dict()
        state = {**state, "shards": [Path(name).name for name in state.get("shards", [])]}  # older: whole paths
        for key in ("split", "T", "seed", "shuffle", "shards", "shard_tokens", "items"):
            if (saved := state.get(key)) != mine[key]:
                raise DataError(f"cannot resume the {self.split} loader of {self.name}: {key}={saved!r} in the "
                                f"checkpoint but {mine[key]!r} here; resume with the same data, --seq-len and --seed")
        check_contents(state, mine, f"the {self.split} loader of {self.name}")
        served = state["step"] * state["world_size"] * state["B"]
        self.step = -(-served // (self.world_size * self.B))
        self.resume_skipped = self.step * self.world_size * self.B - served  # items no rank will see this epoch


class ConversationLoader(RowStream):
    """Batches (x, y) of whole conversations packed into rows of T+1 tokens (y = -1 where nothing is learned), for one
    rank, with fineweb.TokenLoader's interface: a RowStream of the rows (train: a seeded shuffle per epoch; val: in
    order). A row's conversations see each other in attention, as pretraining's documents do; each starts with BOS."""

    def __init__(self, source: str, split: str, B: int, T: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                 device: str | torch.device = "cpu", family: tuple[str, str] = ("", "")):
        convs, truncated, dropped = render_rows(str(source), read_conversations(str(source), split, family), T + 1)
        if not convs:  # none in the split (a one-row file's train), or each was cut before its first assistant token
            raise DataError(f"{source} {split}: " + (f"none of its {dropped:,} conversations has an assistant token "
                            f"within T+1 = {T + 1} tokens; raise --seq-len" if dropped else "no conversations (a "
                            f"single file's every {VAL_EVERY}th row, from row 0, is val); add conversations"))
        rows = pack(lengths := [len(ids) for ids, _ in convs], T + 1)
        self.ids = np.full((len(rows), T + 1), BOS, dtype=np.uint16)  # padding: BOS, with targets -1
        self.mask = np.zeros((len(rows), T + 1), dtype=bool)
        for r, row in enumerate(rows):  # a row's conversations end to end
            ids, mask = (np.concatenate([convs[i][j] for i in row]) for j in (0, 1))
            self.ids[r, :len(ids)], self.mask[r, :len(ids)] = ids, mask
        self._stream(str(source), split, B, T, rank, world_size, seed, device, split == "train", len(rows),
                     [ids for ids, _ in convs])
        self.num_rows, self.padding = len(rows), 1 - sum(lengths) / (len(rows) * (T + 1))  # pack keeps all
        if self.num_windows == 0:
            raise DataError(f"{source} {split}: {len(convs)} conversations pack into {self.num_rows} rows of "
                            f"T+1 = {T + 1} tokens, fewer than B = {B}; lower --batch-size or add conversations")
        if rank == 0:
            print(f"{source} {split}: {len(convs):,} conversations in {self.num_rows:,} rows of {T + 1} tokens, "
                  f"{self.padding:.1%} padding; {truncated - dropped:,} of them truncated to {T + 1} tokens; "
                  f"{dropped:,} more dropped: no assistant token within them{val_note(str(source), split)}")

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next (x, y), each int64 (B, T) on the loader's device; y is -1 where nothing is learned."""
        rows = self.next_items()
        ids = torch.from_numpy(self.ids[rows].astype(np.int64))
        x, y = ids[:, :-1], ids[:, 1:].masked_fill(~torch.from_numpy(self.mask[rows, 1:]), -1)
        cuda = self.device.type == "cuda"  # from pinned memory, the copy overlaps the GPU's work (as fineweb's)
        return tuple((t.pin_memory() if cuda else t).to(self.device, non_blocking=cuda) for t in (x, y))

