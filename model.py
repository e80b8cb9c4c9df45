"""GPT-2, the model only: GPTConfig and presets, KV cache, RoPE, attention, MLP, Block and GPT (forward, the optimizer,
FLOP accounting, loading this project's checkpoints and OpenAI/HF GPT-2 weights). The loss lives beside its kernel in
fused_ce.py, decoding in generate.py, HF export in export.py."""

from __future__ import annotations

import math
import os
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import GPT2_VOCAB, checkpoints, gpt2_bpe_dir, is_reward_model, load_checkpoint, read_json
from fused_ce import lm_loss, token_losses
from fused_gelu import bias_gelu

# HF's GPT-2 keeps these matmuls as Conv1D, weight (in, out); ours are nn.Linear, (out, in): transposed both ways
HF_DIR = "a local HF GPT-2 directory (config.json + model.safetensors)"
HF_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# transformers' GPT2Config fills a key config.json leaves out with its default: so does from_pretrained
HF_GPT2_DEFAULTS = dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
                        activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                        scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False)


# ----------------------------------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class GPTConfig:
    """GPT-2 architecture. Defaults are GPT-2 124M with the vocabulary padded for speed."""

    block_size: int = 1024  # maximum context length (learned position table size)
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64 for faster matmuls
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # query heads
    n_embd: int = 768  # residual stream width
    n_kv_head: int | None = None  # key/value heads for GQA (1 = MQA); None means n_head (plain GPT-2)
    dropout: float = 0.0  # dropout on attention probs, residual branches and embeddings (0 for pretraining)
    bias: bool = True  # biases in Linear and LayerNorm layers (GPT-2 has them); RMSNorm has none either way
    mlp: str = "gelu"  # "gelu": GPT-2's 4x GELU(tanh) MLP; "swiglu": gated SiLU MLP with ~the same params
    pos: str = "learned"  # "learned": GPT-2 position table; "rope": rotary embeddings on q and k
    rope_theta: float = 10000.0  # RoPE base frequency
    norm: str = "layernorm"  # "layernorm": GPT-2's LayerNorm; "rmsnorm": LLaMA's RMSNorm (scale only, no bias)
    fused_gelu: bool = False  # Triton bias+GELU kernel in the MLP (CUDA only; CPU always uses the reference)
    loss_chunk: int = 0  # >0: the loss with targets is computed this many rows at a time, logits not returned
    # lm_head + loss fused: the logits' gradient made in forward by a Triton kernel (CUDA only; elsewhere the PyTorch
    # reference), in loss_chunk rows at a time (0: all at once); with targets the logits are not returned
    fused_ce: bool = False
    # under autocast, the residual stream between blocks in autocast's 16-bit dtype instead of fp32: half the bytes
    # through every LayerNorm and residual add, each add rounded to 8 mantissa bits (LayerNorm still computes in fp32)
    half_residual: bool = False
    value_head: bool = False  # a scalar head on every position (forward(values=True)): reward models, PPO's critic
    # widths of their own, as structured pruning leaves them (prune.py): None is GPT-2's n_embd // n_head and 4 * n_embd
    head_size: int | None = None  # channels per attention head
    mlp_hidden: int | None = None  # the MLP's hidden width (SwiGLU: of each of its two halves)

    def __post_init__(self) -> None:
        # types first: a string or float that slipped past a caller would fail deep inside nn.Linear
        ints = {"block_size": 1, "vocab_size": 1, "n_layer": 1, "n_head": 1, "n_embd": 1, "n_kv_head": 1,
                "loss_chunk": 0, "head_size": 1, "mlp_hidden": 1}  # the lowest value each takes
        optional = {"n_kv_head": " or None (= n_head)", "head_size": " or None", "mlp_hidden": " or None"}
        for name, low in ints.items():
            value, none = getattr(self, name), optional.get(name, "")
            if not (none and value is None) and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ValueError(f"GPTConfig.{name} must be an integer >= {low}{none}, got {value!r}")
        choices = {"mlp": ("gelu", "swiglu"), "pos": ("learned", "rope"), "norm": ("layernorm", "rmsnorm")}
        checks = [*((isinstance(getattr(self, key), bool), f"{key} must be True or False, got {getattr(self, key)!r}")
                    for key in (f.name for f in fields(self) if f.type == "bool")),  # a new one too
                  (self.n_embd % self.n_head == 0 or self.head_size is not None,
                   f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})"),
                  (self.n_head % self.kv_heads == 0,
                   f"n_head ({self.n_head}) must be divisible by n_kv_head ({self.kv_heads})"),
                  (0.0 <= self.dropout < 1.0, f"dropout must be in [0, 1), got {self.dropout}"),
                  *((getattr(self, name) in allowed,
                     f"{name} must be {' or '.join(map(repr, allowed))}, got {getattr(self, name)!r}")
                    for name, allowed in choices.items()),
                  (self.pos != "rope" or self.head_dim % 2 == 0,
                   f"pos='rope' needs an even head size, got {self.head_dim}"),
                  (self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}"),
                  (not self.fused_gelu or self.mlp == "gelu" and self.bias, "fused_gelu fuses the c_fc bias into GELU, "
                   f"so it needs mlp='gelu' and bias=True; got mlp={self.mlp!r}, bias={self.bias}")]
        if why := next((why for ok, why in checks if not ok), None):
            raise ValueError(f"GPTConfig.{why}")

    @property
    def kv_heads(self) -> int:
        """n_kv_head, or n_head when None: not stored, so replace(config, n_head=...) keeps a plain config plain."""
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head


