"""What every stage script shares (train.py, sft.py, prefs.py, rl.py), written once: the flags of a stage that trains a
model from a start on a dataset, the model it starts from, the step of a next-token or pair objective, the checks and
notes of a resume, the Run's assembly, and main's exits.

A stage script reads top to bottom: its config and presets, its data, its objective and step, its evaluations, then
setup(cfg, ctx) -> engine.Run, built here in three calls (Setup, build, run), and main = stage.main(...).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
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
from common import (
    LOCAL,
    all_sum,
    checkpoints,
    describe_provenance,
    first_on_each_node,
    flag,
    hold_lock,
    is_reward_model,
    load_checkpoint,
    own_process_group,
    parse_config,
    provenance,
    same_verdict,
    setup_distributed,
    shared_problem,
    token_bytes,
)
from engine import Checkpointer, Context, Eval, Run, RunArgs, SpikeGuard, TokenCount, get_lr, optimizer_kind, set_lr
from fineweb import DataError
from model import GPT, MODEL_PRESETS, RUN_OPTIONS, GPTConfig, check_weights, checkpoint_config, with_new_head
from parallel import (
    Trainable,
    attention_conflict,
    build_trainable,
    check_flags,
    cuda_graph_conflict,
    optimizer_conflict,
    sdpa_switches,
    set_hyperparameters,
    set_sdpa_switches,
    train_step,
)
from parallelize import data_rank, degrees
from trackers import missing_package


@dataclass
class StageArgs(RunArgs):
    """A stage that trains a model from a start on a dataset (train.py, sft.py, prefs.py). Every GPTConfig field
    (--n-layer, --mlp, --dropout...) is a flag too."""

    # model
    model: str | None = None  # architecture preset: gpt2 (None), gpt2-medium/-large/-xl, d12..d48, llama-124m, tiny
    seq_len: int = 1024  # T: tokens per sequence; also the model's block_size
    # the GPTConfig fields given as flags, over the preset's: the architecture, dropout and the model's speed options
    arch: dict[str, Any] = dataclasses.field(default_factory=dict, metadata={"flags_of": GPTConfig,
                                                                            "except": ("block_size",)})
    init_from: Annotated[str, LOCAL] = ""  # '' (random init), a checkpoint of this project, or HF GPT-2 (a name, a dir)
    # data and batch
    data: Annotated[str, LOCAL] = "data/edu_fineweb10B"  # the stage's dataset: a path, or a hub name
    total_batch_size: int = 524288  # tokens per optimizer step, over all ranks and micro-steps
    batch_size: int = 64  # B: sequences per micro-step per rank (lower it to fit memory; see README table)
    # (the default: build-nanogpt's 20 val batches of 64 x 1024 on each of 8 GPUs, the same tokens on any world size)
    eval_tokens: int = 10_485_760  # val tokens per evaluation, all ranks together (rounded up to whole B*T windows)
    skip_loss_z: float = 0.0  # skip the update when the loss's z-score in the last 128 exceeds this (0 = off)
    skip_norm_z: float = 0.0  # skip the update when the grad norm's z-score in the last 128 exceeds this (0 = off)
    peak_tflops: Annotated[float | None, LOCAL] = None  # override the per-GPU peak bf16 TFLOP/s used for MFU

    def __post_init__(self) -> None:
        super().__post_init__()
        lows = dict(seq_len=1, batch_size=1, total_batch_size=1, eval_tokens=1, skip_loss_z=0, skip_norm_z=0)
        check_flags([(self.model in (None, *MODEL_PRESETS),
                      f"--model must be one of {', '.join(MODEL_PRESETS)}; got {self.model!r}"),
                     *((getattr(self, name) >= low, f"--{flag(name)} must be >= {low}; got {getattr(self, name)}")
                       for name, low in lows.items()),  # a NaN fails it too
                     (self.peak_tflops is None or 0 < self.peak_tflops < float("inf"),  # else NaN/negative MFU
                      f"--peak-tflops must be a positive number; got {self.peak_tflops}")])
        model_config(self)  # the architecture flags make a valid GPTConfig


@dataclass
class TaskEvalArgs:
    """A chat model's held-out task accuracy as an evaluation (sft.py, prefs.py): mixed in before StageArgs."""

    # a task whose held-out greedy accuracy is an eval: gsm8k, arc-easy, arc-challenge, mmlu, humaneval, addition,
    # FILE.py:NAME or module:NAME; several, comma-separated (NAME=FILE: a local copy in the hub's schema): ChatCORE
    task: str = ""
    task_every: int = 0  # score --task every N steps (and at the last step); 0 = at the last step only
    task_limit: int = 256  # held-out problems scored each time (per task)

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]
        if self.task:
            tasks.task_list(self.task)
        check_flags([(self.task_every >= 0 and self.task_limit >= 1,
                      f"--task-every must be >= 0 and --task-limit >= 1; got {self.task_every} and {self.task_limit}"),
                     # FSDP's forwards would hang
                     (not (self.task and self.parallel == "fsdp"),  # type: ignore[attr-defined]
                      "--task generates replies, which --parallel fsdp cannot: use ddp or zero1, or --task ''")])


