"""The training run's machinery, one small object per concern, each owning its state and its cadence.

train.py's loop reads as the story; what each phase does in detail lives here:
    Checkpointer  find, agree across ranks, restore, due(step), save with prune, judge (a NaN sets one aside)
    Evaluator     val loss, HellaSwag and samples: due/run
    RunLog        log.jsonl (and TensorBoard / W&B), the console step line and the ETA
    SpikeGuard    llm.c's loss/grad-norm z-scores that skip an outlier update
    StopFlags     SIGTERM, Ctrl-C and the wall-clock budget, agreed across ranks (a context manager)
    Profiler      a few profiled steps after warmup
Every object that holds state has state_dict()/load_state_dict(); the checkpoint is assembled from them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn as nn

from common import agree, checkpoints, first_on_each_node, get_tokenizer, iter_log, load_checkpoint, shared_problem
from fineweb import TokenLoader

if TYPE_CHECKING:
    from model import GPT
    from train import TrainConfig

# ----------------------------------------------------------------------------------------------------------------------
# Checkpointer


def optimizer_kind(optimizer: torch.optim.Optimizer, parallel: str) -> str:
    """What a checkpoint's optimizer state is: ZeRO-1's own format, or the parameter-keyed one of everything else."""
    if hasattr(optimizer, "consolidate_state_dict"):
        return "zero1"
    return parallel if dist.is_initialized() else "single"


def step_of(path: Path) -> int:
    return int(path.stem.removeprefix("ckpt_"))


class Checkpointer:
    """Finds the checkpoint a run continues (the same on every rank), restores it, and saves every --ckpt-every steps,
    pruning to the newest --keep-last. A file found unreadable is never counted or deleted in place of a good one, nor
    is the newest known good; one whose weights gave a NaN is set aside (judge)."""

    def __init__(self, cfg: TrainConfig, rank: int = 0, world: int = 1, prov: dict | None = None):
        self.cfg, self.rank, self.world, self.prov = cfg, rank, world, prov or {}
        self.out_dir = Path(cfg.out_dir)
        self.master = rank == 0
        self.unreadable: list[Path] = []
        self.last: str | None = None  # the path written last
        self.newest: Path | None = None  # this run's newest checkpoint (resumed or written), resolved
        self.good: Path | None = None  # the newest whose weights trained a step to a finite loss and gradient norm

    def due(self, step: int) -> bool:
        """Whether the state after `step` optimizer steps is saved: every --ckpt-every, and at the end."""
        return (self.cfg.ckpt_every > 0 and step % self.cfg.ckpt_every == 0) or step == self.cfg.max_steps

    # finding the checkpoint to resume

    def find(self) -> tuple[Path, dict] | None:
        """find_resume on every rank, then agreed: every rank resumes the same checkpoint, or all stop with a reason
        before anything collective could pair up wrong and hang."""
        found, problem = None, None
        try:
            found = self.find_resume()
        except (ValueError, OSError) as e:  # OSError: a --resume PATH this node cannot read
            problem = str(e)
        problem = shared_problem(problem, self.world)
        if not problem and self.world > 1:
            # the loss history tells two runs' checkpoints of the same step apart (each node's own out-dir, say)
            mine = None if found is None else (int(found[1]["step"]), found[1].get("outliers", {}).get("loss"))
            seen: list[tuple | None] = [None] * self.world
            dist.all_gather_object(seen, mine)
            if any(other != seen[0] for other in seen):
                steps = [other[0] if other else None for other in seen]
                which = "different checkpoints" if len(set(steps)) == 1 else \
                    f"different steps {steps} (None: none found)"
                problem = (f"ranks resumed {which}: every node must see the same checkpoints in --out-dir "
                           f"{self.out_dir} (put it on a shared filesystem, or copy the checkpoint to each node and "
                           "pass --resume PATH)")
        if problem:
            raise ValueError(problem)
        self.newest = found[0].resolve() if found else None
        return found

    def find_resume(self) -> tuple[Path, dict] | None:
        """The checkpoint this run continues (path, loaded dict), None for a fresh start, or a ValueError where
        starting would bury another run (truncate its log, prune its checkpoints)."""
        cfg, out_dir = self.cfg, self.out_dir
        existing = checkpoints(out_dir) if out_dir.is_dir() else []
        if not cfg.resume:
            existing = existing or sorted(out_dir.glob("ckpt_*.pt.diverged"))  # a NaN-stopped run's
            if existing and not cfg.eval_only:  # an evaluation writes nothing there
                raise ValueError(f"--out-dir {out_dir} holds another run's checkpoints ({existing[-1].name} the last "
                                 "written): continue that run with --resume auto, or start this one in a new "
                                 "--out-dir (or delete them first)")
            return None
        if cfg.resume != "auto":
            return Path(cfg.resume), load_checkpoint(cfg.resume, mmap=True)
        found = find_checkpoint(out_dir, self.unreadable)
        if self.master:
            note_set_aside(out_dir, found[0] if found else None)
        if found is None and existing:
            raise ValueError(f"none of the {len(existing)} checkpoints in {out_dir} can be read (see the warnings "
                             "above): resume one with --resume PATH, or move them away to start afresh")
        if found is None and cfg.eval_only:  # it would score a random model as if it were the run's
            raise ValueError(f"--eval-only --resume auto: no checkpoint in {out_dir} to evaluate")
        if found is None:
            if self.master:
                print(f"resume: no checkpoint in {out_dir}; starting "
                      + (f"from --init-from {cfg.init_from}" if cfg.init_from else "from scratch"))
            return None
        # passed over for an older write with a later step; not those written after it, which could not be read
        later = [p for p in existing[:existing.index(found[0])] if step_of(p) > int(found[1]["step"])]
        if later and self.master:
            print(f"note: resuming {found[0].name}, the checkpoint written last; {later[-1].name} has a later step "
                  "but was written earlier (a rewind leaves such files; files copied without their times lose the "
                  "order: then pass --resume PATH)")
        return found

    # restoring

    def restore(self, ckpt: dict, raw: GPT, optimizer: torch.optim.Optimizer, loader: TokenLoader | None,
                scaler: torch.amp.GradScaler | None) -> int:
        """Load a checkpoint into the run: the weights, and unless --eval-only the optimizer, the loader's position,
        the GradScaler and the RNG. Returns its step."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(raw, ckpt["model"], options=StateDictOptions(full_state_dict=True))
        if self.cfg.eval_only:  # it needs no more, so it scores any checkpoint
            return int(ckpt["step"])
        self._restore_optimizer(ckpt, raw, optimizer)
        if loader is not None:
            loader.load_state_dict(ckpt["loader"])
            if self.master:
                note_new_windows(ckpt["loader"], loader)
        if scaler and ckpt["scaler"]:
            scaler.load_state_dict(ckpt["scaler"])
        self._restore_rng(ckpt["rng"])
        return int(ckpt["step"])

    def _restore_optimizer(self, ckpt: dict, raw: GPT, optimizer: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        kind = optimizer_kind(optimizer, self.cfg.parallel)
        if (ckpt["optimizer_kind"] == "zero1") != (kind == "zero1"):
            saved = ckpt["optimizer_kind"]
            how = "under torchrun with --parallel zero1" if saved == "zero1" else "without --parallel zero1"
            raise ValueError(f"the checkpoint's optimizer state was saved by parallel={saved} and this "
                             f"run's optimizer is {kind}: ZeRO-1 keeps its own format, so resume it {how}")
        optim_sd = packed_8bit_state(ckpt["optimizer"])
        if kind != "zero1":
            set_optimizer_state_dict(raw, optimizer, optim_sd, options=StateDictOptions(full_state_dict=True))
            return
        optimizer.load_state_dict(optim_sd)
        if any(group.get("fused") for group in optimizer.optim.param_groups):
            # ZeRO's load moves Adam's 0-d `step` tensors to the CPU, where the fused CUDA kernel refuses them
            # (docs/notes.md): put them back beside their parameters
            for p, state in optimizer.optim.state.items():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(p.device, torch.float32)
        # ZeRO's own load also kept a second device copy of this rank's moments that it never reads again
        optimizer.state.clear()

    def _restore_rng(self, rngs: list[dict]) -> None:
        if len(rngs) == self.world:
            rng = rngs[self.rank]
            torch.set_rng_state(rng["cpu"])
            if rng["cuda"] is not None and torch.cuda.is_initialized():  # a CUDA run (see save)
                torch.cuda.set_rng_state(rng["cuda"])
        elif self.master:
            print(f"note: the checkpoint came from world size {len(rngs)}, this run has {self.world}: the data "
                  "stream goes on where it was (less than one step's windows skipped, none repeated) and the RNG "
                  "streams restart, so this is not the run an unchanged world size would give")

    # saving

    def save(self, step: int, raw: GPT, optimizer: torch.optim.Optimizer, parts: dict[str, Any]) -> Path:
        """Write ckpt_{step}.pt on rank 0 (every rank takes part in gathering it), then prune. `parts` are the other
        components' state_dicts (loader, scaler, outliers, tokens)."""
        path = self.out_dir / f"ckpt_{step:06d}.pt"
        if path in self.unreadable:  # written anew, and readable now
            self.unreadable.remove(path)
        model_sd, optim_sd = state_dicts(raw, optimizer)
        # is_initialized, not is_available: a --device cpu run on a GPU host has no CUDA context to read
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None
        rng = {"cpu": torch.get_rng_state(), "cuda": cuda}
        rngs = [rng]
        if self.world > 1:
            rngs = [None] * self.world
            dist.all_gather_object(rngs, rng)  # dropout masks differ per rank, so every rank's RNG is saved
        self.last, self.newest = str(path), path.resolve()
        if not self.master:
            return path
        kind = optimizer_kind(optimizer, self.cfg.parallel)
        ckpt = {"model": model_sd, "optimizer": plain_8bit_state(optim_sd), "optimizer_kind": kind, "step": step,
                "loader": parts["loader"], "rng": rngs, "scaler": parts["scaler"],
                "model_config": dataclasses.asdict(raw.config), "train_config": dataclasses.asdict(self.cfg),
                "provenance": self.prov, "world_size": self.world, "outliers": parts["outliers"],
                "tokens": parts["tokens"]}  # trained on, all ranks together
        write_atomically(path, ckpt)
        self.prune()
        print(f"saved {path}")
        return path

    def prune(self) -> None:
        """Keep the newest --keep-last readable checkpoints, every multiple of --keep-every, and the newest known good:
        the newer ones may yet be set aside by a NaN."""
        cfg = self.cfg
        readable = [p for p in checkpoints(self.out_dir) if p not in self.unreadable]
        for stale in readable[:-cfg.keep_last] if cfg.keep_last > 0 else []:
            milestone = cfg.keep_every and step_of(stale) % cfg.keep_every == 0
            if not milestone and stale.resolve() != self.good:
                stale.unlink()

    def judge(self, step: int, finite: bool) -> Path | None:
        """The loss and gradient norm of `step` come from the weights in this run's ckpt_{step}, if it has one: finite
        makes it the newest known good; not finite sets it aside as .diverged (rank 0), so --resume auto takes the
        one before. Returns the path set aside."""
        path = self.out_dir / f"ckpt_{step:06d}.pt"
        if self.newest is None or path.resolve() != self.newest:
            return None
        if finite:
            self.good = self.newest
            return None
        self.newest = self.last = None
        if not self.master:
            return None
        try:
            os.replace(path, diverged_path(path))
        except OSError as e:  # the NaN is the error to report; this one only loses the mark
            print(f"warning: could not set {path} aside: {e}", file=sys.stderr)
            return None
        return path

    def remove_partial_writes(self) -> None:
        """A .tmp left by a run killed mid-write is never a valid checkpoint. Not for --eval-only, which may sit beside
        a live run whose .tmp is a checkpoint in flight."""
        if self.master and not self.cfg.eval_only:
            for stale in self.out_dir.glob("ckpt_*.pt.tmp"):
                stale.unlink()


def write_atomically(path: Path, ckpt: dict) -> None:
    """torch.save to a .tmp, fsync, rename: a kill mid-write leaves the previous checkpoint untouched. A write that
    fails (a full disk) removes the .tmp and is a one-line ValueError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        code, full = errno.errorcode.get(e.errno, "error"), e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise ValueError(f"cannot write checkpoint {path}: {code} ({e.strerror or e}); the partial file is removed "
                         "and the earlier checkpoints are intact"
                         + ("; free space there (or lower --keep-last), then --resume auto" if full else "")) from e


def state_dicts(raw: GPT, optimizer: torch.optim.Optimizer) -> tuple[dict | None, dict | None]:
    """Full (unsharded, unwrapped) model and optimizer state; collective under ZeRO-1/FSDP, so every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd = get_model_state_dict(raw, options=opts)
    if "lm_head.weight" in model_sd and raw.lm_head.weight is raw.transformer.wte.weight:
        # the offload copies each name on its own: one tensor under both names stores the tied matrix once
        model_sd["transformer.wte.weight"] = model_sd["lm_head.weight"]
    if not hasattr(optimizer, "consolidate_state_dict"):  # keyed by parameter name: DDP, FSDP, single interchange
        return model_sd, get_optimizer_state_dict(raw, optimizer, options=opts)
    optimizer.consolidate_state_dict(to=0)  # ZeRO-1: gather every rank's shard on rank 0
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the gathered state arrives by non_blocking copies that nothing else waits for
    return model_sd, optimizer.state_dict() if dist.get_rank() == 0 else None


def plain_8bit_state(optim_sd: dict) -> dict:
    """torchao's 8-bit optimizer states (OptimState8bit tensors) as their plain tensors, so that any tool loads the
    checkpoint with weights_only=True and without torchao; packed_8bit_state undoes it. A new dict: the one given
    may hold the optimizer's live state."""
    def plain(value: Any) -> Any:
        if type(value).__name__ != "OptimState8bit":
            return value
        return {"codes": value.codes, "scale": value.scale, "qmap": value.qmap, "signed": value.signed}

    return {**optim_sd, "state": {k: {name: plain(v) for name, v in state.items()}
                                  for k, state in optim_sd["state"].items()}}


def packed_8bit_state(optim_sd: dict) -> dict:
    """The checkpoint's optimizer state with plain_8bit_state's dicts made OptimState8bit tensors again."""
    def packed(value: Any) -> Any:
        if not (isinstance(value, dict) and "codes" in value):
            return value
        from torchao.optim.subclass_8bit import OptimState8bit

        return OptimState8bit(value["codes"], value["scale"], value["qmap"], value["signed"])

    return {**optim_sd, "state": {k: {name: packed(v) for name, v in state.items()}
                                  for k, state in optim_sd["state"].items()}}


def find_checkpoint(out_dir: Path, unreadable: list[Path] | None = None) -> tuple[Path, dict] | None:
    """The newest checkpoint in out_dir that loads; corrupt or partial ones are reported, skipped and appended to
    `unreadable`."""
    for path in reversed(checkpoints(out_dir)):
        try:
            return path, load_checkpoint(path, mmap=True)
        except (ValueError, OSError) as e:
            print(f"warning: skipping unreadable checkpoint {path}: {e} (left in place; --keep-last does not count "
                  "it)", file=sys.stderr)
            if unreadable is not None:
                unreadable.append(path)
    return None


def diverged_path(path: Path) -> Path:
    return path.with_name(path.name + ".diverged")  # out of checkpoints()'s pattern: never resumed or pruned


def note_set_aside(out_dir: Path, resumed: Path | None) -> None:
    """Name the checkpoints set aside after this one was written: a NaN-stopped run's (Checkpointer.judge)."""
    after = resumed.stat().st_mtime_ns if resumed else -1
    for aside in sorted(out_dir.glob("ckpt_*.pt.diverged"), key=lambda p: p.stat().st_mtime_ns):
        if aside.stat().st_mtime_ns > after and re.fullmatch(r"ckpt_\d+\.pt\.diverged", aside.name):
            print(f"note: passing over {aside.name}: the run that wrote it set it aside, as its weights gave a NaN/inf "
                  f"loss or gradient norm at step {step_of(Path(aside.stem))}")


def note_new_windows(saved: dict, loader: TokenLoader) -> None:
    """Say where the data goes on when the checkpoint read other windows (--batch-size or --shuffle changed)."""
    old_b, old_shuffle = saved["B"], TokenLoader.state_shuffle(saved)
    if old_b == loader.B and old_shuffle == loader.shuffle:
        return
    if loader.continues_in_shard(old_shuffle):
        where = "where it was, cut into windows of the new size"
    elif loader.resume_skipped:
        where = (f"at the next shard, skipping the {loader.resume_skipped:,} tokens the checkpoint's run had "
                 "not yet served from the shard being read (it read that shard's windows in another order)")
    else:
        where = "where it was, at a shard's start (the checkpoint fell between shards: nothing skipped)"
    print(f"note: the checkpoint read {old_b}-sequence windows with --shuffle {old_shuffle}, this run reads "
          f"{loader.B}-sequence windows with --shuffle {loader.shuffle}: the data goes on {where}, none "
          "served twice" + (", and the optimizer step keeps --total-batch-size tokens" if old_b != loader.B else ""))


# ----------------------------------------------------------------------------------------------------------------------
# Evaluator


class Evaluator:
    """Val loss every --eval-every steps, HellaSwag every --hellaswag-every and samples every --sample-every, each also
    at the final step. `latest` holds the last val loss and HellaSwag metrics."""

    def __init__(self, cfg: TrainConfig, raw: GPT, model: nn.Module, val_loader: TokenLoader | None,
                 autocast: contextlib.AbstractContextManager, log: RunLog, rank: int = 0, world: int = 1,
                 local_rank: int = 0):
        self.cfg, self.raw, self.model, self.val_loader, self.autocast, self.log = cfg, raw, model, val_loader, \
            autocast, log
        self.rank, self.world, self.master = rank, world, rank == 0
        self.device = next(raw.parameters()).device
        self.windows = self._windows() if val_loader is not None else 0
        self.examples = load_hellaswag(cfg, rank, local_rank, world)
        self.enc = get_tokenizer() if (cfg.sample_every > 0 or self.examples) else None
        self.latest: dict[str, Any] = {}

    def _windows(self) -> int:
        """Val windows of B*T tokens per evaluation, all ranks together: --eval-tokens rounded up, at most the split."""
        cfg, loader = self.cfg, self.val_loader
        BT = loader.B * loader.T
        windows = -(-cfg.eval_tokens // BT)
        if windows > loader.num_windows:  # more would score some windows twice, weighting them double
            windows = loader.num_windows
            if self.master:
                print(f"val: the val split holds {windows * BT:,} tokens in windows of B*T = {BT:,}, so each "
                      f"evaluation scores those instead of --eval-tokens {cfg.eval_tokens:,}")
        elif windows * BT != cfg.eval_tokens and self.master:
            print(f"val: each evaluation scores {windows * BT:,} tokens ({windows} x B*T = {BT:,}): --eval-tokens "
                  f"{cfg.eval_tokens:,} rounded up to whole windows")
        return windows

    def due(self, step: int, final: bool) -> tuple[bool, bool, bool]:
        """Which evaluations run at `step` (val loss, HellaSwag, samples): each every N steps and at the end. No
        samples at a training run's step 0: an untrained model's say nothing."""
        cfg = self.cfg
        return (self.val_loader is not None and (final or step % cfg.eval_every == 0),
                bool(self.examples) and (final or step % cfg.hellaswag_every == 0),
                cfg.sample_every > 0 and (final or step % cfg.sample_every == 0) and (step > 0 or cfg.eval_only))

    def run(self, step: int, final: bool, tokens: int = 0) -> bool:
        """The evaluations due at `step`, on the weights after `step` optimizer steps; whether any ran."""
        val, hellaswag, samples = self.due(step, final)
        if val:
            self._val_loss(step, tokens)
        if hellaswag:
            self._hellaswag(step, tokens)
        if samples:
            self._samples(step)
        return val or hellaswag or samples

    def _val_loss(self, step: int, tokens: int) -> None:
        vl = val_loss(self.model, self.val_loader, self.windows, self.autocast, self.world)
        self.latest["val_loss"] = vl
        self.log.write({"type": "val", "step": step, "tokens": tokens, "val_loss": vl})
        self.log.say(f"step {step:6d} | val loss {vl:.4f}")

    def _hellaswag(self, step: int, tokens: int) -> None:
        import hellaswag

        # the uncompiled module: HellaSwag's many sequence lengths would recompile the training forward
        hs = hellaswag.evaluate(self.raw, self.examples, self.device, self.rank, self.world,
                                limit=self.cfg.hellaswag_limit, enc=self.enc, progress=True)
        self.latest["hellaswag"] = hs
        self.log.write({"type": "hellaswag", "step": step, "tokens": tokens, **hs})
        self.log.say(f"step {step:6d} | hellaswag acc_norm {hs['acc_norm']:.4f} ({hs['n']} examples)")

    def _samples(self, step: int) -> None:
        if not (self.master or self.cfg.parallel == "fsdp"):  # FSDP forwards are collective: every rank runs them
            return
        texts = sample_text(self.raw, self.enc, self.cfg, self.device, step, self.autocast)
        if self.master:
            for text in texts:
                print(f"sample: {text!r}")
            self.log.write({"type": "sample", "step": step, "texts": texts})


@torch.no_grad()
def val_loss(model: nn.Module, loader: TokenLoader, windows: int, autocast: contextlib.AbstractContextManager,
             world_size: int) -> float:
    """Mean loss over the split's first `windows` windows (identical every call), all ranks together. Rank r scores
    windows r, r + world_size, ...: the same number for any number of ranks. Every rank runs the same number of
    forwards (collective under FSDP); a turn past `windows` is scored and left out."""
    model.eval()
    loader.reset()
    total = torch.zeros((), device=loader.device)
    for turn in range(-(-windows // world_size)):
        x, y = loader.next_batch()
        with autocast:
            _, loss = model(x, y)
        if turn * world_size + loader.rank < windows:
            total += loss.float()
    if world_size > 1:
        dist.all_reduce(total)  # SUM: gloo has no AVG
    model.train()
    return total.item() / windows


def sample_text(raw: GPT, enc: Any, cfg: TrainConfig, device: torch.device, step: int,
                autocast: contextlib.AbstractContextManager) -> list[str]:
    """A few samples from the uncompiled module, in the training precision; its own generator, so the training RNG
    (and exact resume) is untouched."""
    idx = torch.tensor([enc.encode(cfg.sample_prompt)] * 2, device=device)
    gen = torch.Generator(device=device).manual_seed(cfg.seed + step)
    with autocast:
        out = raw.generate(idx, cfg.sample_tokens, temperature=1.0, top_k=50, generator=gen)
    return [enc.decode([t for t in row if t < enc.n_vocab]) for row in out.tolist()]


def load_hellaswag(cfg: TrainConfig, rank: int, local_rank: int, world: int) -> list[dict] | None:
    """HellaSwag examples on every rank, or None on every rank (evaluate is collective, so all or none)."""
    if cfg.hellaswag == "off" or (cfg.hellaswag_every <= 0 and not cfg.eval_only):
        return None
    import hellaswag

    path = Path(cfg.hellaswag) if cfg.hellaswag != "auto" else hellaswag.default_cache_dir() / "hellaswag_val.jsonl"
    reason = None
    if cfg.hellaswag == "auto":  # whatever fails (offline, a truncated response...), every rank skips it
        try:
            first_on_each_node(hellaswag.download, local_rank, world, catch=(Exception,),
                               reason=lambda e: f"could not download it: {e.__cause__ or e}")
        except ValueError as e:
            reason = str(e)
    examples = None
    if reason is None:
        problem = None
        try:
            examples = hellaswag.load_examples(path)
        except (OSError, ValueError) as e:  # load_examples' own hint names hellaswag.py's flags, not train.py's
            problem = f"{path} is not a file" if not path.is_file() else str(e).splitlines()[0][:200]
        if problem is None and not examples:
            problem = f"{path} holds no examples"
        reason = shared_problem(problem, world)  # the reason of the rank that lacks them
    if not reason and world > 1:  # the same examples everywhere: the batch count (FSDP collectives) and the score
        digest = hashlib.sha1(json.dumps(examples, sort_keys=True).encode()).hexdigest()
        reason = agree([len(examples), digest], rank, world, lambda mine, first: None if mine == first else (
            f"rank {rank} has {mine[0]} examples in {path}, rank 0 {first[0]}"
            + (", other ones" if mine[0] == first[0] else "")))
    if reason:
        if rank == 0:
            print(f"hellaswag: skipped ({reason}); pass --hellaswag PATH to a local hellaswag_val.jsonl to enable it, "
                  "or --hellaswag off to silence this")
        return None
    return examples


# ----------------------------------------------------------------------------------------------------------------------
# RunLog


class RunLog:
    """The run's log.jsonl (rank 0, not for --eval-only), the trackers that get its records too (trackers.py:
    TensorBoard, W&B), and its console lines: the step line every --log-every steps with the ETA from the median of
    the last 20 step times."""

    def __init__(self, path: Path | None, resume_step: int | None, master: bool = True, max_steps: int = 0,
                 log_every: int = 1, trackers: list[Any] | None = None):
        self.file = open_log(path, resume_step) if path is not None else None
        self.trackers = trackers or []
        self.master = master
        self.max_steps, self.log_every = max_steps, log_every
        self.recent_ms: list[float] = []
        self.losses: list[float] = []  # every step's loss, all ranks together

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
        for tracker in self.trackers:
            tracker.write(record)

    def say(self, text: str) -> None:
        if self.master:
            print(text)

    def step(self, step: int, record: dict, timed: bool) -> None:
        """Log one optimizer step's record (loss, lr, grad_norm, ms, tok_s, mfu...); `timed`: its time counts
        towards the ETA (not the first step, which includes compilation and warmup)."""
        self.losses.append(record["loss"])
        if timed:
            self.recent_ms = (self.recent_ms + [record["ms"]])[-20:]
        self.write({"type": "train", "step": step, **record})
        if not self.master:
            return
        if record.get("skipped"):
            print(f"step {step:6d} | update skipped: {record['skipped']}")
        if step % self.log_every == 0 or step == self.max_steps - 1:
            ms = sorted(self.recent_ms)[len(self.recent_ms) // 2] if self.recent_ms else record["ms"]
            eta = ms * (self.max_steps - step - 1) / 1000
            util = record["mfu"]
            print(f"step {step:6d}/{self.max_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | norm "
                  f"{record['grad_norm']:.3f} | {record['ms']:7.1f} ms | {record['tok_s']:,.0f} tok/s | mfu "
                  f"{f'{util:.1%}' if util else 'n/a'} | eta {fmt_time(eta)}", flush=True)

    def close(self) -> None:
        if self.file:
            self.file.close()
        for tracker in self.trackers:
            tracker.close()


def open_log(path: Path, resume_step: int | None) -> Any:
    """The run's JSONL log, line-buffered. A resumed run keeps the records before the step it resumes at and drops
    those an interrupted run logged past its last checkpoint, which it is about to log again."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if resume_step is None or not path.is_file():
        return open(path, "w", buffering=1)
    kept = [json.dumps(record) + "\n" for record in iter_log(path)
            if record["type"] == "config" or record["step"] < resume_step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, path)
    return open(path, "a", buffering=1)


def fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


# ----------------------------------------------------------------------------------------------------------------------
# SpikeGuard


OUTLIER_WINDOW = 128  # steps of history behind a z-score, as in llm.c


class OutlierDetector:
    """z-score of a value against its last OUTLIER_WINDOW values, as llm.c's -sl/-sg update skipping computes it.
    0 until the window is full, so nothing is skipped early in a run; a NaN or inf never enters the window."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def __call__(self, x: float) -> float:
        if not math.isfinite(x):
            return 0.0
        full = len(self.values) >= OUTLIER_WINDOW
        self.values = (self.values + [x])[-OUTLIER_WINDOW:]
        if not full:
            return 0.0
        mean = sum(self.values) / len(self.values)
        std = math.sqrt(sum((v - mean) ** 2 for v in self.values) / len(self.values))
        return (x - mean) / std if std > 0 else 0.0


class SpikeGuard:
    """llm.c's spike guard: no update from a step whose loss or gradient norm z-score exceeds --skip-loss-z /
    --skip-norm-z. Its history is kept and checkpointed even when it is off, so a resumed run can turn it on."""

    def __init__(self, skip_loss_z: float = 0.0, skip_norm_z: float = 0.0, world: int = 1):
        self.skip_loss_z, self.skip_norm_z, self.world = skip_loss_z, skip_norm_z, world
        self.detectors = {"loss": OutlierDetector(), "norm": OutlierDetector()}
        self.skipped = ""  # why this step's update was dropped, or ""

    @property
    def on(self) -> bool:
        """Deciding reads the loss and norm on the host before the optimizer step: one sync more, so only when asked."""
        return self.skip_loss_z > 0 or self.skip_norm_z > 0

    def for_step(self) -> Callable[[torch.Tensor, torch.Tensor], bool] | None:
        """train_step's `update` for the next step (None when the guard is off), with no skip recorded yet."""
        self.skipped = ""
        return self.update if self.on else None

    def update(self, loss: torch.Tensor, norm: torch.Tensor) -> bool:
        """train_step's `update`: whether to apply this step. Every rank must decide the same, so both figures are
        averaged over the ranks in one all-reduce, which hands every rank the same history and verdict."""
        stats = torch.stack([loss.detach().float(), norm.detach().float()])
        if self.world > 1:
            dist.all_reduce(stats)
            stats /= self.world
        mean_loss, mean_norm = stats.tolist()
        z_loss, z_norm = self.detectors["loss"](mean_loss), self.detectors["norm"](mean_norm)
        if self.skip_loss_z > 0 and z_loss > self.skip_loss_z:
            self.skipped = f"loss z-score {z_loss:.1f} > {self.skip_loss_z}"
        elif self.skip_norm_z > 0 and z_norm > self.skip_norm_z:
            self.skipped = f"grad norm z-score {z_norm:.1f} > {self.skip_norm_z}"
        return not self.skipped

    def observe(self, loss: float, norm: float) -> None:
        """With the guard off, the history still grows, from values read anyway (no extra sync)."""
        if not self.on:
            self.detectors["loss"](loss)
            self.detectors["norm"](norm)

    def state_dict(self) -> dict[str, list[float]]:
        return {name: d.values for name, d in self.detectors.items()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        for name, detector in self.detectors.items():
            detector.values = [float(v) for v in state.get(name, [])]


# ----------------------------------------------------------------------------------------------------------------------
# StopFlags


class StopFlags:
    """SIGTERM (cloud preemption), Ctrl-C and the wall-clock budget: checked once per step, agreed across ranks. A
    context manager: it installs its handlers on entry and puts the caller's handlers and std streams back on exit.

    The first Ctrl-C stops the run as SIGTERM does, with a checkpoint; a Ctrl-C after any stop signal quits at once.
    A SIGTERM after a SIGTERM does not: a preempted node's workers may get one from the scheduler and one from
    torchrun (docs/resume.md has the rules)."""

    def __init__(self, max_minutes: float, interrupt: bool = True, master: bool = True,
                 device: torch.device | None = None, world: int = 1):
        self.term: str | None = None  # the first signal this rank received: "SIGTERM" or "SIGINT"
        self.signal = "SIGTERM"  # after should_stop said "signal": SIGTERM if any rank had it, else SIGINT
        self.master, self.interrupt, self.device, self.world = master, interrupt, device, world
        self.last = False  # set when no step is left to stop after: Ctrl-C then quits at once
        self.deadline = time.time() + 60 * max_minutes if max_minutes > 0 else None
        self._saved: dict[int, Any] = {}
        self._streams = sys.stdout, sys.stderr

    def __enter__(self) -> StopFlags:
        self._streams = sys.stdout, sys.stderr
        if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
            self._saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
            signal.signal(signal.SIGTERM, self._on_signal)
            # not for --eval-only (no step to stop after), nor where SIGINT is ignored (nohup, a job started with &)
            if self.interrupt and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
                signal.signal(signal.SIGINT, self._on_signal)
        return self

    def __exit__(self, *exc: Any) -> None:
        # left installed, the handlers would swallow SIGTERM in the process that goes on (tests, a notebook)
        for sig, handler in self._saved.items():
            if handler is not None:
                signal.signal(sig, handler)
        sys.stdout, sys.stderr = self._streams

    def _on_signal(self, signum: int, *_: Any) -> None:
        name = signal.Signals(signum).name
        if (self.term is not None and "SIGINT" in (name, self.term)) or (self.last and name == "SIGINT"):
            raise KeyboardInterrupt  # a second Ctrl-C, here or (as SIGTERM) through torchrun, or nothing to stop
        if self.term is None:
            # the same Ctrl-C kills a `| tee` of this run's output: from here on output without a reader is dropped
            sys.stdout, sys.stderr = (_PipeGuard(s) if s is not None else None for s in (sys.stdout, sys.stderr))
        if name == "SIGINT" and self.master:  # os.write, not print: a handler that prints can land inside a print
            with contextlib.suppress(OSError):
                os.write(2, b"\nCtrl-C: stopping after this step, with a checkpoint; Ctrl-C again quits now\n")
        self.term = self.term or name

    def should_stop(self) -> str | None:
        """"signal", "max_time" or None, the same on every rank: one rank's signal stops them all at this step."""
        flags = [self.term == "SIGTERM", self.term == "SIGINT",
                 self.deadline is not None and time.time() > self.deadline]
        if self.world > 1:
            agreed = torch.tensor(flags, dtype=torch.float32, device=self.device)
            dist.all_reduce(agreed)
            flags = (agreed > 0).tolist()
        self.signal = "SIGTERM" if flags[0] else "SIGINT"
        return "signal" if flags[0] or flags[1] else "max_time" if flags[2] else None

    def reason(self, stopping: str, max_time: float) -> str:
        return {"SIGTERM": "SIGTERM", "SIGINT": "Ctrl-C"}[self.signal] if stopping == "signal" else \
            f"--max-time {max_time} min"


class _PipeGuard:
    """A text stream that, once its reader is gone (EPIPE), points its file descriptor at /dev/null and goes on, so
    that neither a later print nor the interpreter's flush at exit fails."""

    def __init__(self, stream: Any):
        self.stream = stream

    def _guarded(self, call: Callable[[], Any], default: Any = None) -> Any:
        try:
            return call()
        except BrokenPipeError:
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)
            return default

    def write(self, text: str) -> int:
        return self._guarded(lambda: self.stream.write(text), len(text))

    def flush(self) -> None:
        self._guarded(self.stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


# ----------------------------------------------------------------------------------------------------------------------
# Profiler


class Profiler:
    """--profile: a Chrome/Perfetto trace of --profile-steps steps, starting two steps into the run (after the first
    steps' compilation and allocator warmup)."""

    def __init__(self, enabled: bool, start_step: int, steps: int, out_dir: Path, rank: int = 0):
        self.enabled, self.at, self.steps, self.out_dir, self.rank = enabled, start_step + 2, steps, out_dir, rank
        self.prof: torch.profiler.profile | None = None

    def step_begins(self, step: int, device: torch.device) -> None:
        if self.enabled and step == self.at:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=True)
            self.prof.start()

    def step_ends(self, step: int) -> None:
        if self.prof is not None and step == self.at + self.steps - 1:
            self._stop()

    def finish(self, step: int, trained: bool) -> None:
        """The run ended: keep what was recorded, or say that nothing was."""
        if self.prof is not None:
            self._stop()
        elif self.enabled and self.rank == 0 and step <= self.at and trained:
            print(f"profile: nothing recorded; the run ended before step {self.at}, where profiling starts")

    def _stop(self) -> None:
        self.prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)  # on another node the master's out_dir may not exist
        trace = self.out_dir / f"trace_rank{self.rank}.json"
        self.prof.export_chrome_trace(str(trace))
        if self.rank == 0:
            sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
            print(self.prof.key_averages().table(sort_by=sort, row_limit=15))
            print(f"profile: trace written to {trace} (open in chrome://tracing or ui.perfetto.dev)")
        self.prof = None


# ----------------------------------------------------------------------------------------------------------------------
# Agreement across ranks: a node whose command or data differs stops every rank with the reason


# paths may differ from node to node, so only whether they are set is compared; the others change a rank's own files
PER_NODE_FIELDS = ("data", "out_dir", "hellaswag", "init_from", "resume")
RANK_LOCAL_FIELDS = ("max_time", "peak_tflops", "keep_last", "keep_every", "preload", "dist_timeout", "tensorboard",
                     "wandb")


def commands_disagree(cfg: TrainConfig, rank: int, world: int) -> str | None:
    """Why the ranks were started with commands that cannot train together, or None: a flag that differs on one
    node would hang a collective or train the replicas apart without an error. Collective."""
    mine = {k: repr(v) for k, v in dataclasses.asdict(cfg).items()  # repr: a NaN equals itself
            if k not in PER_NODE_FIELDS + RANK_LOCAL_FIELDS}
    hellaswag = "off" if cfg.hellaswag_every <= 0 and not cfg.eval_only else cfg.hellaswag  # never run: off
    mine["hellaswag"] = repr(hellaswag if hellaswag in ("off", "auto") else "PATH")
    mine["init_from"] = repr("NAME" if cfg.init_from else "")

    def describe(mine: dict, first: dict) -> str | None:
        diff = ", ".join(f"--{k.replace('_', '-')} {mine[k]} (rank 0: {v})" for k, v in first.items() if mine[k] != v)
        return f"rank {rank} was started with {diff}: every node must run the same command" if diff else None

    return agree(mine, rank, world, describe)


def data_disagree(loaders: tuple[TokenLoader | None, ...], rank: int, world: int) -> str | None:
    """Why the ranks' shards differ, or None: with a shard missing on one node its ranks would index other windows,
    some served twice, silently. Names and token counts are compared. Collective."""
    mine = [(state["split"], state["shards"], state["shard_tokens"])
            for state in (loader.state_dict() for loader in loaders if loader is not None)]

    def describe(mine: list, first: list) -> str | None:
        for (split, names, sizes), (_, names0, sizes0) in zip(mine, first, strict=True):
            if (names, sizes) != (names0, sizes0):
                files, files0 = list(zip(names, sizes, strict=True)), list(zip(names0, sizes0, strict=True))
                i = next(i for i in range(max(len(files), len(files0)))
                         if i >= min(len(files), len(files0)) or files[i] != files0[i])
                there = f"{names[i]} ({sizes[i]:,} tokens)" if i < len(names) else "nothing"
                here = f"{names0[i]} ({sizes0[i]:,} tokens)" if i < len(names0) else "nothing"
                return (f"rank {rank}'s {split} shards differ from rank 0's ({len(names)} files against "
                        f"{len(names0)}; file {i + 1} is {there} there, {here} on rank 0): every node must hold the "
                        "same --data")
        return None

    return agree(mine, rank, world, describe)


def weights_disagree(raw: GPT, source: str, rank: int, world: int) -> str | None:
    """Why the ranks loaded other weights from `source`, or None: each node loads its own copy and nothing
    broadcasts rank 0's. A digest of the bytes is exact where a float sum is not. Collective."""
    if world == 1:  # a digest of a 1.5B model takes seconds: only where there is something to compare
        return None
    digest = hashlib.sha1()
    for p in raw.parameters():
        digest.update(p.detach().contiguous().view(torch.uint8).numpy())
    fingerprint = [digest.hexdigest()[:16], raw.num_params()]
    return agree(fingerprint, rank, world, lambda mine, first: None if mine == first else (
        f"rank {rank} loaded other weights from {source} than rank 0 (digest {mine[0]}, rank 0: {first[0]}): every "
        "node must start from the same model"))