# the fields a run may set whatever its weights came from: they change no weight's shape or meaning
RUN_OPTIONS = ("block_size", "dropout", "fused_gelu", "loss_chunk", "fused_ce", "half_residual", "value_head")


def _gpt2(n_layer: int, n_head: int, n_embd: int) -> Callable[[], GPTConfig]:
    return lambda: GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd)


MODEL_PRESETS: dict[str, Callable[[], GPTConfig]] = {
    "gpt2": _gpt2(12, 12, 768),  # 124M
    "gpt2-medium": _gpt2(24, 16, 1024),  # 350M
    "gpt2-large": _gpt2(36, 20, 1280),  # 774M
    "gpt2-xl": _gpt2(48, 25, 1600),  # 1558M
    # depth N at aspect ratio 64 (width 64*N, N heads of 64): d12 is GPT-2 124M, the others are wider than GPT-2 of
    # that depth (llm.c's -e d24/d36/d48 mean the GPT-2 sizes: gpt2-medium/-large/-xl here)
    "d12": _gpt2(12, 12, 768),
    "d24": _gpt2(24, 24, 1536),
    "d36": _gpt2(36, 36, 2304),
    "d48": _gpt2(48, 48, 3072),
    # GPT-2 124M's shape with LLaMA's choices: RoPE, SwiGLU, 4 key-value heads, RMSNorm, no biases (114M params:
    # no position table, smaller k/v projections)
    "llama-124m": lambda: GPTConfig(n_layer=12, n_head=12, n_embd=768, n_kv_head=4, mlp="swiglu", pos="rope",
                                    norm="rmsnorm", bias=False),
    # for tests and CPU demos
    "tiny": lambda: GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64),
}


# ----------------------------------------------------------------------------------------------------------------------
# Model

# both norms' epsilon: GPT-2's LayerNorm and LLaMA 2's rms_norm_eps (export.py writes it into the HF configs)
NORM_EPS = 1e-5


