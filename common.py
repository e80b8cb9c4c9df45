"""TEMPORARY shim on the train branch until the split branch's common.py lands (replaced at merge)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from model import (  # noqa: F401
    EOT, GPT2_VOCAB, checkpoints, device_name, get_tokenizer, load_checkpoint, load_model, mfu, parse_config,
    provenance, run_and_exit,
)

T = TypeVar("T")


def iter_log(path: str | os.PathLike) -> Iterator[dict]:
    """Records of a train.py log.jsonl (plot.py, a resumed run and the tests read it through this). A last line
    without its newline is a record cut short, by a crash (the log is not fsynced) or because the run is writing it
    right now: it is left out. Any other line that is not JSON is an error that names the file and line."""
    with open(path, encoding="utf-8") as f:
        try:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    if not line.endswith("\n"):  # only the last line can lack one
                        return
                    raise ValueError(f"{path}, line {number}: not a JSON record ({e}); the log is corrupt: delete "
                                     "that line, or the file (a resumed run then starts a new one)") from None
        except UnicodeDecodeError as e:  # the log is ASCII (json.dumps escapes the rest): this is another file
            raise ValueError(f"{path} is not a train.py log.jsonl: it is not text ({e.reason} at byte {e.start}); "
                             "pass the log.jsonl in the run's --out-dir") from None

def shared_problem(problem: str | None, world: int) -> str | None:
    """This rank's reason to stop, else the first other rank's (named by its rank), else None: the same verdict on
    every rank, so all stop together and each says why, rather than one exiting while the others wait for it in a
    collective and then report only a lost peer. Collective when world > 1: every rank must call it."""
    if world == 1:
        return problem
    import torch.distributed as dist

    problems: list[str | None] = [None] * world
    dist.all_gather_object(problems, problem)
    return problem or next((f"rank {r}: {p}" for r, p in enumerate(problems) if p), None)


def agree(mine: Any, rank: int, world: int, describe: Callable[[Any, Any], str | None]) -> str | None:
    """Rank 0's `mine` is sent to every rank, where describe(mine, rank 0's) says how this rank's differs (None: it
    does not); the first rank's difference comes back, the same on every rank, or None. Collective: one broadcast of
    rank 0's object (not world copies of everyone's) and a gather of the short answers."""
    if world == 1:
        return None
    import torch.distributed as dist

    box = [mine if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    answers: list[str | None] = [None] * world
    dist.all_gather_object(answers, describe(mine, box[0]))
    return next((a for a in answers if a), None)


# paths may differ from node to node (each mounts the data and out-dir where it will), so only whether they are set
# is compared (what the data hold is compared on its own); these others only change a rank's own files or figures


def same_verdict(work: Callable[[], T], world: int, error: type[Exception] = ValueError,
                 catch: tuple[type[Exception], ...] = (ValueError, OSError)) -> T:
    """work() on this rank; where it fails on any rank, every rank raises error(reason) with the first reason, so
    all stop together instead of leaving the others waiting in a collective. Collective when world > 1."""
    result, problem = None, None
    try:
        result = work()
    except catch as e:
        problem = str(e)
    if problem := shared_problem(problem, world):
        raise error(problem)
    return result


def first_on_each_node(load: Callable[[], T], local_rank: int, world: int) -> T:
    """load() on each node's first rank, then on its other ranks, which find what it fetched in the cache (a hub
    download once per node). A failure anywhere stops every rank with its reason. Collective when world > 1."""
    first = world == 1 or local_rank == 0
    fetched = same_verdict(load if first else lambda: None, world)
    return same_verdict((lambda: fetched) if first else load, world)
