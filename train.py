"""Train GPT-2: one process, or torchrun DDP / ZeRO-1 / FSDP2 on one or many nodes.

Usage:
    python train.py --preset tiny                                   # CPU, seconds (needs data/stdlib, see README)
    torchrun --standalone --nproc_per_node=8 train.py --preset gpt2-124m
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 train.py --preset gpt2-124m
    python train.py --help                                          # every option, with its meaning
"""

# Read top to bottom: config and presets, one optimizer step of the language model, its evaluations, then setup (one
# engine.Run) and the entry points. The loop and the run's machinery are engine.py; the step's is parallel.py.
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import torch.distributed as dist

import engine
import tasks
from chat_format import CHAT_VOCAB, ConversationLoader
from common import (
    LOCAL,
    checkpoints,
    describe_provenance,
    first_on_each_node,
    get_tokenizer,
    load_checkpoint,
    parse_config,
    provenance,
    run_and_exit,
    same_verdict,
    setup_distributed,
    shared_problem,
)
from engine import (
    Checkpointer,
    Eval,
    Evaluator,
    Profiler,
    Run,
    RunArgs,
    RunLog,
    SpikeGuard,
    StopFlags,
    TokenCount,
    agree_fingerprint,
    command_of,
    optimizer_kind,
    shards_of,
    val_loss,
    weights_digest,
)
from fineweb import SHUFFLES, DataError, TokenLoader
from model import GPT, MODEL_PRESETS, RUN_OPTIONS, GPTConfig, check_weights, checkpoint_config, with_new_head
from parallel import (
    Trainable,
    attention_conflict,
    build_trainable,
    cuda_graph_conflict,
    optimizer_conflict,
    sdpa_switches,
    set_hyperparameters,
    set_sdpa_switches,
    train_step,
)
from prefs import PairLoader, PairObjective, dpo_metrics, evaluate_pairs, reward_model_metrics