def make_norm(config: GPTConfig) -> nn.LayerNorm | nn.RMSNorm:
    """GPT-2's LayerNorm, or LLaMA's RMSNorm: x / rms(x) * weight, with no mean subtracted and no bias."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, eps=NORM_EPS)
    return nn.LayerNorm(config.n_embd, eps=NORM_EPS, bias=config.bias)


class KVCache:
    """Per-layer keys/values for decoding, `pos` of them cached, in the dtype of the first keys (autocast and FSDP2
    mixed precision hide it). `pad` (B,) left-pads a ragged batch: row b's positions count from pad[b], and it holds
    block_size tokens of its own after them (`least`: the fewest pad columns of a row, which the longest row bounds)."""

    def __init__(self, config: GPTConfig, batch_size: int, pad: torch.Tensor | None = None):
        extra, self.least = (0, 0) if pad is None else (int(pad.max()), int(pad.min()))
        self.shape = (batch_size, config.kv_heads, config.block_size + extra, config.head_dim)
        self.k: list[torch.Tensor | None] = [None] * config.n_layer
        self.v: list[torch.Tensor | None] = [None] * config.n_layer
        self.pos = 0
        self.pad = pad

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k.new_zeros(self.shape), v.new_zeros(self.shape)
        ck, cv = self.k[layer], self.v[layer]
        t0, t1 = self.pos, self.pos + k.size(2)
        ck[:, :, t0:t1] = k  # type: ignore[index]
        cv[:, :, t0:t1] = v  # type: ignore[index]
        return ck[:, :, :t1], cv[:, :, :t1]  # type: ignore[index]

    def visible(self, T: int) -> torch.Tensor:
        """(B, 1, T, pos + T) mask of the keys each of the next T queries sees: causal, pad keys hidden. A query
        always sees itself: some SDPA kernels give NaN for an all-hidden row, which zero weights would still spread."""
        q = torch.arange(self.pos, self.pos + T, device=self.pad.device)[:, None]
        k = torch.arange(self.pos + T, device=self.pad.device)
        return (((k >= self.pad[:, None, None]) & (k <= q)) | (k == q)).unsqueeze(1)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished generations leave the batch and stop costing compute)."""
        self.k, self.v = ([t[rows] for t in ts] for ts in (self.k, self.v))  # filled: called after the prefill
        if self.pad is not None:
            self.pad = self.pad[rows]
            self.least = int(self.pad.min())


def rope_tables(config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    exponents = torch.arange(0, config.head_dim, 2).float() / config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)  # (hs/2,)
    angles = torch.outer(torch.arange(config.block_size).float(), inv_freq)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (i, i + hs/2) of x (B, nh, T, hs) by position-dependent angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.config, self.layer = config, layer
        kv_dim, q_dim = config.kv_heads * config.head_dim, config.n_head * config.head_dim  # q_dim: C unless pruned
        # one matmul for q, k and v: (C) -> (q_dim + 2 * kv_dim)
        self.c_attn = nn.Linear(config.n_embd, q_dim + 2 * kv_dim, bias=config.bias)
        self.c_proj = nn.Linear(q_dim, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
                cache: KVCache | None) -> torch.Tensor:
        B, T, _ = x.size()
        cfg = self.config
        qkv = self.c_attn(x)
        # the k/v width of the heads this module holds: all, or a tensor-parallel rank's share (parallelize.py)
        kv = qkv.size(2) // (cfg.n_head // cfg.kv_heads + 2)
        # q (B, nh, T, hs), k and v (B, nkv, T, hs)
        q, k, v = (t.view(B, T, -1, cfg.head_dim).transpose(1, 2) for t in qkv.split([qkv.size(2) - 2 * kv, kv, kv], 2))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # a chunk attends causally to itself, one decoded token to the whole cache. Without a cache a plain True:
        # under torch.compile with dynamic T, `T > 1` is a SymBool, which SDPA refuses
        causal = cache is None or T > 1
        if cache is not None:
            if cache.pos > 0 and T > 1:
                raise ValueError("KVCache supports a prefill into an empty cache, then one token at a time")
            k, v = cache.update(self.layer, k, v)
        mask = cache.visible(T) if cache is not None and cache.pad is not None else None  # a ragged batch
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                           dropout_p=cfg.dropout if self.training else 0.0,
                                           enable_gqa=cfg.kv_heads != cfg.n_head)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config, gelu = config, config.mlp == "gelu"
        # SwiGLU: 2/3 of 4C keeps the GELU MLP's parameter count; rounded up to 64 for matmul speed
        hidden = config.mlp_hidden or (4 * config.n_embd if gelu else 64 * math.ceil(8 * config.n_embd / 3 / 64))
        self.c_fc = nn.Linear(config.n_embd, hidden if gelu else 2 * hidden, bias=config.bias)  # SwiGLU: gate and up
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.mlp == "swiglu":
            gate, up = self.c_fc(x).chunk(2, dim=-1)
            h = F.silu(gate) * up
        elif self.c_fc.bias is not None:
            # matmul without bias, then bias+GELU in one fused pass (Triton on CUDA, reference elsewhere)
            h = bias_gelu(F.linear(x, self.c_fc.weight), self.c_fc.bias, self.config.fused_gelu)
        else:
            h = F.gelu(self.c_fc(x), approximate="tanh")
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope, cache)
        return x + self.mlp(self.ln_2(x))


