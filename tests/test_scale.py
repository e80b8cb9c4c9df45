"""Tensor and pipeline parallelism (parallelize.py) on CPU over gloo: every layout trains the run one process trains,
resumes its own checkpoints bitwise and another layout's within 1e-6, and refuses what cannot shard in one line."""

import contextlib
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import model
import prefs
import prune
import rl
import sft
import train
from conftest import make_token_data, run_nodes, run_torchrun, run_train_runs
from model import GPT, MODEL_PRESETS
from parallel import StepArgs
from parallelize import Sharded, Stage, data_rank, local, reorder, shard, shard_problem

# the tiny GPT-2 on a 512-token vocabulary (its fp32 gradient norm is exact enough to compare: docs/scale.md)
BASE = ["--preset", "tiny", "--vocab-size", "512", "--max-steps", "10", "--total-batch-size", "1024", "--eval-every",
        "5", "--eval-tokens", "2048", "--hellaswag", "off"]
LLAMA = ["--pos", "rope", "--mlp", "swiglu", "--n-kv-head", "2", "--norm", "rmsnorm", "--bias", "false"]
RUNS = {  # name -> flags, run one after another in one launch; a resume names the run whose step-5 checkpoint it takes
    "two": {"tp2": ["--tp", "2", "--ckpt-every", "5"],
            "tp2_as_dp2": ["resume:tp2"],
            "pp2": ["--pp", "2", "--ckpt-every", "5"],
            "pp2_again": ["--pp", "2", "resume:pp2"],
            "pp2gpipe_llama": ["--pp", "2", "--pp-schedule", "gpipe", *LLAMA],
            "pp2interleaved_l4": ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--n-layer", "4"]},
    "four": {"dp2tp2": ["--tp", "2", "--parallel", "fsdp", "--ckpt-every", "5"],
             "dp2tp2_again": ["--tp", "2", "--parallel", "fsdp", "resume:dp2tp2"],
             "dp2tp2_as_dp4": ["--parallel", "fsdp", "resume:dp2tp2"],
             "pp2tp2sp_llama": ["--pp", "2", "--tp", "2", "--sequence-parallel", *LLAMA]},
}


def launch(data: Path, out: Path, which: str, nproc: int, timeout: int) -> list[str]:
    """RUNS[which] in one torchrun launch of nproc ranks, each run's log.jsonl in out/<name>; returns the model each
    run trained (tests/train_runs.py's line): Sharded for --tp/--pp, a data-parallel wrapper otherwise."""
    runs = [[*BASE, "--data", data, "--out-dir", out / name,
             *(f"--resume={out / f.removeprefix('resume:')}/ckpt_000005.pt" if f.startswith("resume:") else f
               for f in flags)] for name, flags in RUNS[which].items()]
    proc = run_train_runs(runs, nproc, out / "runs.json", timeout=timeout)
    return re.findall(r"^train_runs: built (\w+) with", proc.stdout, re.M)


@pytest.fixture(scope="module")
def tokens512(tmp_path_factory) -> Path:
    """Random ids below 512 (the tests' vocabulary): a val shard and two train shards."""
    return make_token_data(tmp_path_factory.mktemp("tokens512"), vocab=512)


@pytest.fixture(scope="module")
def references(tokens512, tmp_path_factory) -> dict[str, Any]:
    """The one-process runs the layouts must equal: the tiny GPT-2 (checkpointing at step 5), its LLaMA-style twin,
    and 4 blocks for interleaved 1F1B's four stages; computed once for both launches."""
    out = tmp_path_factory.mktemp("references")
    runs = {"ref": ["--ckpt-every", "5"], "llama": LLAMA, "layers4": ["--n-layer", "4"]}
    return {name: log(one_process(tokens512, out / name, *flags)) for name, flags in runs.items()} | {"dir": out}


def one_process(data: Path, out: Path, *flags: str) -> Path:
    """The same run in this process, on one thread as torchrun's ranks run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.main([*BASE, "--data", str(data), "--out-dir", str(out), *flags])
    finally:
        torch.set_num_threads(threads)
    return out


def log(out: Path) -> dict[tuple[str, int], float]:
    """{("loss" | "grad_norm" | "val_loss", step): value} of a run's log.jsonl."""
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return {(k, r["step"]): r[k] for r in records for k in ("loss", "grad_norm", "val_loss") if k in r}


def worst(run: dict, ref: dict, steps: range = range(10)) -> float:
    """The largest difference of the two logs' losses, gradient norms and val losses at these steps."""
    keys = [k for k in ref if k[1] in steps]
    assert keys and all(k in run for k in keys), sorted(set(keys) - set(run))
    return max(abs(run[k] - ref[k]) for k in keys)


@pytest.mark.slow
def test_two_ranks_train_as_one_process_and_resume_on_any_layout(tokens512, references, tmp_path):
    built = launch(tokens512, tmp_path, "two", nproc=2, timeout=600)
    ref, llama, layers4 = references["ref"], references["llama"], references["layers4"]
    # 10 fp32 steps: losses, gradient norms and val losses as one process's
    for name, want in (("tp2", ref), ("pp2", ref), ("pp2gpipe_llama", llama), ("pp2interleaved_l4", layers4)):
        assert worst(log(tmp_path / name), want) <= 1e-5, name
    # a resume on the same layout continues bitwise (tensor parallel's: the four-rank test's dp2tp2_again); on another
    # (tp2 -> dp2, pp2 -> one process) within 1e-6
    assert worst(log(tmp_path / "pp2_again"), log(tmp_path / "pp2"), range(5, 10)) == 0
    assert worst(log(tmp_path / "tp2_as_dp2"), log(tmp_path / "tp2"), range(5, 10)) <= 1e-6
    one = one_process(tokens512, tmp_path / "pp2_as_one", f"--resume={tmp_path}/pp2/ckpt_000005.pt")
    assert worst(log(one), log(tmp_path / "pp2"), range(5, 10)) <= 1e-6
    # the checkpoints are the GPT's own full state, as export.py and sample.py read it: a row out of place would be
    # off by the weights' scale (0.02), where AdamW's rounding of near-zero gradients moves a few by 1e-5
    for name in ("tp2", "pp2"):
        theirs, mine = (GPT.from_checkpoint(d / "ckpt_000005.pt").state_dict() for d in (tmp_path / name,
                                                                                          references["dir"] / "ref"))
        assert theirs.keys() == mine.keys()
        assert max((theirs[k] - mine[k]).abs().max().item() for k in mine) <= 1e-4
    # the layouts were sharded (a --tp whose ranks both trained the whole model on the same batch matches too)
    assert built == ["Sharded", "DistributedDataParallel", "Sharded", "Sharded", "Sharded", "Sharded"]


@pytest.mark.slow
def test_four_ranks_compose_data_tensor_and_pipeline_parallel(tokens512, references, tmp_path):
    built = launch(tokens512, tmp_path, "four", nproc=4, timeout=900)
    ref, llama = references["ref"], references["llama"]
    assert worst(log(tmp_path / "dp2tp2"), ref) <= 1e-5  # FSDP2 over dp x Megatron over tp
    # pipeline x tensor x sequence parallel, with GQA's key-value heads and SwiGLU split
    assert worst(log(tmp_path / "pp2tp2sp_llama"), llama) <= 1e-5
    assert worst(log(tmp_path / "dp2tp2_again"), log(tmp_path / "dp2tp2"), range(5, 10)) == 0
    assert worst(log(tmp_path / "dp2tp2_as_dp4"), log(tmp_path / "dp2tp2"), range(5, 10)) <= 1e-6
    # the layouts were sharded (a --tp whose ranks both trained the whole model on the same batch matches too)
    assert built == ["Sharded", "Sharded", "FSDPGPT", "Sharded"]  # dp2tp2_as_dp4: FSDP2 alone


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (scripts/gpu_suite.sh runs it on one)"))])
def test_one_rank_runs_the_sharded_code_as_the_plain_model(tokens512, tmp_path, device, monkeypatch, capsys):
    # --tp 1 --pp 1: DTensor on a one-rank mesh (sequence parallel too) and a one-stage pipeline schedule
    flags = ["--device", device, "--dtype", "fp32", "--compile", "false", "--ckpt-every", "5"]
    plain = log(one_process(tokens512, tmp_path / "plain", *flags))
    real, scheduled = Sharded.pipeline, []
    monkeypatch.setattr(Sharded, "pipeline", lambda self, xs, ys, train, *a: scheduled.append(train) or
                        real(self, xs, ys, train, *a))
    sharded = log(one_process(tokens512, tmp_path / "tp1pp1", *flags, "--tp", "1", "--pp", "1",
                              "--sequence-parallel"))
    monkeypatch.undo()
    assert re.search(r"\| compile False \| attention \w+ \| pp1 x dp1 x tp1 \| fp32", capsys.readouterr().out)  # layout
    assert scheduled.count(True) == 10  # every step went through the pipeline schedule, not the plain model
    tolerance = 1e-5 if device == "cpu" else 1e-3  # CUDA: TF32 matmuls, summed in another order
    assert worst(sharded, plain) <= tolerance
    back = one_process(tokens512, tmp_path / "back", *flags, f"--resume={tmp_path}/tp1pp1/ckpt_000005.pt")
    assert worst(log(back), sharded, range(5, 10)) <= tolerance / 10


def test_fused_rows_give_each_rank_whole_heads_and_come_back():
    config = dataclasses.replace(MODEL_PRESETS["tiny"](), n_head=4, n_kv_head=2, n_embd=32)  # head size 8
    rows = torch.arange(32 + 2 * 16)  # the row numbers of c_attn: q 0..31, k 32..47, v 48..63
    shares = reorder("transformer.h.0.attn.c_attn.weight", rows, config, 2).view(2, -1)
    assert shares[0].tolist() == [*range(0, 16), *range(32, 40), *range(48, 56)]  # q heads 0-1, kv head 0
    assert shares[1].tolist() == [*range(16, 32), *range(40, 48), *range(56, 64)]  # q heads 2-3, kv head 1
    assert torch.equal(reorder("x.attn.c_attn.bias", shares.flatten(), config, 2, inverse=True), rows)
    swiglu = dataclasses.replace(config, mlp="swiglu")  # c_fc stacks gate and up
    assert reorder("h.1.mlp.c_fc.weight", torch.arange(8), swiglu, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert reorder("h.1.mlp.c_fc.weight", torch.arange(8), config, 2).tolist() == list(range(8))  # GELU: no fusion
    pruned = dataclasses.replace(config, head_size=4)  # prune.py's narrower heads: q is 4 x 4 rows, not n_embd's 32
    shares = reorder("h.0.attn.c_attn.weight", torch.arange(16 + 2 * 8), pruned, 2).view(2, -1)
    assert shares[0].tolist() == [*range(0, 8), *range(16, 20), *range(24, 28)]  # q heads 0-1, kv head 0


def test_a_stage_keeps_the_half_residual_stream():
    # --half-residual: the residual stream in autocast's dtype from the embedding on, as GPT.forward makes it
    torch.manual_seed(0)
    gpt = GPT(dataclasses.replace(MODEL_PRESETS["tiny"](), vocab_size=512, half_residual=True)).eval()
    x = torch.randint(0, 512, (2, 16))
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        assert torch.equal(Stage(gpt, 0, 2)(x), gpt(x)[0])


@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    """This process as one rank of a `world`-rank group whose collectives do nothing: a rank's own part of the plan
    and the split, built in-process without torchrun."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("schedule, blocks, ends", [
    ("1f1b", [[[0, 1]], [[2, 3, 4]]], [[(True, False)], [(False, True)]]),
    ("interleaved-1f1b", [[[0], [2, 3]], [[1], [4]]],
     [[(True, False), (False, False)], [(False, False), (False, True)]]),
])
def test_each_pipeline_rank_builds_its_stages_of_contiguous_blocks(schedule, blocks, ends):
    # 5 blocks over 2 stages (2.5 each: 2 and 3) or 4 (1.25 each: 1, 1, 2, 1); interleaved: rank r runs r and r + 2
    config = dataclasses.replace(MODEL_PRESETS["tiny"](), vocab_size=512, n_layer=5)
    for rank in range(2):
        with fake_rank(rank, 2):
            sharded = shard(GPT(config), StepArgs(pp=2, pp_schedule=schedule, device="cpu"), torch.device("cpu"),
                            torch.float32)
            assert [[int(i) for i in s.transformer.h] for s in sharded.stages] == blocks[rank]
            assert [(s.first, s.last) for s in sharded.stages] == ends[rank]
            assert sharded.stage_ids == [rank + 2 * k for k in range(len(blocks[rank]))]
            assert [("wte" in s.transformer, s.lm_head is not None) for s in sharded.stages] == ends[rank]


def test_each_tensor_parallel_rank_holds_its_heads_neurons_and_vocabulary_rows():
    # Megatron's plan: c_attn and c_fc by output rows (c_attn's reordered so a rank's rows are whole q, k, v heads),
    # the c_projs by input columns, the tied embedding by vocabulary rows, norms and output biases whole
    config = dataclasses.replace(MODEL_PRESETS["tiny"](), vocab_size=512, n_kv_head=2)
    split = {"attn.c_attn.weight": 0, "attn.c_attn.bias": 0, "mlp.c_fc.weight": 0, "mlp.c_fc.bias": 0,
             "attn.c_proj.weight": 1, "mlp.c_proj.weight": 1, "wte.weight": 0}  # the dim each splits: rows, columns
    with fake_rank(0, 2):  # rank 0: the others' shares are scattered from it, which the fake group does not do
        torch.manual_seed(0)
        gpt = GPT(config)
        whole = {name: reorder(name, p.detach().clone(), config, 2) for name, p in gpt.named_parameters()}
        sharded = shard(gpt, StepArgs(tp=2, device="cpu"), torch.device("cpu"), torch.float32)
        params = dict(sharded.stages[0].named_parameters())
        assert params.keys() == whole.keys()
        for name, p in params.items():
            dim = next((d for k, d in split.items() if name.endswith(k)), None)
            assert torch.equal(local(p), whole[name] if dim is None else whole[name].chunk(2, dim)[0]), name
    with fake_rank(0, 4):  # --pp 2 too: the first stage's embedding, not tied to a head there, by its own plan
        torch.manual_seed(0)
        gpt = GPT(config)
        wte = gpt.transformer.wte.weight.detach().clone()
        first = shard(gpt, StepArgs(tp=2, pp=2, device="cpu"), torch.device("cpu"), torch.float32).stages[0]
        assert first.lm_head is None and torch.equal(local(first.transformer.wte.weight), wte.chunk(2, 0)[0])


# a QK-norm (an RMSNorm over head_dim on q and k) in model.py's attention, as a researcher adds one: this launcher
# patches it in, then runs train.py as tests/train_runs.py does
QK_NORM = """
import runpy, sys
sys.path.insert(0, ".")
import torch.nn as nn, torch.nn.functional as F
import model

class QKNorm(model.CausalSelfAttention):
    def __init__(self, config, layer):
        super().__init__(config, layer)
        self.q_norm, self.k_norm = nn.RMSNorm(config.head_dim), nn.RMSNorm(config.head_dim)

    def forward(self, x, rope, cache):
        B, T, _ = x.size()
        q, k, v = (t.view(B, T, -1, self.config.head_dim).transpose(1, 2) for t in self.c_attn(x).chunk(3, 2))
        y = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).flatten(2))