# ----------------------------------------------------------------------------------------------------------------------
# The model a stage starts from: a checkpoint it resumes, --init-from's weights, or a fresh init


def run_options(cfg: StageArgs) -> dict[str, Any]:
    """The GPTConfig fields a run sets whatever its weights came from (model.RUN_OPTIONS) and the context length."""
    return {"block_size": cfg.seq_len, **{k: v for k, v in cfg.arch.items() if k in RUN_OPTIONS}}


def model_config(cfg: StageArgs) -> GPTConfig:
    """The preset's architecture with this run's GPTConfig flags (and --seq-len as block_size)."""
    try:
        return dataclasses.replace(MODEL_PRESETS[cfg.model or "gpt2"](), **cfg.arch, block_size=cfg.seq_len)
    except ValueError as e:  # GPTConfig.n_head -> --n-head
        raise ValueError(re.sub(r"GPTConfig\.(\w+)", lambda m: "--" + flag(m.group(1)), str(e))) from None


def check_architecture(cfg: StageArgs, src: GPTConfig, source: str) -> None:
    """Refuse a run whose architecture flags or --model preset say otherwise than the weights it starts from, which
    fix the architecture: they would be ignored without a word."""
    has, asked = (dataclasses.replace(c, n_kv_head=c.kv_heads) for c in (src, model_config(cfg)))
    # the flags given, and the --model preset's shape and options where no flag replaces them (n_kv_head None: n_head)
    follows = () if "n_kv_head" in cfg.arch or MODEL_PRESETS[cfg.model or "gpt2"]().n_kv_head else ("n_kv_head",)
    fixed = [f.name for f in dataclasses.fields(GPTConfig) if f.name not in (*RUN_OPTIONS, *follows)]
    differ = [k for k in fixed if (k in cfg.arch or cfg.model and k != "vocab_size")  # a flag only: presets pad
              and getattr(asked, k) != getattr(has, k)]
    wrong = [f"--{flag(k)} {getattr(asked, k)} (it has {getattr(has, k)})" for k in differ if k in cfg.arch]
    if by_preset := [k for k in differ if k not in cfg.arch]:
        wrong.append(f"--model {cfg.model} ({', '.join(f'{k} {getattr(asked, k)}' for k in by_preset)}; it has "
                     f"{', '.join(f'{k} {getattr(has, k)}' for k in by_preset)})")
    if wrong:
        raise ValueError(f"{source} fixes the architecture, but this run asks for {', '.join(wrong)}: pass "
                         f"{' '.join(f'--{flag(k)} {getattr(has, k)}' for k in differ)} as it has them, or drop the "
                         "flags or preset that say otherwise")


def check_not_run_dir(init_from: str, made_by: str = "") -> Path:
    """--init-from as a path, or a one-line refusal of a run directory (GPT.load's hint would name --ckpt); with
    `made_by`, the stage that writes it, of a path that does not exist (load_checkpoint's hint names train.py)."""
    path = Path(init_from).expanduser()
    if path.is_dir() and not (path / "config.json").exists() and (found := checkpoints(path)):
        raise ValueError(f"--init-from {init_from} is a run directory; pass one of its checkpoints, e.g. "
                         f"--init-from {found[-1]} (the latest)")
    check_flags([(not made_by or path.exists(), f"--init-from {init_from} does not exist; pass a checkpoint that "
                  f"{made_by} wrote")])
    return path


def load_init(cfg: StageArgs, vocab: int = 0) -> GPT:
    """--init-from's weights as a GPT on the CPU, the position table cropped to --seq-len (as nanoGPT's crop), the
    embedding padded to at least `vocab` rows (the chat tokens need more than HF GPT-2's 50,257)."""
    path = check_not_run_dir(cfg.init_from)
    # a checkpoint's tensors are mapped, not read: its AdamW moments (twice the weights) never enter memory
    try:
        ckpt = load_checkpoint(path, mmap=True) if path.is_file() else None
        check_flags([(ckpt is None or not is_reward_model(ckpt) or getattr(cfg, "objective", "") == "reward",
                      f"--init-from {cfg.init_from} is a reward model (prefs.py --objective reward): its logits were "
                      "never trained to write replies; start from the policy it was trained from")])
        source = GPT.from_checkpoint(ckpt) if ckpt is not None else GPT.load(None, cfg.init_from)
        if ckpt and ckpt.get("pruning") and ckpt["pruning"]["method"] != "structured" and not int(os.getenv("RANK", 0)):
            print(f"note: --init-from {cfg.init_from} was pruned ({ckpt['pruning']['method']}): this stage trains "
                  "every weight, so its zeros fill in again; prune.py --init-from it holds them while it recovers")
    except OSError as e:  # the hub is unreachable, or has no such model: one line, not an HTTP client's traceback
        raise ValueError(str(e).replace("\n", " ")) from None
    if source.config.vocab_size < vocab:
        source.pad_vocab(GPTConfig().vocab_size)
    check_architecture(cfg, source.config, f"--init-from {cfg.init_from}")
    check_flags([(cfg.seq_len <= (context := source.config.block_size), f"--seq-len {cfg.seq_len} is longer than "
                  f"--init-from {cfg.init_from}'s context of {context} tokens; pass --seq-len {context} or less")])
    config = dataclasses.replace(source.config, **{"value_head": False, **run_options(cfg)})  # one where asked
    weights = source.state_dict()
    del source  # its tensors live on in `weights`: at most two copies of the model at once
    if "transformer.wpe.weight" in weights:
        weights["transformer.wpe.weight"] = weights["transformer.wpe.weight"][:cfg.seq_len]
    model = GPT(config)
    model.load_state_dict(with_new_head(model, weights))  # a value head added or dropped
    return model


