"""Pretrain GPT-2: one process, or torchrun DDP / ZeRO-1 / FSDP2 on one or many nodes.

Usage:
    python fineweb.py --source stdlib && python train.py --preset tiny   # CPU, seconds
    torchrun --standalone --nproc_per_node=8 train.py --preset gpt2-124m
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 train.py --preset gpt2-124m
        --batch-size 32   # on each node (one line): 32 rows x 1,024 tokens x 16 GPUs fill its 524,288-token step
    python train.py --help                                          # every option, with its meaning
"""

# Read top to bottom: config and presets, the data, the evaluations (val loss, HellaSwag, samples), then setup and main.
# The loop is engine.py's, what every stage shares stage.py's, the optimizer step parallel.py's.
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Annotated, Any

import torch

import core
import hellaswag
import stage
from common import LOCAL, first_on_each_node, get_tokenizer, run_and_exit, same_verdict
from engine import Context, Eval, Run
from fineweb import SHUFFLES, TokenLoader
from generate import sample
from parallel import check_flags, flag
from stage import StageArgs, model_config  # noqa: F401  (model_config: train.model_config, the resolved model)


@dataclass
class TrainConfig(StageArgs):
    """Pretrain a GPT-2 with this project's training loop on token shards. Flags override the chosen --preset; every
    GPTConfig field (--n-layer, --mlp, --dropout...) is a flag too."""

    data: Annotated[str, LOCAL] = "data/edu_fineweb10B"  # token shards (fineweb.py, llm.c), or a dataset of that kind
    preload: Annotated[bool, LOCAL] = False  # load the whole dataset onto the device once (small datasets only)
    shuffle: str = "windows"  # each epoch: windows (shard order and each shard's windows, llm.c) or shards (order only)
    label_smoothing: float = 0.0  # cross-entropy label smoothing
    hellaswag_every: int = 250  # HellaSwag every N steps (and at the last step); 0 = never
    hellaswag: Annotated[str, LOCAL] = "auto"  # HellaSwag val jsonl: a path, 'auto' (cached download) or 'off'
    hellaswag_limit: int | None = None  # evaluate only the first N HellaSwag examples
    sample_every: int = 250  # print samples every N steps; 0 = never
    sample_tokens: int = 32  # new tokens per sample
    sample_prompt: str = "Hello, I'm a language model,"  # prompt for the in-training samples
    core_every: int = 0  # DCLM's CORE every N steps (and at the last step) with --core-bundle; 0 = the last step only
    core_bundle: Annotated[str, LOCAL] = ""  # CORE's eval bundle: a directory or a zip's URL (core.py); '' = no CORE
    overfit_batch: bool = False  # train on the first micro-batch only (each rank's own): the loss must go to ~0
    SHARDS = True  # not a flag: --tp/--pp train this stage's language model

    def __post_init__(self) -> None:
        super().__post_init__()
        lows = {"sample_tokens": 1, "hellaswag_every": 0, "sample_every": 0, "hellaswag_limit": 1, "core_every": 0}
        whole = {"--label-smoothing 0": self.label_smoothing, "--sample-every 0": self.sample_every,
                 "--hellaswag off": self.hellaswag != "off" and self.hellaswag_every,
                 "--core-bundle ''": self.core_bundle}  # each with the setting that turns it off
        sharded = [way for way, on in whole.items() if on and (self.tp or self.pp)]
        check_flags([(self.shuffle in SHUFFLES, f"--shuffle must be one of {', '.join(SHUFFLES)}; got "
                      f"{self.shuffle!r}"),
                     *((getattr(self, name) is None or getattr(self, name) >= low,  # a NaN fails it too
                        f"--{flag(name)} must be >= {low}; got {getattr(self, name)}") for name, low in lows.items()),
                     (0.0 <= self.label_smoothing < 1.0, f"--label-smoothing must be in [0, 1); got "
                      f"{self.label_smoothing}"),
                     (not self.arch.get("value_head"), "train.py trains no value head: drop --value-head true"),
                     (not sharded, f"{', '.join(way.split()[0] for way in sharded)}: not under --tp/--pp, which "
                      f"train and score the language model's loss only; pass {', '.join(sharded)}, or score a "
                      "checkpoint on one process")])


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    # build-nanogpt / llm.c GPT-2 124M on fineweb-edu 10B: 19073 steps of 2**19 tokens
    "gpt2-124m": partial(TrainConfig),
    "gpt2-350m": partial(TrainConfig, model="gpt2-medium", batch_size=32, max_lr=3e-4, out_dir="out/gpt2-350m"),
    "gpt2-774m": partial(TrainConfig, model="gpt2-large", batch_size=16, max_lr=2.5e-4, out_dir="out/gpt2-774m"),
    "gpt2-1558m": partial(TrainConfig, model="gpt2-xl", batch_size=8, max_lr=2e-4, out_dir="out/gpt2-1558m"),
    # gpt2-124m's recipe for its LLaMA-style twin: RoPE, SwiGLU, GQA, RMSNorm, no biases
    "llama-124m": partial(TrainConfig, model="llama-124m", out_dir="out/llama-124m"),
    # a 30M-param model (nanoGPT's 10.7M without the embedding) on Tiny Shakespeare (~300K tokens): minutes on a GPU
    "shakespeare": partial(TrainConfig, model="gpt2", arch={"n_layer": 6, "n_head": 6, "n_embd": 384, "dropout": 0.2},
                           seq_len=256, data="data/shakespeare", preload=True,
                           total_batch_size=16384, batch_size=64, max_lr=1e-3, warmup_steps=100, max_steps=2000,
                           # the val shard's 32K tokens hold one window of B*T+1 = 16,385 (windows do not overlap)
                           eval_every=250, eval_tokens=16384, hellaswag="off", sample_every=500,
                           sample_tokens=128, ckpt_every=1000, out_dir="out/shakespeare", sample_prompt="ROMEO:"),
    # nanoGPT's finetune_shakespeare: OpenAI's GPT-2 124M, about two epochs at a small constant lr; minutes on a GPU
    "shakespeare-ft": partial(TrainConfig, init_from="gpt2", data="data/shakespeare", total_batch_size=32768,
                              batch_size=8, max_lr=3e-5, lr_schedule="constant", warmup_steps=0, max_steps=20,
                              eval_every=5, eval_tokens=24576, hellaswag="off", sample_every=10, sample_tokens=128,
                              ckpt_every=0, out_dir="out/shakespeare-ft", sample_prompt="ROMEO:"),
    # the offline demo: a small model on the Python standard library's docstrings, minutes on 2 CPU cores; small
    # batches learn more per token here, and the chunked loss keeps the logits in malloc's heap (docs/benchmarks.md)
    "demo": partial(TrainConfig, model="tiny", arch={"loss_chunk": 128}, seq_len=128, data="data/stdlib_docs",
                    total_batch_size=512, batch_size=4, max_lr=3e-3, warmup_steps=40, max_steps=900, eval_every=150,
                    eval_tokens=8192, hellaswag="off", sample_every=0, sample_tokens=64, ckpt_every=0,
                    out_dir="out/demo", sample_prompt="Return the"),
    # seconds on CPU, for tests
    "tiny": partial(TrainConfig, model="tiny", seq_len=64, data="data/stdlib", total_batch_size=512, batch_size=4,
                    max_lr=1e-3, warmup_steps=2, max_steps=10, eval_every=5, eval_tokens=512, hellaswag="off",
                    sample_every=0, ckpt_every=0, out_dir="out/tiny", sample_prompt="def "),
}