model.CausalSelfAttention = QKNorm
sys.argv = ["tests/train_runs.py", "train.py", *sys.argv[1:]]
runpy.run_path("tests/train_runs.py", run_name="__main__")
"""
UNSPLIT = ("--tp cannot split {}: inside attention and the MLP a rank holds only its heads and hidden units, and "
           "the plan in parallelize.py's tensor_parallel lists attn.c_attn, mlp.c_fc, attn.c_proj, mlp.c_proj there; "
           "add its module to that plan (docs/scale.md), or use --pp or --parallel fsdp")


@pytest.mark.slow
def test_a_module_the_tp_plan_does_not_split_is_refused_in_one_line_per_rank(tokens512, tmp_path):
    # was each rank's RuntimeError traceback from DTensor: "aten.mul.Tensor got mixed torch.Tensor and DTensor"
    (tmp_path / "qk_norm.py").write_text(QK_NORM)
    proc = run_torchrun([tmp_path / "qk_norm.py", *BASE, "--data", tokens512, "--out-dir", tmp_path, "--tp", "2"],
                        nproc=2, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: " + UNSPLIT.format("transformer.h.0.attn.q_norm.weight")] * 2, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback (most recent call last)") == 1  # torchrun's own report of a failed worker


def run_from_own_inits(tokens512, tmp_path, field: str, values: tuple, *flags: str) -> list:
    """Two nodes, each with an --init-from of its own (a LOCAL path): the same weights, saved with field=values[node]
    in the model config, as a run with that flag saves them (the demo's --loss-chunk 128)."""
    for node, value in enumerate(values):
        torch.manual_seed(0)
        config = dataclasses.replace(MODEL_PRESETS["tiny"](), vocab_size=512, **{field: value})
        torch.save({"model": GPT(config).state_dict(), "model_config": dataclasses.asdict(config)},
                   tmp_path / f"init{node}.pt")
    args = [*BASE, "--data", tokens512, "--out-dir", tmp_path / "out", "--sample-every", "0", *flags]
    return run_nodes([["train.py", *map(str, args), f"--init-from={tmp_path}/init{node}.pt"] for node in (0, 1)])


def test_nodes_whose_init_from_was_saved_with_another_dropout_stop_naming_it(tokens512, tmp_path):
    # the weights digest matched, and DDP trained one replica with dropout, the other without: apart, without a word
    done = run_from_own_inits(tokens512, tmp_path, "dropout", (0.0, 0.1))
    line = (f"error: rank 1 built its model from --init-from {tmp_path}/init1.pt with dropout 0.1 (rank 0: 0.0): "
            "every node must build the same model (its checkpoint's options, where no flag sets them)\n")
    assert [(r.returncode, r.stderr) for r in done] == [(1, line)] * 2


@pytest.mark.slow
def test_a_model_only_one_node_cannot_shard_stops_every_node_naming_the_difference(tokens512, tmp_path):
    # one node's --loss-chunk 128: that rank refused alone and the other got gloo's "Connection closed by peer"; then
    # both stopped in shard() with its refusal; now the model config differs, and is named before anything shards
    done = run_from_own_inits(tokens512, tmp_path, "loss_chunk", (128, 0), "--tp", "2", "--batch-size", "16")
    line = (f"error: rank 1 built its model from --init-from {tmp_path}/init1.pt with loss_chunk 0 (rank 0: 128): "
            "every node must build the same model (its checkpoint's options, where no flag sets them)\n")
    assert [(r.returncode, r.stderr) for r in done] == [(1, line)] * 2


def test_nodes_resuming_copies_saved_with_another_dropout_stop_naming_it(tokens512, tmp_path):
    # each node's --resume PATH: the same step and weights (Checkpointer.find's check), one copy's config with
    # dropout 0.1, which the resumed model takes where no --dropout is given
    train.main([*BASE, "--data", str(tokens512), "--out-dir", str(tmp_path / "a"), "--max-steps", "2"])
    ckpt = torch.load(tmp_path / "a/ckpt_000002.pt", weights_only=False)
    ckpt["model_config"]["dropout"] = 0.1
    torch.save(ckpt, tmp_path / "b.pt")
    args = [*BASE, "--data", tokens512, "--out-dir", tmp_path / "out", "--sample-every", "0"]
    done = run_nodes([["train.py", *map(str, args), f"--resume={path}"] for path in (tmp_path / "a/ckpt_000002.pt",
                                                                                    tmp_path / "b.pt")])
    line = (f"error: rank 1 built its model from --resume {tmp_path}/b.pt with dropout 0.1 (rank 0: 0.0): every node "
            "must build the same model (its checkpoint's options, where no flag sets them)\n")
    assert [(r.returncode, r.stderr) for r in done] == [(1, line)] * 2


class Scaled(model.MLP):  # a learned scale on the MLP's hidden units: rank-local there, so refused
    def __init__(self, config):
        super().__init__(config)
        self.scale = nn.Parameter(torch.ones(4 * config.n_embd))


class Gated(model.Block):  # a block's own module on the residual stream: a DTensor there, so replicated
    def __init__(self, config, layer):
        super().__init__(config, layer)
        self.gate = nn.Linear(config.n_embd, config.n_embd)


@pytest.mark.parametrize("name, cls, error", [("MLP", Scaled, UNSPLIT.format("transformer.h.0.mlp.scale")),
                                              ("Block", Gated, None)])
def test_what_the_tp_plan_refuses_is_inside_attention_and_the_mlp(monkeypatch, name, cls, error):
    monkeypatch.setattr(model, name, cls)
    config = dataclasses.replace(MODEL_PRESETS["tiny"](), vocab_size=512)
    with fake_rank(0, 2), (pytest.raises(ValueError) if error else contextlib.nullcontext()) as refused:
        shard(GPT(config), StepArgs(tp=2, device="cpu"), torch.device("cpu"), torch.float32)
    assert (refused and str(refused.value)) == error


@pytest.mark.parametrize("where, add", [
    ("transformer.emb_norm", lambda gpt: gpt.transformer.update({"emb_norm": nn.LayerNorm(64)})),
    ("logit_scale", lambda gpt: gpt.register_parameter("logit_scale", nn.Parameter(torch.ones(1)))),
    # a parameter set on the transformer dict itself, and a buffer of the GPT's other than RoPE's tables
    ("transformer.emb_scale",
     lambda gpt: gpt.transformer.register_parameter("emb_scale", nn.Parameter(torch.ones(64)))),
    ("logit_bias", lambda gpt: gpt.register_buffer("logit_bias", torch.zeros(512)))])
def test_a_module_stage_does_not_carry_is_refused_not_dropped(where, add):
    """A researcher's module outside the blocks: Stage rebuilt the model without it, and --tp/--pp trained a model
    that silently lacked it."""
    gpt, rope = (GPT(dataclasses.replace(MODEL_PRESETS["tiny"](), n_embd=64, pos=pos)) for pos in ("learned", "rope"))
    assert len(Stage(gpt, 0, 2).state_dict()) > 0 and Stage(rope, 0, 2).rope_cos is not None  # the models as built
    add(gpt)
    with pytest.raises(ValueError) as refused:
        Stage(gpt, 0, gpt.config.n_layer)
    assert str(refused.value) == (f"--tp/--pp run the model as parallelize.Stage, which carries GPT's wte, wpe, drop, "
                                  f"blocks, ln_f and lm_head only: add {where} to Stage's __init__ and forward")


def test_tensor_and_pipeline_groups_share_their_data_rank():
    args = StepArgs(tp=2, pp=2)  # mesh (pp, dp, tp) over 8 ranks: dp = 2
    assert [data_rank(args, r, 8) for r in range(8)] == [(0, 2), (0, 2), (1, 2), (1, 2)] * 2


@pytest.mark.parametrize("flags, world, error", [
    (dict(tp=3), 3, "--tp 3 must divide the 4 heads"),
    (dict(tp=2, arch=dict(n_kv_head=1)), 2, "and the 1 key-value heads"),
    (dict(pp=3), 3, "--pp 3 with --pp-schedule 1f1b makes 3 stages of the 2 blocks"),
    (dict(pp=2, pp_schedule="interleaved-1f1b"), 2, "makes 4 stages of the 2 blocks"),
    (dict(tp=2, arch=dict(fused_ce=True)), 2, "--fused-ce and --loss-chunk do not shard: pass --fused-ce false "
     "with --tp/--pp"),
    # the demo preset's --loss-chunk 128, which the user never typed: "drop them" pointed at nothing to drop
    # ... or an --init-from checkpoint of the demo, whose model_config keeps it (stage.load_init's run options)
    (dict(pp=2, arch=dict(loss_chunk=128, fused_gelu=True)), 2, "pass --fused-gelu false, --loss-chunk 0 with "
     "--tp/--pp (a preset or an --init-from checkpoint may set them)"),
    (dict(tp=2, arch=dict(dropout=0.1)), 2, "use --dropout 0"),
    (dict(tp=2), 4, "over 2 data-parallel ranks shard them with FSDP2: pass --parallel fsdp"),
    (dict(tp=2), 3, "--tp 2 x --pp 1 = 2 ranks must divide the world size 3"),
    (dict(tp=2, arch=dict(vocab_size=50257)), 2, "--tp 2 must divide the vocabulary (50257 rows) and the MLP width "
     "(256); an HF GPT-2's 50,257 rows (29 x 1733) divide by no --tp: fine-tune it with --pp or --parallel fsdp"),
])
def test_what_cannot_shard_is_refused_in_one_line(flags, world, error):
    cfg = train.TrainConfig(model="tiny", hellaswag="off", sample_every=0, **flags)
    assert error in shard_problem(cfg, train.model_config(cfg), world)


@pytest.mark.parametrize("flags, error", [
    (dict(tp=2, parallel="zero1"), "--parallel zero1 keeps a whole model's optimizer state"),
    (dict(pp=2, optimizer="muon"), "--optimizer muon needs whole matrices"),
    (dict(tp=2, dtype="fp16"), "--dtype fp16's GradScaler"),
    (dict(sequence_parallel=True), "--sequence-parallel splits the norms over the --tp ranks"),
    (dict(pp_schedule="gpipe"), "--pp-schedule gpipe needs --pp stages: pass --pp"),  # was ignored in silence
    (dict(pp=1, pp_schedule="interleaved-1f1b"), "--pp-schedule interleaved-1f1b interleaves stages over the --pp"),
    (dict(pp=2, pp_schedule="zero-bubble"), "--pp-schedule must be one of 1f1b, gpipe, interleaved-1f1b"),
    (dict(tp=2, hellaswag="off"), "--sample-every: not under --tp/--pp"),
    (dict(pp=2, sample_every=0, label_smoothing=0.1), "--label-smoothing, --hellaswag: not under --tp/--pp, which "
     "train and score the language model's loss only; pass --label-smoothing 0, --hellaswag off, or score a checkpoint "
     "on one process"),
])
def test_flags_that_cannot_shard_are_refused_before_any_work(flags, error):
    with pytest.raises(ValueError, match="^" + error.replace("(", r"\(").replace(")", r"\)")):
        train.TrainConfig(**flags)


@pytest.mark.parametrize("stage", [sft.SFTConfig, prefs.PrefsConfig, rl.RLConfig, prune.PruneConfig])
def test_stages_other_than_pretraining_refuse_tp_and_pp(stage):
    for flags in (dict(tp=2), dict(pp=2)):
        with pytest.raises(ValueError, match="^--tp/--pp shard pretraining's language model only"):
            stage(**flags)


def test_tensor_parallel_without_torchrun_names_the_fix(tokens512, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main([*BASE, "--data", str(tokens512), "--out-dir", str(tmp_path), "--tp", "2"])
    assert capsys.readouterr().err == ("error: --tp 2 x --pp 1 = 2 ranks must divide the world size 1: launch "
                                       "torchrun with a multiple of 2 processes\n")


def test_the_plan_holds_fp32_gradients_between_micro_steps():
    # FSDP2 (reduce dtype fp32) accumulates a shard's unsharded gradients in fp32 while the pipeline schedule keeps
    # gradient sync off: 2 + 4 bytes a parameter of the stage with its bf16 weights (docs/scale.md's table)
    import importlib.util

    spec = importlib.util.spec_from_file_location("scale_plan", Path(__file__).parents[1] / "scripts/scale_plan.py")
    plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plan)
    assert [round(plan.memory(p, 36.1)["held"], 2) for p in plan.PLANS] == [0.12, 9.64, 8.64]
