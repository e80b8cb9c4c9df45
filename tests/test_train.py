"""train.py: schedule, CLI, overfitting, exact resume, SIGTERM, atomic checkpoints, NaN stop, DDP/ZeRO-1/FSDP2."""

import contextlib
import copy
import dataclasses
import gc
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import engine
import parallel as par
import prune
import stage
import train
from common import _field_help, describe_provenance, iter_log, load_checkpoint, parse_config
from conftest import ROOT, children, graph_breaks, run_nodes, run_torchrun, run_train_runs, sdpa_named_and_run
from fineweb import DataError, FinewebConfig, TokenLoader, read_shard, write_shard
from model import GPT, GPTConfig


def tiny_args(data, out, *extra: str) -> list[str]:
    return ["--preset", "tiny", "--data", str(data), "--out-dir", str(out), *extra]


def v512_args(data, out, *extra: str) -> list[str]:
    """tiny_args for conftest's tokens_512."""
    return tiny_args(data, out, "--vocab-size=512", *extra)


# ----------------------------------------------------------------------------------------------------------------------
# config and schedule


def test_lr_schedule_values():
    cfg = train.TrainConfig(max_lr=1.0, min_lr_frac=0.1, warmup_steps=10, max_steps=110)
    assert engine.get_lr(0, cfg) == pytest.approx(0.1)  # warmup start: max_lr / warmup
    assert engine.get_lr(9, cfg) == pytest.approx(1.0)  # warmup end
    assert engine.get_lr(10, cfg) == pytest.approx(1.0)  # decay start
    assert engine.get_lr(60, cfg) == pytest.approx(0.55)  # middle of the cosine: halfway between max and min
    assert engine.get_lr(110, cfg) == pytest.approx(0.1)  # end
    assert engine.get_lr(109, cfg) == pytest.approx(0.1 + 0.45 * (1 + torch.cos(torch.tensor(torch.pi * 0.99))).item())
    zero_min = train.TrainConfig(max_lr=1.0, min_lr_frac=0.0, warmup_steps=0, max_steps=100)
    assert engine.get_lr(0, zero_min) == pytest.approx(1.0) and engine.get_lr(100, zero_min) == 0.0
    # at max_lr 1 a min_lr of min_lr_frac (not min_lr_frac * max_lr) would pass the checks above
    real = train.TrainConfig(max_lr=6e-4, min_lr_frac=0.1, warmup_steps=10, max_steps=110)
    assert [engine.get_lr(s, real) for s in (0, 60, 110, 200)] == pytest.approx([6e-5, 3.3e-4, 6e-5, 6e-5], rel=1e-9)