def build_model(cfg: StageArgs, found: tuple[Path, dict] | None, ctx: Context, vocab: int = 0) -> GPT:
    """The model on the CPU: the resumed checkpoint's architecture (restore() loads its weights), --init-from's
    weights, or a fresh init, identical on every rank (the fingerprint checks). A resume's refusals come first."""
    if found is None:  # the same collectives on every rank, with --init-from or without
        torch.manual_seed(cfg.seed)  # identical initial weights on every rank
        return first_on_each_node(lambda: load_init(cfg, vocab) if cfg.init_from else GPT(model_config(cfg)),
                                  ctx.local_rank, ctx.world)
    check_resume(found, cfg)
    src = checkpoint_config(found[1], f"--resume {found[0]}")
    check_architecture(cfg, src, f"--resume {found[0]}")
    check_flags([(cfg.seq_len == src.block_size, f"--seq-len {cfg.seq_len} is not the context of --resume "
                  f"{found[0]}, {src.block_size} tokens; pass --seq-len {src.block_size}"),
                 (cfg.arch.get("value_head", src.value_head) == src.value_head, f"--resume {found[0]} has "
                  f"{'a' if src.value_head else 'no'} value head; a resume cannot change that: start a new run from "
                  "its weights with --init-from")])
    model = GPT(dataclasses.replace(src, **run_options(cfg)))
    check_weights(model, found[1]["model"], f"checkpoint {found[0]}")  # restore() would print every tensor
    return model


def describe_model(cfg: StageArgs, mcfg: GPTConfig) -> str:
    """The model in one line: `tiny: 2 layers, 4 heads, width 64, context 64, gelu MLP, learned positions`."""
    name = f"--init-from {cfg.init_from}" if cfg.init_from else cfg.model
    heads = f"{mcfg.n_head} heads" + (f" ({mcfg.kv_heads} key-value)" if mcfg.kv_heads != mcfg.n_head else "")
    shape = f"{mcfg.n_layer} layers, {heads}, width {mcfg.n_embd}, context {mcfg.block_size}, {mcfg.mlp} MLP, " \
        f"{mcfg.pos} positions" + (", RMSNorm" if mcfg.norm == "rmsnorm" else "")
    return f"{name}: {shape}" if name else shape


# ----------------------------------------------------------------------------------------------------------------------
# One optimizer step of a next-token or pair objective


def lm_step(cfg: StageArgs, built: Trainable, next_batch: Callable[[], tuple], grad_accum: int, guard: SpikeGuard,
            ctx: Context, objective: Any = None, label_smoothing: float = 0.0) -> Callable[[int], dict[str, Any]]:
    """engine.Run's step_fn, which returns the step's log record; `objective` (prefs.py's, on pairs: two sequences
    each, with a summary() of its last micro-batch) replaces the next-token loss."""
    dp = data_rank(cfg, ctx.rank, ctx.world)[1]  # the ranks that read other data
    tokens = grad_accum * cfg.batch_size * cfg.seq_len * dp * (2 if objective else 1)

    def step_fn(step: int) -> dict[str, Any]:
        lr = set_lr(built.optimizer, step, cfg)
        loss, norm = train_step(built.model, built.optimizer, next_batch, grad_accum, built.autocast, cfg.grad_clip,
                                label_smoothing, built.scaler, guard.for_step(), objective)
        # waits for the GPU, so the step's time is real
        loss_value, norm_value = (all_sum(loss, ctx.world) / ctx.world).item(), norm.item()
        guard.observe(loss_value, norm_value)
        return {"loss": loss_value, "lr": lr, "grad_norm": norm_value, "tokens": tokens,
                **(objective.summary(ctx.world) if objective else {}),
                **({"skipped": guard.skipped} if guard.skipped else {})}

    return step_fn


def val_evals(cfg: StageArgs, setup: Setup) -> list[Eval]:
    """The val split's mean loss (the next-token loss where targets are not -1) and bits per byte, if it has one."""
    if setup.val_loader is None:
        return []
    built, ctx = setup.built, setup.ctx
    windows = val_windows(cfg, setup.val_loader, ctx.master)
    nbytes = token_bytes(setup.raw.config.vocab_size, ctx.device)

    def val(step: int) -> dict[str, Any]:
        vl = engine.val_metrics(built.model, setup.val_loader, windows, built.autocast, setup.data.world, nbytes)
        setup.log.say(f"step {step:6d} | val loss {vl['loss']:.4f} | bpb {vl['bpb']:.4f}")
        return {"val_loss": vl["loss"], "val_bpb": vl["bpb"]}

    return [Eval("val", cfg.eval_every, val)]


