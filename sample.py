"""Generate text from this project's checkpoint or an OpenAI GPT-2, streamed to the terminal as it is produced.

Samples are drawn one after another from one generator seeded by --seed, so a seed gives the same text on a
given device. bf16 on CUDA, fp32 on CPU. The text goes to stdout; notices and the speed line go to stderr.

Usage:
    python sample.py --ckpt out/run/ckpt_019000.pt --prompt "Hello, I'm a language model,"
    python sample.py --init-from gpt2-xl --prompt @prompt.txt --num-samples 1 --max-new-tokens 200
    python sample.py --ckpt out/demo/ckpt_000900.pt --prompt "Return the" --quantize int8   # pip install torchao
    echo "The meaning of life is" | python sample.py --init-from gpt2 --prompt - --temperature 0
"""

from __future__ import annotations

import codecs
import collections
import re
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from chat_format import exported_chat, is_chat
from common import EOT, get_tokenizer, import_torchao, parse_config, resolve_device, tensor_bytes, user_errors
from generate import check_sampling, for_decoding, sample_stream
from model import GPT
from parallel import check_counts, check_flags

WORD = re.compile(r"\w+", re.ASCII)  # identifier-like: letters, digits and _
DOC_BREAK = "\n--- end of document ---\n"  # printed for <|endoftext|>, where the model ends a document


@dataclass
class SampleConfig:
    """Sample text from a checkpoint of this project (--ckpt) or an HF GPT-2 (--init-from)."""

    ckpt: str | None = None  # checkpoint of this project (.pt written by any stage)
    init_from: str | None = None  # or HF GPT-2: gpt2, gpt2-medium, gpt2-large, gpt2-xl, or a local HF directory
    prompt: str = "Hello, I'm a language model,"  # text to continue; @FILE reads a file, - reads stdin
    num_samples: int = 3  # samples, generated one after another
    max_new_tokens: int = 100  # tokens generated per sample
    temperature: float = 0.8  # softmax temperature; 0 is greedy
    top_k: int | None = 200  # sample among the k most likely tokens only; none disables
    top_p: float | None = None  # nucleus sampling: the smallest set of tokens with this much probability
    seed: int = 1337  # seed of the sampling generator: the same seed gives the same text on a given device
    no_cache: bool = False  # recompute the whole context every step instead of using the KV cache (slow; a check)
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    quantize: str = "none"  # none, or int8: torchao weight-only INT8 matmuls in the blocks (pip install torchao)
    stop_at_eot: bool = False  # end a sample where the model ends its document (<|endoftext|>)
    corpus: str | None = None  # token-shard dir: report the share of sampled words in its train split, and blank lines

    def __post_init__(self) -> None:
        check_flags([(self.quantize in ("none", "int8"), f"--quantize must be none or int8, got {self.quantize!r}")])
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed)  # before a model loads
        check_counts(self, ("num_samples", "max_new_tokens"))


def read_prompt(prompt: str, stdin: TextIO | None = None) -> str:
    """`-` reads stdin, `@FILE` reads a file, anything else is the prompt itself."""
    if prompt == "-":
        return (stdin or sys.stdin).read()
    if prompt.startswith("@"):
        path = Path(prompt[1:])
        try:  # a missing file or a directory: the OSError's one line names it
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"prompt file {path} is not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                             "UTF-8") from None
    return prompt


def generate_text(model: GPT, enc: Any, cfg: SampleConfig, device: torch.device | str,
                  out: TextIO | None = None) -> list[str]:
    """Stream cfg.num_samples continuations of cfg.prompt (the text itself) to `out`; return the continuations.
    The model is used as it is (main casts it to bf16 on CUDA). Speed goes to stderr: `N tokens in S s (R tok/s)`."""
    tokens = enc.encode(cfg.prompt, allowed_special="all") or [EOT]  # an empty prompt starts a new document
    shown = cfg.prompt
    keep = model.config.block_size - 1  # room for at least one new token in the context window
    if len(tokens) > keep:
        n_prompt, tokens = len(tokens), tokens[-keep:]
        # the cut can fall inside a multi-byte character: drop leading tokens that start with continuation bytes
        # (0b10xxxxxx), so the echoed text and the model's context start at a whole character, not a U+FFFD
        while len(tokens) > 1 and 0x80 <= enc.decode_single_token_bytes(tokens[0])[0] < 0xC0:
            tokens = tokens[1:]
        whole = "" if len(tokens) == keep else " (from the first whole character)"
        print(f"notice: the prompt has {n_prompt} tokens, more than block_size - 1 = {keep}; "
              f"keeping the last {len(tokens)}{whole}", file=sys.stderr)
        shown = enc.decode(tokens)
    idx = torch.tensor([tokens], dtype=torch.long, device=device)  # (1, T)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    texts, n_tokens = [], 0
    t0 = time.perf_counter()
    for _ in range(cfg.num_samples):
        print(shown, end="", file=out, flush=True)
        # a token can end in the middle of a multi-byte UTF-8 character: the decoder holds it back until complete
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        pieces = []
        for nxt in sample_stream(model, idx, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                                 top_p=cfg.top_p, use_cache=not cfg.no_cache, generator=generator):
            eot = int(nxt[0, 0]) == EOT  # shown as a break; the returned text keeps the token, a word boundary
            piece = decoder.decode(b"" if eot else enc.decode_single_token_bytes(int(nxt[0, 0])), final=eot)
            pieces.append(piece + "<|endoftext|>" * eot)
            print(piece + DOC_BREAK * eot, end="", file=out, flush=True)
            n_tokens += 1
            if eot and cfg.stop_at_eot:
                break
        pieces.append(decoder.decode(b"", final=True))
        print(pieces[-1] + "\n---------------", file=out, flush=True)
        texts.append("".join(pieces))
    elapsed = time.perf_counter() - t0
    print(f"{n_tokens} tokens in {elapsed:.2f} s ({n_tokens / elapsed:.1f} tok/s)", file=sys.stderr)
    return texts