@dataclass
class TrainConfig(RunArgs):
    """Train a GPT-2 with this project's training loop. Flags override the chosen --preset; every GPTConfig field
    (--n-layer, --mlp, --dropout...) is a flag too."""

    # model
    model: str | None = None  # architecture preset: gpt2 (None), gpt2-medium/-large/-xl, d12..d48, llama-124m, tiny
    seq_len: int = 1024  # T: tokens per sequence; also the model's block_size
    # the GPTConfig fields given as flags, over the preset's: the architecture, dropout and the model's speed options
    arch: dict[str, Any] = dataclasses.field(default_factory=dict, metadata={"flags_of": GPTConfig,
                                                                            "except": ("block_size",)})
    init_from: Annotated[str, LOCAL] = ""  # '' (random init), a train.py checkpoint, or HF GPT-2 (gpt2..gpt2-xl, a dir)
    # data
    data: Annotated[str, LOCAL] = "data/edu_fineweb10B"  # token shards (fineweb.py, llm.c), or a dataset of that kind
    data_kind: str = "tokens"  # tokens (fineweb.py's shards), chat (conversations: SFT) or pairs (prefs.py's)
    objective: str = "lm"  # lm (next token), reward (Bradley-Terry reward model) or dpo, both on pairs
    reward_logprob: bool = False  # --objective reward: the score adds the mean log-prob of the reply (prefs.rewards)
    dpo_beta: float = 0.1  # DPO's beta: how far the implicit reward may pull the policy from its reference
    dpo_sft: float = 0.0  # DPO's loss adds this times the chosen replies' token NLL (RPO; TRL's rpo_alpha)
    preload: Annotated[bool, LOCAL] = False  # load the whole dataset onto the device once (small datasets only)
    shuffle: str = "windows"  # each epoch: windows (shard order and each shard's windows, llm.c) or shards (order only)
    # batch
    total_batch_size: int = 524288  # tokens per optimizer step, over all ranks and micro-steps
    batch_size: int = 64  # B: sequences per micro-step per rank (lower it to fit memory; see README table)
    # schedule and loss
    min_lr_frac: float = 0.1  # the schedule decays to min_lr_frac * max_lr
    lr_schedule: str = "cosine"  # after warmup: cosine or linear decay, constant, wsd (stable, then decay)
    decay_frac: float = 0.2  # wsd: the fraction of max_steps spent decaying to the min
    warmup_steps: int = 715  # linear warmup steps
    skip_loss_z: float = 0.0  # skip the update when the loss's z-score in the last 128 exceeds this (0 = off)
    skip_norm_z: float = 0.0  # skip the update when the grad norm's z-score in the last 128 exceeds this (0 = off)
    label_smoothing: float = 0.0  # cross-entropy label smoothing
    # evaluation
    eval_every: int = 250  # val loss every N steps (and at the last step); 0 = never
    # (the default: build-nanogpt's 20 val batches of 64 x 1024 on each of 8 GPUs, the same tokens on any world size)
    eval_tokens: int = 10_485_760  # val tokens per evaluation, all ranks together (rounded up to whole B*T windows)
    hellaswag_every: int = 250  # HellaSwag every N steps (and at the last step); 0 = never
    hellaswag: Annotated[str, LOCAL] = "auto"  # HellaSwag val jsonl: a path, 'auto' (cached download) or 'off'
    hellaswag_limit: int | None = None  # evaluate only the first N HellaSwag examples
    sample_every: int = 250  # print samples every N steps; 0 = never
    sample_tokens: int = 32  # new tokens per sample
    sample_prompt: str = "Hello, I'm a language model,"  # prompt for the in-training samples
    task: str = ""  # a tasks.py task whose held-out greedy accuracy is an eval (a chat model's): addition, gsm8k...
    task_every: int = 0  # score --task every N steps (and at the last step); 0 = at the last step only
    task_limit: int = 256  # held-out problems scored each time
    # run control
    overfit_batch: bool = False  # train on the first batch only (sanity check: the loss must go to ~0)
    print_config: bool = False  # print the resolved config (the preset, then the flags) as JSON and exit

    def __post_init__(self) -> None:
        super().__post_init__()
        choices = {"data_kind": ("tokens", "chat", "pairs"), "objective": ("lm", "reward", "dpo"), "shuffle": SHUFFLES,
                   "lr_schedule": ("cosine", "linear", "constant", "wsd"), "model": (None, *MODEL_PRESETS),
                   "task": ("", *tasks.TASKS)}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(filter(None, allowed))}; "
                                 f"got {getattr(self, name)!r}")
        self._check_stage()
        model_config(self)  # the architecture flags make a valid GPTConfig
        # each written so that NaN fails it too
        for name, low in {"seq_len": 1, "batch_size": 1, "total_batch_size": 1, "eval_tokens": 1, "sample_tokens": 1,
                          "warmup_steps": 0, "eval_every": 0, "hellaswag_every": 0, "sample_every": 0, "task_every": 0,
                          "task_limit": 1, "hellaswag_limit": 1, "skip_loss_z": 0, "skip_norm_z": 0,
                          "dpo_sft": 0}.items():
            if getattr(self, name) is not None and not getattr(self, name) >= low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}; got {getattr(self, name)}")
        if not 0.0 <= self.min_lr_frac <= 1.0:
            raise ValueError(f"--min-lr-frac must be in [0, 1]; got {self.min_lr_frac}")
        if not 0.0 < self.decay_frac <= 1.0:
            raise ValueError(f"--decay-frac must be in (0, 1]; got {self.decay_frac}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"--label-smoothing must be in [0, 1); got {self.label_smoothing}")

    def _check_stage(self) -> None:
        """The data, objective and task fit together."""
        if self.objective != "lm" and self.data_kind != "pairs":
            raise ValueError(f"--objective {self.objective} trains on preference pairs: pass --data-kind pairs")
        if self.objective == "lm" and self.data_kind == "pairs":
            raise ValueError("--data-kind pairs trains a preference objective: pass --objective reward or dpo")
        if self.objective == "reward" and self.arch.setdefault("value_head", True) is not True:
            raise ValueError("--objective reward trains a value head: drop --value-head false")
        if self.objective == "dpo" and not self.init_from:  # its reference is the starting weights
            raise ValueError("--objective dpo moves a model away from its starting weights, its reference: pass "
                             "--init-from a fine-tuned model (a random one prefers nothing)")
        if self.objective == "dpo" and self.parallel == "fsdp":
            raise ValueError("--objective dpo keeps a whole frozen reference on every rank: use ddp or zero1")
        if self.task and self.parallel == "fsdp":  # each rank's replies end at their own lengths: FSDP's forwards hang
            raise ValueError("--task generates replies, which --parallel fsdp cannot: use ddp or zero1")


def _preset(**kw: Any) -> Callable[[], TrainConfig]:
    return lambda: TrainConfig(**kw)


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    # build-nanogpt / llm.c GPT-2 124M on fineweb-edu 10B: 19073 steps of 2**19 tokens
    "gpt2-124m": _preset(),
    "gpt2-350m": _preset(model="gpt2-medium", batch_size=32, max_lr=3e-4, out_dir="out/gpt2-350m"),
    "gpt2-774m": _preset(model="gpt2-large", batch_size=16, max_lr=2.5e-4, out_dir="out/gpt2-774m"),
    "gpt2-1558m": _preset(model="gpt2-xl", batch_size=8, max_lr=2e-4, out_dir="out/gpt2-1558m"),
    # gpt2-124m's recipe for its LLaMA-style twin: RoPE, SwiGLU, GQA, RMSNorm, no biases
    "llama-124m": _preset(model="llama-124m", out_dir="out/llama-124m"),
    # a 30M-param model (nanoGPT's 10.7M without the embedding) on Tiny Shakespeare (~300K tokens): minutes on a GPU
    "shakespeare": _preset(model="gpt2", arch={"n_layer": 6, "n_head": 6, "n_embd": 384, "dropout": 0.2}, seq_len=256,
                           data="data/shakespeare", preload=True,
                           total_batch_size=16384, batch_size=64, max_lr=1e-3, warmup_steps=100, max_steps=2000,
                           # the val shard's 32K tokens hold one window of B*T+1 = 16,385 (windows do not overlap)
                           eval_every=250, eval_tokens=16384, hellaswag="off", sample_every=500,
                           sample_tokens=128, ckpt_every=1000, out_dir="out/shakespeare", sample_prompt="ROMEO:"),
    # nanoGPT's finetune_shakespeare: OpenAI's GPT-2 124M, about two epochs at a small constant lr; minutes on a GPU
    "shakespeare-ft": _preset(init_from="gpt2", data="data/shakespeare", total_batch_size=32768, batch_size=8,
                              max_lr=3e-5, lr_schedule="constant", warmup_steps=0, max_steps=20, eval_every=5,
                              eval_tokens=24576, hellaswag="off", sample_every=10, sample_tokens=128, ckpt_every=0,
                              out_dir="out/shakespeare-ft", sample_prompt="ROMEO:"),
    # the offline demo: a small model on the Python standard library's docstrings, minutes on 2 CPU cores; small
    # batches learn more per token here, and the chunked loss keeps the logits in malloc's heap (docs/benchmarks.md)
    "demo": _preset(model="tiny", arch={"loss_chunk": 128}, seq_len=128, data="data/stdlib_docs",
                    total_batch_size=512, batch_size=4, max_lr=3e-3, warmup_steps=40, max_steps=900, eval_every=150,
                    eval_tokens=8192, hellaswag="off", sample_every=0, sample_tokens=64, ckpt_every=0,
                    out_dir="out/demo", sample_prompt="Return the"),
    # SFT into a chat model (chat_format.py): OpenAI's GPT-2 124M on smol-smoltalk, about a third of an epoch
    "sft": _preset(init_from="gpt2", data="HuggingFaceTB/smol-smoltalk", data_kind="chat", total_batch_size=32768,
                   batch_size=8, max_lr=3e-5, lr_schedule="linear", min_lr_frac=0.0, warmup_steps=20, max_steps=2000,
                   eval_every=200, eval_tokens=327680, hellaswag="off", sample_every=0, ckpt_every=500,
                   out_dir="out/sft"),
    # the offline chat demo: the demo's model fine-tuned on tasks.py's addition problems, one to a 24-token row (packed
    # several to a row, the small model learned far slower), scored on held-out ones; minutes on 2 CPU cores
    "sft-demo": _preset(init_from="out/demo/ckpt_000900.pt", data="data/addition", data_kind="chat", seq_len=24,
                        total_batch_size=768, batch_size=32, max_lr=3e-3, lr_schedule="linear", min_lr_frac=0.0,
                        warmup_steps=20, max_steps=2400, eval_every=400, eval_tokens=3072, hellaswag="off",
                        sample_every=0, ckpt_every=0, task="addition", task_every=400, task_limit=256,
                        out_dir="out/sft-demo"),
    # preference stages on the chat demo's pairs (tasks.py --pairs), from the SFT model; the reward model's score adds
    # the reply's mean log-prob (a head alone learns no sums), and a small lr keeps Bradley-Terry from wrecking it
    "rm-demo": _preset(init_from="out/sft-demo/ckpt_002400.pt", data="data/addition_pairs", data_kind="pairs",
                       objective="reward", reward_logprob=True, seq_len=24, total_batch_size=384, batch_size=16,
                       max_lr=1e-4, lr_schedule="linear", min_lr_frac=0.0, warmup_steps=10, max_steps=300,
                       eval_every=50, eval_tokens=6144, hellaswag="off", sample_every=0, ckpt_every=0,
                       out_dir="out/rm-demo"),
    # DPO starts where RL does, from the half-trained SFT model; the SFT term keeps it from lowering both replies
    "dpo-demo": _preset(init_from="out/sft-demo-1200/ckpt_001200.pt", data="data/addition_pairs", data_kind="pairs",
                        objective="dpo", dpo_sft=1.0, seq_len=24, total_batch_size=384, batch_size=16, max_lr=3e-4,
                        lr_schedule="linear", min_lr_frac=0.0, warmup_steps=10, max_steps=200, eval_every=50,
                        eval_tokens=6144, hellaswag="off", sample_every=0, ckpt_every=0, task="addition",
                        task_every=50, task_limit=256, out_dir="out/dpo-demo"),
    # seconds on CPU, for tests
    "tiny": _preset(model="tiny", seq_len=64, data="data/stdlib", total_batch_size=512, batch_size=4,
                    max_lr=1e-3, warmup_steps=2, max_steps=10, eval_every=5, eval_tokens=512, hellaswag="off",
                    sample_every=0, ckpt_every=0, out_dir="out/tiny", sample_prompt="def "),
}