def task_evals(cfg: TaskEvalArgs, setup: Setup) -> list[Eval]:
    """--task's held-out greedy accuracy, the replies generated by generate.py from the uncompiled module. A rank that
    cannot load the task (a node without its file), or loads other problems, stops every rank."""
    if not cfg.task:
        return []
    evaluation, problems = same_verdict(lambda: task_eval(cfg, setup), setup.ctx.world)
    engine.agree_fingerprint(lambda: {"--task data": digest(problems)}, setup.ctx.rank, setup.ctx.world)
    return [evaluation]


def task_eval(cfg: TaskEvalArgs, setup: Setup) -> tuple[Eval, list[list[dict]]]:
    """One task's accuracy, or several tasks' and their ChatCORE, nanochat's mean accuracy above chance, each scored as
    tasks.py --eval scores it (tasks.accuracy, on tasks.held_out's --task-limit problems). The prompts are checked
    against --seq-len now, not at the first task eval (after the whole training, --task-every 0)."""
    ctx, autocast = setup.ctx, setup.built.autocast
    named = tasks.named_tasks(cfg.task, "test", cfg.task_limit)
    if len(named) > 1 or tasks.parse_spec(cfg.task.strip())[1]:  # one task from a local copy: scored as a list
        kind = "chatcore"

        def score(step: int) -> dict[str, Any]:
            result = tasks.chat_core(setup.raw, named, ctx.rank, ctx.world, autocast)
            accuracies = " | ".join(f"{name} {acc:.4f}" for name, acc in result["results"].items())
            setup.log.say(f"step {step:6d} | ChatCORE {result['chatcore']:.4f} | {accuracies}")
            return result
    else:
        kind, ((task, problems),) = "task", named.values()
        named = {cfg.task: (task, problems)}  # check_prompts names the task as given, its path too

        def score(step: int) -> dict[str, Any]:
            result = tasks.accuracy(setup.raw, task, problems, ctx.rank, ctx.world, autocast)
            setup.log.say(f"step {step:6d} | {cfg.task} accuracy {result['acc']:.4f} ({result['n']} held-out problems)")
            return result

    tasks.check_prompts(named, cfg.seq_len, "--task", f"--seq-len {cfg.seq_len} or more (the model's context): raise "
                        "--seq-len where the model allows (not past --init-from's context, nor on a resume), or "
                        "score another task")
    return Eval(kind, cfg.task_every, score), [problems for _, problems in named.values()]