def checkpoint_config(ckpt: dict[str, Any], source: str = "checkpoint", **overrides: Any) -> GPTConfig:
    """The GPTConfig a checkpoint load_checkpoint read was written with (plus overrides), or a one-line ValueError."""
    saved = ckpt["model_config"]
    unknown = set(saved) - {f.name for f in fields(GPTConfig)} if isinstance(saved, dict) else {type(saved).__name__}
    if unknown:
        raise ValueError(f"{source}: its model_config does not match this GPTConfig (no field "
                         f"{', '.join(sorted(map(str, unknown)))}); it was written by another architecture or version")
    return GPTConfig(**{**saved, **overrides})


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
            ln_f=make_norm(config),
        ))
        if config.pos == "learned":
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        else:
            cos, sin = rope_tables(config)
            self.register_buffer("rope_cos", cos, persistent=False)  # (T, hs/2)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying: one matrix embeds and un-embeds
        if config.value_head:
            self.value_head = nn.Linear(config.n_embd, 1)
        for module in self.modules():  # GPT-2's init: N(0, 0.02) weights, zero biases
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        if config.value_head:  # zero: every value starts at 0, a reward model's loss at ln 2
            nn.init.zeros_(self.value_head.weight)
        # residual projections add into the stream once per attn and once per MLP: scale so the stream's
        # variance does not grow with depth (GPT-2 paper, section 2.3)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _apply(self, fn: Callable, recurse: bool = True) -> GPT:
        """Every cast and move (.to, .half) goes through here. RoPE's tables are angles, not weights: a bf16 cast of the
        model (sample.py) must not round them (training's autocast used fp32 ones), so they are rebuilt in fp32."""
        super()._apply(fn, recurse)
        if self.config.pos == "rope" and self.rope_cos.dtype != torch.float32:
            cos, sin = rope_tables(self.config)  # computed as __init__ did, on the CPU: the very same values
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_sin.device)
        return self

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, label_smoothing: float = 0.0,
                cache: KVCache | None = None, last_only: bool = False, return_logits: bool = True, values: bool = False,
                at: torch.Tensor | None = None,
                per_token: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx (B, T) -> logits (B, T, V) ((B, 1, V) with last_only; None with loss_chunk or fused_ce and targets) and
        the mean loss over targets != -1 (None without targets). return_logits=False is the training step's call: a
        compiled forward that outputs logits gets a zero (B, T, V) gradient for them. values=True (config.value_head)
        returns (logits or None, the head's fp32 values (B, T)). `at`, a (B, T) bool mask, keeps only its positions:
        logits (N, V) and values (N,), for RL's and DPO's N scored tokens (the head is most of a small model's work).
        per_token=True returns (None, each target's fp32 loss (B, T), 0 where it is -1): validation's loss and bpb."""
        B, T = idx.size()
        start, pad, least = (cache.pos, cache.pad, cache.least) if cache is not None else (0, None, 0)
        length = start + T - least  # the longest row's, its pad left out
        if length > self.config.block_size:
            raise ValueError(f"sequence of length {length} exceeds block_size {self.config.block_size}")
        x = self.transformer.wte(idx)  # (B, T, C)
        rope = None
        pos = torch.arange(start, start + T, device=idx.device)
        if pad is not None:  # a ragged batch: (B, T) positions, each row's counted from its first token
            pos = (pos - pad[:, None]).clamp(min=0)
        if self.config.pos == "learned":
            x = x + self.transformer.wpe(pos)
        else:  # (1, T, hs/2), or a ragged batch's (B, 1, T, hs/2): each row's angles, shared by its heads
            rope = (self.rope_cos[pos].unsqueeze(-3), self.rope_sin[pos].unsqueeze(-3))
        x = self.transformer.drop(x)
        if self.config.half_residual and torch.is_autocast_enabled(idx.device.type):
            # the blocks' outputs are then 16-bit too (their last ops are autocast matmuls), so the stream stays so
            x = x.to(torch.get_autocast_dtype(idx.device.type))
        for block in self.transformer.h:
            x = block(x, rope, cache)
        if cache is not None:
            cache.pos += T
        x = self.transformer.ln_f(x)
        if last_only:
            x = x[:, -1:]
        if at is not None:
            x = x[at]
        if values:
            return self.lm_head(x) if return_logits else None, self.value_head(x).squeeze(-1).float()
        if targets is None:
            return self.lm_head(x), None  # (B, T, V)
        if per_token:
            losses = token_losses(x.flatten(0, 1), self.lm_head.weight, targets.flatten(), self.config.loss_chunk,
                                  self.config.fused_ce)
            return None, losses.view_as(targets)
        return lm_loss(x, self.lm_head.weight, targets, label_smoothing, self.config.loss_chunk,
                       self.config.fused_ce, return_logits)

    # ------------------------------------------------------------------------------------------------------------------
    # Accounting

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (tied wte/lm_head counted once); non_embedding drops the position table, as in nanoGPT."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and self.config.pos == "learned":
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs per token: 6N for the matmuls (fwd + bwd) plus 12*L*H*Q*T for attention scores."""
        cfg = self.config
        T = seq_len or cfg.block_size
        return 6 * self.num_params(non_embedding=True) + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T

    def configure_optimizers(self, weight_decay: float, lr: float, betas: tuple[float, float] = (0.9, 0.95),
                             eps: float = 1e-8, device_type: str = "cpu", verbose: bool = True) -> torch.optim.AdamW:
        """AdamW with weight decay on 2-D tensors (matmuls, embeddings) only, never on biases or LayerNorms."""
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        if verbose:
            print(f"optimizer: {len(decay)} decayed tensors ({sum(p.numel() for p in decay):,} params), "
                  f"{len(no_decay)} non-decayed tensors ({sum(p.numel() for p in no_decay):,} params)")
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        # the fused CUDA kernel updates every parameter in one launch instead of a loop of small ones
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=device_type == "cuda")

    # ------------------------------------------------------------------------------------------------------------------
    # Interop: this project's checkpoints, OpenAI/HF GPT-2

    @classmethod
    def from_checkpoint(cls, ckpt: str | os.PathLike | dict[str, Any], **overrides: Any) -> GPT:
        """Rebuild the model a train.py checkpoint describes (path or already-loaded dict). Weights holding a NaN or
        inf, or a file a NaN stop set aside (.diverged), are refused: they would sample and score garbage silently."""
        source = "checkpoint"
        if not isinstance(ckpt, dict):
            source = f"checkpoint {ckpt}"
            check_finite(source)  # a .diverged file is refused before it is read
            ckpt = load_checkpoint(ckpt, mmap=True)  # mapped: only the weights are read, once (no optimizer state)
        model = cls(checkpoint_config(ckpt, source, **overrides))
        weights = with_new_head(model, ckpt["model"])
        check_weights(model, weights, source)
        check_finite(source, weights)
        model.load_state_dict(weights)  # strict: every name and shape was checked above
        return model

    @classmethod
    def from_pretrained(cls, name_or_dir: str, **overrides: Any) -> GPT:
        """OpenAI GPT-2 weights from an HF checkpoint: a local dir (config.json + safetensors or .bin) or a hub name."""
        path = Path(name_or_dir)
        if not path.is_dir():
            from huggingface_hub import snapshot_download  # installed with datasets

            path = Path(snapshot_download(name_or_dir, allow_patterns=["config.json", "*.safetensors", "vocab.json",
                                                                       "model.safetensors.index.json"]))
            if not any(path.glob("*.safetensors")):  # an older repo: pytorch_model.bin only (or its shards)
                path = Path(snapshot_download(name_or_dir, allow_patterns=["pytorch_model*.bin", "*.bin.index.json"]))
        hf = {**HF_GPT2_DEFAULTS, **read_json(path / "config.json")}
        _check_plain_gpt2(hf, path)
        inner = hf["n_inner"] if hf["n_inner"] != 4 * hf["n_embd"] else None  # a pruned MLP's (prune.py)
        shape = dict(block_size=hf["n_positions"], vocab_size=hf["vocab_size"], n_layer=hf["n_layer"],
                     n_head=hf["n_head"], n_embd=hf["n_embd"], bias=True, mlp_hidden=inner)
        config = GPTConfig(**{**shape, **overrides})  # an override (e.g. dropout, fused_gelu) wins
        # HF's causal-mask buffers (.attn.bias, .attn.masked_bias) are never looked up
        sd_hf = {k.removeprefix("transformer."): v for k, v in _load_hf_weights(path).items()}
        if (head := sd_hf.get("lm_head.weight")) is not None and not torch.equal(head, sd_hf.get("wte.weight", head)):
            # transformers 5 then keeps the two apart, as tie_word_embeddings=False would
            raise ValueError(f"{path} holds an lm_head.weight unlike its wte.weight: an untied output layer, which "
                             "this model (one matrix embeds and un-embeds) does not implement")
        model = cls(config)
        with torch.no_grad():
            # the transformer's weights: lm_head is wte, and a new value head keeps its init
            for key, p in model.transformer.state_dict(prefix="transformer.").items():
                src = sd_hf.get(key.removeprefix("transformer."))
                if src is None:
                    raise ValueError(f"{path} lacks weight {key}")
                src = src.t() if key.endswith(HF_CONV1D) else src
                if src.shape != p.shape:
                    raise ValueError(f"{key}: checkpoint shape {tuple(src.shape)} != model shape {tuple(p.shape)}")
                p.copy_(src)
        return model

    def pad_vocab(self, rows: int) -> GPT:
        """Grow the tied embedding to `rows` rows, each new one the mean of the old (a neutral start): HF's GPT-2 has
        50,257, and the chat tokens take rows above them in this project's padded 50,304. No more rows: unchanged."""
        if self.config.vocab_size >= rows:
            return self
        old = self.transformer.wte.weight.data
        new = nn.Embedding(rows, old.size(1)).to(old)
        new.weight.data[:len(old)] = old
        new.weight.data[len(old):] = old.mean(dim=0)
        self.transformer.wte, self.lm_head.weight = new, new.weight
        self.config = replace(self.config, vocab_size=rows)
        return self

    @classmethod
    def load(cls, ckpt: str | None, init_from: str | None, **overrides: Any) -> GPT:
        """The model to run, on the CPU: this project's checkpoint (with from_checkpoint's overrides) or an HF GPT-2."""
        if ckpt and init_from:
            raise ValueError("pass either --ckpt or --init-from, not both")
        if ckpt:
            if is_reward_model(load_checkpoint(ckpt, mmap=True)):  # mapped, not read: refused before it is built
                raise ValueError(f"{ckpt} is a reward model (prefs.py --objective reward): it scores replies, and "
                                 "its logits were never trained to write them; load a policy, or score with it in "
                                 "rl.py --reward-model")
            return cls.from_checkpoint(ckpt, **overrides)
        if not init_from:
            raise ValueError("no model given: pass --ckpt PATH (a checkpoint train.py wrote) or --init-from gpt2 "
                             "(or gpt2-medium, gpt2-large, gpt2-xl, or a local HF GPT-2 directory)")
        path = Path(init_from).expanduser()
        if path.is_file():
            raise ValueError(f"--init-from {init_from} is a file; for a checkpoint train.py wrote, use --ckpt "
                             f"{init_from}")
        if path.is_dir():  # from_pretrained's errors name what is wrong with its files, except a missing config.json
            if not (path / "config.json").is_file():
                found = checkpoints(path)
                hint = f"; it holds train.py checkpoints: pass --ckpt {found[-1]}" if found else ""
                raise FileNotFoundError(f"--init-from {init_from} has no config.json, so it is not {HF_DIR}{hint}")
            return cls.from_pretrained(str(path))
        # a hub id is `name` or `org/name` of word characters, '-' and '.', neither first nor last, and no .pt: anything
        # else (./x, ../x, /abs/x, a/b/c, run/ckpt.pt) was meant as a local path
        part = r"\w(?:[\w.-]*\w)?"
        if not re.fullmatch(rf"(?:{part}/)?{part}", init_from) or ".." in init_from or "--" in init_from or \
                path.suffix in (".pt", ".pth"):
            raise FileNotFoundError(f"--init-from {init_from}: no such file or directory (nor a hub name)")
        try:
            return cls.from_pretrained(init_from)
        except OSError as e:
            reason = (str(e).splitlines() or [e.__class__.__name__])[0]
            raise OSError(f"could not get {init_from!r} from the HF hub ({reason}), and there is no local "
                          f"directory of that name; offline, pass --init-from {HF_DIR}") from e


def with_new_head(model: GPT, weights: dict[str, Any]) -> dict[str, Any]:
    """`weights` with `model`'s fresh value head where they have none (a reward model or critic from a language model's
    checkpoint), and without theirs where the model has none (GRPO from a PPO policy, whose head was its critic)."""
    head = {k: v for k, v in model.state_dict().items() if k.startswith("value_head.")}
    return {**{k: v for k, v in weights.items() if head or not k.startswith("value_head.")},
            **{k: v for k, v in head.items() if k not in weights}}


def check_finite(source: str, weights: dict[str, torch.Tensor] | None = None) -> None:
    """Refuse a checkpoint a NaN stop set aside, by its name, or weights holding a NaN or inf (aminmax allocates
    nothing, where isfinite(t).all() writes a mask as large as the tensor)."""
    if source.endswith(".diverged"):
        raise ValueError(f"{source} is the one a NaN stop set aside: its weights gave a NaN or inf loss or gradient "
                         "norm in training; use the checkpoint before it (--resume auto takes that one)")
    bad = [k for k, t in (weights or {}).items() if not all(v.isfinite() for v in torch.aminmax(t))]
    if bad:
        raise ValueError(f"{source} holds non-finite weights (NaN or inf in {len(bad)} of {len(weights)} tensors, the "
                         f"first {bad[0]}), as a run that diverged leaves them; use an earlier checkpoint of the run")


def check_weights(model: GPT, weights: dict[str, Any], source: str) -> None:
    """Refuse weights that do not fit model's config with one line of counts and the first two names: PyTorch's own
    size-mismatch error names every tensor, kilobytes for one mistake."""
    expected = model.state_dict()
    wrong = [f"{k} is a {type(v).__name__}, not a tensor" if not isinstance(v, torch.Tensor) else
             f"{k} is {tuple(v.shape)}, the config makes it {tuple(expected[k].shape)}"
             for k, v in weights.items()
             if k in expected and (not isinstance(v, torch.Tensor) or v.shape != expected[k].shape)]
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    problems = [f"{len(items)} {what} ({'; '.join(items[:2])}{f'; and {len(items) - 2} more' * (len(items) > 2)})"
                for items, what in
                ((wrong, "tensors do not fit"), (missing, "weights missing"), (unexpected, "unexpected weights"))
                if items]
    if problems:
        raise ValueError(f"{source}: the weights do not fit its model_config: {', '.join(problems)}; pass a checkpoint "
                         "as train.py wrote it")


def _check_plain_gpt2(hf: dict[str, Any], path: Path) -> None:
    """Refuse an HF config whose model this GPT cannot reproduce exactly, instead of loading wrong logits."""
    if hf.get("model_type") != "gpt2":
        raise ValueError(f"{path} is not a GPT-2 checkpoint (model_type={hf.get('model_type')!r}), the only HF kind "
                         "read here; for a LLaMA model export.py wrote, use the checkpoint it was exported from")
    # the values this model computes with
    expected = {"activation_function": {"gelu_new", "gelu_pytorch_tanh"},  # both are tanh GELU
                "layer_norm_epsilon": {1e-5}, "tie_word_embeddings": {True}, "scale_attn_weights": {True},
                "scale_attn_by_inverse_layer_idx": {False}}
    wrong = {k: hf[k] for k, ok in expected.items() if hf[k] not in ok}
    if wrong:
        found = ", ".join(f"{k}={v!r}" for k, v in wrong.items())
        raise ValueError(f"{path} is a GPT-2 variant this model does not implement ({found}); only plain GPT-2 "
                         "checkpoints load")
    vocab = path / "vocab.json"  # a tokenizer of its own: this project encodes text with GPT-2's BPE only
    if hf["vocab_size"] < GPT2_VOCAB or vocab.is_file() and read_json(vocab) != read_json(
            gpt2_bpe_dir() / "encoder.json"):
        raise ValueError(f"{path} was trained with a tokenizer other than GPT-2's (vocab_size {hf['vocab_size']}"
                         f"{', its own vocab.json' * vocab.is_file()}), and this project encodes text with GPT-2's "
                         "BPE only: its ids would mean other words")


def _load_hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """An HF directory's tensors: model.safetensors or pytorch_model.bin, or the shards an index.json lists."""
    def load(f: Path) -> dict[str, torch.Tensor]:
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file
            return load_file(str(f))
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:  # torch's message suggests weights_only=False, which would run the code
            raise ValueError(f"refusing to load {f}: it carries a pickled Python object, which could run code. Only "
                             "tensors and plain containers are accepted.") from None

    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).exists():
            return load(path / name)
        index = path / f"{name}.index.json"
        if index.exists():
            listed = read_json(index)
            if not isinstance(listed, dict) or not isinstance(listed.get("weight_map"), dict):
                raise ValueError(f"{index} has no weight_map (tensor name -> shard file), as HF writes one: fix or "
                                 "remove it")
            shards = sorted(set(listed["weight_map"].values()))
            missing = [f for f in shards if not (path / f).exists()]
            if missing:
                raise FileNotFoundError(f"{index} lists {len(shards)} shards, but {len(missing)} are missing from "
                                        f"{path} (the first: {missing[0]})")
            return {k: v for f in shards for k, v in load(path / f).items()}
    raise FileNotFoundError(f"{path} has neither model.safetensors nor pytorch_model.bin (nor a sharded index of "
                            "either)")
