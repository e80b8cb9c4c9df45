"""Chat in the terminal with a model fine-tuned on conversations (sft.py, then prefs.py or rl.py). The reply streams as
it is generated; the calculator tool runs, its call and forced result shown in brackets ([calc 6*7][= 42]). The
conversation is kept as messages and rendered by chat_format.py each turn, its oldest turns dropped once it outgrows
the model's context.

Usage:
    python chat.py --ckpt out/sft-demo/ckpt_002400.pt      # interactive: /clear starts over, Ctrl-D or Ctrl-C quits
    python chat.py --ckpt out/sft/ckpt_001000.pt --prompt "Why is the sky blue?" --temperature 0
"""

from __future__ import annotations

import codecs
import contextlib
import sys
from dataclasses import dataclass

import torch

from chat_format import CHAT_VOCAB, REPLY_STOPS, TOOL_START, exported_chat, is_chat, parse, render_prompt
from common import EOT, get_tokenizer, parse_config, resolve_device, user_errors
from generate import calculator, check_sampling, for_decoding, generate_stream
from model import GPT, GPTConfig
from parallel import check_flags
from sample import read_prompt

with contextlib.suppress(ImportError):  # line editing and history in input()
    import readline  # noqa: F401

MARKS = dict(zip(range(TOOL_START, CHAT_VOCAB), ("[calc ", "]", "[= ", "]"), strict=True))  # tool start/end, output's


@dataclass
class ChatConfig:
    """Chat with a checkpoint of this project fine-tuned for chat (--ckpt), or an HF GPT-2 (--init-from)."""

    ckpt: str | None = None  # checkpoint of this project (.pt; a chat one: written by sft.py, prefs.py or rl.py)
    init_from: str | None = None  # or HF GPT-2: gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a local HF directory
    prompt: str | None = None  # one message (@FILE reads a file, - stdin): print the reply and exit; none: interactive
    system: str | None = None  # a system message that opens every conversation
    temperature: float = 0.6  # softmax temperature; 0 is greedy
    top_k: int | None = 50  # sample among the k most likely tokens only; none disables
    max_new_tokens: int = 256  # most tokens per reply (calculator results count)
    seed: int = 1337  # seed of the sampling generator
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, None, self.seed)  # before a model loads
        check_flags([(self.prompt is None or bool(self.prompt.strip()),
                      "--prompt is empty: pass a message, or leave --prompt out to chat interactively"),
                     (self.system is None or bool(self.system.strip()), "--system is empty: pass a message, or leave "
                      "--system out"),  # the first reply would fail on an empty system message
                     (self.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")])


def load_model(cfg: ChatConfig) -> tuple[GPT, bool]:
    """The model on the CPU, its vocabulary holding the chat tokens, and whether it was fine-tuned for chat (an HF
    directory: export.py gave it the chat template)."""
    model = GPT.load(cfg.ckpt, cfg.init_from).pad_vocab(GPTConfig().vocab_size)  # rows for HF GPT-2's chat tokens
    return model, is_chat(cfg.ckpt) if cfg.ckpt else exported_chat(cfg.init_from)


class Chat:
    """One conversation with the model: messages in, replies streamed out."""

    def __init__(self, model: GPT, cfg: ChatConfig, device: torch.device):
        self.model, self.cfg, self.tool = model, cfg, calculator()
        self.generator = torch.Generator(device=device).manual_seed(cfg.seed)
        self.clear()

    def clear(self) -> None:
        self.messages = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []

    def fit(self, messages: list[dict]) -> tuple[list[dict], list[int]]:
        """The conversation and its prompt ids, its oldest turns dropped while they leave too little room to reply
        (the smaller of --max-new-tokens and half the context)."""
        ids, first, dropped, bs = render_prompt(messages), int(bool(self.cfg.system)), 0, self.model.config.block_size
        while len(ids) > bs - min(self.cfg.max_new_tokens, bs // 2) and len(messages) > first + 1:
            messages = messages[:first] + messages[first + 2:]
            ids, dropped = render_prompt(messages), dropped + 1
        if len(ids) >= bs:
            raise ValueError(f"the message takes {len(ids)} tokens{' with --system' * first}, the model's context "
                             f"only {bs}; say less")
        if dropped:
            print(f"(the conversation outgrew the model's context of {bs} tokens: its oldest {dropped} turn(s) "
                  "dropped)", file=sys.stderr)
        return messages, ids

    def reply(self, text: str) -> None:
        """Stream the reply to `text` to stdout, and keep both in the conversation."""
        messages, ids = self.fit([*self.messages, {"role": "user", "content": text}])
        cfg, enc, reply = self.cfg, get_tokenizer(), []
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a token can end mid-character
        for step in generate_stream(self.model, [ids], cfg.max_new_tokens, cfg.temperature, cfg.top_k,
                                    stop_ids=REPLY_STOPS, vocab=CHAT_VOCAB, calculator=self.tool,
                                    generator=self.generator):
            token = step.tokens[0]
            reply.append(token)
            piece = decoder.decode(enc.decode_single_token_bytes(token)) if token < EOT else \
                decoder.decode(b"", final=True) + MARKS.get(token, "")
            print(piece, end="", flush=True)
        print(decoder.decode(b"", final=True), flush=True)
        parts = parse(reply)  # an empty reply has no turn to render: the exchange is left out
        if not parts or reply[-1] not in REPLY_STOPS:  # either looked like a whole reply
            print("(no reply: your message is left out of the conversation)" if not parts else "(the reply was cut at "
                  "--max-new-tokens or the model's context)", file=sys.stderr)
        self.messages = [*messages, {"role": "assistant", "content": parts}] if parts else messages[:-1]


def repl(chat: Chat) -> None:
    print("/clear starts a new conversation; Ctrl-D or Ctrl-C quits", file=sys.stderr)
    while True:  # until EOF (Ctrl-D) or Ctrl-C: main ends it
        text = input("> ")
        if text.strip() == "/clear":
            chat.clear()
            print("(a new conversation)", file=sys.stderr)
        elif text.strip():
            try:
                chat.reply(text)
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the chat; return the conversation as it stands at the end."""
    cfg = parse_config(ChatConfig, argv, doc=__doc__)
    with user_errors(ImportError, OSError, ValueError, RuntimeError):
        device = resolve_device(cfg.device)
        model, fine_tuned = load_model(cfg)
        prompt = None if cfg.prompt is None else read_prompt(cfg.prompt).rstrip("\n")  # as input() gives a line
    if not fine_tuned:
        print(f"warning: {cfg.ckpt or cfg.init_from} was never fine-tuned on conversations (sft.py), so it does not "
              "know the chat format: its replies may be gibberish", file=sys.stderr)
    chat = Chat(for_decoding(model, device), cfg, device)
    with user_errors(ValueError), contextlib.suppress(EOFError, KeyboardInterrupt):  # Ctrl-D, Ctrl-C: the end
        if cfg.prompt is None:
            repl(chat)
        else:
            chat.reply(prompt)
        return chat.messages
    print()  # ended by Ctrl-D or Ctrl-C: the shell's prompt on a line of its own
    return chat.messages


if __name__ == "__main__":
    main()