# ----------------------------------------------------------------------------------------------------------------------
# One optimizer step of the language model, and its learning rate


def lm_step(cfg: TrainConfig, built: Trainable, next_batch: Callable[[], tuple], grad_accum: int, guard: SpikeGuard,
            world: int, objective: PairObjective | None = None) -> Callable[[int], dict[str, Any]]:
    """engine.Run's step_fn, which returns the step's log record; `objective` (a reward model's or DPO's, on pairs: two
    sequences each) replaces the next-token loss."""
    tokens = grad_accum * cfg.batch_size * cfg.seq_len * world * (2 if objective else 1)

    def step_fn(step: int) -> dict[str, Any]:
        lr = get_lr(step, cfg)
        for group in built.optimizer.param_groups:
            group["lr"] = lr
        loss, norm = train_step(built.model, built.optimizer, next_batch, grad_accum, built.autocast, cfg.grad_clip,
                                cfg.label_smoothing, built.scaler, guard.for_step(), objective)
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        loss_value, norm_value = loss.item(), norm.item()  # waits for the GPU, so the step's time is real
        guard.observe(loss_value, norm_value)
        pairs = {k: objective.last[k].item() for k in ("accuracy", "margin")} if objective else {}  # rank 0's last
        return {"loss": loss_value, "lr": lr, "grad_norm": norm_value, "tokens": tokens, **pairs,
                **({"skipped": guard.skipped} if guard.skipped else {})}

    return step_fn