# ----------------------------------------------------------------------------------------------------------------------
# Data: token shards and HellaSwag's examples (CORE's tasks: setup)


def batches(cfg: TrainConfig, setup: stage.Setup) -> Callable[[], tuple] | None:
    """The train batches; with --overfit-batch always the run's first batch, also after a resume."""
    if (loader := setup.train_loader) is None or not cfg.overfit_batch:
        return setup.next_batch
    position = loader.state_dict()
    loader.reset()
    fixed = loader.next_batch()
    loader.load_state_dict(position)
    return lambda: fixed


def load_hellaswag(cfg: TrainConfig, ctx: Context) -> list[dict] | None:
    """HellaSwag examples on every rank, or None on every rank (evaluate is collective, so all or none). The same
    collectives on every rank, whatever its flags say: the fingerprint then compares what each rank loaded."""
    wanted = cfg.hellaswag != "off" and (cfg.hellaswag_every > 0 or cfg.eval_only)
    path = Path(cfg.hellaswag) if cfg.hellaswag != "auto" else hellaswag.default_cache_dir() / "hellaswag_val.jsonl"

    def why(e: Exception) -> str:  # load_examples' own hint names hellaswag.py's flags, not train.py's
        return f"{path} is not a file" if not path.is_file() else str(e).splitlines()[0][:200]

    try:  # whatever fails (offline, a truncated response...), every rank skips it
        first_on_each_node(hellaswag.download if wanted and cfg.hellaswag == "auto" else lambda: None,
                           ctx.local_rank, ctx.world, catch=(Exception,),
                           reason=lambda e: f"could not download it: {e.__cause__ or e}")
        return same_verdict(lambda: hellaswag.load_examples(path) if wanted else None, ctx.world, reason=why)
    except ValueError as e:  # the reason of the rank that lacks them
        if wanted and cfg.eval_only and cfg.hellaswag != "auto":  # the score asked for is the one thing it does
            raise ValueError(f"--hellaswag {cfg.hellaswag}: {e}") from None
        if wanted and ctx.master:
            print(f"hellaswag: skipped ({e}); pass --hellaswag PATH to a local hellaswag_val.jsonl to enable it, "
                  "or --hellaswag off to silence this")
        return None