def test_lr_schedule_shapes():
    def lrs(schedule: str, **kw) -> list[float]:
        cfg = train.TrainConfig(max_lr=1.0, min_lr_frac=0.1, warmup_steps=10, max_steps=110, lr_schedule=schedule,
                                **kw)
        return [engine.get_lr(step, cfg) for step in (0, 9, 10, 60, 100, 109, 110)]

    assert lrs("linear") == pytest.approx([0.1, 1.0, 1.0, 0.55, 0.19, 0.109, 0.1])
    assert lrs("constant") == pytest.approx([0.1, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    # wsd: max_lr until the last 20% (22 of 110 steps), then linear to the min at max_steps
    assert lrs("wsd") == pytest.approx([0.1, 1.0, 1.0, 1.0, 1.0 - 12 / 22 * 0.9, 1.0 - 21 / 22 * 0.9, 0.1])
    assert lrs("wsd", decay_frac=1.0)[2:] == pytest.approx(lrs("linear")[2:])  # decaying from the warmup's end
    with pytest.raises(ValueError, match="--decay-frac must be in"):
        train.TrainConfig(decay_frac=0.0)
    # a fractional decay length is rounded to the nearest step: 22.4 -> 22 and 22.6 -> 23, so both decays start at 90
    for max_steps in (112, 113):
        cfg = train.TrainConfig(max_lr=1.0, min_lr_frac=0.1, warmup_steps=0, max_steps=max_steps, lr_schedule="wsd")
        assert engine.get_lr(90, cfg) == 1.0 and engine.get_lr(91, cfg) < 1.0, max_steps


def test_set_lr_sets_every_param_group():
    # AdamW's decayed and undecayed groups (and Muon's matrices beside AdamW's rest) all follow the schedule
    # set_lr reads param_groups alone (a real optimizer's first construction costs a second in a fresh process)
    optimizer = SimpleNamespace(param_groups=[{"lr": 5.0, "weight_decay": 0.1}, {"lr": 5.0, "weight_decay": 0.0}])
    cfg = train.TrainConfig(max_lr=1.0, min_lr_frac=0.1, warmup_steps=10, max_steps=110)
    assert engine.set_lr(optimizer, 4, cfg) == pytest.approx(0.5)
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([0.5, 0.5])


def test_gpt2_124m_preset_is_the_reference_recipe():
    cfg = train.PRESETS["gpt2-124m"]()
    assert (cfg.total_batch_size, cfg.batch_size, cfg.seq_len, cfg.max_lr) == (524288, 64, 1024, 6e-4)
    assert (cfg.max_steps, cfg.weight_decay, cfg.grad_clip, cfg.eval_every, cfg.ckpt_every) == (19073, 0.1, 1.0, 250,
                                                                                                5000)
    assert 700 <= cfg.warmup_steps <= 750
    mcfg = train.model_config(cfg)
    assert (mcfg.n_layer, mcfg.n_embd, mcfg.vocab_size, mcfg.block_size) == (12, 768, 50304, 1024)
    # build-nanogpt's AdamW(betas=(0.9, 0.95), eps=1e-8) and cosine decay to min_lr = max_lr * 0.1; no dropout
    assert (cfg.beta1, cfg.beta2, cfg.eps, cfg.min_lr_frac, cfg.lr_schedule, mcfg.dropout, cfg.label_smoothing) == \
        (0.9, 0.95, 1e-8, 0.1, "cosine", 0.0, 0.0)
    assert (mcfg.n_head, mcfg.kv_heads, mcfg.mlp, mcfg.pos, mcfg.bias) == (12, 12, "gelu", "learned", True)
    shakespeare = train.model_config(train.PRESETS["shakespeare"]())
    assert (shakespeare.n_layer, shakespeare.n_head, shakespeare.n_embd) == (6, 6, 384)
    # the larger presets train GPT-2's larger shapes (OpenAI's table), on the same 2**19-token batches
    for preset, shape in (("gpt2-350m", (24, 16, 1024)), ("gpt2-774m", (36, 20, 1280)), ("gpt2-1558m", (48, 25, 1600))):
        big = train.PRESETS[preset]()
        mbig = train.model_config(big)
        assert (mbig.n_layer, mbig.n_head, mbig.n_embd, mbig.block_size) == (*shape, 1024), preset
        assert big.total_batch_size == 524288 and big.out_dir == f"out/{preset}", preset


def test_llama_124m_preset_is_gpt2_124ms_recipe_with_the_llama_model():
    llama, gpt2 = train.PRESETS["llama-124m"](), train.PRESETS["gpt2-124m"]()
    assert dataclasses.replace(llama, model=None, out_dir=gpt2.out_dir) == gpt2 and llama.out_dir == "out/llama-124m"
    mcfg = train.model_config(llama)
    assert (mcfg.n_layer, mcfg.n_head, mcfg.n_embd, mcfg.kv_heads, mcfg.block_size) == (12, 12, 768, 4, 1024)
    assert (mcfg.mlp, mcfg.pos, mcfg.norm, mcfg.bias) == ("swiglu", "rope", "rmsnorm", False)
    # a flag still overrides the preset's choice, and --norm rmsnorm alone changes only the norm of GPT-2
    assert train.model_config(dataclasses.replace(llama, arch={"norm": "layernorm", "bias": True})).norm == "layernorm"
    rms = train.model_config(dataclasses.replace(gpt2, arch={"norm": "rmsnorm"}))
    assert (rms.norm, rms.mlp, rms.pos, rms.kv_heads, rms.bias) == ("rmsnorm", "gelu", "learned", 12, True)


def llama_args(data, out, *extra: str) -> list[str]:
    """The llama-124m preset at tiny CPU sizes: its RoPE, SwiGLU, RMSNorm and bias-free layers, GQA of 4 heads on 2."""
    return ["--preset", "llama-124m", "--data", str(data), "--out-dir", str(out), "--n-layer=2", "--n-head=4",
            "--n-embd=64", "--n-kv-head=2", "--seq-len=64", "--batch-size=4", "--total-batch-size=256",
            "--warmup-steps=2", "--max-lr=1e-2", "--eval-tokens=512", "--hellaswag=off", "--sample-every=0", *extra]


def test_llama_trains_and_resumes_bitwise(tokens_512, tmp_path, capsys):
    # the tokens are uniformly random below 512, so the loss can fall below ln(512) = 6.24 only on one batch learned
    # by heart (at 50,257 it fell from 10.8 to under 5; here from 6.24 to 2.8)
    common = ["--vocab-size=512", "--overfit-batch", "--max-steps=16", "--ckpt-every=8", "--eval-every=8",
              "--dropout=0.1"]
    full = train.main(llama_args(tokens_512, tmp_path / "full", *common))
    assert "model: llama-124m: 2 layers, 4 heads (2 key-value), width 64, context 64, swiglu MLP, rope positions, " \
        "RMSNorm\n" in capsys.readouterr().out
    losses = full["losses"]
    assert len(losses) == 16 and losses[0] > 6.0 and losses[-1] < 3.0, losses
    ckpt = load_checkpoint(tmp_path / "full" / "ckpt_000008.pt")
    assert {k: ckpt["model_config"][k] for k in ("mlp", "pos", "norm", "n_kv_head", "bias")} == \
        {"mlp": "swiglu", "pos": "rope", "norm": "rmsnorm", "n_kv_head": 2, "bias": False}
    assert [k for k in ckpt["model"] if k.endswith(".bias") or "wpe" in k] == []
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copy(tmp_path / "full" / "ckpt_000008.pt", resumed_dir)
    rest = train.main(llama_args(tokens_512, resumed_dir, *common, "--resume", "auto"))["losses"]
    assert rest == losses[8:]  # bitwise: float equality, no tolerance
    assert train.main(llama_args(tokens_512, resumed_dir, *common, "--resume", "auto", "--eval-only"))["val_loss"] \
        == full["val_loss"]


@pytest.mark.parametrize("argv, message", [
    (["--max-lrr=1"], "unknown option --max-lrr; did you mean --max-lr"),
    (["--presett", "tiny"], "unknown option --presett; did you mean --preset?"),
    # nanoGPT's and nanochat's names: --block-size was offered --vocab-size, --eval-interval the bool --eval-only
    (["--block-size=64"], "unknown option --block-size; did you mean --seq-len?"),
    (["--eval-interval=5"], "unknown option --eval-interval; did you mean --eval-every?"),
    (["--save-every=5"], "unknown option --save-every; did you mean --ckpt-every?"),  # nanochat's: was --keep-every
    # TRL's name for rl.py's --clip: train.py has no --clip to offer, so its own near name is
    (["--epsilon=1e-8"], r"unknown option --epsilon; did you mean --eps\?"),
    (["--parallel", "zero3"], "--parallel must be one of ddp, zero1, fsdp"),
    (["--batch-size=big"], "--batch-size expects int"),
    (["--preset", "gpt5"], "unknown --preset 'gpt5'"),
    (["--recompute=all"], "--recompute must be one of none, mlp, block"),
    (["--norm=batchnorm"], "--norm must be 'layernorm' or 'rmsnorm', got 'batchnorm'"),
    (["--lr-schedule=step"], "--lr-schedule must be one of cosine, linear, constant, wsd"),
    (["--shuffle=rows"], "--shuffle must be one of windows, shards"),
    (["--optimizer=sgd"], "--optimizer must be one of adamw, muon, adamw8bit"),
    (["--attention=sdpa"], "--attention must be one of auto, flash, cudnn, efficient, math"),
    (["--compile-mode=fast"], "--compile-mode must be one of default, max-autotune"),
    (["--log-every=0"], "--log-every must be >= 1"),
    (["--eval-tokens", "0"], "--eval-tokens must be >= 1"),
    (["--dist-timeout=0"], "--dist-timeout must be a positive number; got 0.0"),
    (["--label-smoothing=2"], r"--label-smoothing must be in \[0, 1\)"),
    (["--max-lr=-1"], "--max-lr must be a positive number"),
    (["--hellaswag-limit=0"], "--hellaswag-limit must be >= 1"),
    (["--skip-loss-z=-1"], "--skip-loss-z must be >= 0"),
    (["--ckpt-every=-1"], "--ckpt-every must be >= 0"),
    (["--max-steps=0"], "--max-steps must be >= 1"),
    (["--min-lr-frac=1.5"], r"--min-lr-frac must be in \[0, 1\]"),
    (["--grad-clip=-1"], "--grad-clip must be finite and >= 0"),
    (["--preset", "tiny", "--preset", "gpt2-124m"], "--preset given twice"),
    # NaN passes a plain `x < 0` check: every float field refuses it, and inf where it means nothing
    (["--max-lr=nan"], "--max-lr must be a positive number; got nan"),
    (["--min-lr-frac=nan"], r"--min-lr-frac must be in \[0, 1\]; got nan"),
    (["--grad-clip=nan"], "--grad-clip must be finite and >= 0; got nan"),
    (["--eps=nan"], "--eps must be finite and >= 0; got nan"),
    (["--dropout=nan"], r"--dropout must be in \[0, 1\), got nan"),
    (["--seed=99999999999999999999999"], r"--seed must be in \[0, 2\*\*63 - 2\*\*16\); got 99999999999999999999999"),
    (["--beta1=nan"], r"--beta1 must be in \[0, 1\); got nan"),
    (["--beta2=1"], r"--beta2 must be in \[0, 1\); got 1.0"),
    (["--weight-decay=inf"], "--weight-decay must be finite and >= 0; got inf"),
    (["--eps=inf"], "--eps must be finite and >= 0; got inf"),
])
def test_cli_rejects_bad_overrides(argv, message):
    with pytest.raises(SystemExit, match=message):
        parse_config(train.TrainConfig, argv, train.PRESETS)


def test_an_architecture_flag_adds_to_the_presets_architecture():
    # --dropout over the shakespeare preset changes that one GPTConfig field and keeps the preset's 6-layer shape
    cfg = parse_config(train.TrainConfig, ["--preset", "shakespeare", "--dropout=0.1", "--n-layer", "4"],
                       train.PRESETS)
    assert cfg.arch == {"n_layer": 4, "n_head": 6, "n_embd": 384, "dropout": 0.1}
    assert train.PRESETS["shakespeare"]().arch["dropout"] == 0.2  # the preset's own dict is not written to


def test_a_flag_given_twice_is_named_with_both_values_and_the_last_wins(capsys, monkeypatch):
    # a warning, not an error: a wrapper's defaults then the user's "$@" (scripts/gpu_suite.sh) repeat flags by design
    monkeypatch.delenv("RANK", raising=False)
    argv = ["--preset", "tiny", "--max-steps", "10", "--max_steps=20", "--fused-ce", "--fused-ce=false", "--seed=3",
            "--seed", "3", "--compile", "--compile=True"]  # the same value twice is no conflict
    cfg = parse_config(train.TrainConfig, argv, train.PRESETS)
    assert (cfg.max_steps, cfg.arch["fused_ce"], cfg.seed) == (20, False, 3)
    assert capsys.readouterr().err == ("warning: --max-steps given twice ('10', then '20'): the last one is used\n"
                                       "warning: --fused-ce given twice ('true', then 'false'): the last one is used\n")
    monkeypatch.setenv("RANK", "1")  # under torchrun, every rank parses the same command line: rank 0 says it
    assert parse_config(train.TrainConfig, ["--max-steps=1", "--max-steps=2"]).max_steps == 2
    assert capsys.readouterr().err == ""


def test_cli_subprocess_one_line_error_and_help():
    bad = subprocess.run([sys.executable, "train.py", "--grad-clp=2"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0
    assert bad.stderr.strip() == "error: unknown option --grad-clp; did you mean --grad-clip?"
    ok = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
    assert ok.returncode == 0
    assert "--total-batch-size" in ok.stdout and "tokens per optimizer step" in ok.stdout and "gpt2-124m" in ok.stdout
    # a field explained by the comment lines above it (no trailing one) gets them as its help, not an empty line
    assert re.search(r"\n--fused-ce +bool +default False +lm_head \+ loss fused: ", ok.stdout)
    assert _field_help(FinewebConfig)["source"].startswith("hub dataset, shakespeare, stdlib, stdlib-docs, or a local")


def test_print_config_prints_the_preset_with_the_flags_and_exits_without_touching_anything(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "--preset", "shakespeare", "--max-steps", "100",
                           "--dropout=0.1", "--print-config"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""
    printed = json.loads(proc.stdout)
    # every field but print_config, in --help's order, then the model's resolved shape
    assert list(printed) == [f.name for f in dataclasses.fields(train.TrainConfig) if f.name != "print_config"] + \
        ["model_config"]
    model = printed.pop("model_config")
    defaults = {k: v for k, v in dataclasses.asdict(train.TrainConfig()).items() if k != "print_config"}
    assert printed == {**defaults,  # the defaults, the preset's fields, then the flags
                       "model": "gpt2", "arch": {"n_layer": 6, "n_head": 6, "n_embd": 384, "dropout": 0.1},
                       "seq_len": 256, "data": "data/shakespeare", "preload": True, "total_batch_size": 16384,
                       "batch_size": 64, "max_lr": 1e-3, "warmup_steps": 100, "max_steps": 100, "eval_every": 250,
                       "eval_tokens": 16384, "hellaswag": "off", "sample_every": 500, "sample_tokens": 128,
                       "ckpt_every": 1000, "out_dir": "out/shakespeare", "sample_prompt": "ROMEO:"}
    assert "print_config" not in printed and printed["lr_schedule"] == "cosine"  # as the run itself would see it
    # the 30M model, not GPT-2 124M: the shape the preset and the flags resolve to
    assert (model["n_layer"], model["n_head"], model["n_embd"], model["block_size"], model["dropout"]) == \
        (6, 6, 384, 256, 0.1)
    assert list(tmp_path.iterdir()) == []  # no data read, no out dir made


def test_indivisible_batch_is_a_clear_error(token_data, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(tiny_args(token_data, tmp_path, "--total-batch-size", "1000"))
    assert capsys.readouterr().err == ("error: --total-batch-size 1000 is not divisible by batch_size * seq_len * "
                                       "world_size = 4 * 64 * 1 = 256; pass another --batch-size or another "
                                       "--total-batch-size\n")
    # the largest micro-batch below the one asked for that fills the step is named: 2048 = 16 * 32 * 4
    with pytest.raises(SystemExit):
        train.main(tiny_args(token_data, tmp_path, "--total-batch-size=2048", "--batch-size=24", "--seq-len=32"))
    assert "= 24 * 32 * 1 = 768; pass --batch-size 16 or another --total-batch-size" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------------------------------
# training behaviour


def test_run_from_python_raises_and_leaves_the_callers_process_group(tokens_512, tmp_path, monkeypatch):
    import torch.distributed as dist

    cfg = parse_config(train.TrainConfig, v512_args(tokens_512, tmp_path / "a", "--max-steps=2", "--eval-every=0"),
                       train.PRESETS)
    with pytest.raises(DataError, match="no train shards"):  # an exception, not the CLI's SystemExit
        train.run(parse_config(train.TrainConfig, tiny_args(tmp_path, tmp_path / "b"), train.PRESETS))
    # a script that made its own process group and then trains under torchrun's variables keeps its group
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        result = train.run(cfg)
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()
    assert result["step"] == 2 and len(result["losses"]) == 2 and result["losses"][0] > 6.0  # ~ln(512) = 6.24


def test_overfit_batch_drives_loss_near_zero(tokens_512, tmp_path):
    result = train.main(v512_args(tokens_512, tmp_path, "--overfit-batch", "--max-steps=50", "--max-lr=1e-2",
                                  "--warmup-steps=5", "--eval-every=0", "--total-batch-size=256"))
    losses = result["losses"]
    assert losses[0] > 6.0  # ~ln(512) = 6.24 at init
    assert losses[-1] < 0.1, losses[-10:]


def test_recompute_and_chunked_loss_give_the_same_losses(tokens_512, tmp_path, monkeypatch):
    # the same losses prove nothing if a flag never reached the model: what each run asked of the model is recorded
    import model as model_module
    asked: list = []
    real_recompute, real_loss = par.apply_recompute, model_module.lm_loss
    monkeypatch.setattr(par, "apply_recompute", lambda m, mode: asked.append(mode) or real_recompute(m, mode))
    monkeypatch.setattr(model_module, "lm_loss", lambda *a: asked.append(a[4:6]) or real_loss(*a))
    base = train.main(v512_args(tokens_512, tmp_path / "a", "--max-steps=3", "--eval-every=2"))
    assert set(asked) == {"none", (0, False)}
    for flag, want in (("--recompute=mlp", {"mlp", (0, False)}), ("--recompute=block", {"block", (0, False)}),
                       ("--loss-chunk=100", {"none", (100, False)}), ("--fused-ce", {"none", (0, True)})):
        asked.clear()
        again = train.main(v512_args(tokens_512, tmp_path / flag[2:], "--max-steps=3", "--eval-every=2", flag))
        assert set(asked) == want, flag
        assert again["losses"] == pytest.approx(base["losses"], abs=1e-5), flag
        assert again["val_loss"] == pytest.approx(base["val_loss"], abs=1e-5), flag


def test_recompute_keeps_fewer_activations_per_block_than_per_mlp_with_the_same_gradients():
    # the losses above cannot tell the modes apart (recompute changes no value): what they trade is the activations
    # autograd keeps for backward, counted here in bytes through the saved-tensor hooks
    def saved(mode: str) -> tuple[int, list[torch.Tensor]]:
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=16, vocab_size=128, n_layer=2, n_head=2, n_embd=32))
        par.apply_recompute(model, mode)
        x = torch.randint(0, 128, (2, 16))
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            loss = model(x, x)[1]
        loss.backward()
        return sum(kept), [p.grad for p in model.parameters()]

    (none, ref), (mlp, mlp_grads), (block, block_grads) = (saved(mode) for mode in ("none", "mlp", "block"))
    # per MLP, at least its hidden layer before and after the GELU (B*T*4C fp32 each) is no longer kept
    assert none - mlp >= 2 * 2 * (2 * 16 * 4 * 32 * 4)
    assert mlp > block  # a whole block recomputed keeps less than its MLP alone
    for grads in (mlp_grads, block_grads):
        for g, g_ref in zip(grads, ref, strict=True):
            torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=0)


def _small_gpt_and_batches(micro_steps: int) -> tuple[GPT, list[tuple[torch.Tensor, torch.Tensor]]]:
    """A GPT small enough for unit tests of one optimizer step (vocab 128, 2 layers of width 32), and its batches."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=128, n_layer=2, n_head=2, n_embd=32))
    batches = [(torch.randint(0, 128, (2, 16)), torch.randint(0, 128, (2, 16))) for _ in range(micro_steps)]
    return model, batches


def test_train_step_accumulates_the_mean_gradient_clips_and_skips():
    # against one backward of the mean loss over all 3 micro-batches: the loss and the (pre-clip) norm train_step
    # returns, and the update, which plain SGD at lr 1 makes the clipped gradient itself
    model, batches = _small_gpt_and_batches(3)
    ref = copy.deepcopy(model)
    loss = sum(ref(x, y, label_smoothing=0.1)[1] for x, y in batches) / len(batches)
    loss.backward()
    grads = [p.grad for p in ref.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    for clip in (0.0, norm / 4):  # 0: no clipping
        run = copy.deepcopy(model)
        got_loss, got_norm = par.train_step(run, torch.optim.SGD(run.parameters(), lr=1.0), iter(batches).__next__, 3,
                                              contextlib.nullcontext(), clip, label_smoothing=0.1)
        assert got_loss.item() == pytest.approx(loss.item(), abs=1e-6) and got_norm.item() == pytest.approx(norm,
                                                                                                         rel=1e-5)
        scale = clip / norm if clip else 1.0
        for before, after, grad in zip(model.parameters(), run.parameters(), grads, strict=True):
            torch.testing.assert_close(before.detach() - after.detach(), scale * grad, rtol=1e-4, atol=1e-7)
        assert all(p.grad is None for p in run.parameters())
    # an update the guard refuses: it saw the mean loss and the norm, nothing moved, and no gradient is left over
    run, seen = copy.deepcopy(model), []
    par.train_step(run, torch.optim.SGD(run.parameters(), lr=1.0), iter(batches).__next__, 3,
                     contextlib.nullcontext(), 1.0, label_smoothing=0.1,
                     update=lambda loss, norm: seen.append((loss.item(), norm.item())) or False)
    assert seen == [(pytest.approx(loss.item(), abs=1e-6), pytest.approx(norm, rel=1e-5))]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), run.state_dict().values(), strict=True))
    assert all(p.grad is None for p in run.parameters())


def test_train_step_in_fp16_clips_the_unscaled_gradient():
    # the GradScaler multiplies the loss by 2**12: the norm train_step clips and returns must be the true one
    model, batches = _small_gpt_and_batches(2)
    ref = copy.deepcopy(model)
    (sum(ref(x, y)[1] for x, y in batches) / len(batches)).backward()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in ref.parameters()])).item()
    run = copy.deepcopy(model)
    dtype, autocast = par.precision("fp16", torch.device("cpu"))
    assert dtype == torch.float16  # which is what makes train.py create a GradScaler
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
    _, got = par.train_step(run, torch.optim.SGD(run.parameters(), lr=1.0), iter(batches).__next__, 2, autocast,
                              norm / 2, scaler=scaler)
    assert got.item() == pytest.approx(norm, rel=1e-2)  # fp16 forward and backward: 1% for the rounding
    moved = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(a.detach() - b.detach())
                                                  for a, b in zip(model.parameters(), run.parameters(), strict=True)]))
    assert moved.item() == pytest.approx(norm / 2, rel=1e-2)  # clipped to half the true norm, then applied


def test_a_skipped_fp16_step_still_updates_the_scaler():
    # the GradScaler's update() after a step the guard refused too: without it the next step's unscale_() raises
    model, batches = _small_gpt_and_batches(2)
    _, autocast = par.precision("fp16", torch.device("cpu"))
    scaler, batch = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12), iter(batches)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    before = copy.deepcopy(model.state_dict())
    par.train_step(model, optimizer, batch.__next__, 1, autocast, 1.0, scaler=scaler, update=lambda loss, norm: False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    _, norm = par.train_step(model, optimizer, batch.__next__, 1, autocast, 1.0, scaler=scaler)
    assert math.isfinite(norm.item()) and not torch.equal(before["lm_head.weight"], model.lm_head.weight)


def test_ddp_reduces_gradients_only_on_the_last_micro_step():
    # no_sync on every micro-step but the last: one all-reduce per optimizer step, after all micro-batches are in
    # (a one-rank group: DDP still runs its reducer, whose calls a comm hook records)
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    raw, batches = _small_gpt_and_batches(3)
    served, reduced = [], []

    def next_batch():
        served.append(batches[len(served) % 3])
        return served[-1]

    def hook(state, bucket):
        reduced.append(len(served))  # micro-batches served when this bucket is reduced
        return allreduce_hook(None, bucket)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = DDP(raw)
        model.register_comm_hook(None, hook)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            par.train_step(model, optimizer, next_batch, 3, contextlib.nullcontext(), 1.0)
        # DDP's reducer holds the group: freed only after destroy_process_group, its gloo group's destructor once
        # hung the suite joining its worker thread, so it goes while the group is alive (as bench's ddp rows do)
        del model, optimizer
        gc.collect()
    finally:
        dist.destroy_process_group()
    buckets = len(reduced) // 2  # each all-reduce of a step's gradient buckets, after its 3rd micro-batch
    assert buckets >= 1 and reduced == [3] * buckets + [6] * buckets


def test_no_compile_mode_note_when_the_mode_was_left_at_its_default(tokens_512, tmp_path, capsys):
    # on the CPU nothing compiles, and the default mode is no choice of the user's to warn about
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=1", "--eval-every=0"))
    out = capsys.readouterr().out
    assert "| compile False |" in out and "--compile-mode" not in out
    # --eval-every 0 reads no val split, so not even the last step is scored: its --help says so
    assert "val loss" not in out and _field_help(train.TrainConfig)["eval_every"].endswith("0 = never (no val split "
                                                                                       "is read)")


def test_attention_flag_picks_the_sdpa_kernel(tokens_512, tmp_path, capsys):
    q = torch.randn(1, 2, 8, 4)
    kernels = {"math": "aten::_scaled_dot_product_attention_math",
               "flash": "aten::_scaled_dot_product_flash_attention_for_cpu"}
    try:
        for name, op in kernels.items():
            par.select_attention(name)
            with torch.profiler.profile() as prof:
                torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            assert op in {e.name for e in prof.events()}, name
        before = par.sdpa_switches()  # flash alone, from the loop above
        with torch.profiler.profile() as prof:  # the run's own choice is the kernel its steps run
            math_run = train.main(v512_args(tokens_512, tmp_path / "math", "--max-steps=3", "--eval-every=0",
                                            "--attention=math"))["losses"]
        ran = {e.name for e in prof.events()}
        assert kernels["math"] in ran and kernels["flash"] not in ran
        assert par.sdpa_switches() == before  # the run's choice does not outlive it in the caller's process
    finally:
        par.select_attention("auto")
    auto_run = train.main(v512_args(tokens_512, tmp_path / "auto", "--max-steps=3", "--eval-every=0"))["losses"]
    assert math_run == pytest.approx(auto_run, abs=1e-5)  # another kernel, the same attention
    for name in ("efficient", "cudnn"):  # CUDA-only kernels: one line up front, not "no viable backend" mid-run
        with pytest.raises(SystemExit):
            train.main(v512_args(tokens_512, tmp_path / name, "--max-steps=1", f"--attention={name}"))
        assert f"--attention {name} has no CPU kernel" in capsys.readouterr().err
        assert all(par.sdpa_switches().values())


@pytest.mark.parametrize("attention, extra, kernel", [("auto", {}, "flash"), ("auto", {"dropout": 0.1}, "math"),
                                                      ("auto", {"n_kv_head": 2}, "flash"), ("math", {}, "math"),
                                                      ("auto", {"n_kv_head": 2, "dropout": 0.1}, "math")])
def test_the_resolved_attention_is_the_kernel_the_training_forward_runs(attention, extra, kernel):
    # what the header and log.jsonl say --attention came to, against the aten kernel the profiler sees run
    config = GPTConfig(block_size=32, vocab_size=64, n_layer=1, n_head=4, n_embd=32, **extra)
    named, ran = sdpa_named_and_run(attention, config, torch.device("cpu"), torch.float32)
    assert named == kernel
    assert ran == {"aten::_scaled_dot_product_flash_attention_for_cpu" if kernel == "flash" else
                   "aten::_scaled_dot_product_attention_math"}


def test_flash_attention_with_dropout_on_a_cpu_is_one_line_before_training(tokens_512, tmp_path, capsys):
    # CPU's flash kernel takes no dropout: "RuntimeError: No available kernel. Aborting execution." came as a traceback
    from conftest import one_line_error

    assert one_line_error(capsys, train.main, v512_args(tokens_512, tmp_path, "--dropout=0.1", "--attention=flash")) \
        == "error: --attention flash has no CPU kernel with dropout (0.1); use --attention auto or math, or --dropout 0"
    assert not (tmp_path / "log.jsonl").exists()


def test_the_resolved_compile_is_whether_the_model_was_compiled():
    # torch.compile wraps lazily (nothing compiles before a forward); the runs above are all eager, so a constant False
    # passed them
    config = GPTConfig(block_size=32, vocab_size=64, n_layer=1, n_head=4, n_embd=32)
    built = par.build_trainable(GPT(config), par.StepArgs(), torch.device("cpu"), use_compile=True, verbose=False)
    assert type(built.model).__name__ == "OptimizedModule"
    assert built.resolved() == {"dtype": "fp32", "compile": True, "attention": "flash"}


def test_log_jsonl_and_provenance(token_data, tmp_path, capsys, monkeypatch):
    hellaswag = ROOT / "tests" / "data" / "hellaswag_tiny.jsonl"
    digested = []  # HellaSwag's examples were digested on one process, for a fingerprint no rank compares
    monkeypatch.setattr(stage, "digest", digested.append)
    train.main(tiny_args(token_data, tmp_path, "--max-steps=4", "--eval-every=2", "--label-smoothing=0.1",
                         "--parallel=zero1", "--fused-gelu", "--fused-ce", "--half-residual",
                         f"--hellaswag={hellaswag}", "--hellaswag-every=3", "--compile-mode=reduce-overhead"))
    out = capsys.readouterr().out
    # a human header; the full config and provenance are log.jsonl's first record only
    lines = out.splitlines()
    assert lines[0] == "model: tiny: 2 layers, 4 heads, width 64, context 64, gelu MLP, learned positions"
    assert lines[1] == f"provenance: {describe_provenance(next(iter_log(tmp_path / 'log.jsonl'))['provenance'])}"
    assert f", torch {torch.__version__}, " in lines[1] and lines[1].endswith(f", cpu ({os.cpu_count()} cores), 1 rank")
    assert not any(line.startswith("{") for line in lines)
    # without torchrun nothing is wrapped or sharded, whatever --parallel says; and the kernel needs CUDA
    assert "| compile False | attention flash | single | fp32" in out
    assert "note: --fused-gelu runs the PyTorch reference on cpu: the Triton kernel is CUDA only" in out
    assert "note: --fused-ce runs the PyTorch reference on cpu: the Triton kernel is CUDA only" in out
    assert "note: --half-residual does nothing in fp32: the residual stream is 16-bit only under --dtype bf16" in out
    assert "note: --compile-mode reduce-overhead does nothing: the model is not compiled (--compile true)" in out
    records = list(iter_log(tmp_path / "log.jsonl"))
    assert records[0]["type"] == "config" and records[0]["provenance"]["torch"] == torch.__version__
    assert records[0]["config"]["label_smoothing"] == 0.1
    assert [r["step"] for r in records if r["type"] == "train"] == [0, 1, 2, 3]
    assert [r["step"] for r in records if r["type"] == "val"] == [0, 2, 4]  # 4: the final weights
    assert [(r["step"], r["n"]) for r in records if r["type"] == "hellaswag"] == [(0, 6), (3, 6), (4, 6)]
    assert digested == []
    first = next(r for r in records if r["type"] == "train")
    assert set(first) >= {"loss", "lr", "grad_norm", "ms", "tok_s", "mfu", "tokens"}
    assert first["tokens"] == 512
    # the first loss is the seeded initial model's own on the loader's first 2 micro-batches (the accumulation),
    # label smoothing included: without it the loss is 1e-3 higher, 100 times the tolerance
    cfg = parse_config(train.TrainConfig, tiny_args(token_data, tmp_path, "--max-steps=4", "--label-smoothing=0.1"),
                       train.PRESETS)
    torch.manual_seed(cfg.seed)
    init = GPT(train.model_config(cfg))
    loader = TokenLoader(str(token_data), "train", cfg.batch_size, cfg.seq_len, 0, 1, cfg.seed, torch.device("cpu"))
    with torch.no_grad():
        ref = sum(init(*loader.next_batch(), label_smoothing=0.1)[1].item() for _ in range(2)) / 2
    assert first["loss"] == pytest.approx(ref, abs=1e-5)
    # each step's lr is the schedule's, and it reached every param group (the no-decay one too)
    assert [r["lr"] for r in records if r["type"] == "train"] == [engine.get_lr(step, cfg) for step in range(4)]
    ckpt = load_checkpoint(tmp_path / "ckpt_000004.pt")
    assert [group["lr"] for group in ckpt["optimizer"]["param_groups"]] == [engine.get_lr(3, cfg)] * 2
    assert ckpt["provenance"]["world_size"] == 1 and ckpt["train_config"]["max_steps"] == 4
    assert not any(k.startswith("_orig_mod") for k in ckpt["model"])


@pytest.mark.parametrize("attention", ["auto", "flash"])
def test_an_evaluation_names_the_kernel_its_forward_runs_without_dropout(tokens_512, tmp_path, capsys, attention):
    # --eval-only's forward is in eval mode, without dropout, so CPU's flash kernel runs: the header said math, and
    # --attention flash stopped with "RuntimeError: No available kernel" before evaluating (the training probe's)
    train.main(v512_args(tokens_512, tmp_path, "--eval-only", "--dropout=0.1", f"--attention={attention}"))
    header = next(line for line in capsys.readouterr().out.splitlines() if "| evaluating at step 0 |" in line)
    assert header.endswith("| 4 x 64 x 1 ranks | attention flash | fp32")


def test_the_logs_first_record_says_what_ran_as_the_console_did(tokens_512, tmp_path, capsys):
    """Runs compared from their log.jsonl alone: the config record held --dtype auto, --compile None and --attention
    auto as given, not what they came to, nor the command or the CPU threads (CPU losses move 1e-6 with them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        # CPU's flash kernel takes no dropout: torch picks math
        for name, extra, kernel in (("flash", (), "flash"), ("math", ("--dropout=0.1",), "math")):
            argv = v512_args(tokens_512, tmp_path / name, "--max-steps=1", "--eval-every=0", *extra)
            train.main(argv)
            header = next(line for line in capsys.readouterr().out.splitlines() if " tokens/step = " in line)
            record = next(iter_log(tmp_path / name / "log.jsonl"))
            assert record["argv"] == ["train.py", *argv]  # the stage, though pytest's is sys.argv[0]
            assert (record["config"]["dtype"], record["config"]["compile"], record["config"]["attention"]) == (
                "auto", None, "auto")
            assert record["resolved"] == {"dtype": "fp32", "compile": False, "attention": kernel}
            assert header.endswith(f"| 1 steps | compile False | attention {kernel} | single | fp32")
            assert record["provenance"]["torch_threads"] == 1
    finally:
        torch.set_num_threads(threads)
    # a resume's record says its own command and threads
    train.main(resumed := v512_args(tokens_512, tmp_path / "math", "--max-steps=2", "--eval-every=0", "--dropout=0.1",
                                    "--resume=auto"))
    records = [r for r in iter_log(tmp_path / "math" / "log.jsonl") if r["type"] == "config"]
    assert [r["argv"] for r in records] == [["train.py", *argv], ["train.py", *resumed]]
    assert records[1]["provenance"]["torch_threads"] == threads


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_resume_is_bitwise_exact(tokens_512, tmp_path, dtype):
    # dropout on, so the restored RNG matters as well as weights, optimizer moments and the data position; fp16 adds
    # the GradScaler, whose state (its scale, and the count of finite steps toward the next growth of the scale) must
    # be restored, not restarted
    # (CPU fp16 matmuls are slow: that run is shorter, on smaller batches, and skips evaluation)
    steps, at = (8, 3) if dtype == "fp32" else (4, 2)
    common = [f"--max-steps={steps}", f"--ckpt-every={at}", "--keep-last=5", "--dropout=0.1", f"--dtype={dtype}",
              *(["--eval-every=4"] if dtype == "fp32" else
                ["--eval-every=0", "--seq-len=32", "--batch-size=2", "--total-batch-size=64"])]
    full = train.main(v512_args(tokens_512, tmp_path / "full", *common))["losses"]
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copy(tmp_path / "full" / f"ckpt_{at:06d}.pt", resumed_dir)
    rest = train.main(v512_args(tokens_512, resumed_dir, *common, "--resume", "auto"))["losses"]
    assert len(full) == steps and len(rest) == steps - at
    assert rest == full[at:]  # bitwise: float equality, no tolerance
    scalers = [load_checkpoint(d / f"ckpt_{steps:06d}.pt")["scaler"] for d in (tmp_path / "full", resumed_dir)]
    assert scalers[0] == scalers[1] and (scalers[0] is None) == (dtype == "fp32")
    if dtype == "fp16":
        assert scalers[0]["_growth_tracker"] == steps  # every step finite, counted across the resume


# ----------------------------------------------------------------------------------------------------------------------
# optimizers: Muon (with AdamW) and torchao's 8-bit AdamW

needs_muon = pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is new in torch 2.9")
BLOCK_MATRICES = {f"transformer.h.{i}.{name}.weight" for i in range(2)
                  for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}


@needs_muon
@pytest.mark.parametrize("arch", [{}, {"mlp": "swiglu", "pos": "rope", "bias": False, "n_kv_head": 2}])
def test_muon_takes_the_block_matrices_and_adamw_the_rest(arch, capsys):
    cfg = train.TrainConfig(model="tiny", seq_len=32, optimizer="muon", weight_decay=0.0, max_lr=1e-2, arch=arch)
    torch.manual_seed(0)
    raw = GPT(train.model_config(cfg))
    optimizer = par.build_optimizer(raw, cfg, torch.device("cpu"), verbose=True)
    names = {id(p): name for name, p in raw.named_parameters()}
    groups = [(g["muon"], g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in optimizer.param_groups]
    embeddings = {"transformer.wte.weight"} | ({"transformer.wpe.weight"} if not arch else set())
    assert [(muon, wd) for muon, wd, _ in groups] == [(True, 0.0), (False, 0.0), (False, 0.0)]
    assert groups[0][2] == BLOCK_MATRICES and groups[1][2] == embeddings  # the tied lm_head is wte: once, in AdamW
    assert groups[2][2] == {n for n, p in raw.named_parameters() if p.dim() == 1}  # biases and norms
    assert len(groups[2][2]) == (18 if not arch else 5)
    assert raw.lm_head.weight is raw.transformer.wte.weight
    out = capsys.readouterr().out
    assert "optimizer: Muon for 8 block matrices (" in out and f"AdamW for {len(embeddings)} embedding tensors" in out
    # one step at the loop's lr moves every parameter: Muon's matrices by about 0.2 x lr RMS (match_rms_adamw's
    # scale; torch's "original" one would give ~0.04-0.08 here), AdamW's first step by about lr
    before = {name: p.detach().clone() for name, p in raw.named_parameters()}
    for group in optimizer.param_groups:
        group["lr"] = 1e-2
    x, y = torch.randint(0, 50257, (2, 2, 32))
    par.train_step(raw, optimizer, lambda: (x, y), 1, contextlib.nullcontext(), 1.0)
    rms = {name: (p.detach() - before[name]).pow(2).mean().sqrt().item() / 1e-2 for name, p in raw.named_parameters()}
    assert all(0.1 < rms[name] < 0.3 for name in BLOCK_MATRICES), rms
    assert all(0.5 < r <= 1.01 for name, r in rms.items() if name not in BLOCK_MATRICES), rms
    # Muon's momentum for the matrices, Adam's moments for the rest: one state, shared with the inner optimizers
    params = dict(raw.named_parameters())
    assert {name for name in params if "momentum_buffer" in optimizer.state[params[name]]} == BLOCK_MATRICES
    assert {name for name in params if "exp_avg" in optimizer.state[params[name]]} == set(params) - BLOCK_MATRICES
    assert optimizer.muon.state is optimizer.adamw.state is optimizer.state
    assert par.optimizer_state_bytes(optimizer) == sum(
        (1 if name in BLOCK_MATRICES else 2) * p.numel() * 4 + (0 if name in BLOCK_MATRICES else 4)
        for name, p in params.items())  # fp32 momentum; fp32 moments and a 0-d fp32 step


@pytest.mark.parametrize("parallel", ["ddp", "zero1"])
@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("muon", marks=needs_muon), "adamw8bit"])
def test_every_optimizer_decays_the_2d_tensors_only_and_takes_the_betas_and_eps_given(optimizer, parallel):
    # the unit tests of Muon's groups run at --weight-decay 0 and the default betas: a group built with another decay,
    # or AdamW built without --beta1/--beta2, passed them. ZeRO-1 (a one-rank group) wraps the same groups, Muon's
    # without AdamW's defaults (its eps is its own)
    if optimizer == "adamw8bit":
        pytest.importorskip("torchao", reason="--optimizer adamw8bit needs torchao")
    from torch.distributed.optim import ZeroRedundancyOptimizer

    raw, _ = _small_gpt_and_batches(0)
    args = par.StepArgs(optimizer=optimizer, weight_decay=0.05, beta1=0.8, beta2=0.99, eps=1e-6, device="cpu",
                        parallel=parallel)
    with one_rank_group() if parallel == "zero1" else contextlib.nullcontext():
        wrapped = par.build_optimizer(raw, args, torch.device("cpu"), verbose=False)
        assert isinstance(wrapped, ZeroRedundancyOptimizer) == (parallel == "zero1")
        built = getattr(wrapped, "optim", wrapped)  # ZeRO-1's: this rank's share, here every parameter
    names = {id(p): name for name, p in raw.named_parameters()}
    decay = {wd: {names[id(p)] for g in built.param_groups if g["weight_decay"] == wd for p in g["params"]}
             for wd in (0.05, 0.0)}
    assert decay == {0.05: {n for n, p in raw.named_parameters() if p.dim() == 2},
                     0.0: {n for n, p in raw.named_parameters() if p.dim() == 1}}
    assert sum(len(g["params"]) for g in built.param_groups) == len(names)
    for group in built.param_groups:
        if group.get("muon"):  # Muon's own momentum, Nesterov's form
            assert (group["momentum"], group["nesterov"], group["adjust_lr_fn"], group["eps"]) == (
                0.95, True, "match_rms_adamw", 1e-7)
        else:
            assert (tuple(group["betas"]), group["eps"]) == ((0.8, 0.99), 1e-6)


def test_a_new_optimizers_builder_reads_its_own_flag_from_the_args(monkeypatch):
    # a user's SGD entry and its --momentum (beta1 here): the builder reads it from the args, not from options that
    # build_optimizer would have to fill, and AdamW's class would then be given too
    def sgd(model, args, options, verbose):
        return par.adamw_groups(model, args, options, verbose)[0], torch.optim.SGD, {"lr": 1.0, "momentum": args.beta1}

    monkeypatch.setitem(par.OPTIMIZERS, "sgd", (sgd, lambda parallel: None))
    args = par.StepArgs(optimizer="sgd", beta1=0.8, weight_decay=0.05, device="cpu")
    built = par.build_optimizer(_small_gpt_and_batches(0)[0], args, torch.device("cpu"), verbose=False)
    assert [(g["momentum"], g["weight_decay"]) for g in built.param_groups] == [(0.8, 0.05), (0.8, 0.0)]


def test_a_resume_gives_the_optimizer_this_runs_options_not_the_checkpoints():
    # a user's optimizer option (SGD's momentum from a new --momentum flag) changed on resume: load_state_dict brings
    # back the checkpoint's group values, which this run's must replace, as its --beta1 and --eps do
    p = torch.nn.Parameter(torch.zeros(2, 2))
    saved = torch.optim.SGD([p], lr=0.1, momentum=0.9).state_dict()
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.5, nesterov=True)
    optimizer.load_state_dict(saved)
    par.set_hyperparameters(optimizer, par.StepArgs())
    assert (optimizer.param_groups[0]["momentum"], optimizer.param_groups[0]["nesterov"]) == (0.5, True)


@pytest.mark.parametrize("optimizer, parallel, saved_on, resumed_on", [
    ("adamw", "ddp", "cpu", "cuda"), ("adamw", "ddp", "cuda", "cpu"), ("adamw", "zero1", "cpu", "cuda"),
    pytest.param("muon", "ddp", "cpu", "cuda", marks=needs_muon)])
def test_a_resume_on_another_device_runs_this_runs_adamw_kernel_under_fp16(optimizer, parallel, saved_on, resumed_on):
    # build_optimizer picks fused AdamW for a CUDA device; its device argument stands for the run's here (torch's
    # fused AdamW runs on CPU too). A CPU run's checkpoint resumed on CUDA under --dtype fp16 kept the saved
    # fused=False, and GradScaler handed that non-fused step the found_inf meant for the fused kernel built (Muon's
    # AdamW groups, and ZeRO-1's (a one-rank group here), only ran the checkpoint's kernel: neither hands on found_inf)
    cfg = train.TrainConfig(model="tiny", arch={"vocab_size": 512}, seq_len=16, device="cpu", optimizer=optimizer,
                            parallel=parallel)
    _, autocast = par.precision("fp16", torch.device("cpu"))
    torch.manual_seed(0)
    batches = [(torch.randint(0, 512, (2, 16)), torch.randint(0, 512, (2, 16))) for _ in range(2)]

    def stepped(device: str, ckpt: dict | None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = GPT(train.model_config(cfg))
        optimizer = par.build_optimizer(model, cfg, torch.device(device), verbose=False)
        if ckpt:
            engine.Checkpointer(cfg).restore(copy.deepcopy(ckpt), model, optimizer, {})  # as read from its file
        par.train_step(model, optimizer, iter(batches[1:] if ckpt else batches[:1]).__next__, 1, autocast, 1.0,
                       scaler=torch.amp.GradScaler("cpu"))
        return model, optimizer

    with one_rank_group() if parallel == "zero1" else contextlib.nullcontext():
        model_sd, optim_sd = engine.state_dicts(*stepped(saved_on, None))
        kind = "zero1" if parallel == "zero1" else "single"
        ckpt = {"model": model_sd, "optimizer": optim_sd, "optimizer_kind": kind, "step": 1,
                "rng": [engine.rng_state()], "scaler": None}
        same, _ = stepped(saved_on, ckpt)  # the run that never changed kernel
        moved, resumed = stepped(resumed_on, ckpt)
    resumed = getattr(resumed, "optim", resumed)  # ZeRO-1's own share
    assert [g.get("fused") for g in resumed.param_groups] == [None] * (optimizer == "muon") + [
        resumed_on == "cuda"] * 2
    assert {(s["step"].item(), s["step"].dtype, s["step"].device.type) for s in resumed.state.values()
            if "step" in s} == {(2.0, torch.float32, "cpu")}
    # fused AdamW and the CPU's per-tensor loop (torch's foreach kernels are CUDA's) round differently: 3.7e-9 apart
    # after one step at lr 6e-4
    diff = max((a - b).abs().max().item() for a, b in zip(same.parameters(), moved.parameters(), strict=True))
    assert diff <= 1e-6, diff


@pytest.mark.parametrize("optimizer, dtype", [pytest.param("muon", "fp16", marks=needs_muon), ("adamw8bit", "fp32")])
@torch.compiler.set_stance("force_eager")  # torchao's 8-bit step, compiled per shape: 55 s of CI's 65 (the same state)
def test_muon_and_8bit_adamw_resume_bitwise_exact(tokens_512, tmp_path, optimizer, dtype):
    if optimizer == "adamw8bit":
        pytest.importorskip("torchao", reason="--optimizer adamw8bit needs torchao")
    # as test_resume_is_bitwise_exact: Muon's momentum and AdamW's moments (8-bit ones: their codes and scales)
    # come back exactly; Muon's under fp16, the GradScaler's in front of MuonAdamW (fp32 is the same path without)
    steps, at = (6, 3) if dtype == "fp32" else (4, 2)  # CPU fp16 matmuls are slow
    small = ["--seq-len=32", "--batch-size=2", "--total-batch-size=128"]
    common = [f"--max-steps={steps}", f"--ckpt-every={at}", "--keep-last=5", "--dropout=0.1", "--eval-every=0",
              f"--optimizer={optimizer}", f"--dtype={dtype}", *small]
    full = train.main(v512_args(tokens_512, tmp_path / "full", *common))["losses"]
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copy(tmp_path / "full" / f"ckpt_{at:06d}.pt", resumed_dir)
    rest = train.main(v512_args(tokens_512, resumed_dir, *common, "--resume", "auto"))["losses"]
    assert len(full) == steps and rest == full[at:]  # bitwise
    ckpt = load_checkpoint(tmp_path / "full" / f"ckpt_{steps:06d}.pt")
    assert ckpt["train_config"]["optimizer"] == optimizer
    state = ckpt["optimizer"]["state"]["transformer.h.0.mlp.c_fc.weight"]
    if optimizer == "muon":
        assert set(state) == {"momentum_buffer"} and set(ckpt["optimizer"]["state"]["transformer.wte.weight"]) == \
            {"step", "exp_avg", "exp_avg_sq"}
        return
    # the 8-bit moments are stored as their plain tensors: 1 byte per element, one fp32 scale per 256, the code table
    codes, scale, qmap = (state["exp_avg"][k] for k in ("codes", "scale", "qmap"))
    assert (codes.dtype, codes.shape, scale.numel(), qmap.numel()) == (torch.uint8, (256, 64), 64, 256)
    assert state["exp_avg"]["signed"] and not state["exp_avg_sq"]["signed"]
    assert all(type(t) is torch.Tensor for s in ckpt["optimizer"]["state"].values() for v in s.values()
               for t in (v.values() if isinstance(v, dict) else [v]) if torch.is_tensor(t))
    # so a run without the 8-bit optimizer starts from its weights, and an evaluation scores it
    final = tmp_path / "full" / f"ckpt_{steps:06d}.pt"
    tuned = train.main(v512_args(tokens_512, tmp_path / "ft", "--max-steps=1", "--eval-every=0", *small,
                                 f"--init-from={final}"))
    assert len(tuned["losses"]) == 1 and math.isfinite(tuned["losses"][0])
    scored = train.main(v512_args(tokens_512, tmp_path / "eval", "--eval-only", "--seq-len=32", "--eval-tokens=128",
                                  f"--resume={final}"))
    assert scored["step"] == 6 and math.isfinite(scored["val_loss"])


@needs_muon
def test_optimizer_refusals_are_one_line_before_anything_runs(tokens_512, tmp_path, capsys, monkeypatch):
    def refused(*extra: str, out: Path = tmp_path / "r") -> str:
        log = out / "log.jsonl"
        before = log.read_text() if log.exists() else None
        with pytest.raises(SystemExit):
            train.main(v512_args(tokens_512, out, "--eval-every=0", *extra))
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and (log.read_text() if log.exists() else None) == before  # nothing ran
        return err.removeprefix("error: ").strip()

    assert refused("--optimizer=muon", "--parallel=fsdp") == (
        "--optimizer muon orthogonalizes whole matrices, which --parallel fsdp shards across ranks; use --parallel "
        "zero1 (each matrix whole on one rank) or ddp")
    assert refused("--optimizer=adamw8bit", "--parallel=fsdp").startswith(
        "--optimizer adamw8bit does not support --parallel fsdp here")
    # a checkpoint's optimizer state is its optimizer's: another --optimizer cannot take it over
    train.main(v512_args(tokens_512, tmp_path / "r", "--max-steps=2", "--eval-every=0", "--optimizer=muon"))
    ckpt = tmp_path / "r" / "ckpt_000002.pt"
    assert refused("--max-steps=4", "--resume=auto") == (
        f"--resume {ckpt} holds --optimizer muon's state, not adamw's: pass --optimizer muon, or start a new run from "
        f"its weights with --init-from {ckpt}")
    # a torch before 2.9, and no torchao
    monkeypatch.delattr(torch.optim, "Muon")
    assert refused("--optimizer=muon", out=tmp_path / "old") == (
        f"--optimizer muon needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}")
    monkeypatch.setitem(sys.modules, "torchao", None)  # what `import torchao` meets when it is not installed
    assert refused("--optimizer=adamw8bit", out=tmp_path / "old") == (
        "--optimizer adamw8bit needs torchao: pip install torchao")


def test_the_optimizer_comparison_reads_equal_steps_and_equal_time_from_the_logs(tmp_path, capsys, monkeypatch):
    # scripts/compare_optimizers.py on finished runs' logs (it trains nothing then): AdamW at 1 s a step, Muon at 2 s
    # with a better curve; at AdamW's 4 s of training Muon is at step 2, its val loss read there
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import compare_optimizers as compare
    prov = {"device": "cpu (2 cores)", "torch": torch.__version__, "git_sha": "abc"}
    for opt, ms, vals in (("adamw", 1000.0, (10.0, 8.0, 6.0)), ("muon", 2000.0, (10.0, 7.0, 5.0))):
        for seed, shift in ((1, 0.0), (2, 0.1)):
            (tmp_path / f"{opt}_s{seed}").mkdir()
            records = [{"type": "config", "step": 0, "provenance": prov}]
            records += [{"type": "val", "step": 2 * i, "val_loss": v + shift} for i, v in enumerate(vals)]
            records += [{"type": "train", "step": step, "loss": 9.0, "ms": ms} for step in range(4)]
            (tmp_path / f"{opt}_s{seed}" / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = compare.main(["--out", str(tmp_path), "--seeds", "1,2", "--steps", "4", "--eval-every", "2"])
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[1] == "| adamw | 1000 | 4 | 6.0000 | 6.1000 | 6.0500 | 6.0000 | 6.1000 | 6.0500 |"
    assert rows[2] == "| muon | 2000 | 8 | 5.0000 | 5.1000 | 5.0500 | 7.0000 | 7.1000 | 7.0500 |"
    assert rows[4:] == ["| 0 | 10.0500 | 10.0500 | +0.0000 |", "| 2 | 8.0500 | 7.0500 | -1.0000 |",
                        "| 4 | 6.0500 | 5.0500 | -1.0000 |"]
    assert compare.at_time([(0, 0.0, 10.0), (2, 4.0, 7.0)], 1.0) == 9.25 and "running" not in capsys.readouterr().out


def _hf_loss(hf_dir, data, split: str, batches: int, B: int, T: int) -> float:
    """transformers' GPT-2 loss on the first batches a one-rank TokenLoader serves (what train.py evaluates)."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    loader = TokenLoader(str(data), split, B, T, 0, 1, 1337, torch.device("cpu"))
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten()).item()
                  for x, y in (loader.next_batch() for _ in range(batches))]
    return sum(losses) / batches


def ft_args(data, hf_dir, out, *extra: str) -> list[str]:
    """The fine-tuning preset, shrunk to the tiny HF model (context 64, cut to 32) and CPU sizes."""
    return ["--preset", "shakespeare-ft", "--data", str(data), "--init-from", str(hf_dir), "--out-dir", str(out),
            "--seq-len=32", "--batch-size=2", "--total-batch-size=128", "--eval-tokens=128", "--sample-tokens=4",
            *extra]


def test_init_from_hf_fine_tunes_and_its_checkpoint_evaluates(token_data, hf_dir, tmp_path, capsys):
    cfg = parse_config(train.TrainConfig, ["--preset", "shakespeare-ft"], train.PRESETS)
    assert (cfg.init_from, cfg.lr_schedule, cfg.max_lr, cfg.seq_len) == ("gpt2", "constant", 3e-5, 1024)
    run = train.main(ft_args(token_data, hf_dir, tmp_path / "ft", "--max-steps=3", "--eval-every=3",
                             "--sample-every=3", "--ckpt-every=3"))
    assert "sample: " in capsys.readouterr().out
    # the first loss is the HF model's own on the first train batch: every weight arrived, the position table cut
    assert run["losses"][0] == pytest.approx(_hf_loss(hf_dir, token_data, "train", 2, 2, 32), abs=1e-5)
    records = list(iter_log(tmp_path / "ft" / "log.jsonl"))
    assert [r["lr"] for r in records if r["type"] == "train"] == [3e-5] * 3  # constant, no warmup
    ckpt = load_checkpoint(tmp_path / "ft" / "ckpt_000003.pt")
    assert {k: ckpt["model_config"][k] for k in ("n_embd", "n_layer", "vocab_size", "block_size")} == \
        {"n_embd": 32, "n_layer": 2, "vocab_size": 50257, "block_size": 32}
    assert tuple(ckpt["model"]["transformer.wpe.weight"].shape) == (32, 32)

    # --eval-only from the HF weights: the HF model's val loss, and out_dir untouched
    before = train.main(ft_args(token_data, hf_dir, tmp_path / "ev", "--eval-only"))
    assert before["losses"] == [] and not (tmp_path / "ev").exists()
    assert before["val_loss"] == pytest.approx(_hf_loss(hf_dir, token_data, "val", 2, 2, 32), abs=1e-5)
    # --init-from a train.py checkpoint: its weights, scored as the run scored them after its last step
    after = train.main(ft_args(token_data, hf_dir, tmp_path / "ev2", "--eval-only",
                               "--init-from", str(tmp_path / "ft" / "ckpt_000003.pt")))
    assert after["val_loss"] == pytest.approx(run["val_loss"], abs=1e-6)
    assert abs(after["val_loss"] - before["val_loss"]) > 1e-4  # the fine-tuned weights, not the HF ones


def test_eval_only_beside_a_live_run_leaves_its_files_alone(token_data, hf_dir, tmp_path):
    run = tmp_path / "run"
    train.main(ft_args(token_data, hf_dir, run, "--max-steps=2", "--eval-every=0", "--ckpt-every=1"))
    (run / "ckpt_000003.pt.tmp").write_bytes(b"PK\x03\x04 a checkpoint being written")  # the live run's next one
    before = {f.name: f.read_bytes() for f in run.iterdir()}
    result = train.main(ft_args(token_data, hf_dir, run, "--eval-only", "--resume=auto", "--profile"))
    assert result["step"] == 2 and result["losses"] == [] and result["val_loss"] > 5.0  # the step-2 weights, scored
    assert {f.name: f.read_bytes() for f in run.iterdir()} == before
    # past --max-steps, eval-only still scores the checkpoint instead of silently doing nothing
    assert train.main(ft_args(token_data, hf_dir, run, "--eval-only", "--resume=auto", "--max-steps=1"))["val_loss"] \
        == pytest.approx(result["val_loss"], abs=1e-6)
    # without --resume, the run's own out-dir is no fresh run's to refuse: an evaluation writes nothing there
    scored = train.main(ft_args(token_data, hf_dir, run, "--eval-only", "--init-from", str(run / "ckpt_000002.pt")))
    assert scored["val_loss"] == pytest.approx(result["val_loss"], abs=1e-6)
    assert {f.name: f.read_bytes() for f in run.iterdir()} == before


def test_resume_takes_the_architecture_from_the_checkpoint(token_data, tmp_path, capsys):
    run = tmp_path / "run"
    trained = train.main(tiny_args(token_data, run, "--max-steps=2", "--eval-every=2"))
    tiny = train.PRESETS["tiny"]()

    def eval_only(*extra: str) -> dict:  # no preset: every flag the tiny run's evaluation needs, but no shape
        return train.main(["--data", str(token_data), "--out-dir", str(tmp_path / "eval"), "--eval-only",
                           f"--resume={run / 'ckpt_000002.pt'}", f"--batch-size={tiny.batch_size}", "--device=cpu",
                           f"--eval-tokens={tiny.eval_tokens}", "--hellaswag=off", *extra])

    # the tiny shape comes from the checkpoint, as nanoGPT's resume takes it, and scores what the run scored
    assert eval_only(f"--seq-len={tiny.seq_len}")["val_loss"] == pytest.approx(trained["val_loss"], abs=1e-6)
    # a flag or preset that says otherwise is one line naming the conflict, not a traceback of size mismatches
    for extra, message in (([f"--seq-len={tiny.seq_len}", "--model=gpt2"],
                            r"fixes the architecture, but this run asks for --model gpt2 \(n_layer 12"),
                           ([f"--seq-len={tiny.seq_len}", "--n-head=2"], r"asks for --n-head 2 \(it has"),
                           # a vocabulary given as a flag too: it was taken from the checkpoint without a word
                           ([f"--seq-len={tiny.seq_len}", "--vocab-size=50432"],
                            r"asks for --vocab-size 50432 \(it has 50304\): pass --vocab-size 50304 as it has"),
                           (["--seq-len=32"], rf"--seq-len 32 is not the context of --resume .*, {tiny.seq_len} ")):
        capsys.readouterr()
        with pytest.raises(SystemExit):
            eval_only(*extra)
        assert re.search(message, capsys.readouterr().err), extra
    # the run options are this run's, not the checkpoint's: dropout turned on for the rest of the run, say
    train.main(tiny_args(token_data, run, "--max-steps=3", "--eval-every=0", "--dropout=0.2", "--loss-chunk=32",
                         "--resume=auto"))
    resumed = load_checkpoint(run / "ckpt_000003.pt")["model_config"]
    assert (resumed["dropout"], resumed["loss_chunk"], resumed["n_layer"]) == (0.2, 32, 2)
    # a checkpoint of another version of the model is one line too
    ckpt = torch.load(run / "ckpt_000002.pt", weights_only=True)
    ckpt["model_config"]["qk_norm"] = True
    torch.save(ckpt, run / "ckpt_000003.pt")
    with pytest.raises(SystemExit):
        eval_only(f"--seq-len={tiny.seq_len}", f"--resume={run / 'ckpt_000003.pt'}")
    assert "its model_config does not match this GPTConfig (" in capsys.readouterr().err


def test_eval_only_needs_only_the_val_split(token_data, hf_dir, tmp_path):
    val_only = tmp_path / "val_only"
    val_only.mkdir()
    shutil.copy(next(token_data.glob("*_val_*.bin")), val_only)
    scored = train.main(ft_args(val_only, hf_dir, tmp_path / "out", "--eval-only"))["val_loss"]
    assert scored == pytest.approx(_hf_loss(hf_dir, token_data, "val", 2, 2, 32), abs=1e-5)


def test_eval_only_refuses_a_hellaswag_file_it_cannot_read(token_data, hf_dir, tmp_path, capsys):
    # training skips it (a node may lack it); an evaluation asked to score it must not exit 0 without the score
    missing = tmp_path / "no.jsonl"
    with pytest.raises(SystemExit, match="1"):
        train.main(ft_args(token_data, hf_dir, tmp_path / "out", "--eval-only", f"--hellaswag={missing}"))
    assert capsys.readouterr().err == f"error: --hellaswag {missing}: {missing} is not a file\n"


def test_resumed_fine_tune_needs_no_init_source(token_data, hf_dir, tmp_path):
    full = train.main(ft_args(token_data, hf_dir, tmp_path, "--max-steps=4", "--eval-every=0", "--ckpt-every=2",
                              "--dropout=0.1"))["losses"]
    (tmp_path / "ckpt_000004.pt").unlink()
    gone = tmp_path / "hf_gone"  # an offline node without the HF weights resumes from the checkpoint alone
    rest = train.main(ft_args(token_data, gone, tmp_path, "--max-steps=4", "--eval-every=0", "--ckpt-every=2",
                              "--dropout=0.1", "--resume=auto"))["losses"]
    assert rest == full[2:]  # bitwise
    # its checkpoint names the run's start, not the resume's: a later resume with --init-from hf_dir said "started
    # from hf_gone" (or "from a random init" after a resume without --init-from)
    assert load_checkpoint(tmp_path / "ckpt_000004.pt")["train_config"]["init_from"] == str(hf_dir)


def test_a_resume_names_the_start_of_its_weights_when_init_from_names_another(capsys, monkeypatch, tmp_path):
    # --resume auto --init-from B over a run started from A (or from scratch) went on from the checkpoint in
    # silence, the header's model line naming B; the same --init-from again (a resumed fine-tune) says nothing
    cfg = train.TrainConfig(init_from="b.pt", resume="auto", eval_only=True)
    for start in ("", "a.pt", "b.pt"):
        stage.note_changed_flags({**dataclasses.asdict(cfg), "init_from": start}, cfg)
    assert capsys.readouterr().out == (
        "note: the weights are the checkpoint's, whose run started from a random init, not --init-from b.pt's\n"
        "note: the weights are the checkpoint's, whose run started from a.pt, not --init-from b.pt's\n")
    # the same file written otherwise: nothing to say
    monkeypatch.chdir(tmp_path)
    for given, start in (("./b.pt", str(tmp_path / "b.pt")), ("~/b.pt", str(Path("~/b.pt").expanduser()))):
        cfg = train.TrainConfig(init_from=given, resume="auto")
        stage.note_changed_flags({**dataclasses.asdict(cfg), "init_from": start}, cfg)
    assert capsys.readouterr().out == ""
    # prune.py's default --init-from on a resume whose command names none: the run's start, said once
    found = (tmp_path / "ckpt_000001.pt", {"train_config": {"init_from": "start.pt"}})
    cfg = engine.resumed_start(prune.PruneConfig(resume="auto"), found, engine.Context(argv=("prune.py", "--resume")))
    stage.note_changed_flags({**dataclasses.asdict(cfg), "init_from": "start.pt"}, cfg)
    assert cfg.init_from == "start.pt" and capsys.readouterr().out == (
        "note: --init-from start.pt, the resumed run's start (its checkpoint records it; none given here)\n")


def test_resume_notes_stay_silent_for_an_evaluation_and_an_older_checkpoints_missing_flags(capsys):
    # --eval-only trains nothing: another --max-steps changes no lr it uses; a checkpoint's config without the
    # schedule's keys (an older run's) is the same schedule, not a KeyError
    cfg = train.TrainConfig(max_steps=20, warmup_steps=2, eval_only=True)
    stage.note_new_schedule({**dataclasses.asdict(cfg), "max_steps": 10}, cfg, 5)
    stage.note_new_schedule({}, dataclasses.replace(cfg, eval_only=False), 5)
    saved = dataclasses.asdict(train.TrainConfig(init_from="a.pt"))
    del saved["init_from"]  # a checkpoint from before the key: its start unknown, so not named
    stage.note_changed_flags(saved, train.TrainConfig(init_from="a.pt"))
    assert capsys.readouterr().out == ""


def test_check_run_counts_the_micro_steps_over_the_data_parallel_ranks():
    # grad_accum = total / (B * T * dp); --eval-only makes the total one micro-step of every data-parallel rank
    cfg = train.TrainConfig(model="tiny", seq_len=32, batch_size=2, total_batch_size=2 * 32 * 4 * 3, compile=False)
    ctx = engine.Context()
    assert stage.check_run(cfg, ctx, stage.model_config(cfg), 4) == (cfg, 3)
    got, grad_accum = stage.check_run(dataclasses.replace(cfg, eval_only=True, total_batch_size=524288), ctx,
                                      stage.model_config(cfg), 4)
    assert (got.total_batch_size, grad_accum) == (2 * 32 * 4, 1)
    # --attention efficient on CUDA has no grouped-query kernel: refused with --n-kv-head, allowed without
    gpu = engine.Context(device=torch.device("cuda"))
    efficient = dataclasses.replace(cfg, attention="efficient")
    stage.check_run(efficient, gpu, stage.model_config(cfg), 4)
    with pytest.raises(ValueError, match="--attention efficient has no grouped-query"):
        stage.check_run(efficient, gpu, dataclasses.replace(stage.model_config(cfg), n_kv_head=2), 4)


def test_hold_out_dir_locks_for_a_training_run_on_rank_0_only(tmp_path):
    # an --eval-only run, or another rank, takes no lock; a directory yet to be made is no problem
    for rank, eval_only, locked in ((0, True, False), (1, False, False), (0, False, True)):
        out = tmp_path / f"{rank}{eval_only}"
        cfg = train.TrainConfig(out_dir=str(out), eval_only=eval_only)
        with contextlib.ExitStack() as stack:
            stage.hold_out_dir(cfg, rank, 1, stack)
            assert (out / ".train.lock").exists() == locked, (rank, eval_only)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is a file, not a directory"), contextlib.ExitStack() as stack:
        stage.hold_out_dir(train.TrainConfig(out_dir=str(tmp_path / "file")), 1, 1, stack)


def test_only_rank_0_needs_the_tracker_packages(tmp_path, monkeypatch):
    # rank 0 alone starts --wandb and --tensorboard: a node without the package may run the others
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now fails, as where it is not installed
    cfg = train.TrainConfig(out_dir=str(tmp_path), wandb="proj")
    with contextlib.ExitStack() as stack:
        stage.hold_out_dir(cfg, 1, 1, stack)
        with pytest.raises(ValueError) as e:
            stage.hold_out_dir(cfg, 0, 1, stack)
    assert str(e.value) == "--wandb needs the wandb package: pip install wandb"


def test_lm_step_logs_the_mean_loss_over_ranks_and_the_tokens_of_every_data_parallel_rank(monkeypatch):
    monkeypatch.setattr(stage, "set_lr", lambda optimizer, step, cfg: 0.25)
    monkeypatch.setattr(stage, "train_step", lambda *args: (torch.tensor(2.0), torch.tensor(0.5)))
    # this rank's loss 2.0, the 3 others' 4.0 each: the mean over the ranks is 3.5, not this rank's own
    monkeypatch.setattr(stage, "all_sum", lambda t, world: t + (world - 1) * 4.0)
    observed = []
    guard = SimpleNamespace(for_step=lambda: None, observe=lambda *a: observed.append(a), skipped=0)
    built = SimpleNamespace(model=None, optimizer=None, autocast=None, scaler=None)
    cfg = train.TrainConfig(model="tiny", seq_len=32, batch_size=2)
    step = stage.lm_step(cfg, built, lambda: None, 3, guard, engine.Context(world=4))
    assert step(7) == {"loss": 3.5, "lr": 0.25, "grad_norm": 0.5, "tokens": 3 * 2 * 32 * 4}
    assert observed == [(3.5, 0.5)]
    guard.skipped = 1
    assert step(8)["skipped"] == 1
    # under --tp 2 the 4 ranks are 2 data-parallel ranks, each pair reading one batch: half the tokens
    tp = dataclasses.replace(cfg, tp=2, hellaswag="off", sample_every=0)
    assert stage.lm_step(tp, built, lambda: None, 3, guard, engine.Context(world=4))(9)["tokens"] == 3 * 2 * 32 * 2


def test_the_runs_mfu_takes_peak_tflops_as_tera_and_the_flop_count_at_seq_len(monkeypatch):
    monkeypatch.setattr(stage, "Run", lambda **kwargs: kwargs)  # what Setup.run hands the engine
    raw = GPT(GPTConfig(block_size=64, vocab_size=96, n_layer=1, n_head=2, n_embd=16))
    setup = SimpleNamespace(cfg=train.TrainConfig(seq_len=32, peak_tflops=312.0), ctx=None, raw=raw, built=None,
                            checkpointer=None, log=None, parts={}, start=0, found=None)
    run = stage.Setup.run(setup, lambda step: {}, [])
    assert (run["peak_flops"], run["flops_per_token"]) == (312e12, raw.flops_per_token(32))
    setup.cfg = train.TrainConfig(seq_len=32)  # no --peak-tflops: common.py's table, by the device's name
    assert stage.Setup.run(setup, lambda step: {}, [])["peak_flops"] is None


def test_val_evals_score_over_the_data_parallel_ranks_at_eval_every(monkeypatch):
    # under --tp the val loss is averaged over the data-parallel ranks (setup.data.world), not every rank; the
    # evaluation's cadence is --eval-every (0: the last step only)
    seen = []
    monkeypatch.setattr(stage, "token_bytes", lambda vocab, device: "bytes")
    monkeypatch.setattr(engine, "val_metrics", lambda *args: seen.append(args[2:]) or {"loss": 1.5, "bpb": 0.5})
    loader = SimpleNamespace(B=2, T=32, num_windows=10)
    setup = SimpleNamespace(val_loader=loader, built=SimpleNamespace(model="m", autocast="ac"),
                            ctx=engine.Context(rank=1, world=4), data=engine.Context(world=2),
                            raw=SimpleNamespace(config=SimpleNamespace(vocab_size=96)), log=SimpleNamespace(say=print))
    cfg = train.TrainConfig(eval_every=0, eval_tokens=128)
    (val,) = stage.val_evals(cfg, setup)
    assert (val.name, val.every) == ("val", 0)
    assert val.fn(3) == {"val_loss": 1.5, "val_bpb": 0.5} and seen == [(2, "ac", 2, "bytes")]


def tiny_init(tmp_path, block_size=16):
    model = GPT(GPTConfig(block_size=block_size, vocab_size=96, n_layer=1, n_head=2, n_embd=16))
    path = tmp_path / "init.pt"
    torch.save({"model": model.state_dict(), "model_config": model.config.__dict__, "train_config": {}}, path)
    return model, path


def test_load_init_crops_the_positions_to_seq_len_and_pads_the_vocabulary_where_asked(tmp_path):
    import sft

    model, path = tiny_init(tmp_path)
    whole = stage.load_init(sft.SFTConfig(init_from=str(path), seq_len=16))  # the whole context is allowed
    assert whole.config.block_size == 16 and whole.config.vocab_size == 96
    short = stage.load_init(sft.SFTConfig(init_from=str(path), seq_len=8), vocab=100)
    assert short.config.block_size == 8 and short.config.vocab_size == 50304
    assert torch.equal(short.transformer.wpe.weight, model.transformer.wpe.weight[:8])
    assert torch.equal(short.transformer.wte.weight[:96], model.transformer.wte.weight)
    with pytest.raises(ValueError, match="--seq-len 17 is longer than --init-from"):
        stage.load_init(sft.SFTConfig(init_from=str(path), seq_len=17))


def test_build_model_inits_from_the_seed_and_a_resume_keeps_its_context(tmp_path):
    cfg = train.TrainConfig(model="tiny", seq_len=16, seed=3)
    torch.manual_seed(0)
    a = stage.build_model(cfg, None, engine.Context())
    torch.manual_seed(1)
    b = stage.build_model(cfg, None, engine.Context())
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    torch.manual_seed(3)  # --seed's init, not one of a seed fixed elsewhere (the default 1337's, say)
    seeded = GPT(train.model_config(cfg))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), seeded.state_dict().values(), strict=True))
    other = stage.build_model(dataclasses.replace(cfg, seed=4), None, engine.Context())
    assert not torch.equal(other.lm_head.weight, a.lm_head.weight)
    found = (tmp_path / "ckpt.pt", {"step": 0, "train_config": dataclasses.asdict(cfg), "model": a.state_dict(),
                                    "model_config": dataclasses.asdict(a.config)})
    assert stage.build_model(cfg, found, engine.Context()).config.block_size == 16
    with pytest.raises(ValueError, match="--seq-len 8 is not the context of --resume"):
        stage.build_model(dataclasses.replace(cfg, seq_len=8), found, engine.Context())


SLOW_RANK_WORKER = """import os, sys, time
sys.path.insert(0, sys.argv[1])
import train
import engine
found = engine.Checkpointer.find_resume
def slow(*args, **kwargs):  # rank 0 works alone (as in a download) while rank 1 waits for it in a collective
    if os.environ["RANK"] == "0":
        time.sleep(6)
    return found(*args, **kwargs)
engine.Checkpointer.find_resume = slow
train.run_and_exit(lambda: train.main(sys.argv[2:]), train.stage.exit_code)  # as train.py's __main__ ends
"""


@pytest.mark.slow
def test_dist_timeout_is_how_long_ranks_wait_for_a_slow_one(token_data, tmp_path):
    (tmp_path / "worker.py").write_text(SLOW_RANK_WORKER)
    argv = [str(tmp_path / "worker.py"), str(ROOT), *tiny_args(token_data, tmp_path / "out", "--eval-only")]
    proc = run_torchrun([*argv, "--dist-timeout=0.05"], nproc=2, check=False)  # 3 s
    assert proc.returncode != 0, proc.stderr[-2000:]
    # one line naming the rank, the timeout and what to check, not gloo's traceback
    assert "error: rank 1 waited --dist-timeout 0.05 min in a collective for a rank that never came: check that " \
        "every rank is alive" in proc.stderr and "Timed out waiting" not in proc.stderr, proc.stderr[-2000:]
    assert "val loss" in run_torchrun([*argv, "--dist-timeout=0.5"], nproc=2).stdout  # 30 s: the 6 s are waited


@pytest.mark.slow
def test_init_from_on_two_ranks_scores_the_hf_model(token_data, hf_dir, tmp_path):
    # each rank loads the weights (local rank 0 first, so a hub download happens once per node); the two val windows
    # are scored one on each rank, and give what the two give on one rank
    proc = run_torchrun(["train.py", *ft_args(token_data, hf_dir, tmp_path, "--eval-tokens=128", "--eval-only")],
                        nproc=2)
    val = float(re.search(r"step +0 \| val loss (\d+\.\d+)", proc.stdout).group(1))
    assert val == pytest.approx(_hf_loss(hf_dir, token_data, "val", 2, 2, 32), abs=1e-4)  # printed to 4 decimals
    # local rank 0 loads first; its failure (no network here, a missing repo elsewhere) is every rank's reason
    proc = run_torchrun(["train.py", *tiny_args(token_data, tmp_path / "nope", "--eval-only", "--hellaswag=off",
                                                "--init-from=no-such-org-xyz/gpt2-nope")], nproc=2, check=False)
    assert proc.returncode != 0
    assert "error: could not get 'no-such-org-xyz/gpt2-nope' from the HF hub" in proc.stderr, proc.stderr[-3000:]
    assert "error: rank 0: could not get" in proc.stderr and "gloo" not in proc.stderr.lower(), proc.stderr[-3000:]


def test_a_resume_without_an_architecture_flag_is_told_to_pass_the_weights_value():
    # a run of --preset demo --mlp swiglu (or a user's new --qk-norm true) resumed as --preset demo --resume auto: its
    # --model tiny says gelu, and the way out is the checkpoint's --mlp swiglu, not "drop those flags" (none was given)
    src = dataclasses.replace(stage.model_config(train.PRESETS["demo"]()), mlp="swiglu")
    with pytest.raises(ValueError, match=r"asks for --model tiny \(mlp gelu; it has mlp swiglu\): pass --mlp swiglu"):
        stage.check_architecture(train.PRESETS["demo"](), src, "--resume ckpt")


@pytest.fixture(scope="module")
def swiglu_ckpt(token_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("swiglu")
    train.main(tiny_args(token_data, out, "--mlp=swiglu", "--max-steps=1", "--eval-every=0"))
    return out / "ckpt_000001.pt"


def test_a_resume_names_a_changed_dropout_or_loss_chunk(token_data, swiglu_ckpt, tmp_path, capsys):
    # the model's run options may change on resume, and do: --dropout 0.1 trained with dropout, without a word, so a
    # sweep loop's `--dropout $p --resume auto` into a finished run's --out-dir read as the run it asked for
    capsys.readouterr()
    train.main(tiny_args(token_data, tmp_path, "--mlp=swiglu", "--max-steps=2", "--eval-every=0", "--resume",
                         str(swiglu_ckpt), "--dropout=0.1", "--loss-chunk=32"))
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: flags")]
    assert notes == ["note: flags changed since the checkpoint: --dropout 0.0 -> 0.1, --loss-chunk 0 -> 32"]
    assert load_checkpoint(tmp_path / "ckpt_000002.pt")["model_config"]["dropout"] == 0.1


def test_a_resume_of_a_finished_run_says_it_trains_nothing(token_data, swiglu_ckpt, tmp_path, capsys):
    # a sweep's `--max-lr $lr --resume auto` into a finished run's --out-dir: it said "from step 1 the lr is 0.003"
    # of a step it never trains, then "done: 0 steps"; now it says at once that the run only evaluates
    capsys.readouterr()
    train.main(tiny_args(token_data, tmp_path, "--mlp=swiglu", "--max-steps=1", "--eval-every=0", "--max-lr=3e-3",
                         "--resume", str(swiglu_ckpt)))
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")] == [
        "note: the checkpoint is at --max-steps 1 already: this run trains no step, it only evaluates; raise "
        "--max-steps to train on, or start a new run in a new --out-dir"]


@pytest.mark.parametrize("source, extra, message", [
    ("hf", ["--n-layer=3"], r"fixes the architecture, but this run asks for --n-layer 3 \(it has 2\): pass --n-layer 2 "
                            "as it has"),
    ("hf", ["--preset=gpt2-350m"], r"--model gpt2-medium \(n_layer 24, n_head 16, n_embd 1024; it has n_layer 2, "
                                   r"n_head 4, n_embd 32\)"),
    ("hf", ["--seq-len=128", "--total-batch-size=256"],
     "--seq-len 128 is longer than --init-from .*'s context of 64 tokens"),
    # a flag given explicitly is checked even when it names GPT-2's default
    ("swiglu", ["--mlp=gelu"], r"asks for --mlp gelu \(it has swiglu\)"),
    # a source without n_kv_head has as many key/value heads as query heads: 4 here, not None
    ("hf", ["--n-kv-head=2"], r"asks for --n-kv-head 2 \(it has 4\): pass --n-kv-head 4 as"),
    # train.py pads no vocabulary: the HF model's 50,257 rows were trained on, --vocab-size 50304 ignored
    ("hf", ["--vocab-size=50304"], r"asks for --vocab-size 50304 \(it has 50257\): pass --vocab-size 50257 as"),
    ("swiglu", ["--norm=rmsnorm"], r"asks for --norm rmsnorm \(it has layernorm\): pass --norm layernorm as"),
    # a preset naming GPT-2's own choices is checked too: the tiny preset is gelu, the checkpoint swiglu
    ("swiglu", ["--model=tiny"], r"asks for --model tiny \(mlp gelu; it has mlp swiglu\): pass --mlp swiglu as"),
    # a named preset's own options are checked too, where no flag replaces them: its shape flags match here
    ("swiglu", ["--model=llama-124m", "--n-layer=2", "--n-head=4", "--n-embd=64"],
     r"asks for --model llama-124m \(bias False, pos rope, norm rmsnorm; it has bias True, pos learned, "
     r"norm layernorm\): pass --bias True --pos learned --norm layernorm as"),
])
def test_init_from_refuses_a_different_architecture(token_data, hf_dir, swiglu_ckpt, tmp_path, capsys, source,
                                                    extra, message):
    init = hf_dir if source == "hf" else swiglu_ckpt
    with pytest.raises(SystemExit):
        train.main(["--data", str(token_data), "--out-dir", str(tmp_path), "--init-from", str(init), "--eval-only",
                    "--seq-len=32", "--batch-size=2", "--total-batch-size=64", *extra])
    assert re.search(message, capsys.readouterr().err)


def test_init_from_accepts_flags_that_match_the_source(token_data, swiglu_ckpt, tmp_path):
    # the tiny preset names the checkpoint's own architecture, and --mlp swiglu agrees with it
    result = train.main(tiny_args(token_data, tmp_path, "--init-from", str(swiglu_ckpt), "--mlp=swiglu",
                                  "--eval-only"))
    assert result["val_loss"] > 5.0


def test_init_from_accepts_a_preset_whose_shape_flags_match_the_source(token_data, hf_dir, tmp_path):
    # as --preset shakespeare does (--model gpt2 with 6 layers of 384): explicit shape flags replace the named
    # preset's, so only they are checked; and --n-kv-head equal to --n-head is what a source without GQA has
    args = ["--data", str(token_data), "--out-dir", str(tmp_path), "--init-from", str(hf_dir), "--eval-only",
            "--seq-len=32", "--batch-size=2", "--eval-tokens=128", "--hellaswag=off", "--model=gpt2", "--n-layer=2",
            "--n-head=4", "--n-embd=32", "--n-kv-head=4"]
    assert train.main(args)["val_loss"] == pytest.approx(_hf_loss(hf_dir, token_data, "val", 2, 2, 32), abs=1e-5)


def test_init_from_a_run_directory_names_its_latest_checkpoint(tokens_512, tmp_path, capsys):
    train.main(v512_args(tokens_512, tmp_path / "run", "--max-steps=2", "--ckpt-every=1", "--eval-every=0"))
    with pytest.raises(SystemExit):
        train.main(v512_args(tokens_512, tmp_path / "b", "--init-from", str(tmp_path / "run"), "--eval-only"))
    assert f"pass one of its checkpoints, e.g. --init-from {tmp_path / 'run' / 'ckpt_000002.pt'}" in \
        capsys.readouterr().err


def test_outlier_detector_zscores(monkeypatch):
    monkeypatch.setattr(engine, "OUTLIER_WINDOW", 4)
    detect = engine.OutlierDetector()
    assert [detect(v) for v in (1.0, 2.0, 3.0, 4.0)] == [0.0] * 4  # no verdict before the window is full
    # as llm.c: 5 replaces 1 and is scored within the window 2, 3, 4, 5 (mean 3.5, population std sqrt(1.25))
    assert detect(5.0) == pytest.approx(1.5 / 1.25 ** 0.5)
    assert detect.values == [2.0, 3.0, 4.0, 5.0]
    assert detect(float("nan")) == 0.0 and detect.values == [2.0, 3.0, 4.0, 5.0]  # not poisoned by a NaN
    # nor an inf (an fp16 step's overflowed norm, which the GradScaler skips): its mean would be inf, every z NaN
    assert detect(float("inf")) == 0.0 and detect.values == [2.0, 3.0, 4.0, 5.0]
    assert detect(1e9) == pytest.approx(3 ** 0.5, rel=1e-6)  # the most a window of 4 allows: sqrt(4 - 1)


def test_spike_guard_skips_a_rise_of_a_figure_it_watches_only(monkeypatch):
    # one-sided, as llm.c: a loss that drops as sharply is applied; a grad norm spike with --skip-norm-z 0 is too
    monkeypatch.setattr(engine, "OUTLIER_WINDOW", 4)
    guard, t = engine.SpikeGuard(skip_loss_z=1.5), torch.tensor
    assert guard.for_step() == guard.update
    for loss in (2.0, 2.1, 1.9, 2.0):
        assert guard.update(t(loss), t(1.0)) and guard.skipped == ""
    assert guard.update(t(0.5), t(1.0)) and guard.skipped == ""  # z = -1.72
    assert guard.update(t(1.0), t(50.0)) and guard.skipped == ""  # the norm's z is 1.73, unwatched
    assert not guard.update(t(10.0), t(1.0)) and guard.skipped == "loss z-score 1.7 > 1.5"
    history = copy.deepcopy(guard.state_dict())
    assert history == {"loss": [2.0, 0.5, 1.0, 10.0], "norm": [1.0, 1.0, 50.0, 1.0]}  # the spike stays in the window
    guard.observe(2.0, 1.0)  # the guard on: update() saw this step's figures already
    assert guard.state_dict() == history and guard.for_step() is not None and guard.skipped == ""
    resumed = engine.SpikeGuard(skip_loss_z=1.5)  # a resume: the checkpoint's history gives the same verdict
    resumed.load_state_dict(history)
    assert not resumed.update(t(30.0), t(1.0)) and not guard.update(t(30.0), t(1.0))
    assert resumed.state_dict() == guard.state_dict()
    off = engine.SpikeGuard()
    assert off.for_step() is None
    off.observe(2.0, 1.0)
    assert off.state_dict() == {"loss": [2.0], "norm": [1.0]}
    off.load_state_dict({})  # a checkpoint from before the guard: no history
    assert off.state_dict() == {"loss": [], "norm": []}


def test_loss_spike_update_is_skipped_and_resume_skips_it_again(tokens_512, tmp_path, monkeypatch):
    # the loss at step 20 is tripled; with --skip-loss-z that step changes neither weights nor AdamW moments
    monkeypatch.setattr(engine, "OUTLIER_WINDOW", 16)  # a lone spike among 16 scores sqrt(15) = 3.9
    current = {}
    real_lr, real_forward = engine.get_lr, GPT.forward
    monkeypatch.setattr(engine, "get_lr", lambda step, cfg: current.update(step=step) or real_lr(step, cfg))

    def spiky(self, idx, targets=None, **kw):
        logits, loss = real_forward(self, idx, targets, **kw)
        return logits, (loss * 3 if self.training and current["step"] == 20 else loss)

    monkeypatch.setattr(GPT, "forward", spiky)
    common = ["--max-steps=21", "--ckpt-every=1", "--keep-last=3", "--eval-every=0", "--skip-loss-z=3",
              "--total-batch-size=256"]
    full = train.main(v512_args(tokens_512, tmp_path / "full", *common))["losses"]
    records = [r for r in iter_log(tmp_path / "full" / "log.jsonl") if r["type"] == "train"]
    assert [r["step"] for r in records if "skipped" in r] == [20] and full[20] > 3 * 6  # ~ln(512) = 6.24 tripled
    ckpts = {step: load_checkpoint(tmp_path / "full" / f"ckpt_{step:06d}.pt") for step in (19, 20, 21)}
    for name, before in ckpts[20]["model"].items():
        assert torch.equal(ckpts[21]["model"][name], before), name  # step 20 was not applied
    assert not torch.equal(ckpts[19]["model"]["lm_head.weight"], ckpts[20]["model"]["lm_head.weight"])  # 19 was
    for name, state in ckpts[20]["optimizer"]["state"].items():  # keyed by parameter name
        assert torch.equal(ckpts[21]["optimizer"]["state"][name]["exp_avg"], state["exp_avg"]), name
    assert ckpts[20]["outliers"]["loss"] == pytest.approx([r["loss"] for r in records[4:20]])  # the last 16 losses
    # resumed at step 20, the restored history flags the spike again: the same losses, bitwise
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(tmp_path / "full" / "ckpt_000020.pt", resumed)
    assert train.main(v512_args(tokens_512, resumed, *common, "--resume=auto"))["losses"] == full[20:]
    skipped = lambda out: [r["step"] for r in iter_log(out / "log.jsonl") if r["type"] == "train" and "skipped" in r]
    assert skipped(resumed) == [20]  # the loss of step 20 comes before the verdict: the log says it was skipped
    # with the guard off the history is kept all the same, so turning it on at a resume (after a spike, say) works
    # from the first step instead of after 16 more
    unguarded = [arg for arg in common if not arg.startswith("--skip")]
    train.main(v512_args(tokens_512, tmp_path / "off", *unguarded))
    off = load_checkpoint(tmp_path / "off" / "ckpt_000020.pt")
    assert off["outliers"] == ckpts[20]["outliers"]
    switched_on = tmp_path / "switched_on"
    switched_on.mkdir()
    shutil.copy(tmp_path / "off" / "ckpt_000020.pt", switched_on)
    assert train.main(v512_args(tokens_512, switched_on, *common, "--resume=auto"))["losses"] == full[20:]
    assert skipped(switched_on) == [20]


def test_grad_norm_spike_update_is_skipped(tokens_512, tmp_path, monkeypatch):
    # --skip-norm-z alone: step 9's gradient is 100 times larger at an unchanged loss, and only its update is dropped
    monkeypatch.setattr(engine, "OUTLIER_WINDOW", 8)  # a lone spike among 8 scores up to sqrt(7) = 2.65
    current = {}
    real_lr, real_forward = engine.get_lr, GPT.forward
    monkeypatch.setattr(engine, "get_lr", lambda step, cfg: current.update(step=step) or real_lr(step, cfg))

    def steep(self, idx, targets=None, **kw):
        logits, loss = real_forward(self, idx, targets, **kw)
        if self.training and current["step"] == 9:
            loss = loss + 99 * (loss - loss.detach())  # the same value, 100 times the gradient
        return logits, loss

    monkeypatch.setattr(GPT, "forward", steep)
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=10", "--ckpt-every=1", "--keep-last=3", "--eval-every=0",
                         "--skip-norm-z=2.4", "--total-batch-size=256"))
    records = [r for r in iter_log(tmp_path / "log.jsonl") if r["type"] == "train"]
    assert [r.get("skipped") for r in records] == [None] * 9 + ["grad norm z-score 2.6 > 2.4"]
    assert records[9]["grad_norm"] > 50 * records[8]["grad_norm"]
    ckpts = {step: load_checkpoint(tmp_path / f"ckpt_{step:06d}.pt")["model"] for step in (8, 9, 10)}
    assert all(torch.equal(ckpts[10][name], before) for name, before in ckpts[9].items())  # step 9 not applied
    assert not torch.equal(ckpts[8]["lm_head.weight"], ckpts[9]["lm_head.weight"])  # step 8 was


def wait_for_first_step(proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Until the run has logged a train step (so it is in its loop), it exits, or the timeout passes."""
    deadline = time.time() + timeout
    logged = lambda: log.exists() and '"type": "train"' in log.read_text()
    while time.time() < deadline and proc.poll() is None and not logged():
        time.sleep(0.2)


@contextlib.contextmanager
def long_run(tokens_512: Path, out: Path, ranks: int = 1) -> Iterator[subprocess.Popen]:
    """A tiny run of 100,000 steps at vocabulary 512 in a child process with text pipes (ranks > 1: under torchrun,
    with ZeRO-1), from its first logged step on. It and its workers are killed at the end whatever happens, so that
    none can outlive a failed test."""
    args = v512_args(tokens_512, out, "--max-steps=100000", "--eval-every=0")
    cmd, env = [sys.executable, "train.py", *args], None
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "train.py",
               *args, "--parallel=zero1"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # SIGINT at its default, as in a terminal's job: a suite started in the background by a non-interactive shell
    # (`bash .ci/run &`) inherits it ignored, and train.py then leaves it ignored, as nohup means it to
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    workers: list[int] = []
    try:
        wait_for_first_step(proc, out / "log.jsonl")
        workers = children(proc.pid) if ranks > 1 else []
        yield proc
    finally:
        for pid in [proc.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_checkpoints_and_exits_cleanly(tokens_512, tmp_path):
    with long_run(tokens_512, tmp_path) as proc:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "stopping after step" in out and "(SIGTERM)" in out
    ckpts = sorted(tmp_path.glob("ckpt_*.pt"))
    assert len(ckpts) == 1
    step = load_checkpoint(ckpts[0])["step"]
    assert 1 <= step < 100000
    more = train.main(v512_args(tokens_512, tmp_path, f"--max-steps={step + 2}", "--eval-every=0", "--resume=auto"))
    assert len(more["losses"]) == 2


def test_ctrl_c_checkpoints_even_when_its_output_pipes_died_with_it(tokens_512, tmp_path):
    # `python train.py ... 2>&1 | tee log`: the terminal's Ctrl-C kills tee too, and the run's next print to the
    # dead pipe must not end it before its checkpoint
    with long_run(tokens_512, tmp_path) as proc:
        proc.send_signal(signal.SIGINT)
        assert "Ctrl-C: stopping after this step" in proc.stderr.readline() + proc.stderr.readline()
        proc.stdout.close()
        proc.stderr.close()
        assert proc.wait(timeout=120) == 0
    steps = [load_checkpoint(path)["step"] for path in tmp_path.glob("ckpt_*.pt")]
    assert len(steps) == 1 and steps[0] >= 1


def test_a_signal_during_an_evaluation_stops_before_the_next_step(tokens_512, tmp_path, monkeypatch, capsys,
                                                                  sigint_handled):
    # torchrun SIGKILLs its workers 30 s after it passes a signal on, so a Ctrl-C (or preemption) during an
    # evaluation stops the run right after it, with the checkpoint the last step's end would have written
    straight = train.main(v512_args(tokens_512, tmp_path / "straight", "--max-steps=2", "--eval-every=0"))
    real, calls = engine.val_metrics, []

    def interrupted(*args, **kw):  # Ctrl-C during the run's `at`-th evaluation: at step 2 * (at - 1)
        calls.append(None)
        if len(calls) == at:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kw)

    monkeypatch.setattr(engine, "val_metrics", interrupted)
    at = 1
    fresh = train.main(v512_args(tokens_512, tmp_path / "fresh", "--max-steps=10", "--eval-every=2"))
    assert fresh["stopped"] == "signal" and fresh["losses"] == [] and not list((tmp_path / "fresh").glob("ckpt_*"))
    assert "stopping at step 0, before training it (Ctrl-C); nothing trained yet" in capsys.readouterr().out
    run, at = tmp_path / "run", 2
    calls.clear()
    result = train.main(v512_args(tokens_512, run, "--max-steps=10", "--eval-every=2", "--ckpt-every=0",
                                  "--hellaswag=off"))
    assert result["stopped"] == "signal" and result["losses"] == straight["losses"]  # steps 0 and 1, no more
    assert "stopping at step 2, before training it (Ctrl-C); resume with --resume auto" in capsys.readouterr().out
    mine, theirs = load_checkpoint(run / "ckpt_000002.pt"), load_checkpoint(tmp_path / "straight" / "ckpt_000002.pt")
    assert mine["loader"] == theirs["loader"] and mine["step"] == theirs["step"] == 2
    for name, tensor in theirs["model"].items():
        assert torch.equal(mine["model"][name], tensor), name
    # the final evaluation, after the last step's checkpoint: no step is left to stop after, so Ctrl-C quits
    last, at = tmp_path / "last", 2  # the evaluations at steps 0 and 2 (the last)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        train.main(v512_args(tokens_512, last, "--max-steps=2", "--eval-every=1000"))
    assert [p.name for p in last.glob("ckpt_*.pt")] == ["ckpt_000002.pt"]


@pytest.mark.parametrize("evaluation", ["hellaswag", "sample"])
def test_a_signal_during_hellaswag_or_the_samples_stops_too_and_a_resumed_run_can_resume(token_data, tmp_path,
                                                                                          monkeypatch, capsys,
                                                                                          evaluation, sigint_handled):
    # torchrun's 30 s run out during any evaluation, not only the val loss: a Ctrl-C during HellaSwag or the samples
    # (no val split here: --eval-every 0) stops the run right after it
    import hellaswag
    where = {"hellaswag": (hellaswag, "evaluate", [f"--hellaswag={ROOT / 'tests' / 'data' / 'hellaswag_tiny.jsonl'}",
                                                   "--hellaswag-every=2"]),
             "sample": (train, "sample", ["--sample-every=2"])}
    module, name, extra = where[evaluation]
    real, calls = getattr(module, name), []

    def interrupted(*args, **kw):  # Ctrl-C during the `at`-th call
        calls.append(None)
        if len(calls) == at:
            signal.raise_signal(signal.SIGINT)
        return real(*args, **kw)

    monkeypatch.setattr(module, name, interrupted)
    args = tiny_args(token_data, tmp_path, "--max-steps=10", "--eval-every=0", "--ckpt-every=2", *extra)
    at = {"hellaswag": 2, "sample": 1}[evaluation]  # HellaSwag also runs at step 0, the samples from step 2 on
    streams = sys.stdout, sys.stderr
    result = train.main(args)
    # the handler put guards on the streams against a dead `| tee`: the caller gets its own back
    assert (sys.stdout, sys.stderr) == streams
    out = capsys.readouterr().out
    assert result["stopped"] == "signal" and len(result["losses"]) == 2
    assert "stopping at step 2, before training it (Ctrl-C); resume with --resume auto" in out
    # step 1's end wrote ckpt_000002 (--ckpt-every 2): the stop does not write it again, but names it
    assert out.count("saved ") == 1 and result["checkpoint"] == str(tmp_path / "ckpt_000002.pt")
    # resumed, the same evaluations run again at step 2 and are interrupted again: nothing trained in this run, but
    # its checkpoint is there to resume from, and the micro-batch did not change
    calls.clear()
    at = 1
    resumed = train.main([*args, "--resume=auto"])
    out = capsys.readouterr().out
    assert resumed["stopped"] == "signal" and resumed["losses"] == []
    assert "stopping at step 2, before training it (Ctrl-C); resume with --resume auto" in out
    assert "micro-batch" not in out and "saved " not in out
    assert [p.name for p in tmp_path.glob("ckpt_*.pt")] == ["ckpt_000002.pt"]


def test_the_stop_check_runs_once_a_step_and_once_after_each_evaluation(tokens_512, tmp_path, monkeypatch):
    # under torchrun each check is an all-reduce, a sync of every rank: one per step, and one more only after the
    # evaluations, where a signal that came during them must not wait for the next step's end
    real, calls = engine.StopFlags.should_stop, []

    def counted(self, *args):
        calls.append(None)
        return real(self, *args)

    monkeypatch.setattr(engine.StopFlags, "should_stop", counted)
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=4", "--eval-every=3"))
    assert len(calls) == 4 + 2  # steps 0-3, and the evaluations at steps 0 and 3 (the one at 4 ends the run)


def test_ctrl_c_checkpoints_and_exits_cleanly(tokens_512, tmp_path):
    with long_run(tokens_512, tmp_path) as proc:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Ctrl-C: stopping after this step, with a checkpoint" in err and "KeyboardInterrupt" not in err
    step = int(re.search(r"stopping after step (\d+) \(Ctrl-C\); resume with --resume auto", out)[1])
    assert [load_checkpoint(path)["step"] for path in tmp_path.glob("ckpt_*.pt")] == [step + 1]


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_and_says_why(tokens_512, tmp_path):
    # a preempted node may signal only its own workers: rank 1's SIGTERM must stop rank 0 at the same step, with a
    # checkpoint, and rank 0 (which prints) must name the signal, not a --max-time that is not set
    with long_run(tokens_512, tmp_path, ranks=2) as proc:
        workers = children(proc.pid)
        environ = {pid: dict(kv.split(b"=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                             if b"=" in kv) for pid in workers}
        rank1 = [pid for pid in workers if environ[pid].get(b"RANK") == b"1"]
        assert len(rank1) == 1, workers
        os.kill(rank1[0], signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    log = tmp_path / "log.jsonl"
    assert proc.returncode == 0, err[-3000:]
    assert re.search(r"stopping after step \d+ \(SIGTERM\)", out), out[-3000:]
    step = load_checkpoint(next(tmp_path.glob("ckpt_*.pt")))["step"]
    assert [r["step"] for r in iter_log(log) if r["type"] == "train"][-1] == step - 1


@pytest.mark.slow
def test_ctrl_c_under_torchrun_is_announced_once_and_named(tokens_512, tmp_path):
    # torchrun passes the terminal's Ctrl-C on to every worker as SIGINT: each stops at the same step with a
    # checkpoint, but only rank 0 (which prints) says so, once, and names Ctrl-C
    with long_run(tokens_512, tmp_path, ranks=2) as proc:
        workers = children(proc.pid)
        assert len(workers) == 2, workers
        for pid in workers:
            os.kill(pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert err.count("Ctrl-C: stopping after this step") == 1, err[-3000:]
    step = int(re.search(r"stopping after step (\d+) \(Ctrl-C\); resume with --resume auto", out)[1])
    assert [load_checkpoint(path)["step"] for path in tmp_path.glob("ckpt_*.pt")] == [step + 1]


def armed(*args, **kw) -> engine.StopFlags:
    """StopFlags with its handlers installed, as `with StopFlags(...)` in train.run does; the tests put the previous
    handlers and streams back themselves."""
    return engine.StopFlags(*args, **kw).__enter__()


def test_stop_flags_budget_is_in_minutes_and_a_signal_is_named_first():
    # a no-op underneath: were StopFlags to install no handler, the SIGTERM below must not end the test session
    previous = signal.signal(signal.SIGTERM, lambda *args: None)
    try:
        assert engine.StopFlags(0).deadline == math.inf  # no budget
        flags = armed(2.0)
        assert flags.deadline - time.time() == pytest.approx(120, abs=10)  # 2 minutes, not 2 seconds (nor hours)
        assert flags.should_stop() is None
        flags.deadline = time.time() - 1
        assert flags.should_stop() == "max_time"
        signal.raise_signal(signal.SIGTERM)  # the handler StopFlags installed
        assert flags.term and flags.should_stop() == "signal"  # both reasons at once: the signal is named
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_first_ctrl_c_asks_for_a_stop_and_a_ctrl_c_after_any_signal_quits_at_once(capfd, sigint_handled):
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    streams = sys.stdout, sys.stderr
    try:
        flags = armed(0)
        signal.raise_signal(signal.SIGINT)
        assert flags.term == "SIGINT" and flags.should_stop() == "signal" and flags.reason == "Ctrl-C"
        assert "Ctrl-C: stopping after this step, with a checkpoint; Ctrl-C again quits now" in capfd.readouterr().err
        assert isinstance(sys.stdout, engine._PipeGuard) and isinstance(sys.stderr, engine._PipeGuard)
        with pytest.raises(KeyboardInterrupt):  # torchrun's answer to a second Ctrl-C: SIGTERM to its workers
            signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        sys.stdout, sys.stderr = streams
        flags = armed(0)
        capfd.readouterr()
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # one from the scheduler, one from torchrun: still a clean stop
        # not announced as a Ctrl-C, which would send the log's reader looking for who pressed it: the "stopping
        # after step" line names the preemption
        assert capfd.readouterr().err == ""
        assert flags.term == "SIGTERM" and flags.should_stop() == "signal" and flags.reason == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C while a preempted run saves: quit
            signal.raise_signal(signal.SIGINT)
        sys.stdout, sys.stderr = streams
        capfd.readouterr()
        quiet = armed(0, master=False)  # only rank 0 says it
        signal.raise_signal(signal.SIGINT)
        assert quiet.term == "SIGINT" and capfd.readouterr().err == ""
        sys.stdout, sys.stderr = streams
        armed(0, interrupt=False)  # --eval-only: Ctrl-C is Python's
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        last = armed(0)
        last.last = True  # the final evaluations: no step left to stop after
        signal.raise_signal(signal.SIGTERM)  # a preemption lets them finish
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
        sys.stdout, sys.stderr = streams
        last = armed(0)
        last.last = True
        with pytest.raises(KeyboardInterrupt):  # a first Ctrl-C there quits too
            signal.raise_signal(signal.SIGINT)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # started by a script with &, or under nohup: stays ignored
        armed(0)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        sys.stdout, sys.stderr = streams
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_pipe_guard_sends_output_whose_reader_is_gone_to_dev_null():
    read, write = os.pipe()
    stream = os.fdopen(write, "w")
    guard = engine._PipeGuard(stream)
    guard.write("read\n")
    guard.flush()
    assert os.read(read, 100) == b"read\n"
    os.close(read)  # the reader is gone: `| tee` killed by the same Ctrl-C
    assert guard.write("x" * 100) == 100
    guard.flush()  # EPIPE, caught: the descriptor is /dev/null's from here on
    assert os.fstat(write).st_rdev == os.stat(os.devnull).st_rdev
    guard.write("more")
    guard.flush()
    stream.close()  # the buffer's flush at close (at exit, for sys.stdout) cannot fail either


def test_pipe_guard_counts_a_write_the_dead_pipe_refused_and_passes_other_errors_on():
    read, write = os.pipe()
    stream = os.fdopen(write, "w")
    guard = engine._PipeGuard(stream)
    os.close(read)
    text = "x" * 100_000  # more than the buffer holds: the write itself meets EPIPE, not a later flush
    assert guard.write(text) == len(text)  # as written: nobody is left to read it
    stream.close()
    # a full disk is no reader that left: its error must reach the run, not send all later output to /dev/null
    full = open("/dev/full", "w")
    try:
        guard = engine._PipeGuard(full)
        guard.write("x")
        with pytest.raises(OSError, match="No space left on device"):
            guard.flush()
        assert not os.path.samestat(os.fstat(full.fileno()), os.stat(os.devnull))
    finally:
        with contextlib.suppress(OSError):
            full.close()


def test_max_time_budget_checkpoints_and_stops(tokens_512, tmp_path, capsys):
    # a budget of 60 us: the first step exceeds it, so the run stops after one step, with a checkpoint
    result = train.main(v512_args(tokens_512, tmp_path, "--max-steps=50", "--eval-every=0", "--max-time=0.000001"))
    assert result["stopped"] == "max_time" and len(result["losses"]) == 1
    assert load_checkpoint(tmp_path / "ckpt_000001.pt")["step"] == 1
    assert "(--max-time 1e-06 min)" in capsys.readouterr().out


def test_restore_gives_each_rank_its_own_rng_and_restarts_them_when_the_world_size_changed(capsys):
    # dropout masks differ per rank: rank r resumes rank r's stream (not rank 0's, which would make every rank's
    # masks alike); at another world size there is no rank r's to resume, so the run's own seeding stays
    cfg = train.TrainConfig(model="tiny", seq_len=16, device="cpu", arch={"dropout": 0.1})
    torch.manual_seed(0)
    saved = GPT(train.model_config(cfg))
    optimizer = par.build_optimizer(saved, cfg, torch.device("cpu"), verbose=False)
    model_sd, optim_sd = engine.state_dicts(saved, optimizer)
    rngs = [{"cpu": torch.manual_seed(seed).get_state(), "cuda": None} for seed in (10, 11)]
    ckpt = {"model": model_sd, "optimizer": optim_sd, "optimizer_kind": "single", "step": 7, "rng": rngs,
            "scaler": None}

    def restored(rank: int, world: int, **kw) -> tuple[int, torch.Tensor]:
        raw = GPT(train.model_config(cfg))
        run_cfg = dataclasses.replace(cfg, **kw)
        optimizer = par.build_optimizer(raw, run_cfg, torch.device("cpu"), verbose=False)
        torch.manual_seed(99)  # the run's own seeding, before the restore
        step = engine.Checkpointer(run_cfg, rank, world).restore(ckpt, raw, optimizer, {})
        for name, tensor in raw.state_dict().items():
            assert torch.equal(tensor, model_sd[name]), name
        return step, torch.rand(4)

    draws = {}
    for seed in (10, 11, 99):
        torch.manual_seed(seed)
        draws[seed] = torch.rand(4)
    for rank in (0, 1):
        step, draw = restored(rank, 2)
        assert step == 7 and torch.equal(draw, draws[10 + rank]), rank
    capsys.readouterr()
    for rank, world in ((0, 1), (3, 4)):
        assert torch.equal(restored(rank, world)[1], draws[99]), (rank, world)
    assert capsys.readouterr().out.count("note: the checkpoint came from world size 2, this run has 1") == 1
    # an evaluation loads the weights alone: neither the optimizer state (here ZeRO-1's, which a plain AdamW cannot
    # take) nor the RNG
    ckpt["optimizer_kind"] = "zero1"
    step, draw = restored(1, 2, eval_only=True)
    assert step == 7 and torch.equal(draw, draws[99])


def test_save_keeps_every_ranks_rng_for_restore_to_give_back(tmp_path, monkeypatch):
    # rank 0 writes the file for both: without the gather, rank 1 would resume rank 0's dropout masks
    cfg = train.TrainConfig(model="tiny", seq_len=16, device="cpu", out_dir=str(tmp_path))
    raw = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=16))
    optimizer = par.build_optimizer(raw, cfg, torch.device("cpu"), verbose=False)
    theirs = {"cpu": torch.manual_seed(11).get_state(), "cuda": None}
    torch.manual_seed(10)
    mine = engine.rng_state()

    def all_gather_object(out: list, obj) -> None:  # rank 1's part: its RNG, and no problem in the write
        assert len(out) == 2
        out[:] = [obj, theirs if isinstance(obj, dict) else None]

    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    path = engine.Checkpointer(cfg, 0, 2).save(3, raw, optimizer, {})
    rngs = load_checkpoint(path)["rng"]
    assert len(rngs) == 2 and torch.equal(rngs[0]["cpu"], mine["cpu"]) and torch.equal(rngs[1]["cpu"], theirs["cpu"])


def test_checkpoint_killed_mid_write_leaves_previous_loadable(tokens_512, tmp_path, monkeypatch):
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=3", "--eval-every=0"))
    good = tmp_path / "ckpt_000003.pt"
    before = good.read_bytes()

    def dies_halfway(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(engine.torch, "save", dies_halfway)
    with pytest.raises(KeyboardInterrupt):
        train.main(v512_args(tokens_512, tmp_path, "--max-steps=6", "--eval-every=0", "--resume=auto"))
    monkeypatch.undo()
    assert good.read_bytes() == before and not (tmp_path / "ckpt_000006.pt").exists()
    # a torn file under the final name (e.g. copied by hand) is skipped with a warning, not loaded
    (tmp_path / "ckpt_000009.pt").write_bytes(b"garbage")
    path, ckpt = engine.find_checkpoint(tmp_path, [])
    assert path == good and ckpt["step"] == 3


@pytest.mark.parametrize("broken, message", [
    ("loss", "loss is nan at step 2"),
    # the loss is computed before the update, so it is still finite on the step whose gradient wrecks the weights
    ("norm", "gradient norm is inf at step 2"),
])
def test_nonfinite_loss_or_grad_norm_stops_without_a_checkpoint(tokens_512, tmp_path, monkeypatch, capsys, broken,
                                                               message):
    real_step = par.train_step
    calls = {"n": 0}

    def breaks_on_third_step(*args, **kwargs):
        loss, norm = real_step(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 3:
            loss, norm = (loss * float("nan"), norm) if broken == "loss" else (loss, norm * float("inf"))
        return loss, norm

    monkeypatch.setattr(stage, "train_step", breaks_on_third_step)
    result = train.main(v512_args(tokens_512, tmp_path, "--max-steps=6", "--ckpt-every=2", "--keep-last=1",
                                  "--eval-every=0"))
    assert result["stopped"] == "nan" and len(result["losses"]) == 2
    # ckpt_000004 never written; ckpt_000002 holds the weights that gave the NaN, so --resume auto must not take it
    assert sorted(p.name for p in tmp_path.glob("ckpt_*")) == ["ckpt_000002.pt.diverged"]
    err = capsys.readouterr().err
    assert message in err and "ckpt_000002.pt holds the weights that gave it: renamed ckpt_000002.pt.diverged" in err
    assert "checkpoint" not in result  # the one it wrote is set aside
    with pytest.raises(SystemExit):  # a fresh run there is refused, as when ckpt_000002.pt stood
        train.main(v512_args(tokens_512, tmp_path, "--max-steps=6", "--eval-every=0"))
    assert "holds another run's checkpoints (ckpt_000002.pt.diverged the last written)" in capsys.readouterr().err


def test_after_a_nan_stop_resume_auto_takes_a_checkpoint_with_a_finite_loss(tokens_512, tmp_path, capsys):
    # the loss of step s comes from the weights in ckpt_s: a NaN there condemns ckpt_s, written after step s - 1
    common = ["--device=cpu", "--ckpt-every=1", "--keep-last=3", "--eval-every=0"]
    train.main(v512_args(tokens_512, tmp_path, *common, "--max-steps=6"))
    blown = train.main(v512_args(tokens_512, tmp_path, *common, "--resume=auto", "--max-lr=1e6", "--max-steps=20"))
    assert blown["stopped"] == "nan" and blown["step"] == 8 and math.isfinite(blown["losses"][-1])
    assert sorted(p.name for p in tmp_path.glob("ckpt_*")) == ["ckpt_000006.pt", "ckpt_000007.pt",
                                                               "ckpt_000008.pt.diverged"]
    # one mtime for all three, as a coarse clock (1 s on HFS+ and some NFS, 2 s on FAT) leaves them: the note was lost
    tie = (tmp_path / "ckpt_000007.pt").stat().st_mtime_ns
    for path in tmp_path.glob("ckpt_*"):
        os.utime(path, ns=(tie, tie))
    capsys.readouterr()
    calm = train.main(v512_args(tokens_512, tmp_path, *common, "--resume=auto", "--max-lr=1e-3", "--max-steps=20"))
    out = capsys.readouterr().out
    assert "note: passing over ckpt_000008.pt.diverged: the run that wrote it set it aside, as its weights gave a " \
        "NaN/inf loss or gradient norm at step 8" in out
    assert f"resumed from {tmp_path / 'ckpt_000007.pt'} at step 7" in out
    assert "stopped" not in calm and calm["step"] == 20 and all(math.isfinite(loss) for loss in calm["losses"])
    assert calm["losses"][0] == blown["losses"][-1]  # step 7's loss, computed before the update from ckpt_000007
    # the step has been trained through, and ckpt_000008 written anew: a later resume passes over nothing
    train.main(v512_args(tokens_512, tmp_path, *common, "--resume=auto", "--max-steps=21"))
    assert "note: passing over" not in capsys.readouterr().out


def test_keep_last_never_deletes_the_newest_known_good_checkpoint(tokens_512, tmp_path, monkeypatch, capsys):
    # --keep-last 1 would keep only the newest, ckpt_000004, whose weights then give the NaN: ckpt_000003 stays
    real_step = par.train_step
    calls = {"n": 0}

    def nan_on_fifth_step(*args, **kwargs):
        loss, norm = real_step(*args, **kwargs)
        calls["n"] += 1
        return (loss * float("nan"), norm) if calls["n"] == 5 else (loss, norm)

    common = ["--device=cpu", "--ckpt-every=1", "--keep-last=1", "--eval-every=0", "--max-steps=6"]
    monkeypatch.setattr(stage, "train_step", nan_on_fifth_step)
    first = train.main(v512_args(tokens_512, tmp_path, *common))
    monkeypatch.undo()
    assert first["stopped"] == "nan" and first["step"] == 4
    assert sorted(p.name for p in tmp_path.glob("ckpt_*")) == ["ckpt_000003.pt", "ckpt_000004.pt.diverged"]
    again = train.main(v512_args(tokens_512, tmp_path, *common, "--resume=auto"))
    assert again["losses"][0] == first["losses"][3]  # resumed at step 3, bitwise
    assert sorted(p.name for p in tmp_path.glob("ckpt_*")) == ["ckpt_000004.pt.diverged", "ckpt_000005.pt",
                                                               "ckpt_000006.pt"]  # ckpt_000005 was known good


def test_main_gives_the_callers_signal_handlers_back(tokens_512, tmp_path):
    # the run's preemption and Ctrl-C handlers must not outlive it in a process that goes on (and in the processes
    # it forks)
    def mine(*args):
        pass

    def also_mine(*args):
        pass

    previous = signal.signal(signal.SIGTERM, mine), signal.signal(signal.SIGINT, also_mine)
    try:
        train.main(v512_args(tokens_512, tmp_path, "--max-steps=1", "--eval-every=0"))
        assert signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGINT) is also_mine
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])


def test_diverged_run_exits_nonzero(token_data, tmp_path):
    proc = subprocess.run([sys.executable, "train.py", *tiny_args(token_data, tmp_path, "--max-lr=1e4",
                                                                  "--warmup-steps=0", "--grad-clip=0", "--max-steps=20",
                                                                  "--eval-every=0")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "stopping without writing a checkpoint" in proc.stderr and not list(tmp_path.glob("ckpt_*.pt"))


def test_an_error_on_two_ranks_exits_1_on_each_with_its_message(tmp_path):
    # the process group is up when the data check fails; each rank must print the reason and exit 1 (torchrun
    # names every failed rank's exit code), neither hanging in a barrier nor aborting (-6) at finalization
    empty = tmp_path / "no_shards"
    empty.mkdir()
    proc = run_torchrun(["train.py", *tiny_args(empty, tmp_path / "out", "--max-steps=2")], nproc=2, check=False)
    assert proc.returncode != 0
    errors = re.findall("^error: .*", proc.stderr, re.M)
    assert len(errors) == 2, proc.stderr[-3000:]  # each on a line of its own
    assert all(f"no train shards in {empty} " in line for line in errors), errors  # the reason, not just any error
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)
    assert codes and set(codes) == {"1"}, proc.stderr[-3000:]


def test_ranks_that_find_different_checkpoints_fail_before_fsdp_restore_can_hang(tokens_512, tmp_path):
    # a node that cannot see --out-dir finds no checkpoint; FSDP's restore is a collective the other rank would wait
    # in forever, so the ranks must compare steps before it and stop with the reason
    out = tmp_path / "run"
    train.main(v512_args(tokens_512, out, "--max-steps=2", "--eval-every=0"))
    script = tmp_path / "rank1_sees_no_checkpoint.py"
    script.write_text(f"""import os, sys
sys.path.insert(0, {str(ROOT)!r})
import engine, train
if os.environ["RANK"] == "1":  # this node cannot see --out-dir
    engine.find_checkpoint = lambda out_dir, unreadable=None: None
    engine.checkpoints = lambda out_dir: []
train.run_and_exit(train.main)
""")
    proc = run_torchrun([str(script), *v512_args(tokens_512, out, "--max-steps=4", "--eval-every=0",
                                                 "--parallel=fsdp", "--resume=auto")],
                        nproc=2, timeout=120, check=False)
    assert proc.returncode != 0
    assert proc.stderr.count("error: ranks resumed different steps [2, None]") == 2, proc.stderr[-3000:]
    # a refusal on one rank (here rank 0's: a fresh run over checkpoints) reaches the other as its reason
    proc = run_torchrun([str(script), *v512_args(tokens_512, out, "--max-steps=4", "--eval-every=0",
                                                 "--parallel=fsdp")], nproc=2, timeout=120, check=False)
    assert proc.returncode != 0
    assert "error: --out-dir" in proc.stderr and "error: rank 0: --out-dir" in proc.stderr, proc.stderr[-3000:]
    assert "gloo" not in proc.stderr.lower(), proc.stderr[-3000:]


def test_overfit_resume_is_exact_and_the_log_has_each_step_once(tokens_512, tmp_path):
    args = v512_args(tokens_512, tmp_path, "--overfit-batch", "--max-steps=6", "--ckpt-every=3", "--keep-last=5",
                     "--eval-every=3")
    full = train.main(args)["losses"]
    (tmp_path / "ckpt_000006.pt").unlink()  # as if the run had died after step 5, its log already written
    rest = train.main([*args, "--resume=auto"])["losses"]
    assert rest == full[3:]  # the same first batch after the resume, not the batch at the loader's position
    records = list(iter_log(tmp_path / "log.jsonl"))
    assert [r["step"] for r in records if r["type"] == "train"] == [0, 1, 2, 3, 4, 5]
    assert [r["step"] for r in records if r["type"] == "val"] == [0, 3, 6]
    assert [r["type"] for r in records].count("config") == 2


def test_a_log_line_cut_short_by_a_crash_does_not_block_the_resume(tokens_512, tmp_path):
    args = v512_args(tokens_512, tmp_path, "--max-steps=4", "--ckpt-every=2", "--eval-every=0")
    train.main(args)
    (tmp_path / "ckpt_000004.pt").unlink()
    log = tmp_path / "log.jsonl"
    with open(log, "a") as f:  # the VM died mid-write: the log is not fsynced, so its tail can be half a record
        f.write('{"type": "train", "step": 4, "lo')
    assert [r["step"] for r in iter_log(log) if r["type"] == "train"] == [0, 1, 2, 3]  # plot.py's view
    train.main([*args, "--resume=auto"])
    records = list(iter_log(log))
    assert [r["step"] for r in records if r["type"] == "train"] == [0, 1, 2, 3]
    assert log.read_text().endswith("}\n")
    # a damaged line anywhere else is not a crash's trace: an error that says where
    lines = log.read_text().splitlines(keepends=True)
    log.write_text("".join([lines[0], "{not json\n", *lines[1:]]))
    with pytest.raises(ValueError, match=r"log.jsonl, line 2: not a JSON record"):
        list(iter_log(log))


def test_a_fresh_run_does_not_overwrite_another_runs_directory(tokens_512, tmp_path, capsys):
    args = v512_args(tokens_512, tmp_path, "--max-steps=3", "--ckpt-every=1", "--keep-last=2", "--eval-every=0")
    train.main(args)
    log = (tmp_path / "log.jsonl").read_text()
    with pytest.raises(SystemExit):  # forgot --resume auto: the log and the checkpoints must survive
        train.main(args)
    assert ("holds another run's checkpoints (ckpt_000003.pt the last written): continue that run with --resume "
            "auto") in capsys.readouterr().err
    assert (tmp_path / "log.jsonl").read_text() == log
    assert sorted(p.name for p in tmp_path.glob("ckpt_*.pt")) == ["ckpt_000002.pt", "ckpt_000003.pt"]
    with pytest.raises(SystemExit):  # resuming past the end would train nothing and say nothing
        train.main([*args, "--max-steps=2", "--resume=auto"])  # the later flag wins
    assert "is at step 3, past --max-steps 2; raise --max-steps" in capsys.readouterr().err
    # a finished run resumed (a scheduler's relaunch, say) is not past its end: it trains and writes nothing more
    again = train.main([*args, "--resume=auto"])
    assert again["step"] == 3 and again["losses"] == []
    assert sorted(p.name for p in tmp_path.glob("ckpt_*.pt")) == ["ckpt_000002.pt", "ckpt_000003.pt"]
    assert [r["step"] for r in iter_log(tmp_path / "log.jsonl") if r["type"] == "train"] == [0, 1, 2]
    log = (tmp_path / "log.jsonl").read_text()
    for ckpt in tmp_path.glob("ckpt_*.pt"):  # none loads: starting from scratch would bury them
        ckpt.write_bytes(b"torn")
    with pytest.raises(SystemExit):
        train.main([*args, "--resume=auto"])
    assert "none of the 2 checkpoints in" in capsys.readouterr().err
    assert (tmp_path / "log.jsonl").read_text() == log
    with pytest.raises(SystemExit):  # nor may an evaluation score a random model as if it were the run's
        train.main([*args, "--resume=auto", "--eval-only"])
    assert "none of the 2 checkpoints in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main(v512_args(tokens_512, tmp_path / "empty", "--resume=auto", "--eval-only"))
    assert "--eval-only --resume auto: no checkpoint in" in capsys.readouterr().err


def test_a_wrong_shaped_tensor_in_a_resumed_checkpoint_is_one_line(tokens_512, tmp_path, capsys):
    train.main(v512_args(tokens_512, tmp_path / "run", "--max-steps=1", "--eval-every=0"))
    ckpt = load_checkpoint(tmp_path / "run" / "ckpt_000001.pt")
    ckpt["model"]["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(3, 5)
    bad = tmp_path / "bad.pt"
    torch.save(ckpt, bad)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        train.main(v512_args(tokens_512, tmp_path / "run", "--max-steps=2", "--eval-every=0", f"--resume={bad}"))
    n_embd = ckpt["model_config"]["n_embd"]
    assert e.value.code == 1 and capsys.readouterr().err == (
        f"error: checkpoint {bad}: the weights do not fit its model_config: 1 tensors do not fit "
        f"(transformer.h.1.mlp.c_fc.weight is (3, 5), the config makes it ({4 * n_embd}, {n_embd})); pass a "
        "checkpoint as train.py wrote it\n")


def note_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("note: the checkpoint's run had --max-steps")]


def test_an_extended_run_keeps_the_evaluations_of_its_last_step(tokens_512, tmp_path):
    # the resume cuts log.jsonl at the checkpoint's step 3: the finished run's final evaluations there are put back
    args = ["--eval-every=2", "--eval-tokens=512", "--hellaswag=off"]
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=3", *args))
    first = {r["step"]: r["val_loss"] for r in iter_log(tmp_path / "log.jsonl") if r["type"] == "val"}
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=5", *args, "--resume=auto"))
    vals = [(r["step"], r["val_loss"]) for r in iter_log(tmp_path / "log.jsonl") if r["type"] == "val"]
    assert [step for step, _ in vals] == [0, 2, 3, 4, 5]
    assert dict(vals)[3] == first[3] and sorted(first) == [0, 2, 3]  # the record itself, put back


def test_a_run_finished_at_its_checkpoints_step_keeps_its_evaluations_there_when_extended(tokens_512, tmp_path,
                                                                                         monkeypatch):
    # a run stopped after step 2 (ckpt 3 of a 6-step run) is finished with --max-steps 3, then extended: the resume
    # cuts log.jsonl at 3, where that finish logged its final val record (the checkpoint's max_steps is 6, not 3)
    real, calls = engine.StopFlags.should_stop, []
    monkeypatch.setattr(engine.StopFlags, "should_stop", lambda self: calls.append(1) or (
        "max_time" if len(calls) == 4 else real(self)))  # the 4th check: after step 2
    args = ["--eval-every=5", "--eval-tokens=512", "--hellaswag=off"]
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=6", *args))
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=3", *args, "--resume=auto"))
    finished = {r["step"]: r["val_loss"] for r in iter_log(tmp_path / "log.jsonl") if r["type"] == "val"}
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=6", *args, "--resume=auto"))
    vals = [(r["step"], r["val_loss"]) for r in iter_log(tmp_path / "log.jsonl") if r["type"] == "val"]
    assert sorted(finished) == [0, 3] and [step for step, _ in vals] == [0, 3, 5, 6]
    assert dict(vals)[3] == finished[3]


def test_a_resume_with_another_max_steps_says_the_lr_schedule_is_not_the_original_runs(tokens_512, tmp_path,
                                                                                        capsys):
    # cosine: a finished 4-step run extended to 6 steps decays again from halfway, well above its final lr
    train.main(v512_args(tokens_512, tmp_path / "cos", "--max-steps=4", "--eval-every=0"))
    capsys.readouterr()
    train.main(v512_args(tokens_512, tmp_path / "cos", "--max-steps=6", "--eval-every=0", "--resume=auto"))
    assert note_lines(capsys.readouterr().out) == [
        "note: the checkpoint's run had --max-steps 4, this run has 6: from step 4 the lr is 0.00055, not that run's "
        "0.0001"]
    # wsd holds max_lr until its decay: extended before the decay began, the lr stays the original's until then
    wsd = ["--lr-schedule=wsd", "--eval-every=0", "--ckpt-every=4", "--keep-last=0"]
    train.main(v512_args(tokens_512, tmp_path / "wsd", "--max-steps=10", *wsd))
    capsys.readouterr()
    train.main(v512_args(tokens_512, tmp_path / "wsd2", "--max-steps=20", *wsd, "--max-time=1e-9",
                         f"--resume={tmp_path / 'wsd' / 'ckpt_000004.pt'}"))
    assert note_lines(capsys.readouterr().out) == [
        "note: the checkpoint's run had --max-steps 10, this run has 20: from step 9 the lr is 0.001, not that run's "
        "0.00055"]
    # constant: no schedule depends on --max-steps, and an evaluation trains nothing: no note
    train.main(v512_args(tokens_512, tmp_path / "const", "--max-steps=3", "--eval-every=0", "--lr-schedule=constant"))
    train.main(v512_args(tokens_512, tmp_path / "const", "--max-steps=5", "--eval-every=0", "--lr-schedule=constant",
                         "--resume=auto"))
    train.main(v512_args(tokens_512, tmp_path / "cos", "--max-steps=9", "--eval-only", "--resume=auto"))
    assert note_lines(capsys.readouterr().out) == []
    # another --max-lr changes every later step's lr, whatever the schedule
    train.main(v512_args(tokens_512, tmp_path / "const", "--max-steps=6", "--eval-every=0", "--lr-schedule=constant",
                         "--max-lr=2e-3", "--resume=auto"))
    assert [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: the checkpoint's")] == [
        "note: the checkpoint's run had --max-steps 5 and --max-lr 0.001, this run has 6 and 0.002: from step 5 the lr "
        "is 0.002, not that run's 0.001"]


def test_a_second_run_into_a_live_runs_out_dir_stops_and_a_killed_runs_lock_blocks_nothing(tokens_512, tmp_path,
                                                                                            capsys):
    busy = (f"error: another run is writing to --out-dir {tmp_path}; let it finish, or pass another --out-dir "
            "(an --eval-only run may share it)\n")
    with long_run(tokens_512, tmp_path) as proc:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            train.main(v512_args(tokens_512, tmp_path, "--max-steps=1", "--resume=auto"))
        assert e.value.code == 1 and capsys.readouterr().err == busy
        assert proc.poll() is None  # the live run goes on
        # an evaluation writes nothing there, so it may run beside the live run (fresh weights: ~ln(512) = 6.24)
        assert train.main(v512_args(tokens_512, tmp_path, "--eval-only"))["val_loss"] > 6.0
        log = (tmp_path / "log.jsonl").read_text()
        proc.kill()  # SIGKILL: its lock goes with it
        proc.communicate(timeout=60)
    assert log.startswith('{"type": "config"')
    assert train.main(v512_args(tokens_512, tmp_path, "--max-steps=1", "--eval-every=0", "--resume=auto"))["step"] == 1


def test_under_torchrun_every_rank_stops_with_the_out_dir_lock_holders_reason(token_data, tmp_path):
    from common import hold_lock

    held = hold_lock(tmp_path / ".train.lock", "held by the test", "")
    try:
        proc = run_torchrun(["train.py", *tiny_args(token_data, tmp_path, "--max-steps=1")], nproc=2, check=False)
    finally:
        held.close()
    reason = f"another run is writing to --out-dir {tmp_path}; let it finish"
    assert proc.returncode != 0 and f"error: {reason}" in proc.stderr and f"error: rank 0: {reason}" in proc.stderr
    assert proc.stderr.count("error: ") == 2 and set(re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr)) == {"1"}
    assert not list(tmp_path.glob("ckpt_*")) and not (tmp_path / "log.jsonl").exists()


def unwritable(tmp_path: Path) -> tuple[Path, str]:
    """A directory this process cannot write in, and the reason creating a file there gives. Root writes anywhere
    chmod allows, so for root a sysfs directory, which nobody writes files into."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    for folder in (ro, Path("/sys/kernel")):
        try:
            (folder / ".probe").open("a").close()
            (folder / ".probe").unlink()
        except OSError as e:
            return folder, e.strerror
    pytest.skip("no directory here refuses this process's writes")


def test_an_out_dir_that_cannot_be_written_is_refused_before_anything_runs(token_data, tmp_path, capsys):
    folder, reason = unwritable(tmp_path)
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(token_data, folder, "--max-steps=1"))
    assert e.value.code == 1 and capsys.readouterr() == ("", f"error: cannot write to --out-dir {folder} ({reason}); "
                                                             "pass a directory you can write to\n")
    try:
        (folder / "run").mkdir()
    except OSError as err:
        reason = err.strerror
    with pytest.raises(SystemExit):  # nor can it be made there
        train.main(tiny_args(token_data, folder / "run", "--max-steps=1"))
    assert capsys.readouterr().err == (f"error: cannot write to --out-dir {folder / 'run'} ({reason}); pass a "
                                       "directory you can write to\n")
    (tmp_path / "ro").chmod(0o755)


def test_resume_auto_names_a_later_step_it_passes_over(tokens_512, tmp_path, capsys):
    # "newest" is the last written (so a rewind continues); files copied without their times may lose that order
    args = v512_args(tokens_512, tmp_path, "--max-steps=3", "--ckpt-every=1", "--keep-last=5", "--eval-every=0")
    train.main(args)
    # as if copied last; a second later, not now: the kernel's coarse file clock gave ckpt_000003's mtime again
    last = (tmp_path / "ckpt_000003.pt").stat().st_mtime_ns + 10**9
    os.utime(tmp_path / "ckpt_000001.pt", ns=(last, last))
    capsys.readouterr()
    result = train.main([*args, "--resume=auto"])
    out = capsys.readouterr().out
    assert "note: resuming ckpt_000001.pt, the checkpoint written last; ckpt_000003.pt has a later step" in out
    assert len(result["losses"]) == 2


def test_tokens_axis_survives_a_resume_with_another_total_batch(tokens_512, tmp_path):
    common = ["--max-steps=4", "--ckpt-every=2", "--eval-every=0", "--batch-size=4"]
    train.main(v512_args(tokens_512, tmp_path, *common, "--total-batch-size=256", "--max-steps=2"))
    assert load_checkpoint(tmp_path / "ckpt_000002.pt")["tokens"] == 2 * 256
    train.main(v512_args(tokens_512, tmp_path, *common, "--total-batch-size=512", "--resume=auto"))
    tokens = [r["tokens"] for r in iter_log(tmp_path / "log.jsonl") if r["type"] == "train"]
    assert tokens == [256, 512, 1024, 1536]  # steps 2 and 3 trained on 512 tokens each
    assert load_checkpoint(tmp_path / "ckpt_000004.pt")["tokens"] == 1536


@pytest.mark.parametrize(("shuffle", "where", "step"), [
    # each shard's windows in order: on after the 4 windows of 4 x 64 tokens served, which are 2 windows of 8 x 64
    # (both runs read the same first shard of the seeded order), then 2 steps
    ("shards", "on, none served twice", 4),
    # shuffled: the 4 windows served are scattered over the shard, so on at the next one (after its 39 windows of
    # 8 x 64), skipping the 78 - 4 windows of 4 x 64 of the 20,000-token shard that were not served
    ("windows", "on at the next shard, skipping this one's 18,944 unserved tokens, none served twice", 39 + 2),
])
def test_resume_with_another_micro_batch_keeps_the_data_position_and_the_total_batch(tokens_512, tmp_path, capsys,
                                                                                     shuffle, where, step):
    # moved to a GPU with other memory, a run resumes with another --batch-size: grad accumulation changes so the
    # step keeps its 512 tokens, and the loader goes on without serving a window twice
    common = ["--eval-every=0", "--ckpt-every=2", "--max-steps=4", f"--shuffle={shuffle}"]
    train.main(v512_args(tokens_512, tmp_path, *common, "--max-steps=2"))  # the tiny preset: B=4, 2 micro-steps
    loader = load_checkpoint(tmp_path / "ckpt_000002.pt")["loader"]
    assert (loader["B"], loader["step"], loader["shuffle"]) == (4, 4, shuffle)
    capsys.readouterr()
    result = train.main(v512_args(tokens_512, tmp_path, *common, "--batch-size=8", "--resume=auto"))
    out = capsys.readouterr().out
    assert (f"note: the checkpoint read 4-sequence windows with --shuffle {shuffle}, this run reads 8-sequence windows "
            f"with --shuffle {shuffle}: the data goes {where}") in out
    assert "512 tokens/step = 8 x 64 x 1 ranks x 1 accum" in out and all(map(math.isfinite, result["losses"]))
    loader = load_checkpoint(tmp_path / "ckpt_000004.pt")["loader"]
    assert (loader["B"], loader["step"]) == (8, step)
    tokens = [r["tokens"] for r in iter_log(tmp_path / "log.jsonl") if r["type"] == "train"]
    assert tokens == [512, 1024, 1536, 2048]


def test_eval_only_needs_no_total_batch_and_hub_failures_are_one_line(token_data, tmp_path, capsys):
    # nothing trains, so a total batch the micro-batch does not divide is no reason to refuse
    # and it evaluates once, whatever --eval-every says
    result = train.main(tiny_args(token_data, tmp_path, "--eval-only", "--batch-size=3", "--eval-tokens=192",
                                  "--eval-every=0"))
    assert result["step"] == 0 and math.isfinite(result["val_loss"])
    assert "evaluating at step 0 | 3 x 64 x 1 ranks" in capsys.readouterr().out
    # a hub name that cannot be fetched (no network here; a missing repo elsewhere): a line, not a traceback
    with pytest.raises(SystemExit):
        train.main(tiny_args(token_data, tmp_path, "--eval-only", "--init-from=no-such-org-xyz/gpt2-nope"))
    err = capsys.readouterr().err
    assert err.startswith("error: could not get 'no-such-org-xyz/gpt2-nope' from the HF hub") and err.count("\n") == 1
    # a checkpoint path with a typo also has a hub id's form (org/name.pt): it is named as a missing file instead
    with pytest.raises(SystemExit):
        train.main(tiny_args(token_data, tmp_path, "--eval-only", "--init-from=out/ckpt_nope.pt"))
    assert capsys.readouterr().err == ("error: --init-from out/ckpt_nope.pt: no such file or directory (nor a "
                                       "hub name)\n")


def test_out_of_gpu_memory_says_what_to_change(token_data, tmp_path, monkeypatch, capsys):
    # what a first run on a smaller GPU meets: torch's allocation failure (CUDA's; raised here by the step itself)
    # becomes the flags to change, with torch's own first line kept
    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.14 GiB. GPU 0 has a total "
                                          "capacity of 79.19 GiB\nOf the allocated memory 70.1 GiB is allocated")

    monkeypatch.setattr(stage, "train_step", oom)
    with pytest.raises(SystemExit) as e:
        train.main(tiny_args(token_data, tmp_path, "--max-steps=1", "--eval-every=0"))
    assert e.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        "error: out of GPU memory at --batch-size 4: lower it (gradient accumulation keeps --total-batch-size), or "
        "add --recompute mlp (every stage takes it); the README's 'Micro-batch by GPU memory' has starting points",
        "(torch: CUDA out of memory. Tried to allocate 6.14 GiB. GPU 0 has a total capacity of 79.19 GiB)"]


def test_eval_tokens_are_capped_at_the_val_windows(tmp_path, capsys):
    # a val shard of 3 windows of B*T+1 = 257 tokens: 5 windows would score 2 of them twice, weighting them double
    val = tmp_path / "val"
    val.mkdir()
    write_shard(val / "rand_val_000000.bin", np.random.default_rng(1).integers(0, 50257, 1000, dtype=np.uint16))
    args = tiny_args(val, tmp_path / "out", "--eval-only", "--eval-tokens=1280")
    capped = train.main(args)["val_loss"]
    assert "val: each evaluation scores 768 tokens (3 x B*T = 256), not --eval-tokens 1,280: whole windows, at most " \
           "the val split's" in capsys.readouterr().out
    cfg = parse_config(train.TrainConfig, args, train.PRESETS)
    torch.manual_seed(cfg.seed)  # the run's initial weights, scored on the 3 windows once each
    init = GPT(train.model_config(cfg))
    loader = TokenLoader(str(val), "val", cfg.batch_size, cfg.seq_len, 0, 1, cfg.seed, torch.device("cpu"))
    with torch.no_grad():
        assert capped == pytest.approx(sum(init(*loader.next_batch())[1].item() for _ in range(3)) / 3, abs=1e-6)


def test_val_loss_scores_the_same_tokens_at_any_micro_batch(tokens_512, tmp_path, capsys):
    # --eval-tokens counts tokens, so B = 2, 4 and 8 (8, 4 and 2 windows of B*64) score the val shard's first 1,024
    # tokens: the same number up to float rounding. A B*T that does not divide it rounds up to whole windows
    scores = [train.main(v512_args(tokens_512, tmp_path / str(b), "--eval-only", f"--batch-size={b}",
                                   "--eval-tokens=1024"))["val_loss"] for b in (2, 4, 8)]
    assert scores[0] > 6 and scores == pytest.approx([scores[0]] * 3, abs=1e-6)  # ~ln(512) = 6.24
    out = capsys.readouterr().out
    assert "val:" not in out
    rounded = train.main(v512_args(tokens_512, tmp_path / "3", "--eval-only", "--batch-size=3", "--eval-tokens=1024"))
    assert "val: each evaluation scores 1,152 tokens (6 x B*T = 192), not --eval-tokens 1,024: whole windows" \
        in capsys.readouterr().out
    assert abs(rounded["val_loss"] - scores[0]) > 1e-4  # 128 more tokens


def test_out_dir_that_is_a_file_is_refused_before_anything_runs(token_data, tmp_path, capsys):
    (tmp_path / "out").write_text("")
    with pytest.raises(SystemExit):
        train.main(tiny_args(token_data, tmp_path / "out", "--max-steps=1"))
    assert f"--out-dir {tmp_path / 'out'} is a file, not a directory" in capsys.readouterr().err


def test_rewinding_to_an_older_checkpoint_keeps_and_resumes_the_new_ones(tokens_512, tmp_path):
    common = ["--max-steps=9", "--ckpt-every=3", "--eval-every=0"]
    train.main(v512_args(tokens_512, tmp_path, *common, "--keep-last=5"))
    assert sorted(p.name for p in tmp_path.glob("ckpt_*.pt")) == ["ckpt_000003.pt", "ckpt_000006.pt",
                                                                 "ckpt_000009.pt"]
    # rewind to step 3 (say, before a loss spike) and stop after one step
    train.main(v512_args(tokens_512, tmp_path, *common, "--keep-last=2", f"--resume={tmp_path / 'ckpt_000003.pt'}",
                         "--max-time=0.000001"))
    # --keep-last 2 keeps ckpt_000004 and ckpt_000009, and ckpt_000003: the newest known good (its step trained to a
    # finite loss; ckpt_000004's has not been trained yet)
    assert sorted(p.name for p in tmp_path.glob("ckpt_*.pt")) == ["ckpt_000003.pt", "ckpt_000004.pt",
                                                                 "ckpt_000009.pt"]
    path, ckpt = engine.find_checkpoint(tmp_path, [])
    assert path.name == "ckpt_000004.pt" and ckpt["step"] == 4  # not the abandoned ckpt_000009


def test_resuming_a_checkpoint_older_than_the_newest_is_a_rewind(tmp_path, monkeypatch):
    # Checkpointer.find's rewinding (the run log then drops the abandoned steps): only for a checkpoint older than the
    # one written last, whichever way it was named (a relative --resume PATH too)
    for step, written in ((3, 1), (6, 2)):
        torch.save({"model": {}, "model_config": {}, "step": step}, tmp_path / f"ckpt_{step:06d}.pt")
        os.utime(tmp_path / f"ckpt_{step:06d}.pt", ns=(written * 10**9, written * 10**9))

    def found(resume: str) -> tuple[str, bool]:
        ckpt = engine.Checkpointer(train.TrainConfig(out_dir=str(tmp_path), resume=resume))
        path = ckpt.find()[0]
        assert ckpt.newest == path.resolve()
        return path.name, ckpt.rewinding

    assert found("auto") == ("ckpt_000006.pt", False)
    assert found(str(tmp_path / "ckpt_000006.pt")) == ("ckpt_000006.pt", False)
    assert found(str(tmp_path / "ckpt_000003.pt")) == ("ckpt_000003.pt", True)
    monkeypatch.chdir(tmp_path)
    assert found("ckpt_000006.pt") == ("ckpt_000006.pt", False) and found("ckpt_000003.pt") == ("ckpt_000003.pt", True)


def test_find_checkpoint_skips_files_it_cannot_read_for_the_newest_that_loads(tmp_path, capsys):
    # written last but unreadable: a checkpoint cut short (a copy interrupted, a full disk), and a path that cannot
    # be opened as a file (OSError rather than ValueError); the one before them is resumed, and each skip is named
    good = tmp_path / "ckpt_000002.pt"
    torch.save({"model": {}, "model_config": {}, "step": 2}, good)
    torn = tmp_path / "ckpt_000004.pt"
    torn.write_bytes(good.read_bytes()[:len(good.read_bytes()) // 2])
    (tmp_path / "ckpt_000003.pt").mkdir()
    for path, written in ((good, 1), (tmp_path / "ckpt_000003.pt", 2), (torn, 3)):
        os.utime(path, ns=(written * 10**9, written * 10**9))
    unreadable = []
    path, ckpt = engine.find_checkpoint(tmp_path, unreadable)
    assert path == good and ckpt["step"] == 2 and unreadable == [torn, tmp_path / "ckpt_000003.pt"]  # newest first
    err = capsys.readouterr().err
    assert err.count("warning: skipping unreadable checkpoint") == 2
    assert f"checkpoint {torn} is corrupt or truncated" in err and f"checkpoint {tmp_path / 'ckpt_000003.pt'} is a " \
        "directory" in err
    # --resume auto says why it passed over a later step only for a file written before the one it resumes: the
    # unreadable ones were written after it, and the warnings above already name them
    auto = train.TrainConfig(resume="auto", out_dir=str(tmp_path))
    assert engine.Checkpointer(auto).find_resume()[0] == good and "note: resuming" not in capsys.readouterr().out
    rewound = tmp_path / "ckpt_000005.pt"
    torch.save({"model": {}, "model_config": {}, "step": 5}, rewound)
    os.utime(rewound, ns=(0, 0))  # written before ckpt_000002: the run was rewound to step 2 after it
    assert engine.Checkpointer(auto).find_resume()[0] == good
    assert "ckpt_000005.pt has a later step but was written earlier" in capsys.readouterr().out


def test_keep_last_counts_only_the_checkpoints_that_load(tokens_512, tmp_path, capsys):
    # the newest checkpoint is corrupt (a disk error, a copy cut short): the run resumes the one before it, and the
    # corrupt file must not take a good one's place among the --keep-last 3, nor be deleted behind the user's back
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=6", "--ckpt-every=2", "--keep-last=5", "--eval-every=0"))
    torn = tmp_path / "ckpt_000006.pt"
    torn.write_bytes(torn.read_bytes()[:1000])
    capsys.readouterr()
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=7", "--ckpt-every=0", "--keep-last=3", "--eval-every=0",
                         "--resume=auto"))
    assert "(left in place; --keep-last does not count it)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.glob("ckpt_*.pt")) == ["ckpt_000002.pt", "ckpt_000004.pt", "ckpt_000006.pt",
                                                                 "ckpt_000007.pt"]
    assert load_checkpoint(tmp_path / "ckpt_000007.pt")["step"] == 7
    # without ckpt_000007, resumed from step 4 again and past step 6 with checkpoints every 2 steps: ckpt_000006 is
    # written anew, readable, and counted again, so the oldest good one goes
    (tmp_path / "ckpt_000007.pt").unlink()
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=8", "--ckpt-every=2", "--keep-last=3", "--eval-every=0",
                         "--resume=auto"))
    assert sorted(p.name for p in tmp_path.glob("ckpt_*.pt")) == ["ckpt_000004.pt", "ckpt_000006.pt", "ckpt_000008.pt"]
    assert load_checkpoint(tmp_path / "ckpt_000006.pt")["step"] == 6


def rot(path: Path, size: int = 100_000) -> None:
    """Zero `size` bytes in the middle of a file: the zip around them stays well-formed, its CRC-32s no longer match."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2 - size // 2)
        f.write(bytes(size))


def test_a_checkpoint_whose_bytes_rotted_is_skipped_and_the_resume_is_exact(tokens_512, tmp_path, capsys):
    import export
    import hellaswag
    import sample

    common = ["--device=cpu", "--lr-schedule=constant", "--ckpt-every=1", "--keep-last=3", "--eval-every=0"]
    full = train.main(v512_args(tokens_512, tmp_path / "full", *common, "--max-steps=12"))["losses"]
    out = tmp_path / "rotted"
    train.main(v512_args(tokens_512, out, *common, "--max-steps=10"))
    newest = out / "ckpt_000010.pt"
    rot(newest)
    assert zipfile.ZipFile(newest).testzip() is not None  # well-formed, and torch.load alone would take it
    why = f"checkpoint {newest} is corrupt or truncated (BadZipFile: Bad CRC-32 for file 'archive/data/"
    capsys.readouterr()
    rest = train.main(v512_args(tokens_512, out, *common, "--max-steps=12", "--resume=auto"))["losses"]
    assert f"warning: skipping unreadable checkpoint {newest}: {why}" in capsys.readouterr().err
    assert rest == full[9:]  # resumed from ckpt_000009: bitwise what the uninterrupted run did
    assert load_checkpoint(newest)["step"] == 10  # written anew by the resumed run
    rot(newest)
    with pytest.raises(SystemExit) as e:
        train.main(v512_args(tokens_512, out, *common, "--max-steps=12", f"--resume={newest}"))
    assert e.value.code == 1 and capsys.readouterr().err.startswith(f"error: {why}")
    examples = str(ROOT / "tests" / "data" / "hellaswag_tiny.jsonl")
    for main, argv in ((sample.main, ["--ckpt", str(newest)]),
                       (hellaswag.main, ["--ckpt", str(newest), "--data", examples]),
                       (export.main, ["--ckpt", str(newest), "--export-hf", str(tmp_path / "hf")])):
        with pytest.raises(SystemExit, match=rf"^error: {re.escape(why)}\d+'\); pass an intact copy, or an earlier "
                                             "checkpoint of the run$"):
            main(argv)


def test_prune_keeps_the_newest_readable_the_milestones_and_the_known_good(tmp_path):
    # on files alone (prune reads names and write times): 8 checkpoints, ckpt_000008 written last
    def kept(tmp: Path, keep_last: int, keep_every: int = 0, good: int = 0, unreadable: tuple = ()) -> list[int]:
        out = tmp / f"{keep_last}-{keep_every}-{good}-{len(unreadable)}"
        out.mkdir()
        for step in range(1, 9):
            (out / f"ckpt_{step:06d}.pt").write_bytes(b"")
            os.utime(out / f"ckpt_{step:06d}.pt", ns=(step * 10**9, step * 10**9))
        ckpt = engine.Checkpointer(train.TrainConfig(out_dir=str(out), ckpt_every=1, keep_last=keep_last,
                                                     keep_every=keep_every))
        ckpt.good = (out / f"ckpt_{good:06d}.pt").resolve() if good else None
        ckpt.unreadable = [out / f"ckpt_{step:06d}.pt" for step in unreadable]
        ckpt.prune()
        return sorted(engine.step_of(p) for p in out.glob("ckpt_*.pt"))

    assert kept(tmp_path, 0) == [1, 2, 3, 4, 5, 6, 7, 8]  # --keep-last 0 keeps all
    assert kept(tmp_path, 1) == [8] and kept(tmp_path, 2) == [7, 8]
    assert kept(tmp_path, 2, keep_every=3) == [3, 6, 7, 8]
    assert kept(tmp_path, 2, good=4) == [4, 7, 8]
    assert kept(tmp_path, 2, unreadable=(8,)) == [6, 7, 8]  # left in place, and not one of the 2


def test_keep_every_checkpoints_survive_pruning(tokens_512, tmp_path):
    (tmp_path / "ckpt_best.pt").write_bytes(b"a user's own file")  # not a step: neither pruned nor resumed from
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=7", "--ckpt-every=1", "--keep-last=2", "--keep-every=3",
                         "--eval-every=0"))
    assert sorted(p.name for p in tmp_path.glob("ckpt_*.pt")) == ["ckpt_000003.pt", "ckpt_000006.pt", "ckpt_000007.pt",
                                                                 "ckpt_best.pt"]
    assert engine.find_checkpoint(tmp_path, [])[0].name == "ckpt_000007.pt"
    with pytest.raises(ValueError, match="--keep-every 5 must be a multiple of --ckpt-every 2"):
        train.TrainConfig(ckpt_every=2, keep_every=5)


def test_profile_writes_a_trace(tokens_512, tmp_path, capsys):
    train.main(v512_args(tokens_512, tmp_path, "--max-steps=5", "--eval-every=0", "--profile", "--profile-steps=1"))
    trace = json.loads((tmp_path / "trace_rank0.json").read_text())
    assert len(trace["traceEvents"]) > 10
    assert "Self CPU" in capsys.readouterr().out


def test_a_run_stopped_right_after_its_profiled_steps_does_not_say_nothing_was_recorded(tmp_path, capsys):
    profiler = engine.Profiler(True, 0, 1, tmp_path)  # --profile-steps 1: step 2 alone, then a Ctrl-C after it
    for step in range(3):
        profiler.step_begins(step)
        profiler.step_ends(step)
    profiler.finish(2)
    trace = tmp_path / "trace_rank0.json"
    assert trace.is_file() and capsys.readouterr().out.endswith(
        f"profile: trace written to {trace} (open in chrome://tracing or ui.perfetto.dev)\n")


# every TrainConfig field with another valid value. The nodes of a run may differ in their paths (each mounts the data
# and out-dir where it will) and in what changes only their own files or figures; any other flag must be the same on
# every node. A field added to TrainConfig must be classified here
OTHER_VALUE = {
    "model": "gpt2-medium", "seq_len": 512, "data": "/other/data", "optimizer": "muon",
    "preload": True, "shuffle": "shards", "total_batch_size": 262144, "batch_size": 32, "max_lr": 3e-4,
    "min_lr_frac": 0.0,
    "lr_schedule": "wsd", "decay_frac": 0.5, "warmup_steps": 700, "max_steps": 100, "weight_decay": 0.0, "beta1": 0.8,
    "beta2": 0.99, "eps": 1e-6, "grad_clip": 0.5, "skip_loss_z": 6.0, "skip_norm_z": 6.0, "label_smoothing": 0.1,
    "device": "cpu", "dtype": "fp32", "compile": False, "compile_mode": "max-autotune", "attention": "math",
    "parallel": "fsdp", "dist_timeout": 60.0, "recompute": "block", "seed": 1338, "peak_tflops": 312.0,
    "eval_every": 100, "eval_tokens": 4096, "hellaswag_every": 100, "hellaswag_limit": 10, "sample_every": 0,
    "sample_tokens": 8,
    "sample_prompt": "def ", "out_dir": "/other/out", "ckpt_every": 1000, "keep_last": 0, "keep_every": 10000,
    "resume": "auto", "log_every": 10, "overfit_batch": True, "eval_only": True, "max_time": 60.0, "profile": True,
    "profile_steps": 5, "tensorboard": True, "wandb": "proj", "print_config": True, "hellaswag": "off",
    "init_from": "gpt2", "core_every": 2000, "core_bundle": "/other/bundle",
}
# --tp/--pp refuse the generating evaluations: both ranks drop them (and run --tp 2 where --sequence-parallel needs it,
# --pp 2 where --pp-schedule does)
SHARDED_VALUE = {"tp": 2, "pp": 2, "sequence_parallel": True, "pp_schedule": "gpipe"}
# the GPTConfig fields, each a flag through TrainConfig.arch
OTHER_ARCH = {"vocab_size": 50257, "n_layer": 6, "n_head": 6, "n_embd": 384, "n_kv_head": 4, "dropout": 0.1,
              "bias": False, "mlp": "swiglu", "pos": "rope", "rope_theta": 5e5, "norm": "rmsnorm", "fused_gelu": True,
              "loss_chunk": 128, "fused_ce": True, "half_residual": True, "head_size": 32,
              "mlp_hidden": 1024}
# paths and a rank's own settings (what a path names is compared as data, weights or examples instead)
MAY_DIFFER = {"data", "out_dir", "resume", "max_time", "peak_tflops", "keep_last", "keep_every", "preload",
              "dist_timeout", "tensorboard", "wandb", "hellaswag", "init_from", "core_bundle"}

AGREEMENT_WORKER = """import json, sys
import torch
import torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import common, engine, stage, train
from fineweb import TokenLoader
rank, spec = int(sys.argv[2]), json.loads(open(sys.argv[3]).read())
dist.init_process_group("gloo", init_method="file://" + spec["store"], rank=rank, world_size=2)
def verdict(fingerprint):
    try:
        engine.agree_fingerprint(lambda: fingerprint, rank, 2)
    except ValueError as e:
        return str(e)
out = {"commands": [verdict({"command": stage.command(train.TrainConfig(**case[rank]))}) for case in spec["commands"]],
       "shared": common.shared_problem(spec["problems"][rank], 2), "data": [], "hellaswag": []}
for dirs in spec["data"]:
    loaders = [TokenLoader(dirs[rank], split, 4, 64, rank, 2, 1337, "cpu") for split in ("train", "val")]
    out["data"].append(verdict({"data": engine.shards_of(loaders)}))
for paths in spec["hellaswag"]:
    ctx = engine.Context(rank, 0, 2)
    examples = train.load_hellaswag(train.TrainConfig(hellaswag=paths[rank], hellaswag_every=1), ctx)
    out["hellaswag"].append(verdict({"--hellaswag file": stage.digest(examples)}))
out["stops"] = []
for signals in spec["signals"]:  # the signal each rank received (None: none): all stop together, naming one
    flags = engine.StopFlags(0, device=torch.device("cpu"), world=2)
    flags.term = signals[rank]
    stopping = flags.should_stop()
    out["stops"].append([stopping, flags.reason if stopping else None])
dist.destroy_process_group()
print("RESULT " + json.dumps(out))
common.exit_now(0)  # past interpreter finalization, which can abort after gloo collectives (docs/notes.md)
"""


def test_ranks_agree_on_commands_data_and_hellaswag_only_where_they_may_differ(token_data, tmp_path):
    # two processes in a gloo group (no torchrun: ~10 s), each passing its own config, data and HellaSwag file to
    # one fingerprint comparison, as two nodes would; the slow two-node test covers the same inside whole runs
    assert set(OTHER_VALUE) | set(SHARDED_VALUE) | {"arch"} == {f.name for f in dataclasses.fields(train.TrainConfig)}
    # (train.py refuses --value-head true: a head no step trains)
    assert set(OTHER_ARCH) == {f.name for f in dataclasses.fields(GPTConfig)} - {"block_size", "value_head"}
    base, arch = dataclasses.asdict(train.TrainConfig()), dataclasses.asdict(train.model_config(train.TrainConfig()))
    commands, expected = [], []
    differ = "rank 1 was started with --{} {!r} (rank 0: {!r}): every node must run the same command"
    for name, other in OTHER_VALUE.items():
        commands.append([{}, {name: other}])
        expected.append(None if name in MAY_DIFFER else differ.format(name.replace("_", "-"), other, base[name]))
    # a preset names its shape: the resolved shape is compared too
    expected[list(OTHER_VALUE).index("model")] = (
        "rank 1 was started with --model 'gpt2-medium' (rank 0: None), --n-layer 24 (rank 0: 12), --n-head 16 (rank 0: "
        "12), --n-embd 1024 (rank 0: 768): every node must run the same command")
    for name, other in OTHER_ARCH.items():
        commands.append([{}, {"arch": {name: other}}])
        expected.append(differ.format(name.replace("_", "-"), other, arch[name]))
    for name, other in SHARDED_VALUE.items():
        both = {"sample_every": 0, "hellaswag": "off", **{"sequence_parallel": {"tp": 2}, "pp_schedule": {"pp": 2}}.get(
            name, {})}
        commands.append([both, {**both, name: other}])
        expected.append(differ.format(name.replace("_", "-"), other, base[name]))
    # data: an identical copy, and copies whose train (then val) split has one token less in one shard
    copies = {}
    for name, short in (("same", None), ("short_train", "rand_train_000002.bin"), ("short_val", "rand_val_000000.bin"),
                        ("other_train", "rand_train_000001.bin")):
        copies[name] = tmp_path / name
        shutil.copytree(token_data, copies[name])
        if short:  # one token less; or as many, the last one other
            tokens = read_shard(token_data / short)[:-1]
            write_shard(copies[name] / short, np.append(tokens, 7) if "other" in name else tokens)
    hs = ROOT / "tests" / "data" / "hellaswag_tiny.jsonl"
    (tmp_path / "hs_copy.jsonl").write_text(hs.read_text())
    lines = hs.read_text().splitlines(keepends=True)
    lines[0] = lines[0].replace("paints the sink bright blue.", "paints the sink bright red.")
    (tmp_path / "hs_other.jsonl").write_text("".join(lines))
    spec = {"store": str(tmp_path / "store"), "commands": commands, "problems": [None, "no data on this node"],
            "data": [[str(token_data), str(copies[name])] for name in copies],
            "hellaswag": [[str(hs), str(tmp_path / name)] for name in ("hs_copy.jsonl", "hs_other.jsonl")],
            "signals": [[None, None], [None, "SIGINT"], ["SIGINT", "SIGTERM"], ["SIGTERM", None]]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    (tmp_path / "worker.py").write_text(AGREEMENT_WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(ROOT), str(rank),
                               str(tmp_path / "spec.json")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for rank in (0, 1)]
    outputs = [proc.communicate(timeout=120) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    results = [json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
               for out, _ in outputs]
    for rank, result in enumerate(results):  # every rank gets the same verdict
        for case, got, want in zip(commands, result["commands"], expected, strict=True):
            assert got == want, (rank, case)
        assert result["shared"] == ("rank 1: no data on this node" if rank == 0 else "no data on this node")
        assert result["data"] == [
            None,
            "rank 1's train shard rand_train_000002.bin holds 19,999 tokens, rank 0's 20,000: every node must hold "
            "the same --data",
            "rank 1's val shard rand_val_000000.bin holds 7,999 tokens, rank 0's 8,000: every node must hold the same "
            "--data",
            "rank 1's train shard rand_train_000001.bin holds other tokens than rank 0's, as many: every node must "
            "hold the same --data"]
        # the same examples in another path are the same HellaSwag; as many other ones stop every rank
        assert result["hellaswag"] == [None, "rank 1's --hellaswag file differs from rank 0's: every node must hold "
                                             "the same --hellaswag file"]
        # one rank's Ctrl-C stops both; SIGTERM (a preemption) is named before Ctrl-C
        assert result["stops"] == [[None, None], ["signal", "Ctrl-C"], ["signal", "SIGTERM"], ["signal", "SIGTERM"]]


# ----------------------------------------------------------------------------------------------------------------------
# distributed (gloo, 2 processes) against one process with the same total batch


@pytest.mark.slow
def test_ddp_zero1_fsdp_match_single_process(token_data, tmp_path):
    # --skip-loss-z: the spike guard's collective (the loss averaged over ranks before the update) runs every step
    # HellaSwag's 5 examples split 3 + 2: each rank scores its own (FSDP's forwards are collectives), the counts summed
    hellaswag = ["--hellaswag=" + str(ROOT / "tests" / "data" / "hellaswag_tiny.jsonl"), "--hellaswag-every=8",
                 "--hellaswag-limit=5"]
    common = ["--max-steps=8", "--ckpt-every=4", "--keep-last=5", "--eval-every=2", "--eval-tokens=768",
              "--total-batch-size=512", "--batch-size=4", "--dropout=0.0", "--skip-loss-z=6", *hellaswag,
              "--weight-decay=0.05", "--beta1=0.85", "--beta2=0.9", "--eps=1e-6"]  # reach AdamW under every wrapper
    single = train.main(tiny_args(token_data, tmp_path / "single", *common))  # 2 micro-steps of accumulation
    ref = load_checkpoint(tmp_path / "single" / "ckpt_000004.pt")["model"]
    # one launch: the three wrappers, then a sharded run resumed from its (full) checkpoint at step 4 on 2 ranks
    runs = [tiny_args(token_data, tmp_path / parallel, *common, f"--parallel={parallel}")
            for parallel in ("ddp", "zero1", "fsdp")]
    runs.append(tiny_args(token_data, tmp_path / "fsdp_again", *common, "--parallel=fsdp",
                          f"--resume={tmp_path / 'fsdp' / 'ckpt_000004.pt'}"))
    proc = run_train_runs(runs, nproc=2, spec=tmp_path / "runs.json")
    assert proc.stdout.count("2 ranks x 1 accum") == 4
    for parallel in ("ddp", "zero1", "fsdp"):
        out = tmp_path / parallel
        ckpt = load_checkpoint(out / "ckpt_000004.pt")
        assert ckpt["world_size"] == 2
        groups = [(g["weight_decay"], tuple(g["betas"]), g["eps"]) for g in ckpt["optimizer"]["param_groups"]]
        assert sorted(groups) == [(0.0, (0.85, 0.9), 1e-6), (0.05, (0.85, 0.9), 1e-6)], parallel  # 2-D tensors decay
        tied = ckpt["model"]["lm_head.weight"], ckpt["model"]["transformer.wte.weight"]
        assert tied[0].data_ptr() == tied[1].data_ptr(), parallel  # stored once, also when FSDP gathers it
        for name, ref_tensor in ref.items():
            torch.testing.assert_close(ckpt["model"][name], ref_tensor, atol=1e-5, rtol=0, msg=f"{parallel} {name}")
        losses = [r["loss"] for r in iter_log(out / "log.jsonl") if r["type"] == "train"]
        assert losses == pytest.approx(single["losses"], abs=1e-5), parallel
        # the val loss scores --eval-tokens 768 = 3 windows, whatever the ranks: 2 on rank 0, 1 on rank 1 (whose
        # second forward, collective under FSDP, is left out), as on one rank
        vals = [[r["val_loss"] for r in iter_log(run / "log.jsonl") if r["type"] == "val"] for run in
                (out, tmp_path / "single")]
        assert len(vals[0]) == 5 and vals[0] == pytest.approx(vals[1], abs=1e-5), parallel
        scores = [[(r["step"], r["n"], r["acc"], r["acc_norm"]) for r in iter_log(run / "log.jsonl")
                   if r["type"] == "hellaswag"] for run in (out, tmp_path / "single")]
        assert [s[:2] for s in scores[0]] == [(0, 5), (8, 5)] and scores[0] == scores[1], parallel
        if parallel == "fsdp":  # the resumed steps 4-7 repeat the uninterrupted ones exactly
            again = [r["loss"] for r in iter_log(tmp_path / "fsdp_again" / "log.jsonl") if r["type"] == "train"]
            assert again == losses[4:]
        # preempted on 2 ranks, resumed on 1: accumulation 2 then sees the same windows, so steps 4-7 (which use
        # the restored AdamW moments) follow the 2-rank run. ZeRO-1 splits its consolidated state anew for its one
        # rank (a group of this process alone); DDP's and FSDP's state seeds a plain single-process AdamW
        (out / "ckpt_000008.pt").unlink()
        with one_rank_group() if parallel == "zero1" else contextlib.nullcontext():
            train.main(tiny_args(token_data, out, *common, f"--parallel={parallel}", "--resume=auto"))
        again = [r["loss"] for r in iter_log(out / "log.jsonl") if r["type"] == "train"]
        assert len(again) == 8 and again == pytest.approx(losses, abs=1e-5), parallel
    # and those were the wrappers named (a --parallel fsdp that fell back to DDP would match as well as FSDP2 does)
    assert re.findall(r"^train_runs: built (\w+) with (\w+)$", proc.stdout, re.M) == [
        ("DistributedDataParallel", "AdamW"), ("DistributedDataParallel", "ZeroRedundancyOptimizer"),
        ("FSDPGPT", "AdamW"), ("FSDPGPT", "AdamW")]


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo group of this process alone (no torchrun to start): ZeRO-1 resumes its state at one rank in it."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", [pytest.param("muon", marks=needs_muon), "adamw8bit"])
def test_muon_and_8bit_adamw_under_ddp_and_zero1_match_single_process(tokens_512, tmp_path, optimizer):
    if optimizer == "adamw8bit":
        pytest.importorskip("torchao", reason="--optimizer adamw8bit needs torchao")
    # ZeRO-1 gives each rank whole tensors: Muon orthogonalizes each matrix on the rank that owns it, and the 8-bit
    # state of a tensor lives on one rank; both then match one process with the same total batch
    common = ["--max-steps=4", "--ckpt-every=2", "--keep-last=5", "--eval-every=0", "--total-batch-size=512",
              "--batch-size=4", "--weight-decay=0.05", f"--optimizer={optimizer}"]
    # one thread here as in run_torchrun's ranks: sums in another order would round Muon's bf16 Newton-Schulz and
    # the 8-bit codes otherwise, and Adam's tiny gradients of unseen tokens' embeddings magnify that past 1e-5
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # torchao compiles its 8-bit step anew for each shape and hyperparameter (~35 s of CI's CPU, cold, per process):
    # here every process runs the same math eagerly (compiled: bench.py's compile+adamw8bit row, on CUDA)
    try:
        with torch.compiler.set_stance("force_eager"):
            single = train.main(v512_args(tokens_512, tmp_path / "single", *common))["losses"]
    finally:
        torch.set_num_threads(threads)
    ref = load_checkpoint(tmp_path / "single" / "ckpt_000004.pt")
    run_train_runs([v512_args(tokens_512, tmp_path / parallel, *common, f"--parallel={parallel}")
                    for parallel in ("ddp", "zero1")], nproc=2, spec=tmp_path / "runs.json",
                   env={"TORCHDYNAMO_DISABLE": "1"})
    for parallel in ("ddp", "zero1"):
        out = tmp_path / parallel
        ckpt = load_checkpoint(out / "ckpt_000004.pt")
        assert (ckpt["optimizer_kind"], ckpt["train_config"]["optimizer"]) == (parallel, optimizer)
        for name, ref_tensor in ref["model"].items():
            torch.testing.assert_close(ckpt["model"][name], ref_tensor, atol=1e-5, rtol=0, msg=f"{parallel} {name}")
        losses = [r["loss"] for r in iter_log(out / "log.jsonl") if r["type"] == "train"]
        assert losses == pytest.approx(single, abs=1e-5), parallel
    # ZeRO-1's consolidated state: every tensor's, with Muon's own hyperparameters (not the AdamW defaults ZeRO-1
    # hands every group), the 8-bit moments as plain tensors
    groups = [(g.get("muon"), g["eps"], g["weight_decay"]) for g in ckpt["optimizer"]["param_groups"]]
    assert groups == ([(True, 1e-7, 0.05), (False, 1e-8, 0.05), (False, 1e-8, 0.0)] if optimizer == "muon" else
                      [(None, 1e-8, 0.05), (None, 1e-8, 0.0)])
    assert len(ckpt["optimizer"]["state"]) == len(ref["optimizer"]["state"]) == 28
    if optimizer == "adamw8bit":
        assert ckpt["optimizer"]["state"][1]["exp_avg"]["codes"].dtype == torch.uint8  # c_attn.weight, (192, 64)
    # preempted at step 2, resumed on 1 rank: ZeRO-1 loads the consolidated state, both ranks' shares, into its one
    # rank, and steps 2-3 follow the 2-rank run
    (tmp_path / "zero1" / "ckpt_000004.pt").unlink()
    torch.set_num_threads(1)
    try:
        with one_rank_group(), torch.compiler.set_stance("force_eager"):
            train.main(v512_args(tokens_512, tmp_path / "zero1", *common, "--parallel=zero1", "--resume=auto"))
    finally:
        torch.set_num_threads(threads)
    again = [r["loss"] for r in iter_log(tmp_path / "zero1" / "log.jsonl") if r["type"] == "train"]
    assert len(again) == 4 and again == pytest.approx(losses, abs=1e-5)


@pytest.mark.slow
def test_two_nodes_train_as_one_and_stop_when_their_commands_data_or_checkpoints_differ(token_data, tmp_path):
    # two nodes, one rank each: each parses its own command line and reads its own files
    common = ["--max-steps=4", "--ckpt-every=2", "--keep-last=5", "--eval-every=2", "--eval-tokens=512",
              "--total-batch-size=512", "--batch-size=4", "--hellaswag=off"]
    single = train.main(tiny_args(token_data, tmp_path / "single", *common))
    # HellaSwag only where every node has it, and the skip names the node that lacks it
    hellaswag = ROOT / "tests" / "data" / "hellaswag_tiny.jsonl"
    same = run_nodes([["train.py", *tiny_args(token_data, tmp_path / "shared", *common, f"--hellaswag={path}",
                                              "--hellaswag-every=2")] for path in (hellaswag, tmp_path / "no.jsonl")])
    assert [r.returncode for r in same] == [0, 0], same[1].stderr[-2000:]
    assert f"hellaswag: skipped (rank 1: {tmp_path / 'no.jsonl'} is not a file); pass --hellaswag PATH" \
        in same[0].stdout
    losses = [r["loss"] for r in iter_log(tmp_path / "shared" / "log.jsonl") if r["type"] == "train"]
    assert losses == pytest.approx(single["losses"], abs=1e-5)

    def refused(node1: list[str], node0: list[str] | None = None) -> list[str]:
        """Both nodes stop, each with the reason (not a lost peer, a hang, or replicas that drift apart)."""
        done = run_nodes([["train.py", *(node0 or tiny_args(token_data, tmp_path / "a", *common))],
                          ["train.py", *node1]])
        assert [r.returncode for r in done] == [1, 1]
        return [next(line for line in r.stderr.splitlines() if line.startswith("error: ")) for r in done]

    # HellaSwag files that differ: evaluate's batch count would differ (FSDP forwards are collectives) or the score
    few = tmp_path / "few.jsonl"
    few.write_text("".join(hellaswag.read_text().splitlines(keepends=True)[:2]))
    short = [*common, "--max-steps=1", "--eval-every=0", "--hellaswag-every=1"]
    assert refused(tiny_args(token_data, tmp_path / "hs", *short, f"--hellaswag={few}"),
                   tiny_args(token_data, tmp_path / "hs", *short, f"--hellaswag={hellaswag}")) == [
        "error: rank 1's --hellaswag file differs from rank 0's: every node must hold the same --hellaswag file"] * 2

    # a flag that differs: a collective would hang (another --max-steps, HellaSwag off on one node) or the replicas
    # drift apart (another lr); one that a rank refuses alone (the batch does not divide) left the others a lost peer
    # a flag one node cannot parse: it still reaches the others, which would wait for it at the rendezvous
    done = run_nodes([["train.py", *tiny_args(token_data, tmp_path / "a", *common)],
                      ["train.py", *tiny_args(token_data, tmp_path / "a", *common, "--max-lrr=3e-3")]])
    assert [r.returncode for r in done] == [1, 1]
    assert "error: rank 1: unknown option --max-lrr; did you mean --max-lr?" in done[0].stderr.splitlines()
    assert "error: unknown option --max-lrr; did you mean --max-lr?" in done[1].stderr.splitlines()
    assert refused(tiny_args(token_data, tmp_path / "a", *common, "--max-lr=3e-3", "--batch-size=3")) == [
        "error: rank 1 was started with --max-lr 0.003 (rank 0: 0.001), --batch-size 3 (rank 0: 4): every node must "
        "run the same command"] * 2
    # a node whose copy lacks a shard indexes other windows: some would be served twice, silently
    partial = tmp_path / "partial"
    partial.mkdir()
    for f in ("rand_val_000000.bin", "rand_train_000001.bin"):
        shutil.copy(token_data / f, partial)
    assert refused(tiny_args(partial, tmp_path / "a", *common)) == [
        "error: rank 1's train shard rand_train_000002.bin holds 0 tokens, rank 0's 20,000: every node must hold the "
        "same --data"] * 2
    # out-dirs that are not shared, each with another run's checkpoint of the same step: restored each on its own
    # rank, after DDP's initial broadcast, they would train two different models for the rest of the run
    train.main(tiny_args(token_data, tmp_path / "other", *common, "--max-lr=3e-3"))
    resume = [*common, "--max-steps=6", "--resume=auto"]
    # nodes that start from other weights (FSDP would shard each rank's own, nothing broadcasts rank 0's)
    init = [*common, "--max-steps=1", "--eval-every=0"]
    reasons = refused(tiny_args(token_data, tmp_path / "i", *init, f"--init-from={tmp_path / 'other/ckpt_000004.pt'}"),
                      tiny_args(token_data, tmp_path / "i", *init, f"--init-from={tmp_path / 'single/ckpt_000004.pt'}"))
    assert reasons[0] == reasons[1] and reasons[0].startswith(
        f"error: rank 1 loaded other weights from --init-from {tmp_path / 'other/ckpt_000004.pt'} than rank 0")
    reasons = refused(tiny_args(token_data, tmp_path / "other", *resume), tiny_args(token_data, tmp_path / "shared",
                                                                                    *resume))
    assert reasons == [f"error: ranks resumed different checkpoints: every node must see the same checkpoints in "
                       f"--out-dir {tmp_path / out} (put it on a shared filesystem, or copy the checkpoint to each "
                       "node and pass --resume PATH)" for out in ("shared", "other")]


@pytest.mark.slow
def test_one_rank_under_torchrun_takes_the_distributed_path(tokens_512, tmp_path, capsys):
    # as in nanoGPT, torchrun means DDP/ZeRO-1/FSDP2 even on one rank: a one-GPU machine then runs the real wrappers
    common = ["--max-steps=4", "--ckpt-every=2", "--keep-last=5", "--eval-every=0"]
    single = train.main(v512_args(tokens_512, tmp_path / "single", *common))["losses"]
    proc = run_train_runs([v512_args(tokens_512, tmp_path / parallel, *common, f"--parallel={parallel}")
                           for parallel in ("ddp", "zero1", "fsdp")], nproc=1, spec=tmp_path / "runs.json")
    # the wrappers themselves, at one rank too (optimizer_kind below is the flag's name whenever a group is up)
    assert re.findall(r"^train_runs: built (\w+) with (\w+)$", proc.stdout, re.M) == [
        ("DistributedDataParallel", "AdamW"), ("DistributedDataParallel", "ZeroRedundancyOptimizer"),
        ("FSDPGPT", "AdamW")]
    for parallel in ("ddp", "zero1", "fsdp"):
        out = tmp_path / parallel
        assert load_checkpoint(out / "ckpt_000004.pt")["optimizer_kind"] == parallel
        losses = [r["loss"] for r in iter_log(out / "log.jsonl") if r["type"] == "train"]
        assert losses == pytest.approx(single, abs=1e-5), parallel
    # (ZeRO-1's own state resuming at one rank under torchrun: test_ddp_zero1_fsdp_match_single_process, from 2 ranks)
    with pytest.raises(SystemExit):  # ZeRO-1 state cannot seed a plain AdamW: the refusal names the fix
        train.main(v512_args(tokens_512, tmp_path / "zero1", *common, "--max-steps=6", "--resume=auto"))
    assert "resume it under torchrun with --parallel zero1" in capsys.readouterr().err
    # an evaluation needs only the weights, so it scores a ZeRO-1 checkpoint without torchrun
    scored = train.main(v512_args(tokens_512, tmp_path / "eval", "--eval-only", "--eval-every=1", "--hellaswag=off",
                                  f"--resume={tmp_path / 'zero1' / 'ckpt_000004.pt'}"))
    ddp_scored = train.main(v512_args(tokens_512, tmp_path / "eval", "--eval-only", "--eval-every=1",
                                      "--hellaswag=off", f"--resume={tmp_path / 'ddp' / 'ckpt_000004.pt'}"))
    assert scored["step"] == 4 and scored["val_loss"] == pytest.approx(ddp_scored["val_loss"], abs=1e-5)


def test_attention_conflicts_are_the_kernels_missing_for_the_device_and_dtype():
    # CPU has the flash and math kernels only; CUDA's flash and cuDNN kernels take no fp32 (efficient and math do)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # a device object needs no GPU
    conflicts = {(name, dtype, dev.type) for name in ("auto", *par.SDPA_SWITCHES) for dtype in ("fp32", "bf16")
                 for dev in (cuda, cpu)
                 if par.attention_conflict(train.TrainConfig(attention=name, dtype=dtype), dev, GPTConfig())}
    assert conflicts == {("efficient", "fp32", "cpu"), ("efficient", "bf16", "cpu"), ("cudnn", "fp32", "cpu"),
                         ("cudnn", "bf16", "cpu"), ("flash", "fp32", "cuda"), ("cudnn", "fp32", "cuda")}


def test_cuda_graph_modes_refuse_gradient_accumulation():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # a device object needs no GPU
    for mode in ("reduce-overhead", "max-autotune"):
        why = par.cuda_graph_conflict(train.TrainConfig(compile_mode=mode), 8, cuda)
        assert why and "max-autotune-no-cudagraphs" in why and "8 micro-steps" in why
        assert par.cuda_graph_conflict(train.TrainConfig(compile_mode=mode), 1, cuda) is None  # nothing accumulates
        assert par.cuda_graph_conflict(train.TrainConfig(compile_mode=mode), 8, cpu) is None  # no CUDA graphs on CPU
    for mode in ("default", "max-autotune-no-cudagraphs"):
        assert par.cuda_graph_conflict(train.TrainConfig(compile_mode=mode), 8, cuda) is None
    # bench.py's attention column reads "n/a" exactly where a step is a graph replay: compiled, on CUDA, these modes
    graphs = {(mode, compiled, dev.type): par.uses_cuda_graphs(train.TrainConfig(compile_mode=mode, compile=compiled),
                                                                 dev)
              for mode in par.COMPILE_MODES for compiled in (True, False, None) for dev in (cuda, cpu)}
    on = {(mode, compiled, "cuda") for mode in ("reduce-overhead", "max-autotune") for compiled in (True, None)}
    assert {k for k, v in graphs.items() if v} == on  # compile=None means compiled on CUDA


@pytest.mark.slow
def test_fsdp_bf16_samples_between_evaluations(token_data, tmp_path):
    # FSDP2 gathers parameters in bf16 for a forward and reshards them to fp32 after the backward: the samples at
    # step 1 and 3 follow a training step, not an evaluation, and must still run (their cache follows the bf16 keys)
    proc = run_torchrun(["train.py", *tiny_args(token_data, tmp_path, "--parallel=fsdp", "--dtype=bf16",
                                                "--max-steps=3", "--sample-every=1", "--sample-tokens=4",
                                                "--eval-every=0", "--total-batch-size=512")], nproc=2)
    assert " | fsdp | bf16" in proc.stdout  # bf16 autocast, and FSDP2's bf16 parameters for compute
    assert proc.stdout.count("sample: ") == 6  # 2 samples at each of steps 1, 2, 3
    assert (tmp_path / "ckpt_000003.pt").is_file()


@pytest.mark.slow
def test_the_graph_break_count_sees_one():
    """The positive control of the compiled runs' 'no graph break' (here and in test_gpu_train.py): graph_breaks finds
    none in what TORCH_LOGS=graph_breaks logs for a whole graph, then the one a torch._dynamo.graph_break() makes."""
    def step(x: torch.Tensor, cut: bool) -> torch.Tensor:
        x = x + 1
        if cut:
            torch._dynamo.graph_break()
        return x * 2

    counts, err = [], io.StringIO()
    with contextlib.redirect_stderr(err):  # torch's log handlers write to the stderr of the moment they are made
        torch._logging.set_logs(graph_breaks=True)  # what TORCH_LOGS=graph_breaks sets in a new process
    try:
        for cut in (False, True):
            torch.compile(step, backend="eager")(torch.ones(3), cut)
            counts.append(len(graph_breaks(err.getvalue())))
    finally:
        torch._logging.set_logs()
    assert counts == [0, 1]


@pytest.mark.slow
def test_compiled_run_with_eval_hellaswag_and_samples(token_data, tmp_path):
    hellaswag_data = ROOT / "tests" / "data" / "hellaswag_tiny.jsonl"
    # T=128: HellaSwag's batches, padded to a multiple of 32 tokens, are shorter than the training sequences
    args = ["--max-steps=3", "--eval-every=2", "--hellaswag-every=2", f"--hellaswag={hellaswag_data}",
            "--sample-every=2", "--sample-tokens=8", "--seq-len=128"]
    # under torchrun, as users run it: DDP wraps the compiled model even at one rank, the wrapping whose order
    # matters (compiling the DDP wrapper instead gave 3 graph breaks a step, in DDP's own forward)
    out = tmp_path / "compiled"
    proc = run_torchrun(["train.py", *tiny_args(token_data, out, "--compile", *args)], nproc=1,
                        env={"TORCH_LOGS": "graph_breaks,recompiles"})
    # HellaSwag's many sequence lengths never reach the compiled model either: no graph break, and one recompile
    # of the forward (evaluation: eval mode and no grad) on top of the training graph
    assert not graph_breaks(proc.stderr), proc.stderr[-3000:]
    # exactly one: none would also mean that TORCH_LOGS no longer reached stderr, and the graph break check was blind
    assert proc.stderr.count("Recompiling function forward") == 1, proc.stderr[-3000:]
    assert "compile True" in proc.stdout and " | ddp | " in proc.stdout
    assert proc.stdout.count("sample: ") == 4  # 2 at step 2 and 2 at the end (step 3)
    # no HellaSwag bar among the step lines: a pipe is no terminal (it drew "hellaswag: 100%|...| 1/1" 3 times)
    assert proc.stdout.count("hellaswag acc_norm") == 3 and "batch/s" not in proc.stderr + proc.stdout
    log = list(iter_log(out / "log.jsonl"))
    compiled = {"losses": [r["loss"] for r in log if r["type"] == "train"],
                "val_loss": [r["val_loss"] for r in log if r["type"] == "val"][-1],
                "hellaswag": [r for r in log if r["type"] == "hellaswag"][-1]}
    eager = train.main(tiny_args(token_data, tmp_path / "eager", *args))
    # the compiled run trains, evaluates and scores HellaSwag like the eager one (to float reassociation)
    assert compiled["losses"] == pytest.approx(eager["losses"], abs=1e-4)
    assert compiled["val_loss"] == pytest.approx(eager["val_loss"], abs=1e-4) and compiled["val_loss"] > 5.0
    assert compiled["hellaswag"]["n"] == eager["hellaswag"]["n"] == 6
    assert (compiled["hellaswag"]["acc"], compiled["hellaswag"]["acc_norm"]) == \
        (eager["hellaswag"]["acc"], eager["hellaswag"]["acc_norm"])


@pytest.mark.slow
def test_attention_choice_is_not_undone_by_compile_caches(monkeypatch):
    """torch.compile's on-disk caches do not key on the SDPA switches: without par.set_sdpa_switches's tag, a
    `math` run compiled after an `auto` one got the cached graph with the flash kernel (on an H200, a `flash` run got
    cuDNN's). Compiled twice each way, the kernel that runs is the one chosen."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.delenv("TORCH_COMPILE_CACHE_KEY_TAG", raising=False)
    cfg = GPTConfig(block_size=32, vocab_size=96, n_layer=1, n_head=2, n_embd=32)
    x = torch.randint(0, 96, (2, 32))

    def sdpa_ops(name: str) -> list[str]:
        torch.compiler.reset()
        par.select_attention(name)
        model = torch.compile(GPT(cfg))
        model(x, x)[1].backward()  # compiles (or loads the cached graph)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            model(x, x)[1].backward()
        return sorted({e.key for e in prof.key_averages() if "scaled_dot_product" in e.key})

    flash = ["aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_flash_attention_for_cpu_backward"]
    try:
        assert [sdpa_ops(n) for n in ("auto", "math", "auto", "math")] == [flash, [], flash, []]  # math: plain ops
        monkeypatch.setenv("TORCH_COMPILE_CACHE_KEY_TAG", "mine-")  # a user's own tag is kept
        par.select_attention("cudnn")
        assert torch.compiler.config.cache_key_tag == "mine-sdpa=cudnn"
        forced = par.sdpa_switches()
        par.select_attention("auto")
        assert torch.compiler.config.cache_key_tag == "mine-"
        par.set_sdpa_switches(forced)  # switches put back (train.main's exit, bench's) put their tag back too
        assert torch.compiler.config.cache_key_tag == "mine-sdpa=cudnn"
    finally:
        monkeypatch.delenv("TORCH_COMPILE_CACHE_KEY_TAG", raising=False)
        torch.compiler.reset()
        par.select_attention("auto")