def val_windows(cfg: StageArgs, loader: Any, master: bool) -> int:
    """Val windows of B*T tokens per evaluation, all ranks together: --eval-tokens rounded up, at most the split."""
    BT = loader.B * loader.T
    windows = min(-(-cfg.eval_tokens // BT), loader.num_windows)  # more would score some windows twice
    if windows * BT != cfg.eval_tokens and master:
        print(f"val: each evaluation scores {windows * BT:,} tokens ({windows} x B*T = {BT:,}), not --eval-tokens "
              f"{cfg.eval_tokens:,}: whole windows, at most the val split's")
    return windows


# ----------------------------------------------------------------------------------------------------------------------
# Setup: everything the loop needs, in one engine.Run


class Setup:
    """A stage's run under construction, in the order every stage needs. Each check one rank could fail alone is
    shared first, so every rank stops with the reason instead of leaving the others waiting in a collective.

        setup = Setup(cfg, ctx, loader)  # the RNG, the data, the checkpoint to resume, the model on the CPU
        setup.build()                    # the shared checks, the model on its device, the optimizer, resume, log
        return setup.run(step_fn, evals) # the engine.Run
    """

    def __init__(self, cfg: StageArgs, ctx: Context, loader: Callable[[str, Context], Any], chat: bool = False,
                 vocab: int = 0):
        self.ctx, self.prov = ctx, provenance(ctx.device, ctx.world)
        # loader(split, data): data's rank and world are the data-parallel ones (a --tp/--pp group reads one batch)
        dp_rank, dp = data_rank(cfg, ctx.rank, ctx.world)
        self.data = dataclasses.replace(ctx, rank=dp_rank, world=dp)
        self.train_loader, self.val_loader = same_verdict(
            lambda: (loader("train", self.data) if not cfg.eval_only else None,
                     loader("val", self.data) if cfg.eval_every or cfg.eval_only else None),
            ctx.world, error=DataError, catch=(DataError, OSError))  # a node without the data stops all
        self.next_batch = self.train_loader.next_batch if self.train_loader is not None else None
        self.checkpointer = Checkpointer(cfg, ctx.rank, ctx.world, self.prov, chat=chat)
        self.found = self.checkpointer.find()  # first: a resumed fine-tune needs no --init-from source
        self.cfg = cfg = engine.resumed_start(cfg, self.found, ctx)  # a resume without --init-from: its run's start
        self.raw = build_model(cfg, self.found, ctx, vocab)

    def build(self, fingerprint: Callable[[], dict[str, Any]] = dict, parts: dict[str, Any] | None = None) -> None:
        """`fingerprint` makes what else every rank must share (train.py's HellaSwag examples), called only where
        ranks compare; `parts`: the stage's own checkpointed parts (prefs.py's DPO reference)."""
        cfg, ctx = self.cfg, self.ctx
        loaders = [loader for loader in (self.train_loader, self.val_loader) if loader is not None]
        source = f"--resume {self.found[0]}" if self.found else f"--init-from {cfg.init_from}" if cfg.init_from \
            else "--seed"  # what every rank must share, once; the model's config as built (an --init-from's options)
        engine.agree_fingerprint(lambda: {"command": command(cfg), "data": engine.shards_of(loaders),
                                          "model": self.raw.config, "weights": engine.weights_digest(self.raw) if
                                          self.found is None else None, **fingerprint()},  # a resume's: find's
                                 ctx.rank, ctx.world, source)
        self.cfg, self.grad_accum = check_run(cfg, ctx, self.raw.config, self.data.world)
        self.raw = self.raw.to(ctx.device)
        for loader in loaders:
            loader.check_vocab(self.raw.config.vocab_size)
        torch.manual_seed(cfg.seed + ctx.rank)  # every device's generator; ranks see other data, so other dropout
        if ctx.master:  # the full config and provenance are log.jsonl's first record
            print(f"model: {describe_model(cfg, self.raw.config)}\nprovenance: {describe_provenance(self.prov)}")
        self.guard = SpikeGuard(cfg.skip_loss_z, cfg.skip_norm_z, ctx.world)
        self.parts = {"loader": self.train_loader, "outliers": self.guard, **(parts or {})}
        self.built, self.start = build_and_resume(self.raw, self.parts, self.cfg, ctx, self.checkpointer, self.found)
        self.raw = self.built.shards or self.raw  # under --tp/--pp: this rank's part, which checkpoints and evaluates
        if ctx.master:
            print_header(self, max((getattr(loader, "sides", 1) for loader in loaders), default=1))
        self.log = engine.open_log(self.cfg, self.raw, self.built, ctx, self.checkpointer, self.found, self.start)

    def run(self, step_fn: Callable[[int], dict[str, Any]], evals: list[Eval]) -> Run:
        peak = self.cfg.peak_tflops
        return Run(cfg=self.cfg, ctx=self.ctx, step_fn=step_fn, raw=self.raw, trainable=self.built,
                   checkpointer=self.checkpointer, log=self.log, evals=evals, parts=self.parts, start_step=self.start,
                   resumed=self.found is not None, flops_per_token=self.raw.flops_per_token(self.cfg.seq_len),
                   peak_flops=peak * 1e12 if peak else None)


def command(cfg: StageArgs) -> dict[str, str]:
    """The command every node must run: the config, with the model as its flags resolve it."""
    resolved = dataclasses.asdict(model_config(cfg))
    return {**engine.command_of(cfg), **{k: repr(v) for k, v in resolved.items() if k != "block_size"}}


def digest(obj: Any) -> str:
    """A digest of JSON-able data (HellaSwag's examples) for the fingerprint; others by their repr, less any address
    (a task's row holding a function: each process its own)."""
    stable = lambda o: re.sub(r" at 0x[0-9a-fA-F]+", "", repr(o))
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=stable).encode()).hexdigest()


def use_compile(cfg: RunArgs, device: torch.device) -> bool:
    """--compile; by default on CUDA but for a one-off evaluation, where compiling would take longer than it saves,
    and for --tp/--pp shards, which run eager."""
    return cfg.compile if cfg.compile is not None else device.type == "cuda" and not (cfg.eval_only or cfg.tp or cfg.pp)


def check_run(cfg: StageArgs, ctx: Context, model: GPTConfig, dp: int) -> tuple[StageArgs, int]:
    """Refuse what cannot run on `dp` data-parallel ranks: (cfg, gradient accumulation steps)."""
    B, T, world, device = cfg.batch_size, cfg.seq_len, ctx.world, ctx.device
    if cfg.eval_only:  # nothing trains, so no total batch to fill
        cfg = dataclasses.replace(cfg, total_batch_size=B * T * dp)
    if cfg.total_batch_size % (B * T * dp):
        # e.g. more ranks than a preset was sized for (the demo's on 2 CPU ranks): name a micro-batch that fits
        fits = next((b for b in range(B - 1, 0, -1) if cfg.total_batch_size % (b * T * dp) == 0), None)
        raise ValueError(f"--total-batch-size {cfg.total_batch_size} is not divisible by batch_size * seq_len * "
                         f"world_size = {B} * {T} * {dp} = {B * T * dp}; pass "
                         f"{f'--batch-size {fits}' if fits else 'another --batch-size'} or another --total-batch-size")
    grad_accum, compiled = cfg.total_batch_size // (B * T * dp), use_compile(cfg, device)
    problems = [attention_conflict(cfg, device, model), optimizer_conflict(cfg),
                compiled and cuda_graph_conflict(cfg, grad_accum, device)]
    if why := shared_problem(next((p for p in problems if p), None), world):  # a node may lack torchao
        raise ValueError(why)
    return cfg, grad_accum


