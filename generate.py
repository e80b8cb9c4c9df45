"""Every decoding loop and the sampling helpers: one prompt batch continued (sample, sample_stream: sample.py, the
in-training samples, bench.py), and prompts of different lengths decoded at once over one KV cache (generate,
generate_stream: chat, task evals, RL), each row until a stop token or max_new_tokens, with an optional calculator tool
whose results are forced in.

The batched loop left-pads its prompts (model.KVCache's pad), so every row's next token is in the last column; a
finished row leaves the batch. bench.py's batched suite times 64 prompts at once against one at a time.
"""

from __future__ import annotations

import ast
import contextlib
import operator
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from chat_format import OUTPUT_END, OUTPUT_START, TOOL_END, TOOL_START
from common import GPT2_VOCAB, get_tokenizer
from model import GPT, KVCache
from parallel import check_flags

# ----------------------------------------------------------------------------------------------------------------------
# Sampling: filter the logits, draw a token


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, seed: int = 0) -> None:
    check_flags([(0 <= seed < 2**64, f"--seed must be in [0, 2**64), got {seed}"),  # torch.Generator's range
                 (temperature >= 0, f"temperature must be >= 0 (0 is greedy), got {temperature}"),  # NaN fails too
                 (temperature < float("inf"), f"temperature must be finite, got {temperature}"),
                 (top_k is None or top_k >= 1, f"top_k must be >= 1 or None, got {top_k}"),
                 (top_p is None or 0.0 < top_p <= 1.0, f"top_p must be in (0, 1] or None, got {top_p}")])


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                  vocab: int = GPT2_VOCAB) -> torch.Tensor:
    """A new (B, V) fp32 tensor to sample from: logits / temperature (> 0: greedy never filters), -inf outside the
    top_k and outside the top_p nucleus (HF's order), and at ids >= vocab (GPT-2's padded rows by default)."""
    logits = logits.float().clone()  # a copy: float() of fp32 logits is the caller's tensor, edited below
    logits[:, vocab:] = -float("inf")  # ids the caller does not sample (padding, or specials; none past the end)
    # less the row's max, over at least fp32's smallest normal: a tiny temperature makes the others -inf, never two
    # +inf or a 0 / 0 (a NaN softmax, whose draw is an id past the vocabulary)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # a token is dropped when it and every less likely token hold at most 1 - top_p; that tail mass is
        # summed from the smallest up, as a running sum from the largest loses fp32 precision over 50K terms
        tail = probs.flip(-1).cumsum(dim=-1).flip(-1)
        drop = tail <= 1.0 - top_p
        drop[:, 0] = False  # the most likely token always stays
        logits = logits.masked_fill(drop.scatter(1, order, drop), -float("inf"))
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One id per row of probs (B, V) as (B, 1): the first whose running sum (fp64) passes a uniform draw. Exact (a
    zero-probability id never passes), and ~30x faster than torch.multinomial over 50K ids on a CPU."""
    sums = probs.double().cumsum(dim=-1)
    u = torch.rand(probs.size(0), 1, generator=generator, device=probs.device, dtype=torch.float64) * sums[:, -1:]
    return torch.searchsorted(sums, u, right=True)


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
               generator: torch.Generator | None, vocab: int = GPT2_VOCAB) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's next id (B, 1), and the probabilities it was drawn from (None for greedy: no copy of every row's
    logits for the argmax; top-k and top-p keep the top token)."""
    if temperature == 0.0:
        return logits[:, :vocab].argmax(dim=-1, keepdim=True), None
    probs = filter_logits(logits, temperature, top_k, top_p, vocab).softmax(dim=-1)
    return draw(probs, generator), probs


def for_decoding(model: GPT, device: torch.device) -> GPT:
    """The model on device, in bf16 on CUDA: decoding is bound by reading the weights, and bf16 halves their bytes."""
    return model.to(device, torch.bfloat16 if device.type == "cuda" else None)