def get_lr(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine or linear decay to min_lr_frac * max_lr at max_steps, or constant; wsd holds max_lr,
    then decays linearly over the last decay_frac of the steps, so a run can be extended from before its decay."""
    min_lr = cfg.min_lr_frac * cfg.max_lr
    if step < cfg.warmup_steps:
        return cfg.max_lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.max_lr
    if step >= cfg.max_steps:
        return min_lr
    start = cfg.warmup_steps  # of the decay; wsd's: decay_frac of max_steps before the end
    if cfg.lr_schedule == "wsd":
        start = max(start, cfg.max_steps - round(cfg.decay_frac * cfg.max_steps))
    progress = max(0, step - start) / max(1, cfg.max_steps - start)
    if cfg.lr_schedule == "cosine":
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.max_lr - min_lr)
    return cfg.max_lr - progress * (cfg.max_lr - min_lr)


# ----------------------------------------------------------------------------------------------------------------------
# Evaluations: val loss, HellaSwag, samples (engine.Eval entries; a new one is an entry here and its flag)


def evaluations(cfg: TrainConfig, raw: GPT, built: Trainable, val_loader: TokenLoader | None,
                examples: list[dict] | None, log: RunLog, rank: int, world: int,
                objective: PairObjective | None = None) -> list[Eval]:
    master, device = rank == 0, next(raw.parameters()).device
    enc = get_tokenizer() if (cfg.sample_every > 0 or examples) else None
    evals = []
    if val_loader is not None:
        windows = val_windows(cfg, val_loader, master)

        def val(step: int) -> dict[str, Any]:
            if objective is None:
                vl = val_loss(built.model, val_loader, windows, built.autocast, world)
                log.say(f"step {step:6d} | val loss {vl:.4f}")
                return {"val_loss": vl}
            pairs = evaluate_pairs(built.model, val_loader, windows, objective.metrics_fn, built.autocast, world)
            log.say(f"step {step:6d} | val loss {pairs['loss']:.4f} | pairs ranked right {pairs['accuracy']:.4f}")
            return {"val_loss": pairs["loss"], "val_accuracy": pairs["accuracy"], "val_margin": pairs["margin"]}

        evals.append(Eval("val", cfg.eval_every, val))
    if examples:
        def hellaswag_eval(step: int) -> dict[str, Any]:
            import hellaswag

            # the uncompiled module: HellaSwag's many sequence lengths would recompile the training forward
            hs = hellaswag.evaluate(raw, examples, device, rank, world, limit=cfg.hellaswag_limit, enc=enc,
                                    progress=True)
            log.say(f"step {step:6d} | hellaswag acc_norm {hs['acc_norm']:.4f} ({hs['n']} examples)")
            return hs

        evals.append(Eval("hellaswag", cfg.hellaswag_every, hellaswag_eval))
    if cfg.task:  # held-out greedy accuracy, the replies generated by generate.py from the uncompiled module
        task = tasks.TASKS[cfg.task]()
        problems = task.examples("test")[:cfg.task_limit]

        def score(step: int) -> dict[str, Any]:
            result = tasks.evaluate(raw, task, problems, rank, world, autocast=built.autocast)
            log.say(f"step {step:6d} | {cfg.task} accuracy {result['acc']:.4f} ({result['n']} held-out problems)")
            return result

        evals.append(Eval("task", cfg.task_every, score))
    if cfg.sample_every > 0:
        def samples(step: int) -> dict[str, Any] | None:
            if not (master or cfg.parallel == "fsdp"):  # FSDP forwards are collective: every rank runs them
                return None
            texts = sample_text(raw, enc, cfg, device, step, built.autocast)
            for text in texts:
                log.say(f"sample: {text!r}")
            return {"texts": texts} if master else None

        evals.append(Eval("sample", cfg.sample_every, samples, at_start=False))
    return evals


def val_windows(cfg: TrainConfig, loader: TokenLoader, master: bool) -> int:
    """Val windows of B*T tokens per evaluation, all ranks together: --eval-tokens rounded up, at most the split."""
    BT = loader.B * loader.T
    windows = min(-(-cfg.eval_tokens // BT), loader.num_windows)  # more would score some windows twice
    if windows * BT != cfg.eval_tokens and master:
        print(f"val: each evaluation scores {windows * BT:,} tokens ({windows} x B*T = {BT:,}), not --eval-tokens "
              f"{cfg.eval_tokens:,}: whole windows, at most the val split's")
    return windows


def sample_text(raw: GPT, enc: Any, cfg: TrainConfig, device: torch.device, step: int,
                autocast: contextlib.AbstractContextManager) -> list[str]:
    """Two samples from the uncompiled module; their own generator leaves the training RNG (and exact resume) alone."""
    idx = torch.tensor([enc.encode(cfg.sample_prompt)] * 2, device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + step)
    with autocast:
        out = raw.generate(idx, cfg.sample_tokens, temperature=1.0, top_k=50, generator=gen)
    return [enc.decode([t for t in row if t < enc.n_vocab]) for row in out.tolist()]


def load_hellaswag(cfg: TrainConfig, rank: int, local_rank: int, world: int) -> list[dict] | None:
    """HellaSwag examples on every rank, or None on every rank (evaluate is collective, so all or none). The same
    collectives on every rank, whatever its flags say: the fingerprint then compares what each rank loaded."""
    import hellaswag

    wanted = cfg.hellaswag != "off" and (cfg.hellaswag_every > 0 or cfg.eval_only)
    path = Path(cfg.hellaswag) if cfg.hellaswag != "auto" else hellaswag.default_cache_dir() / "hellaswag_val.jsonl"

    def why(e: Exception) -> str:  # load_examples' own hint names hellaswag.py's flags, not train.py's
        return f"{path} is not a file" if not path.is_file() else str(e).splitlines()[0][:200]

    try:  # whatever fails (offline, a truncated response...), every rank skips it
        first_on_each_node(hellaswag.download if wanted and cfg.hellaswag == "auto" else lambda: None, local_rank,
                           world, catch=(Exception,), reason=lambda e: f"could not download it: {e.__cause__ or e}")
        return same_verdict(lambda: hellaswag.load_examples(path) if wanted else None, world, reason=why)
    except ValueError as e:  # the reason of the rank that lacks them
        if wanted and rank == 0:
            print(f"hellaswag: skipped ({e}); pass --hellaswag PATH to a local hellaswag_val.jsonl to enable it, "
                  "or --hellaswag off to silence this")
        return None


# ----------------------------------------------------------------------------------------------------------------------
# Setup: everything the loop needs, in one engine.Run


def setup(cfg: TrainConfig, rank: int, local_rank: int, world: int, device: torch.device) -> Run:
    """Build the Run. Each check that one rank could fail alone is shared first, so every rank stops with the
    reason instead of leaving the others waiting in a collective; what every rank must share is one fingerprint."""
    master, prov = rank == 0, provenance(device, world)
    torch.manual_seed(cfg.seed + rank)  # every device's generator; ranks see other data, so other dropout masks
    train_loader, val_loader = open_loaders(cfg, rank, world, device)
    checkpointer = Checkpointer(cfg, rank, world, prov, chat=cfg.data_kind != "tokens")
    found = checkpointer.find()  # first: a resumed fine-tune needs no --init-from source
    raw = build_model(cfg, found, local_rank, world)
    objective = pair_objective(cfg, device)  # before the RNG is seeded for the run: DPO's reference may be a fresh init
    examples = load_hellaswag(cfg, rank, local_rank, world)
    # before any check one rank could fail alone: a node with another command stops every node with the reason
    fingerprint(cfg, (train_loader, val_loader), raw, examples, found, rank, world)
    cfg, grad_accum, use_compile = check_run(cfg, rank, world, device)
    raw = raw.to(device)
    for loader in (train_loader, val_loader):
        if loader is not None:
            loader.check_vocab(raw.config.vocab_size)
    torch.manual_seed(cfg.seed + rank)
    if master:  # the full config and provenance are log.jsonl's first record
        print(f"model: {describe_model(cfg, raw.config)}\nprovenance: {describe_provenance(prov)}")
    if device.type == "cuda" and cfg.attention == "efficient" and raw.config.kv_heads != raw.config.n_head:
        raise ValueError("--attention efficient has no grouped-query (--n-kv-head) kernel; use --attention flash, "
                         "cudnn or auto")
    built = build_trainable(raw, cfg, device, use_compile, verbose=master)
    guard, tokens = SpikeGuard(cfg.skip_loss_z, cfg.skip_norm_z, world), TokenCount()
    parts = {"loader": train_loader, "scaler": built.scaler, "outliers": guard, "tokens": tokens}
    start_step = resume(found, checkpointer, raw, built, parts, cfg) if found else 0
    if master:
        print_header(cfg, raw, built, start_step, grad_accum, world, use_compile, device)
    checkpointer.remove_partial_writes()
    log = engine.open_run_log(cfg, start_step if found else None, checkpointer.rewinding, rank, world)
    log.write({"type": "config", "step": start_step, "config": dataclasses.asdict(cfg),
               "model_config": dataclasses.asdict(raw.config), "provenance": prov})
    return Run(step_fn=lm_step(cfg, built, batches(cfg, train_loader), grad_accum, guard, world, objective), raw=raw,
               trainable=built, checkpointer=checkpointer, log=log,
               evaluator=Evaluator(evaluations(cfg, raw, built, val_loader, examples, log, rank, world, objective), log,
                                   tokens, cfg.eval_only),
               stop=StopFlags(cfg.max_time, interrupt=not cfg.eval_only, master=master, device=device, world=world),
               profiler=Profiler(cfg.profile and not cfg.eval_only, start_step, cfg.profile_steps, Path(cfg.out_dir),
                                 rank),
               parts=parts, tokens=tokens, start_step=start_step,
               last_step=start_step if cfg.eval_only else cfg.max_steps, resumed=found is not None,
               eval_only=cfg.eval_only, rank=rank, world=world, device=device,
               flops_per_token=raw.flops_per_token(cfg.seq_len), device_name=prov["device"],
               peak_flops=cfg.peak_tflops * 1e12 if cfg.peak_tflops else None)


def pair_objective(cfg: TrainConfig, device: torch.device) -> PairObjective | None:
    """--objective reward or dpo as train_step's objective (None: the next-token loss). DPO's reference is the
    starting weights, loaded again: a resumed run's model has moved on from them."""
    if cfg.objective == "reward":
        return PairObjective(functools.partial(reward_model_metrics, logprob=cfg.reward_logprob))
    if cfg.objective == "dpo":
        ref = (load_init(cfg) if cfg.init_from else fresh_model(cfg)).to(device).eval().requires_grad_(False)
        return PairObjective(functools.partial(dpo_metrics, ref=ref, beta=cfg.dpo_beta, sft=cfg.dpo_sft))
    return None


def fingerprint(cfg: TrainConfig, loaders: tuple, raw: GPT, examples: list[dict] | None,
                found: tuple[Path, dict] | None, rank: int, world: int) -> None:
    """What every rank must share, compared once: the command, the data, the HellaSwag examples, the weights."""
    if world == 1:  # a digest of a 1.5B model takes seconds: only where there is something to compare
        return
    source = f"--init-from {cfg.init_from}" if cfg.init_from else "--seed"
    agree_fingerprint({"command": command(cfg), "data": shards_of(list(loaders)),
                       "--hellaswag file": examples_digest(examples),
                       "weights": weights_digest(raw) if found is None else None},  # a resume's: Checkpointer.find's
                      rank, world, source)


def command(cfg: TrainConfig) -> dict[str, str]:
    """The command every node must run: the config, with the model as its flags resolve it."""
    resolved = dataclasses.asdict(model_config(cfg))
    return {**command_of(cfg), **{k: repr(v) for k, v in resolved.items() if k != "block_size"}}


def examples_digest(examples: list[dict] | None) -> str | None:
    return None if examples is None else hashlib.sha1(json.dumps(examples, sort_keys=True).encode()).hexdigest()


def check_run(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> tuple[TrainConfig, int, bool]:
    """Refuse what cannot run: (cfg, gradient accumulation steps, whether to compile)."""
    B, T = cfg.batch_size, cfg.seq_len
    if cfg.eval_only:  # nothing trains, so no total batch to fill
        cfg = dataclasses.replace(cfg, total_batch_size=B * T * world)
    if cfg.total_batch_size % (B * T * world):
        # e.g. more ranks than a preset was sized for (the demo's on 2 CPU ranks): name a micro-batch that fits
        fits = next((b for b in range(B - 1, 0, -1) if cfg.total_batch_size % (b * T * world) == 0), None)
        fix = f"--batch-size {fits}" if fits else "another --batch-size"
        raise ValueError(f"--total-batch-size {cfg.total_batch_size} is not divisible by batch_size * seq_len * "
                         f"world_size = {B} * {T} * {world} = {B * T * world}; pass {fix} or another "
                         "--total-batch-size")
    grad_accum = cfg.total_batch_size // (B * T * world)
    if why := attention_conflict(cfg, device):
        raise ValueError(why)
    if cfg.optimizer != "adamw" and (why := shared_problem(optimizer_conflict(cfg), world)):  # a node may lack torchao
        raise ValueError(why)
    # by default on CUDA, except for a one-off evaluation, where compiling would take longer than it saves
    use_compile = cfg.compile if cfg.compile is not None else device.type == "cuda" and not cfg.eval_only
    if use_compile and (why := cuda_graph_conflict(cfg, grad_accum, device)):
        raise ValueError(why)
    return cfg, grad_accum, use_compile


def open_loaders(cfg: TrainConfig, rank: int, world: int,
                 device: torch.device) -> tuple[TokenLoader | None, TokenLoader | None]:
    """The train and val loaders (an evaluation needs only val); a node without the data stops every rank."""
    B, T = cfg.batch_size, cfg.seq_len

    def loader(split: str, wanted: int) -> TokenLoader | ConversationLoader | PairLoader | None:
        if not wanted:
            return None
        if cfg.data_kind == "chat":
            return ConversationLoader(cfg.data, split, B, T, rank, world, cfg.seed, device)
        if cfg.data_kind == "pairs":
            return PairLoader(cfg.data, split, B, T, rank, world, cfg.seed, device, shuffle=split == "train")
        return TokenLoader(cfg.data, split, B, T, rank, world, cfg.seed, device, cfg.preload, cfg.shuffle)

    return same_verdict(lambda: (loader("train", not cfg.eval_only), loader("val", cfg.eval_every or cfg.eval_only)),
                        world, DataError, (DataError, OSError))


def build_model(cfg: TrainConfig, found: tuple[Path, dict] | None, local_rank: int, world: int) -> GPT:
    """The model on the CPU: the resumed checkpoint's architecture (restore() loads its weights), --init-from's
    weights, or a fresh init, identical on every rank (the fingerprint checks)."""
    if found is None:  # the same collectives on every rank, with --init-from or without
        return first_on_each_node(lambda: load_init(cfg) if cfg.init_from else fresh_model(cfg), local_rank, world)
    src = checkpoint_config(found[1], f"--resume {found[0]}")
    check_architecture(cfg, src, f"--resume {found[0]}")
    if cfg.seq_len != src.block_size:
        raise ValueError(f"--seq-len {cfg.seq_len} is not the context of --resume {found[0]}, "
                         f"{src.block_size} tokens; pass --seq-len {src.block_size}")
    if int(found[1]["step"]) > cfg.max_steps and not cfg.eval_only:
        raise ValueError(f"--resume {found[0]} is at step {found[1]['step']}, past --max-steps {cfg.max_steps}; "
                         "raise --max-steps to train further, or score it with --eval-only")
    saved = found[1].get("train_config", {}).get("optimizer", "adamw")
    if saved != cfg.optimizer and not cfg.eval_only:
        raise ValueError(f"--resume {found[0]} holds --optimizer {saved}'s state, not {cfg.optimizer}'s: pass "
                         f"--optimizer {saved}, or start a new run from its weights with --init-from {found[0]}")
    if cfg.arch.get("value_head", src.value_head) != src.value_head:
        raise ValueError(f"--resume {found[0]} has {'a' if src.value_head else 'no'} value head; a resume cannot "
                         "change that: start a new run from its weights with --init-from")
    model = GPT(dataclasses.replace(src, **run_options(cfg)))
    check_weights(model, found[1]["model"], f"checkpoint {found[0]}")  # restore() would print every tensor
    return model


def fresh_model(cfg: TrainConfig) -> GPT:
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank
    return GPT(model_config(cfg))


def resume(found: tuple[Path, dict], checkpointer: Checkpointer, raw: GPT, built: Trainable, parts: dict[str, Any],
           cfg: TrainConfig) -> int:
    """Restore the checkpoint found into the built run on every rank (or stop all of them); returns its step."""
    path, ckpt = found
    step = same_verdict(lambda: checkpointer.restore(ckpt, raw, built.optimizer, parts), checkpointer.world,
                        ValueError, (DataError, ValueError))
    if checkpointer.master:
        print(f"resumed from {path} at step {step}")
        if isinstance(parts["loader"], TokenLoader) and not cfg.eval_only:
            note_new_windows(ckpt["loader"], parts["loader"])
        note_new_schedule(ckpt.get("train_config", {}).get("max_steps"), cfg, step)
    if not cfg.eval_only and (changed := set_hyperparameters(built.optimizer, cfg)) and checkpointer.master:
        print(f"note: {', '.join(changed)} differ from the checkpoint's run: this run's values apply from step {step}")
    del ckpt["model"], ckpt["optimizer"]  # copied into the model and optimizer: free the CPU copy
    return step


def note_new_windows(saved: dict, loader: TokenLoader) -> None:
    """Say where the data goes on when the checkpoint read other windows (--batch-size or --shuffle changed)."""
    old_b, old_shuffle = saved["B"], TokenLoader.state_shuffle(saved)
    if (old_b, old_shuffle) != (loader.B, loader.shuffle):
        n = loader.resume_skipped  # tokens of the shard being read that the checkpoint's run had not served
        skip = f" at the next shard, skipping this one's {n:,} unserved tokens" if n else ""
        print(f"note: the checkpoint read {old_b}-sequence windows with --shuffle {old_shuffle}, this run reads "
              f"{loader.B}-sequence windows with --shuffle {loader.shuffle}: the data goes on{skip}, none served twice")


def note_new_schedule(saved_steps: int | None, cfg: TrainConfig, step: int) -> None:
    """Say so when the resumed run had another --max-steps that changes the lr from `step` on."""
    if saved_steps is None or saved_steps == cfg.max_steps or cfg.eval_only:
        return
    old = dataclasses.replace(cfg, max_steps=int(saved_steps))
    differs = next((s for s in range(step, max(old.max_steps, cfg.max_steps) + 1) if get_lr(s, old) != get_lr(s, cfg)),
                   None)
    if differs is not None:
        print(f"note: the checkpoint's run had --max-steps {old.max_steps}, this run has {cfg.max_steps}: from step "
              f"{differs} the lr is {get_lr(differs, cfg):.3g}, not that run's {get_lr(differs, old):.3g}")


def batches(cfg: TrainConfig, loader: TokenLoader | None) -> Callable[[], tuple] | None:
    """The train batches; with --overfit-batch always the run's first batch, also after a resume."""
    if loader is None or not cfg.overfit_batch:
        return loader.next_batch if loader is not None else None
    position = loader.state_dict()
    loader.reset()
    fixed = loader.next_batch()
    loader.load_state_dict(position)
    return lambda: fixed


def describe_model(cfg: TrainConfig, mcfg: GPTConfig) -> str:
    """The model in one line: `tiny: 2 layers, 4 heads, width 64, context 64, gelu MLP, learned positions`."""
    name = f"--init-from {cfg.init_from}" if cfg.init_from else cfg.model
    heads = f"{mcfg.n_head} heads" + (f" ({mcfg.kv_heads} key-value)" if mcfg.kv_heads != mcfg.n_head else "")
    shape = f"{mcfg.n_layer} layers, {heads}, width {mcfg.n_embd}, context {mcfg.block_size}, {mcfg.mlp} MLP, " \
        f"{mcfg.pos} positions" + (", RMSNorm" if mcfg.norm == "rmsnorm" else "")
    return f"{name}: {shape}" if name else shape


def print_header(cfg: TrainConfig, raw: GPT, built: Trainable, start_step: int, grad_accum: int, world: int,
                 use_compile: bool, device: torch.device) -> None:
    B, T, mcfg = cfg.batch_size, cfg.seq_len, raw.config
    if cfg.eval_only:
        print(f"{raw.num_params():,} params | evaluating at step {start_step} | {B} x {T} x {world} ranks | "
              f"{built.dtype}")
        return
    print(f"{raw.num_params():,} params | {grad_accum * B * T * world:,} tokens/step = {B} x {T} x {world} ranks x "
          f"{grad_accum} accum | {cfg.max_steps} steps | compile {use_compile} | "
          f"{optimizer_kind(built.optimizer, cfg.parallel)} | {built.dtype}")  # single: no torchrun
    for flag, on in (("--fused-gelu", mcfg.fused_gelu), ("--fused-ce", mcfg.fused_ce)):
        if on and device.type != "cuda":
            print(f"note: {flag} runs the PyTorch reference on {device.type}: the Triton kernel is CUDA only")
    if mcfg.half_residual and built.dtype == torch.float32:
        print("note: --half-residual does nothing in fp32: the residual stream is 16-bit only under --dtype bf16")
    if cfg.compile_mode != "default" and not use_compile:
        print(f"note: --compile-mode {cfg.compile_mode} does nothing: the model is not compiled (--compile true)")


# ----------------------------------------------------------------------------------------------------------------------
# The model's config: the preset, then the GPTConfig fields given as flags


def run_options(cfg: TrainConfig) -> dict[str, Any]:
    """The GPTConfig fields a run sets whatever its weights came from (model.RUN_OPTIONS) and the context length."""
    return {"block_size": cfg.seq_len, **{k: v for k, v in cfg.arch.items() if k in RUN_OPTIONS}}


def model_config(cfg: TrainConfig) -> GPTConfig:
    """The preset's architecture with this run's GPTConfig flags (and --seq-len as block_size)."""
    try:
        return dataclasses.replace(MODEL_PRESETS[cfg.model or "gpt2"](), **cfg.arch, block_size=cfg.seq_len)
    except ValueError as e:  # GPTConfig.n_head -> --n-head
        raise ValueError(re.sub(r"GPTConfig\.(\w+)", lambda m: "--" + m.group(1).replace("_", "-"), str(e))) from None


def check_architecture(cfg: TrainConfig, src: GPTConfig, source: str) -> None:
    """Refuse a run whose architecture flags or --model preset say otherwise than the weights it starts from, which
    fix the architecture: they would be ignored without a word."""
    has, asked = (dataclasses.replace(c, n_kv_head=c.kv_heads) for c in (src, model_config(cfg)))
    # the flags given, and the --model preset's shape and options (llama-124m's) where no flag replaces them; a preset's
    # n_kv_head of None follows n_head
    follows = () if "n_kv_head" in cfg.arch or MODEL_PRESETS[cfg.model or "gpt2"]().n_kv_head else ("n_kv_head",)
    fixed = [f.name for f in dataclasses.fields(GPTConfig) if f.name not in (*RUN_OPTIONS, "vocab_size", *follows)]
    differ = [k for k in fixed if (k in cfg.arch or cfg.model) and getattr(asked, k) != getattr(has, k)]
    wrong = [f"--{k.replace('_', '-')} {getattr(asked, k)} (it has {getattr(has, k)})" for k in differ if k in cfg.arch]
    if by_preset := [k for k in differ if k not in cfg.arch]:
        wrong.append(f"--model {cfg.model} ({', '.join(f'{k} {getattr(asked, k)}' for k in by_preset)}; it has "
                     f"{', '.join(f'{k} {getattr(has, k)}' for k in by_preset)})")
    if wrong:
        raise ValueError(f"{source} fixes the architecture, but this run asks for {', '.join(wrong)}: drop those "
                         "flags, or use a preset that does not set them")


def load_init(cfg: TrainConfig) -> GPT:
    """--init-from's weights as a GPT on the CPU, the position table cropped to --seq-len (as nanoGPT's crop)."""
    path = Path(cfg.init_from).expanduser()
    if path.is_dir() and not (path / "config.json").exists() and (found := checkpoints(path)):
        raise ValueError(f"--init-from {cfg.init_from} is a run directory; pass one of its checkpoints, e.g. "
                         f"--init-from {found[-1]} (the latest)")
    # a checkpoint's tensors are mapped, not read: its AdamW moments (twice the weights) never enter memory
    try:
        source = GPT.from_checkpoint(load_checkpoint(path, mmap=True)) if path.is_file() else \
            GPT.load(None, cfg.init_from)
    except OSError as e:  # the hub is unreachable, or has no such model: one line, not an HTTP client's traceback
        raise ValueError(str(e).replace("\n", " ")) from None
    src = source.config
    check_architecture(cfg, src, f"--init-from {cfg.init_from}")
    if cfg.seq_len > src.block_size:
        raise ValueError(f"--seq-len {cfg.seq_len} is longer than --init-from {cfg.init_from}'s context of "
                         f"{src.block_size} tokens; pass --seq-len {src.block_size} or less")
    if cfg.data_kind == "chat" and src.vocab_size < CHAT_VOCAB:  # HF GPT-2's 50,257 rows: the chat tokens need more
        source.pad_vocab(GPTConfig().vocab_size)
        src = source.config
    config = dataclasses.replace(src, **run_options(cfg))
    weights = source.state_dict()
    del source  # its tensors live on in `weights`: at most two copies of the model at once
    if "transformer.wpe.weight" in weights:
        weights["transformer.wpe.weight"] = weights["transformer.wpe.weight"][:cfg.seq_len]
    model = GPT(config)
    model.load_state_dict(with_new_head(model, {k: v for k, v in weights.items()  # a value head added or dropped
                                                 if config.value_head or not k.startswith("value_head.")}))
    return model


# ----------------------------------------------------------------------------------------------------------------------
# Entry points


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The command line (sys.argv[1:] by default) into run(); a user error is one line on stderr and exit code 1."""
    try:
        cfg = parse_config(TrainConfig, sys.argv[1:] if argv is None else argv, PRESETS, __doc__)
    except SystemExit as e:
        # under torchrun, a rank whose flags do not parse (one node's typo) joins the group as the default config would,
        # to hand its reason to the other ranks' first collective: they would wait for it until the timeout
        if e.code and not isinstance(e.code, int) and "RANK" in os.environ and not dist.is_initialized():
            world = setup_distributed(TrainConfig().device, TrainConfig().dist_timeout)[2]
            shared_problem(str(e.code).removeprefix("error: "), world)
            dist.destroy_process_group()
        raise
    if cfg.print_config:
        resolved = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "print_config"}
        print(json.dumps({**resolved, "model_config": dataclasses.asdict(model_config(cfg))}, indent=1))
        return {}
    try:
        return run(cfg)
    except (DataError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except torch.cuda.OutOfMemoryError as e:  # the usual first failure on a new GPU: say what to change
        print(f"error: out of GPU memory at --batch-size {cfg.batch_size}: lower it (gradient accumulation keeps "
              "--total-batch-size), or add --loss-chunk 4096 or --recompute mlp; the README's 'Micro-batch by GPU "
              f"memory' has starting points\n(torch: {str(e).splitlines()[0] if str(e) else 'no message'})",
              file=sys.stderr)
        raise SystemExit(1) from None
    except RuntimeError as e:  # gloo's raw traceback for a rank that never came (NCCL's watchdog aborts by itself)
        if not (dist.is_initialized() or "RANK" in os.environ) or "timed out" not in str(e).lower():
            raise
        print(f"error: rank {os.environ.get('RANK', 0)} waited --dist-timeout {cfg.dist_timeout:g} min in a collective "
              "for a rank that never came: check that every rank is alive and running (not killed, stopped or stuck "
              "in I/O) and that the nodes reach each other, then --resume auto", file=sys.stderr)
        raise SystemExit(1) from None


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or evaluate) as cfg says, from Python: errors stay exceptions. It joins the default process group, or
    creates it and destroys it at the end. Returns engine.train()'s result, the same on every rank."""
    owns_group = not dist.is_initialized()
    rank, local_rank, world, device = setup_distributed(cfg.device, cfg.dist_timeout)
    attention = sdpa_switches()
    try:
        with engine.hold_out_dir(cfg, rank, world):
            state = setup(cfg, rank, local_rank, world, device)
            with state.stop:  # its signal handlers live as long as the loop, and put the caller's back
                result = engine.train(state)
                if dist.is_initialized():
                    dist.barrier()  # leave together: no rank tears its group down while another is in a collective
        return result
    finally:
        set_sdpa_switches(attention)  # --attention's choice must not outlive the run either
        if owns_group and dist.is_initialized():  # a group the caller made is the caller's to destroy
            dist.destroy_process_group()


if __name__ == "__main__":
    # a diverged run must not look like success to a scheduler
    run_and_exit(main, lambda result: 1 if result.get("stopped") == "nan" else 0)