def print_header(setup: Setup, sides: int) -> None:
    """`sides`: the sequences in one of the loader's items (a preference pair's two). What --dtype, --compile and
    --attention came to is built.resolved(), as log.jsonl's config record has it."""
    cfg, raw, built, ctx, accum = setup.cfg, setup.raw, setup.built, setup.ctx, setup.grad_accum
    B, T, mcfg, dp, came = cfg.batch_size, cfg.seq_len, raw.config, setup.data.world, built.resolved()
    rows = f"{B} x {T}" if sides == 1 else f"{sides} x {B} pairs x {T}"
    tp, pp = degrees(cfg)  # --tp/--pp's mesh, or else the data-parallel wrapper (ddp, zero1, fsdp; single: no torchrun)
    layout = f"pp{pp} x dp{dp} x tp{tp}" if cfg.tp or cfg.pp else optimizer_kind(built.optimizer, cfg.parallel)
    if cfg.eval_only:
        print(f"{raw.num_params():,} params | evaluating at step {setup.start} | {rows} x {dp} ranks | attention "
              f"{came['attention']} | {came['dtype']}")
        return
    print(f"{raw.num_params():,} params | {sides * accum * B * T * dp:,} tokens/step = {rows} x {dp} ranks x "
          f"{accum} accum | {cfg.max_steps} steps | compile {came['compile']} | attention {came['attention']} | "
          f"{layout} | {came['dtype']}")
    kernel = f"runs the PyTorch reference on {ctx.device.type}: the Triton kernel is CUDA only"
    notes = [(mcfg.fused_gelu and ctx.device.type != "cuda", f"--fused-gelu {kernel}"),
             (mcfg.fused_ce and ctx.device.type != "cuda", f"--fused-ce {kernel}"),
             (mcfg.half_residual and built.dtype == torch.float32,
              "--half-residual does nothing in fp32: the residual stream is 16-bit only under --dtype bf16"),
             (cfg.compile_mode != "default" and not came["compile"],
              f"--compile-mode {cfg.compile_mode} does nothing: the model is not compiled (--compile true)")]
    for note in (note for due, note in notes if due):
        print(f"note: {note}")


# ----------------------------------------------------------------------------------------------------------------------
# Resume: the refusals before anything is built, the restore and its notes


@dataclass
class Reference:
    """A frozen reference's weights digest (RL's KL anchor, DPO's), a checkpointed part: the reference is --init-from
    loaded again on resume, so another --init-from would move it. `tie`: how the run depends on it, for the error."""

    digest: str
    init_from: str
    tie: str
    config: dict[str, Any] | None = None  # DPO's GPTConfig as built: a resume builds it from --init-from and the flags

    def state_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "init_from": self.init_from, "config": self.config}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        was, now = state.get("config") or {}, self.config or {}  # an older checkpoint's (or RL's): the weights alone
        changed = [k for k in was if now.get(k, was[k]) != was[k]]  # a key the stage leaves out: unchanged
        fix = dict.fromkeys(f"--{flag(k)} {was[k]}" if k in RUN_OPTIONS else "the --init-from it was built from"
                            for k in changed)  # a run option's flag sets it over the file's, the architecture none
        check_flags([(state["digest"] == self.digest, f"the run resumed {self.tie} the weights of --init-from "
                      f"{state['init_from']}, not {self.init_from}'s: pass its --init-from, or start a new run"),
                     (not changed, f"the run resumed {self.tie} --init-from {state['init_from']} built with "
                      f"{', '.join(f'{k} {was[k]}' for k in changed)}, this run with "
                      f"{', '.join(f'{k} {now[k]}' for k in changed)}: pass {' and '.join(fix)}, or start a new run")])


def check_resume(found: tuple[Path, dict], cfg: RunArgs) -> None:
    """Refuse another stage's or --objective's checkpoint (its parts and heads differ: a reward model went on as DPO,
    an SFT model as RL), first: raising --max-steps is no way out; one past --max-steps (nothing would train) or of
    another optimizer's state; under --eval-only, a reward model scored as a policy, or a policy as one."""
    path, ckpt = found
    config = ckpt.get("train_config", {})
    saved, ours, rm = config.get("optimizer", "adamw"), engine.stage_of(dataclasses.asdict(cfg)), is_reward_model(ckpt)
    # --eval-only scores another stage's policy (train.py: an SFT model's val loss), a reward model as one
    check_flags([(engine.stage_of(config) == ours or cfg.eval_only and rm == (ours[0] == "reward"),
                  f"--resume {path} was written by another stage or --objective, which this run cannot "
                  f"{'score' if cfg.eval_only else 'continue'}: "
                  + ("it is a reward model (prefs.py --objective reward), not a policy: " + (
                      "score it with prefs.py --objective reward --eval-only" if cfg.eval_only else
                      "start a new run from the policy it was trained from") if rm  # load_init refuses --init-from it
                     else f"start a new run from its weights with --init-from {path}")),
                 (cfg.eval_only or int(ckpt["step"]) <= cfg.max_steps,
                  f"--resume {path} is at step {ckpt['step']}, past --max-steps {cfg.max_steps}; raise --max-steps "
                  "to train further, or score it with --eval-only"),
                 (cfg.eval_only or saved == cfg.optimizer,
                  f"--resume {path} holds --optimizer {saved}'s state, not {cfg.optimizer}'s: pass --optimizer "
                  f"{saved}, or start a new run from its weights with --init-from {path}")])