def last_logits(model: GPT, idx: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
    """The last position's logits (B, V), cuDNN's attention off: it plans each new key length, so a fresh process
    decoded 15-20 bf16 tokens/s on an H200, 150 without it, the same after (docs/benchmarks.md, 2026-11-30)."""
    cuda = torch.backends.cuda
    was = cuda.cudnn_sdp_enabled()  # kept when it is the only kernel allowed (--attention cudnn): SDPA needs one
    cuda.enable_cudnn_sdp(was and not (cuda.flash_sdp_enabled() or cuda.mem_efficient_sdp_enabled()
                                       or cuda.math_sdp_enabled()))
    try:
        return model(idx, cache=cache, last_only=True)[0][:, -1]
    finally:
        cuda.enable_cudnn_sdp(was)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """model.eval() inside, and back to the mode it was in after, a generator's close included."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def full_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off, around a user's check or reward: one that builds tensors would round in bf16 (1.001 @ 1 is 1)."""
    return torch.autocast(device.type, enabled=False)


@torch.inference_mode()
def sample_stream(model: GPT, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                  top_k: int | None = None, top_p: float | None = None, use_cache: bool = True,
                  generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
    """Continue idx (B, T): yield (B, 1) new tokens one at a time. The context is cropped to the last block_size."""
    shape = "idx must be (batch, prompt length) token ids with at least one token, got shape"
    check_flags([(idx.dim() == 2 and idx.size(1) > 0, f"{shape} {tuple(idx.shape)}"),
                 (max_new_tokens >= 0, f"max_new_tokens must be >= 0, got {max_new_tokens}")])
    check_sampling(temperature, top_k, top_p)
    bs, cache = model.config.block_size, None
    with evaluating(model):
        for _ in range(max_new_tokens):
            if use_cache and cache is not None and cache.pos < bs:
                logits = last_logits(model, idx[:, -1:], cache)
            else:
                # first step, or the context overflowed: (re)fill the cache from the cropped context
                cache = KVCache(model.config, idx.size(0)) if use_cache else None
                logits = last_logits(model, idx[:, -bs:], cache)
            nxt = next_token(logits, temperature, top_k, top_p, generator)[0]
            idx = torch.cat((idx, nxt), dim=1)
            yield nxt


def sample(model: GPT, idx: torch.Tensor, max_new_tokens: int, **kwargs: Any) -> torch.Tensor:
    """sample_stream run to the end: (B, T + max_new_tokens). temperature=0 is greedy."""
    return torch.cat([idx, *sample_stream(model, idx, max_new_tokens, **kwargs)], dim=1)


# ----------------------------------------------------------------------------------------------------------------------
# The calculator: arithmetic on an AST walked here, never Python's eval on model output

MAX_EXPR_CHARS = 100  # a longer expression is refused unparsed (deep nesting would exhaust the parser)
MAX_BITS = 256  # no value beyond 2**256, so every operation stays microseconds
MAX_EXPONENT = 64
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
       ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
SIGNS = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expr: str, seconds: float = 0.1) -> str | None:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses) as text; None for anything
    else, or too long, too large, too slow (past `seconds`), or undefined (1/0)."""
    expr = expr.replace(",", "").strip()  # 1,000 is a thousand, not a tuple
    if len(expr) > MAX_EXPR_CHARS:
        return None
    try:
        value = _evaluate(ast.parse(expr, mode="eval").body, time.perf_counter() + seconds)
    except (SyntaxError, ValueError, ArithmeticError, RecursionError, MemoryError):
        return None
    return str(value) if isinstance(value, int) else f"{value:.10g}"


def _evaluate(node: ast.AST, deadline: float) -> int | float:
    if time.perf_counter() > deadline:
        raise ValueError("out of time")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in SIGNS:
        return SIGNS[type(node.op)](_evaluate(node.operand, deadline))
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        a, b = _evaluate(node.left, deadline), _evaluate(node.right, deadline)
        if isinstance(node.op, ast.Pow) and abs(b) > MAX_EXPONENT:
            raise ValueError(f"exponent {b} is over {MAX_EXPONENT}")
        return _bounded(OPS[type(node.op)](a, b))
    raise ValueError(f"not arithmetic: {type(node).__name__}")


def _bounded(value: Any) -> int | float:
    # type() rather than isinstance: bool and complex ((-8) ** 0.5) are not results; NaN and inf fail the comparison
    if type(value) not in (int, float) or not abs(value) < 2 ** MAX_BITS:
        raise ValueError(f"{type(value).__name__} out of range")
    return value


@dataclass(frozen=True)
class Calculator:
    """The calculator tool: a row that emits start, an expression, end gets output_start, the value's tokens and
    output_end forced in next (nothing if calculate refuses the expression)."""

    start: int  # <|tool_start|> id
    end: int  # <|tool_end|> id
    output_start: int  # <|output_start|> id
    output_end: int  # <|output_end|> id
    enc: Any  # common.get_tokenizer(): decode reads the expression, encode_ordinary writes the value


def calculator() -> Calculator:
    """The calculator tool on chat_format.py's tool tokens."""
    return Calculator(TOOL_START, TOOL_END, OUTPUT_START, OUTPUT_END, get_tokenizer())


@dataclass
class Rollout:
    """One prompt's generation: its stop token, if it met one, is the last token (the policy chose it)."""

    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1: sampled, 0: forced by the calculator
    logprobs: list[float] = field(default_factory=list)  # see Step.logprobs