def words(text: str) -> list[str]:
    """The identifier-like words of text (runs of letters, digits and _); <|endoftext|> is a boundary, not a word."""
    return WORD.findall(text.replace("<|endoftext|>", "\n"))


def corpus_words(data_dir: str, max_tokens: int = 20_000_000) -> set[str]:
    """The words of data_dir's train shards' first max_tokens tokens (a fineweb-sized corpus takes minutes whole)."""
    from fineweb import find_shards, read_shard

    if not Path(data_dir).is_dir():
        raise ValueError(f"--corpus {data_dir} is not a directory; give the token-shard directory the model trained on")
    enc, seen, left = get_tokenizer(), set(), max_tokens
    for shard in find_shards(data_dir, "train"):
        tokens = read_shard(shard)[:left]
        seen.update(words(enc.decode(tokens.tolist())))
        left -= len(tokens)
        if left <= 0:
            break
    return seen


def corpus_check(texts: list[str], seen: set[str]) -> dict[str, float]:
    """How much the samples read as the corpus: the share of their words in `seen` and of their blank lines."""
    sampled = [w for text in texts for w in words(text)]
    lines = [line for text in texts for line in text.strip("\n").split("\n")]
    return {"words": len(sampled), "known": sum(w in seen for w in sampled) / max(1, len(sampled)),
            "lines": len(lines), "blank": sum(not line.strip() for line in lines) / max(1, len(lines))}


# ----------------------------------------------------------------------------------------------------------------------
# INT8 weight-only quantization (torchao, optional)

def torchao_int8() -> tuple[Any, Any]:
    """(torchao's quantize_, its weight-only INT8 config); a missing torchao is one ImportError line."""
    import_torchao("--quantize int8")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    # no global inductor settings: bench.py compiles training variants in the same process afterwards
    return quantize_, Int8WeightOnlyConfig(set_inductor_config=False)


def quantize_int8(model: nn.Module) -> list[str]:
    """Make every nn.Linear weight int8 in place (torchao weight-only, a scale per output row; cast the model first);
    return their names. The tied lm_head stays: quantize_ would untie it, keeping the embedding beside an int8 copy."""
    quantize_, config = torchao_int8()
    uses = collections.Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and uses[id(m.weight)] == 1]
    quantize_(model, config, filter_fn=lambda module, fqn: fqn in names)
    return names


def weight_bytes(model: nn.Module) -> int:
    return sum(tensor_bytes(p) for p in model.parameters())  # a tied matrix once


def main(argv: list[str] | None = None) -> list[str]:
    cfg = parse_config(SampleConfig, argv, doc=__doc__)
    with user_errors(ImportError, OSError, ValueError, RuntimeError):
        device = resolve_device(cfg.device)
        prompt = read_prompt(cfg.prompt)
        if cfg.quantize == "int8":
            torchao_int8()  # a missing torchao fails before the model loads
        model = GPT.load(cfg.ckpt, cfg.init_from)
        chat = is_chat(cfg.ckpt) if cfg.ckpt else exported_chat(cfg.init_from)
        seen = corpus_words(cfg.corpus) if cfg.corpus else None
    if chat:  # a chat model is prompted in chat_format's turns, which sample.py does not add
        print(f"note: {cfg.ckpt or cfg.init_from} is a chat model (fine-tuned on conversations): sample.py continues "
              "the prompt as raw text; chat.py sends it as a user message and streams the reply", file=sys.stderr)
    model = for_decoding(model, device)  # bf16 on CUDA: about twice the speed
    if cfg.quantize == "int8":
        before = weight_bytes(model)
        names = quantize_int8(model)
        dtype = str(model.transformer.wte.weight.dtype).removeprefix("torch.")  # GPT always ties it to lm_head
        print(f"int8: {len(names)} nn.Linear weights quantized, weights {before / 1e6:.1f} MB -> "
              f"{weight_bytes(model) / 1e6:.1f} MB (the tied wte/lm_head stays {dtype})", file=sys.stderr)
    texts = generate_text(model, get_tokenizer(), replace(cfg, prompt=prompt), device)
    if seen is not None:
        c = corpus_check(texts, seen)
        print(f"corpus check: {c['known']:.0%} of {c['words']} sampled words occur in {cfg.corpus}'s train shards; "
              f"{c['blank']:.0%} of {c['lines']} sampled lines are whitespace only", file=sys.stderr)
    return texts


if __name__ == "__main__":
    main()