def build_and_resume(raw: GPT, parts: dict[str, Any], cfg: RunArgs, ctx: Context, checkpointer: Checkpointer,
                     found: tuple[Path, dict] | None) -> tuple[Trainable, int]:
    """The model on its device and its optimizer, and the checkpoint found restored into them and into `parts` (the
    stage's checkpointed parts; its scaler and token count join them) on every rank, or stop all: (built, the step)."""
    built = build_trainable(raw, cfg, ctx.device, use_compile(cfg, ctx.device), ctx.master and not cfg.eval_only)
    parts.update(scaler=built.scaler, tokens=TokenCount())
    if found is None:
        return built, 0
    raw, config = built.shards or raw, raw.config  # under --tp/--pp: this rank's part
    path, ckpt = found
    saved = ckpt.get("train_config", {})
    if "init_from" in saved:  # its checkpoints name the run's start, not this resume's --init-from (or none)
        checkpointer.args = dataclasses.replace(checkpointer.args, init_from=saved["init_from"])
    step = same_verdict(lambda: checkpointer.restore(ckpt, raw, built.optimizer, parts), ctx.world, catch=(ValueError,))
    if cfg.eval_only and (ref := parts.get("reference")) and ref.config and ckpt.get("reference"):  # DPO scores
        same_verdict(lambda: ref.load_state_dict(ckpt["reference"]), ctx.world, catch=(ValueError,))  # against it
    if ctx.master:
        print(f"resumed from {path} at step {step}")
        if (loader := parts.get("loader")) is not None and (note := loader.resume_note(ckpt["loader"])):
            print(f"note: {note}")
        note_new_schedule(saved, cfg, step)
        note_changed_flags({**ckpt.get("model_config", {}), **saved}, cfg, config)
    clip = ["--grad-clip"] * (saved.get("grad_clip", cfg.grad_clip) != cfg.grad_clip)
    if not cfg.eval_only and (changed := set_hyperparameters(built.optimizer, cfg) + clip) and ctx.master:
        print(f"note: {', '.join(changed)} differ from the checkpoint's run: this run's values apply from step {step}")
    del ckpt["model"], ckpt["optimizer"]  # copied into the model and optimizer: free the CPU copy
    return built, step


SCHEDULE = ("max_steps", "max_lr", "warmup_steps", "lr_schedule", "min_lr_frac", "decay_frac")  # the lr's flags


def note_new_schedule(saved: dict[str, Any], cfg: RunArgs, step: int) -> None:
    """Say so when the resumed run had another schedule (--max-steps, --lr-schedule...) that changes the lr."""
    old = dataclasses.replace(cfg, **{k: saved[k] for k in SCHEDULE if k in saved})
    changed = [k for k in SCHEDULE if getattr(old, k) != getattr(cfg, k)]
    steps = range(step, cfg.max_steps) if changed and not cfg.eval_only else ()  # the steps this run trains
    differs = next((s for s in steps if get_lr(s, old) != get_lr(s, cfg)), None)
    if differs is not None:
        had = " and ".join(f"--{flag(k)} {getattr(old, k)}" for k in changed)
        has = " and ".join(str(getattr(cfg, k)) for k in changed)
        print(f"note: the checkpoint's run had {had}, this run has {has}: from step {differs} the lr is "
              f"{get_lr(differs, cfg):.3g}, not that run's {get_lr(differs, old):.3g}")


def same_path(a: str, b: str) -> bool:
    """One file or HF name, however written (./a.pt, its absolute path, ~/a.pt)."""
    return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()


def note_changed_flags(saved: dict[str, Any], cfg: RunArgs, model: GPTConfig | None = None) -> None:
    """Name the flags a run changed since its checkpoint (--clip, --dropout...) but those the notes above cover (the
    lr's, the optimizer's, the data's), LOCAL ones (paths; --init-from apart) and any it lacks."""
    said = (*SCHEDULE, "weight_decay", "beta1", "beta2", "eps", "grad_clip", "batch_size", "shuffle")
    options = {k: repr(getattr(model, k)) for k in RUN_OPTIONS} if model else {}  # --dropout, --loss-chunk...
    now = {**engine.command_of(cfg), **options}
    changed = [f"--{flag(k)} {saved[k]!r} -> {v}" for k, v in now.items() if k in saved and k not in said
               and repr(saved[k]) != v]
    start, given = saved.get("init_from", cfg.init_from), cfg.init_from  # LOCAL, so not in `changed`
    if given and not (start and same_path(start, given)):  # not given on the command line: resumed_start took it
        print(f"note: the weights are the checkpoint's, whose run started from {start or 'a random init'}, not "
              f"--init-from {given}'s")
    if changed and not cfg.eval_only:
        print(f"note: flags changed since the checkpoint: {', '.join(changed)}")