class Step(NamedTuple):
    """One decoding step of the rows still running."""

    rows: list[int]  # indices into the prompts
    tokens: list[int]  # each row's new token
    mask: list[int]  # 1: sampled, 0: forced by the calculator
    # each token's log-prob under the distribution it was drawn from (after temperature, top-k and top-p; PPO's
    # ratio wants temperature 1 and neither filter); 0.0 for a sure one: greedy, or forced
    logprobs: list[float]


@dataclass
class _Row:
    forced: deque[int] = field(default_factory=deque)  # calculator output waiting to be fed in
    expr: list[int] | None = None  # the ids since an unclosed tool start

    def next(self, sampled: int, calc: Calculator | None) -> tuple[int, int]:
        """This row's token (a forced one first, else the sampled one) and its mask; runs the tool calls."""
        token, mask = (self.forced.popleft(), 0) if self.forced else (sampled, 1)
        if calc is None:
            return token, mask
        if token == calc.start:
            self.expr = []
        elif token == calc.end and self.expr is not None:
            text = calc.enc.decode([t for t in self.expr if t < calc.enc.n_vocab])  # a special id is not text
            value = calculate(text)
            if value is not None:
                self.forced.extend([calc.output_start, *calc.enc.encode_ordinary(value), calc.output_end])
            self.expr = None
        elif self.expr is not None:
            self.expr.append(token)
        return token, mask


# ----------------------------------------------------------------------------------------------------------------------
# The engine


@torch.inference_mode()
def generate_stream(model: GPT, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 1.0,
                    top_k: int | None = None, top_p: float | None = None, stop_ids: Sequence[int] = (),
                    vocab: int = GPT2_VOCAB, calculator: Calculator | None = None,
                    generator: torch.Generator | None = None) -> Iterator[Step]:
    """Decode all prompts at once; yield a Step per token position until every row has met a stop id or made
    max_new_tokens tokens (forced ones count), or filled its context (block_size). Ids >= vocab are never sampled."""
    check_sampling(temperature, top_k, top_p)
    bs = model.config.block_size
    check_flags([(bool(prompts) and 0 < min(map(len, prompts)) and max(map(len, prompts)) <= bs,
                  f"prompts must be 1 or more lists of 1 to block_size ({bs}) token ids; crop long prompts"),
                 (max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {max_new_tokens}")])
    device, T = model.lm_head.weight.device, max(map(len, prompts))
    pads = [T - len(p) for p in prompts]
    with evaluating(model):  # the prefill: the prompts left-padded into one batch, run into a fresh cache
        idx = torch.tensor([[0] * n + list(p) for n, p in zip(pads, prompts, strict=True)], device=device)
        # equal lengths take the plain causal path: sample()'s kernels and numbers
        cache = KVCache(model.config, len(prompts), torch.tensor(pads, device=device) if any(pads) else None)
        logits = last_logits(model, idx, cache)
        alive, rows = list(range(len(prompts))), [_Row() for _ in prompts]
        for step in range(max_new_tokens):
            sampled, probs = next_token(logits, temperature, top_k, top_p, generator, vocab)  # as sample() draws
            logprobs = probs.gather(1, sampled)[:, 0].log().tolist() if probs is not None else [0.0] * len(alive)
            chosen = [rows[r].next(t, calculator) for r, t in zip(alive, sampled[:, 0].tolist(), strict=True)]
            tokens, mask = [t for t, _ in chosen], [m for _, m in chosen]
            yield Step(alive, tokens, mask, [lp if m else 0.0 for lp, m in zip(logprobs, mask, strict=True)])
            # a row whose context (block_size) is full leaves: its own, whatever the other rows' lengths
            keep = [i for i, t in enumerate(tokens) if t not in stop_ids and len(prompts[alive[i]]) + step < bs]
            if not keep or step + 1 == max_new_tokens:
                return
            if len(keep) < len(alive):
                cache.keep(torch.tensor(keep, device=device))
                alive = [alive[i] for i in keep]
            idx = torch.tensor([[tokens[i]] for i in keep], device=device)
            logits = last_logits(model, idx, cache)


def generate(model: GPT, prompts: Sequence[Sequence[int]], max_new_tokens: int, **kwargs: Any) -> list[Rollout]:
    """generate_stream run to the end: one Rollout per prompt."""
    out = [Rollout() for _ in prompts]
    for step in generate_stream(model, prompts, max_new_tokens, **kwargs):
        for r, token, mask, logprob in zip(*step, strict=True):
            out[r].tokens.append(token)
            out[r].mask.append(mask)
            out[r].logprobs.append(logprob)
    return out