# ----------------------------------------------------------------------------------------------------------------------
# Evaluations: val loss and bpb, HellaSwag, CORE, samples (engine.Eval entries; a new one is an entry here and its flag)


def evaluations(cfg: TrainConfig, setup: stage.Setup, examples: list[dict] | None,
                core_tasks: list | None) -> list[Eval]:
    raw, built, log, ctx = setup.raw, setup.built, setup.log, setup.ctx
    enc = get_tokenizer() if (cfg.sample_every > 0 or examples) else None  # a broken install stops the run here
    evals = stage.val_evals(cfg, setup)
    if examples:
        def hellaswag_eval(step: int) -> dict[str, Any]:
            # the uncompiled module: HellaSwag's many sequence lengths would recompile the training forward
            hs = hellaswag.evaluate(raw, examples, ctx.device, ctx.rank, ctx.world, limit=cfg.hellaswag_limit,
                                    enc=enc, progress=True)
            log.say(f"step {step:6d} | hellaswag acc_norm {hs['acc_norm']:.4f} ({hs['n']} examples)")
            return hs

        evals.append(Eval("hellaswag", cfg.hellaswag_every, hellaswag_eval))
    if core_tasks:
        def core_eval(step: int) -> dict[str, Any]:
            scores = core.evaluate(raw, core_tasks, ctx.rank, ctx.world, built.autocast, say=lambda line: None)
            log.say(f"step {step:6d} | CORE {scores['core_metric']:.4f} ({len(core_tasks)} tasks, at most "
                    f"{core.TRAIN_ROWS} rows each)")
            return scores

        evals.append(Eval("core", cfg.core_every, core_eval, at_start=False))  # untrained weights: nanochat's too
    if cfg.sample_every > 0:
        def samples(step: int) -> dict[str, Any] | None:
            if not (ctx.master or cfg.parallel == "fsdp"):  # FSDP forwards are collective: every rank runs them
                return None
            # two samples from the uncompiled module; their own generator leaves the training RNG (and resume) alone
            idx = torch.tensor([enc.encode(cfg.sample_prompt)] * 2, device=ctx.device)
            gen = torch.Generator(device=ctx.device).manual_seed(cfg.seed + step)
            with built.autocast:
                out = sample(raw, idx, cfg.sample_tokens, temperature=1.0, top_k=50, generator=gen)
            texts = [enc.decode([t for t in row if t < enc.n_vocab]) for row in out.tolist()]
            for text in texts:
                log.say(f"sample: {text!r}")
            return {"texts": texts} if ctx.master else None

        evals.append(Eval("sample", cfg.sample_every, samples, at_start=False))
    return evals


# ----------------------------------------------------------------------------------------------------------------------
# Setup and entry points


def setup(cfg: TrainConfig, ctx: Context) -> Run:
    """The Run: token shards, the model (fresh, --init-from's or resumed), and its evaluations."""
    # a split's token shards for `data`'s rank among its data-parallel world (a --tp/--pp group reads one batch)
    loader = lambda split, data: TokenLoader(cfg.data, split, cfg.batch_size, cfg.seq_len, data.rank, data.world,
                                             cfg.seed, data.device, cfg.preload, cfg.shuffle)
    setup = stage.Setup(cfg, ctx, loader)
    examples = load_hellaswag(cfg, ctx)
    # CORE's tasks, nanochat's base_train subsample of each, on every rank (the bundle fetched once per node)
    load_core = lambda: core.load_tasks(core.fetch_bundle(cfg.core_bundle), core.TRAIN_ROWS)
    core_tasks = first_on_each_node(load_core, ctx.local_rank, ctx.world) if cfg.core_bundle else None
    setup.build(lambda: {"--hellaswag file": stage.digest(examples),
                         "--core-bundle": stage.digest(core_tasks and [dataclasses.asdict(t) for t in core_tasks])})
    step_fn = stage.lm_step(setup.cfg, setup.built, batches(cfg, setup), setup.grad_accum, setup.guard,
                            ctx, label_smoothing=cfg.label_smoothing)
    return setup.run(step_fn, evaluations(cfg, setup, examples, core_tasks))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """The command line (sys.argv[1:] by default) into run(); a user error is one line on stderr and exit code 1."""
    return stage.main(TrainConfig, argv, PRESETS, setup, __doc__)


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or evaluate) as cfg says, from Python: errors stay exceptions (stage.run)."""
    return stage.run(cfg, setup)


if __name__ == "__main__":
    run_and_exit(main, stage.exit_code)