# ----------------------------------------------------------------------------------------------------------------------
# Entry points: main's exits, once for every stage


def hold_out_dir(cfg: RunArgs, rank: int, world: int, stack: contextlib.ExitStack) -> None:
    """Rank 0 locks --out-dir until `stack` closes (--eval-only writes nothing there): a second run there stops at
    once instead of pruning this one's checkpoints. A problem on any rank (a missing logging package too) stops all."""
    out_dir = Path(cfg.out_dir)

    def hold() -> None:
        if rank == 0 and (missing := missing_package(cfg.tensorboard, cfg.wandb)):
            raise ValueError(missing)
        check_flags([(not out_dir.exists() or out_dir.is_dir(), f"--out-dir {out_dir} is a file, not a directory")])
        if rank == 0 and not cfg.eval_only:
            stack.enter_context(hold_lock(out_dir / ".train.lock", f"another run is writing to --out-dir "
                                          f"{out_dir}; let it finish, or pass another --out-dir (an --eval-only run "
                                          "may share it)", "make sure no other run writes there"))

    same_verdict(hold, world, reason=lambda e: str(e) if isinstance(e, ValueError) else
                 f"cannot write to --out-dir {out_dir} ({e.strerror}); pass a directory you can write to")


def main(config: type, argv: list[str] | None, presets: dict[str, Callable[[], Any]], setup: Callable[..., Run],
         doc: str | None) -> dict[str, Any]:
    """The command line (sys.argv[1:] by default) into run(); a user error is one line on stderr and exit code 1."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse_config(config, argv, presets, doc)
    except SystemExit as e:
        # under torchrun, a rank whose flags do not parse (one node's typo) joins the group as the default config would,
        # to hand its reason to the other ranks' first collective: they would wait for it until the timeout
        if e.code and not isinstance(e.code, int) and "RANK" in os.environ and not dist.is_initialized():
            world = setup_distributed(config().device, config().dist_timeout)[2]
            shared_problem(str(e.code).removeprefix("error: "), world)
            dist.destroy_process_group()
        raise
    if cfg.print_config:
        resolved = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "print_config"}
        model = {"model_config": dataclasses.asdict(model_config(cfg))} if isinstance(cfg, StageArgs) else {}
        print(json.dumps({**resolved, **model}, indent=1))
        return {}
    try:
        return run(cfg, setup, (Path(setup.__code__.co_filename).name, *argv))  # the script: not pytest's argv[0]
    except (DataError, ValueError, FileNotFoundError, IsADirectoryError) as e:  # rl.py --init-from DIR
        message = f"error: {e}"
    except torch.cuda.OutOfMemoryError as e:  # the usual first failure on a new GPU: say what to change
        keeps = "--total-batch-size" if isinstance(cfg, StageArgs) else "the batch: raise --grad-accum"  # prune.py's
        at = f"--rollout-batch {cfg.rollout_batch}: lower it or raise --minibatches" if hasattr(cfg, "rollout_batch") \
            else f"--batch-size {cfg.batch_size}: lower it (gradient accumulation keeps {keeps})"
        message = (f"error: out of GPU memory at {at}, or add --recompute mlp (every stage takes it); the README's "
                   "'Micro-batch by GPU memory' has starting points"
                   f"\n(torch: {(str(e) or ' ').splitlines()[0]})")
    except RuntimeError as e:  # gloo's raw traceback for a rank that never came (NCCL's watchdog aborts by itself)
        if not (dist.is_initialized() or "RANK" in os.environ) or "timed out" not in str(e).lower():
            raise
        message = (f"error: rank {os.environ.get('RANK', 0)} waited --dist-timeout {cfg.dist_timeout:g} min in a "
                   "collective for a rank that never came: check that every rank is alive and running (not killed, "
                   "stopped or stuck in I/O) and that the nodes reach each other, then --resume auto")
    sys.stderr.write(message + "\n")  # one write: under torchrun the ranks' lines would interleave
    raise SystemExit(1)


def run(cfg: RunArgs, setup: Callable[[Any, Context], Run], argv: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Train (or evaluate) as cfg says, from Python: errors stay exceptions. It joins the default process group, or
    creates it and destroys it at the end. Returns engine.train()'s result, the same on every rank. `argv`: the
    command that made cfg, for log.jsonl."""
    with own_process_group(), contextlib.ExitStack() as held:  # what the run holds goes when it ends, in reverse
        ctx = Context(*setup_distributed(cfg.device, cfg.dist_timeout), argv)
        held.callback(set_sdpa_switches, sdpa_switches())  # --attention's choice must not outlive the run either
        hold_out_dir(cfg, ctx.rank, ctx.world, held)  # the lock file closes, and the lock goes, when the run ends
        r = setup(cfg, ctx)
        with r.stop:  # its signal handlers live as long as the loop, and put the caller's back
            result = engine.train(r)
            if dist.is_initialized():
                dist.barrier()  # leave together: no rank tears its group down while another is in a collective
        return result


def exit_code(result: dict[str, Any]) -> int:
    """A diverged run must not look like success to a scheduler."""
    return 1 if result.get("stopped") == "nan" else 0
