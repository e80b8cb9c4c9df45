"""prune.py: each method's sparsity and shapes, masks that hold through AdamW, Muon and 8-bit AdamW, a bitwise resume,
the one-line refusals, and a structured checkpoint read by sample.py, hellaswag.py, export.py and train.py."""

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import engine
import export
import generate
import hellaswag
import prune
import sample
import stage
import train
from chat_format import is_chat
from common import get_tokenizer, load_checkpoint
from conftest import one_line_error, run_nodes
from model import GPT, GPTConfig
from parallel import StepArgs, build_trainable, lm_loss, train_step

SMALL = GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=32, dropout=0.1)  # GPT-2's vocabulary: the tokenizer's ids
HELLASWAG = Path(__file__).resolve().parent / "data" / "hellaswag_tiny.jsonl"  # 6 examples


def noisy(config: GPTConfig, seed: int = 0) -> GPT:
    """A random GPT, noise on every tensor: zero biases and unit norms would hide a weight put in the wrong place."""
    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("start") / "ckpt.pt"
    model = noisy(SMALL)
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(SMALL), "step": 0}, path)
    return path


def run(start: Path, data: Path, out: Path, *extra: str) -> dict:
    return prune.main(["--init-from", str(start), "--data", str(data), "--out-dir", str(out), "--batch-size=2",
                       "--seq-len=16", "--eval-tokens=64", "--warmup-steps=0", "--max-lr=1e-3", *extra])


def zeros(model: torch.nn.Module) -> dict[str, int]:
    return {name: int((p == 0).sum()) for name, p in prune.matrices(model).items()}


# ----------------------------------------------------------------------------------------------------------------------
# The methods


def test_magnitude_and_2_4_remove_the_smallest_weights_to_the_sparsity_asked():
    model = noisy(SMALL)
    weights = {name: p.detach().abs() for name, p in prune.matrices(model).items()}
    total = sum(w.numel() for w in weights.values())
    masks = prune.magnitude_masks(model, 0.3, "global")
    assert sum(int((~m).sum()) for m in masks.values()) == round(0.3 * total)
    pairs = list(zip(weights.values(), masks.values(), strict=True))
    pruned, kept = (torch.cat([w[m == want] for w, m in pairs]) for want in (0, 1))
    assert pruned.max() <= kept.min()
    layer = prune.magnitude_masks(model, 0.3, "layer")
    assert {n: int((~m).sum()) for n, m in layer.items()} == {n: round(0.3 * w.numel()) for n, w in weights.items()}
    for name, mask in prune.two_four_masks(model).items():
        groups, keep = weights[name].view(-1, 4), mask.view(-1, 4)
        assert (keep.sum(1) == 2).all()  # 2 of every 4 along the input dimension, the larger two
        assert (groups[keep].view(-1, 2).min(1).values >= groups[~keep].view(-1, 2).max(1).values).all()


def test_a_size_or_parallel_refusal_names_only_the_flag_at_fault():
    def refusal(**flags: object) -> str:
        with pytest.raises(ValueError) as e:
            prune.PruneConfig(**flags)
        return str(e.value)

    assert refusal(calib_batches=0) == "--calib-batches must be >= 1; got 0"
    assert refusal(batch_size=0, eval_tokens=0) == "--batch-size must be >= 1; got 0"
    assert refusal(seq_len=-1) == "--seq-len must be >= 0 (0: the model's context); got -1"
    assert refusal(parallel="fsdp") == ("--parallel fsdp shards each tensor, and the masks cover whole ones: use "
                                        "--parallel ddp or zero1")


def test_2_4_refuses_a_matrix_whose_inputs_are_not_groups_of_4_even_when_its_outputs_are():
    # mlp.c_proj is (32, 30): 960 weights would split into 4s, but each 4 would straddle two rows
    model = GPT(dataclasses.replace(SMALL, mlp_hidden=30))
    with pytest.raises(ValueError, match=r"transformer\.h\.0\.mlp\.c_proj\.weight is \(32, 30\): 30 inputs"):
        prune.two_four_masks(model)


def test_norm_scores_are_each_units_l2_norm_over_all_its_weights():
    # GQA and SwiGLU: a group's q rows (2 heads), k and v rows, and attn.c_proj columns; a neuron's two c_fc rows
    # (gate, up) and its mlp.c_proj column
    model = noisy(dataclasses.replace(SMALL, vocab_size=64, n_head=8, n_kv_head=4, mlp="swiglu", bias=False))
    cfg, block = model.config, model.transformer.h[1]
    hs, hidden = cfg.head_dim, block.mlp.c_proj.in_features
    attn, proj = block.attn.c_attn.weight.detach(), block.attn.c_proj.weight.detach()
    fc, out = block.mlp.c_fc.weight.detach(), block.mlp.c_proj.weight.detach()
    want = []
    for g in range(4):
        q = [h * hs + i for h in (2 * g, 2 * g + 1) for i in range(hs)]
        kv = [8 * hs + g * hs + i for i in range(hs)]
        rows = q + kv + [r + 4 * hs for r in kv]
        want.append((attn[rows].pow(2).sum() + proj[:, q].pow(2).sum()).sqrt())
    neurons = [(fc[j].pow(2).sum() + fc[hidden + j].pow(2).sum() + out[:, j].pow(2).sum()).sqrt()
               for j in range(hidden)]
    with torch.no_grad():
        heads, mlp = prune.block_scores(block, cfg, "norm")
    torch.testing.assert_close(heads, torch.stack(want))
    torch.testing.assert_close(mlp, torch.stack(neurons))


def test_structured_keeps_the_rounded_share_and_prunes_further_counting_from_the_dense_model():
    model = noisy(dataclasses.replace(SMALL, dropout=0.0))
    cfg = prune.PruneConfig(method="structured", sparsity=0.3)
    small, record = prune.prune(model, None, cfg, None)  # 4 groups, 128 neurons: 0.7 of them round to 3 and 90
    assert (small.config.n_head, small.config.mlp_hidden) == (3, 90)
    assert record["dense"] == {"weights": 24576, "groups": 4, "hidden": 128}
    smaller, record = prune.prune(small, record, dataclasses.replace(cfg, sparsity=0.5), None)
    assert (smaller.config.n_head, smaller.config.mlp_hidden) == (2, 64)  # half of the dense 4 and 128, not of 3, 90
    assert record["dense"]["hidden"] == 128


def test_taylor_scores_average_every_calibration_batch():
    model = noisy(dataclasses.replace(SMALL, vocab_size=64, dropout=0.0))
    batches = [torch.randint(0, 64, (2, 16)) for _ in range(3)]
    served = []

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        served.append(x := batches[len(served)])
        return x, torch.roll(x, -1, 1)

    calib = SimpleNamespace(next_batch=next_batch)
    dense = {"weights": 0, "groups": 4, "hidden": 128}
    prune.structured(model, prune.PruneConfig(method="structured", importance="taylor", calib_batches=3), dense,
                     calib)
    assert len(served) == 3


def test_pruning_further_keeps_the_masks_before_it():
    # global magnitude prunes all of a tiny matrix; pruning further per layer (--scope layer) must not revive half
    model = noisy(SMALL)
    with torch.no_grad():
        model.transformer.h[0].attn.c_proj.weight.mul_(1e-3)
    model, record = prune.prune(model, None, prune.PruneConfig(sparsity=0.25), None)
    name = "transformer.h.0.attn.c_proj.weight"
    assert not record["masks"][name].any()
    model, record = prune.prune(model, record, prune.PruneConfig(sparsity=0.5, scope="layer"), None)
    assert not record["masks"][name].any() and (model.transformer.h[0].attn.c_proj.weight == 0).all()


def zeroed(model: GPT, keep: list[tuple[torch.Tensor, torch.Tensor]]) -> GPT:
    """The dense model with every unit not in `keep` zeroed: its q, k, v rows and output columns, its MLP rows."""
    cfg, dense = model.config, GPT(model.config)
    dense.load_state_dict(model.state_dict())
    hs, rep, hidden = cfg.head_dim, cfg.n_head // cfg.kv_heads, dense.transformer.h[0].mlp.c_proj.in_features
    with torch.no_grad():
        for block, (groups, neurons) in zip(dense.transformer.h, keep, strict=True):
            for g in set(range(cfg.kv_heads)) - set(groups.tolist()):
                heads = range(g * rep, (g + 1) * rep)
                q_rows = [h * hs + i for h in heads for i in range(hs)]
                kv = [cfg.n_head * hs + g * hs + i for i in range(hs)]
                rows = q_rows + kv + [r + cfg.kv_heads * hs for r in kv]
                block.attn.c_attn.weight[rows] = 0
                if block.attn.c_attn.bias is not None:
                    block.attn.c_attn.bias[rows] = 0
                block.attn.c_proj.weight[:, q_rows] = 0
            for j in set(range(hidden)) - set(neurons.tolist()):
                block.mlp.c_proj.weight[:, j] = 0
    return dense.eval()


@pytest.mark.parametrize("arch", [{}, {"n_head": 8, "n_kv_head": 4, "mlp": "swiglu", "pos": "rope", "bias": False,
                                     "norm": "rmsnorm"}])
def test_structured_pruning_shrinks_the_tensors_and_computes_what_the_zeroed_dense_model_does(arch, tmp_path):
    model = noisy(dataclasses.replace(SMALL, dropout=0.0, **arch)).eval()
    cfg, hidden = model.config, model.transformer.h[0].mlp.c_proj.in_features
    keep = [(torch.tensor([0, cfg.kv_heads - 1]), torch.arange(0, hidden, 3)) for _ in range(cfg.n_layer)]
    small = prune.shrink(model, keep).eval()
    heads = 2 * cfg.n_head // cfg.kv_heads
    shape = (small.config.n_head, small.config.head_size, small.config.mlp_hidden)
    assert shape == (heads, cfg.head_dim, len(keep[0][1]))
    assert small.transformer.h[0].attn.c_attn.weight.shape == ((heads + 2 * 2) * cfg.head_dim, cfg.n_embd)  # 2 k, 2 v
    assert small.transformer.h[0].attn.c_proj.weight.shape == (cfg.n_embd, heads * cfg.head_dim)
    assert small.transformer.h[1].mlp.c_proj.weight.shape == (cfg.n_embd, len(keep[0][1]))
    idx = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(small(idx)[0], zeroed(model, keep)(idx)[0], atol=1e-5, rtol=1e-5)
    if arch:  # the LLaMA architecture exports its own head_dim: transformers computes the same logits
        transformers = pytest.importorskip("transformers")
        hf = transformers.LlamaForCausalLM.from_pretrained(export.export_hf(small, tmp_path)).eval()
        assert (hf.config.num_attention_heads, hf.config.num_key_value_heads, hf.config.head_dim) == (4, 2, 4)
        with torch.no_grad():
            torch.testing.assert_close(hf(idx).logits, small(idx)[0][..., :50257], atol=1e-4, rtol=1e-4)


def test_structured_ranks_by_weight_norm_and_taylor_is_the_gate_derivative():
    model = noisy(dataclasses.replace(SMALL, dropout=0.0))
    with torch.no_grad():  # head 1 of block 0 large, head 2 tiny: norm keeps the one and drops the other
        model.transformer.h[0].attn.c_proj.weight[:, 8:16] *= 10
        model.transformer.h[0].attn.c_proj.weight[:, 16:24] *= 0.01
    dense = {"weights": 0, "groups": 4, "hidden": 128}
    small, masks = prune.structured(model, prune.PruneConfig(method="structured", sparsity=0.25), dense, None)
    assert (small.config.n_head, small.config.mlp_hidden, masks) == (3, 96, {})
    kept, before = small.transformer.h[0].attn.c_proj.weight, model.transformer.h[0].attn.c_proj.weight
    assert torch.equal(kept[:, 8:16], before[:, 8:16])  # heads 0, 1 and 3 kept, in their order
    assert not any(torch.equal(kept[:, 8 * i:8 * i + 8], before[:, 16:24]) for i in range(3))
    # taylor: |dL/dg| for a gate g on each head's (and neuron's) output, by autograd through real gates
    x = torch.randint(0, 50257, (2, 16))
    batch = SimpleNamespace(next_batch=lambda: (x, torch.roll(x, -1, 1)))
    model.eval()  # the gradient prune.structured's taylor scores read: the mean loss's, dropout off
    model(*batch.next_batch())[1].backward()
    block = model.transformer.h[1]
    with torch.no_grad():
        scores = prune.block_scores(block, model.config, "taylor")
    model.zero_grad()
    gates = [torch.ones(4, requires_grad=True), torch.ones(128, requires_grad=True)]
    hooks = [block.attn.c_proj.register_forward_pre_hook(lambda m, a: (a[0] * gates[0].repeat_interleave(8),)),
             block.mlp.c_proj.register_forward_pre_hook(lambda m, a: (a[0] * gates[1],))]
    model.eval()
    model(*batch.next_batch())[1].backward()
    for hook in hooks:
        hook.remove()
    for score, gate in zip(scores, gates, strict=True):
        torch.testing.assert_close(score, gate.grad.abs(), rtol=1e-4, atol=1e-7)


# ----------------------------------------------------------------------------------------------------------------------
# Recovery: the masks hold, the resume is exact


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "adamw8bit"])
def test_masks_hold_after_optimizer_steps(optimizer):
    if optimizer == "muon" and not hasattr(torch.optim, "Muon"):
        pytest.skip("torch.optim.Muon is new in torch 2.9")
    if optimizer == "adamw8bit":
        pytest.importorskip("torchao", reason="--optimizer adamw8bit needs torchao")
    x = torch.randint(0, 64, (4, 16))
    batch = lambda: (x, torch.roll(x, -1, 1))

    def steps(hold: bool) -> tuple[GPT, prune.Pruning]:
        # 8-bit moments for tensors of 4096+ elements: the MLP's two here
        model = noisy(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32))
        masks = prune.magnitude_masks(model, 0.5, "global")
        pruning = prune.Pruning(model, {"masks": masks, "dense": {"weights": sum(m.numel() for m in masks.values())}})
        pruning.hold()
        built = build_trainable(model, StepArgs(optimizer=optimizer, max_lr=1e-2, device="cpu"), torch.device("cpu"),
                                False, verbose=False)
        if hold:
            pruning.attach(built.optimizer)
        for _ in range(3):
            with torch.compiler.set_stance("force_eager"):  # torchao's 8-bit step: compiled, ~30 s of CPU per shape set
                train_step(built.model, built.optimizer, batch, 1, built.autocast, 1.0)
            if hold:
                pairs = zip(prune.matrices(model).values(), masks.values(), strict=True)
                assert all((p[~keep] == 0).all() for p, keep in pairs)
        return model, pruning

    model, pruning = steps(hold=True)
    assert pruning.sparsity() == 0.5
    start = noisy(model.config)
    trained, started = (prune.matrices(m).values() for m in (model, start))
    assert all((p != q).any() for p, q in zip(trained, started, strict=True))  # the kept weights trained
    _, unheld = steps(hold=False)  # the test can fail: without the hooks the optimizer revives pruned weights
    assert unheld.sparsity() < 0.01


def test_clipping_and_the_logged_norm_count_only_the_kept_weights():
    x = torch.randint(0, 64, (4, 16))
    batch = lambda: (x, torch.roll(x, -1, 1))
    model = noisy(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=2, n_embd=32))
    masks = prune.magnitude_masks(model, 0.75, "global")
    pruning = prune.Pruning(model, {"masks": masks, "dense": {"weights": 1}})
    pruning.hold()
    lm_loss(model, batch()).backward()  # the dense gradient: the removed weights' entries are not 0
    kept = torch.cat([(p.grad * masks.get(n, 1)).flatten() for n, p in model.named_parameters()]).norm()
    model.zero_grad(set_to_none=True)
    built = build_trainable(model, StepArgs(device="cpu"), torch.device("cpu"), False, verbose=False)
    pruning.attach(built.optimizer)
    torch.testing.assert_close(train_step(built.model, built.optimizer, batch, 1, built.autocast, 1.0)[1], kept)


def test_recovery_resumes_bitwise_and_the_checkpoint_records_the_pruning(start, token_data, tmp_path, monkeypatch):
    args = ["--method=magnitude", "--sparsity=0.5", "--max-steps=4", "--ckpt-every=2", "--keep-last=5",
            "--eval-every=2"]
    full = run(start, token_data, tmp_path / "full", *args)
    assert len(full["losses"]) == 4 and full["val"]["sparsity"] == 0.5
    (tmp_path / "resumed").mkdir()
    shutil.copy(tmp_path / "full" / "ckpt_000002.pt", tmp_path / "resumed")
    seen = []  # a resume compared its random init's digest across ranks: every torchrun resume stopped at once
    monkeypatch.setattr(engine, "agree_fingerprint", lambda make, *_: seen.append(make()["weights"]))
    rest = run(start, token_data, tmp_path / "resumed", *args, "--resume=auto")
    assert rest["losses"] == full["losses"][2:] and rest["val"] == full["val"] and seen == [None]  # bitwise
    first, last = (load_checkpoint(tmp_path / "full" / f"ckpt_{s:06d}.pt") for s in (0, 4))
    record = last["pruning"]
    assert (record["method"], record["sparsity"], record["scope"]) == ("magnitude", 0.5, "global")
    assert all(torch.equal(record["masks"][n], m) for n, m in first["pruning"]["masks"].items())
    for name, keep in record["masks"].items():
        weights, before = last["model"][name], first["model"][name]
        assert (weights[~keep] == 0).all() and (weights[keep] != before[keep]).any()


def test_ranks_resuming_step_0_checkpoints_of_other_weights_are_refused(start, token_data, tmp_path, monkeypatch):
    # ckpt_000000 has no loss history, and a resume's fingerprint leaves the weights to find: two nodes' own out-dirs
    # holding other runs' (another --init-from) were resumed, each rank training its own model
    run(start, token_data, tmp_path / "a", "--max-steps=1")
    (tmp_path / "a" / "ckpt_000001.pt").unlink()
    ckpt = load_checkpoint(tmp_path / "a" / "ckpt_000000.pt")
    (tmp_path / "b").mkdir()
    torch.save({**ckpt, "model": {k: v + 1 for k, v in ckpt["model"].items()}}, tmp_path / "b" / "ckpt_000000.pt")
    monkeypatch.setattr(engine, "same_verdict", lambda work, world, **_: work())
    theirs = []  # rank 1's, its node's out-dir b
    monkeypatch.setattr(engine.dist, "all_gather_object", lambda seen, mine: theirs.append(mine))
    engine.Checkpointer(prune.PruneConfig(out_dir=str(tmp_path / "b"), resume="auto"), 1, 2).find()
    monkeypatch.setattr(engine.dist, "all_gather_object", lambda seen, mine: seen.__setitem__(1, theirs[0]))
    with pytest.raises(ValueError, match="ranks resumed different checkpoints"):
        engine.Checkpointer(prune.PruneConfig(out_dir=str(tmp_path / "a"), resume="auto"), 0, 2).find()


def test_taylor_calibration_reads_its_own_batches_not_the_recoverys(start, token_data, tmp_path, monkeypatch):
    # the calibration batches come from a loader of their own (rank 0's, another seed): drawn from the recovery's, its
    # first --calib-batches batches would be skipped
    class Pruned(Exception):
        pass

    def calibrated(model, record, cfg, calib):
        seen.update(seed=(calib.seed, cfg.seed), ranks=(calib.rank, calib.world_size), step=calib.step)
        raise Pruned

    seen = {}
    monkeypatch.setattr(prune, "prune", calibrated)
    with pytest.raises(Pruned):
        run(start, token_data, tmp_path / "t", "--method=structured", "--importance=taylor", "--seed=5")
    assert seen == {"seed": (6, 5), "ranks": (0, 1), "step": 0}


def test_the_checkpoint_records_the_seq_len_the_run_resolved(start, token_data, tmp_path):
    # it kept --seq-len 0, and every resume against the run's 32 said "flags changed: --seq-len 0 -> 32"
    prune.main(["--init-from", str(start), "--data", str(token_data), "--out-dir", str(tmp_path), "--eval-tokens=64"])
    assert load_checkpoint(tmp_path / "ckpt_000000.pt")["train_config"]["seq_len"] == 32


def test_the_step_0_checkpoint_leaves_adamw_at_its_first_step():
    """DCP's get_optimizer_state_dict fills a fresh optimizer by a step at lr 0, which AdamW counts: ckpt_000000 made
    recovery's first update AdamW's second (a 26% smaller one) on one process and DDP, not under ZeRO-1, and its
    resume did the same on load."""
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    _, saved = engine.state_dicts(model, optimizer)
    assert not optimizer.state and not saved["state"]
    ckpt = {"model": model.state_dict(), "optimizer": saved, "optimizer_kind": "single", "step": 0,
            "rng": [engine.rng_state()]}
    assert engine.Checkpointer(prune.PruneConfig()).restore(ckpt, model, optimizer, {}) == 0
    assert not optimizer.state


# ----------------------------------------------------------------------------------------------------------------------
# Refusals, and the pruned checkpoint in the other scripts


def test_refusals_are_one_line(start, token_data, tmp_path, capsys):
    def refusal(*argv: str) -> str:
        return one_line_error(capsys, prune.main, list(argv))

    assert refusal("--sparsity=1.0") == ("error: --sparsity must be in [0, 1), and 0.5 for --method 2:4 (2 of every 4 "
                                        "weights); got 1.0")
    assert refusal("--sparsity=-0.1").endswith("got -0.1")
    assert refusal("--method=2:4", "--sparsity=0.25").endswith("got 0.25")
    assert refusal("--method=random").startswith("error: --method must be one of magnitude, structured, 2:4")
    odd = tmp_path / "odd.pt"
    config = dataclasses.replace(SMALL, n_embd=30, n_head=2)
    torch.save({"model": GPT(config).state_dict(), "model_config": dataclasses.asdict(config)}, odd)
    assert refusal("--init-from", str(odd), "--data", str(token_data), "--out-dir", str(tmp_path / "a"),
                   "--method=2:4") == ("error: --method 2:4 takes 4 weights at a time along a matrix's input "
                                       "dimension, and transformer.h.0.attn.c_attn.weight is (90, 30): 30 inputs; use "
                                       "--method magnitude or structured")
    run(start, token_data, tmp_path / "mag", "--sparsity=0.25")
    pruned = tmp_path / "mag" / "ckpt_000000.pt"
    assert refusal("--init-from", str(pruned), "--data", str(token_data), "--out-dir", str(tmp_path / "b"),
                   "--method=structured") == (f"error: --init-from {pruned} was pruned by --method magnitude, which "
                                              "--method structured cannot extend: pass --method magnitude, or start "
                                              "from the unpruned checkpoint")
    assert refusal("--init-from", str(pruned), "--data", str(token_data), "--out-dir", str(tmp_path / "c"),
                   "--sparsity=0.1") == (f"error: --init-from {pruned} is pruned to --sparsity 0.25: pass --sparsity "
                                         "0.25 (more prunes it further, in a new run from it)")
    # a global 0.25's zeros kept under --scope layer 0.5 left a matrix past 0.5, its record saying 0.5
    assert refusal("--init-from", str(pruned), "--data", str(token_data), "--out-dir", str(tmp_path / "s"),
                   "--sparsity=0.5", "--scope=layer") == (
        f"error: --init-from {pruned} was pruned with --scope global: pass --scope global (its zeros stay, so under "
        "--scope layer some matrices would end past --sparsity 0.5)")
    further = run(pruned, token_data, tmp_path / "d", "--sparsity=0.5")
    assert further["val"]["sparsity"] == 0.5
    # GPT.load's hint for a run directory named --ckpt, which prune.py has not
    assert refusal("--init-from", str(tmp_path / "mag"), "--data", str(token_data), "--out-dir", str(tmp_path / "e")) \
        == f"error: --init-from {tmp_path / 'mag'} is a run directory; pass one of its checkpoints, e.g. --init-from " \
        f"{pruned} (the latest)"
    assert refusal("--init-from", str(start), "--data", str(token_data), "--out-dir", str(tmp_path / "g"),
                   "--seq-len=64") == (f"error: --seq-len 64 is longer than --init-from {start}'s context of 32 "
                                       "tokens; pass --seq-len 32 or less (0: the model's)")
    assert not list((tmp_path / "g").glob("ckpt_*"))  # it failed at the first evaluation, ckpt_000000.pt written
    reward = tmp_path / "rm.pt"  # its pruned checkpoint was exported, and refused by rl.py, as a language model
    torch.save({**torch.load(start), "train_config": {"objective": "reward"}}, reward)
    assert refusal("--init-from", str(reward), "--data", str(token_data), "--out-dir", str(tmp_path / "f")).startswith(
        f"error: --init-from {reward} is a reward model: recovery trains a language model's loss")


def test_a_pruned_chat_model_stays_one_and_exports_its_chat_tokens(start, token_data, tmp_path):
    chat = tmp_path / "chat.pt"
    torch.save({**torch.load(start), "chat": True}, chat)
    run(chat, token_data, tmp_path / "p", "--max-steps=1")
    run(chat, token_data, tmp_path / "p", "--max-steps=2", "--resume=auto")
    assert [is_chat(load_checkpoint(tmp_path / "p" / f"ckpt_{s:06d}.pt")) for s in (0, 1, 2)] == [True] * 3
    export.main(["--ckpt", str(tmp_path / "p" / "ckpt_000002.pt"), "--export-hf", str(tmp_path / "hf")])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["vocab_size"] == 50304  # not cropped to 50,257


def test_an_exported_chat_model_stays_one_and_a_critic_is_left_out(start, token_data, tmp_path):
    # from an HF export of a chat model the mark was lost: the pruned model's export cropped the chat tokens' rows
    export.export_hf(GPT.from_checkpoint(start), tmp_path / "hf", chat=True)
    run(tmp_path / "hf", token_data, tmp_path / "p", "--max-steps=1")
    assert is_chat(load_checkpoint(tmp_path / "p" / "ckpt_000001.pt"))
    # a PPO policy's critic: recovery trains no value head, and DDP stopped on the gradient it never got
    ppo, critic = tmp_path / "ppo.pt", dataclasses.replace(SMALL, value_head=True)
    torch.save({"model": noisy(critic).state_dict(), "model_config": dataclasses.asdict(critic), "step": 0}, ppo)
    run(ppo, token_data, tmp_path / "q", "--max-steps=1")
    saved = load_checkpoint(tmp_path / "q" / "ckpt_000001.pt")
    assert not saved["model_config"]["value_head"] and not any(k.startswith("value_head.") for k in saved["model"])


def test_train_py_refuses_to_resume_a_pruned_checkpoint(tmp_path):
    """train.py --resume of prune.py's checkpoint went on as pretraining: the masks lost in silence, the zeros trained
    back, with none of --init-from's note. A resume stays in its stage; prune.py's and train.py's own still resume."""
    pruned, plain = ({"step": 0, "train_config": dataclasses.asdict(c)}
                     for c in (prune.PruneConfig(), train.TrainConfig()))
    with pytest.raises(ValueError, match=f"^--resume {tmp_path} was written by another stage or --objective, which "
                       f"this run cannot continue: start a new run from its weights with --init-from {tmp_path}$"):
        stage.check_resume((tmp_path, pruned), train.TrainConfig())
    with pytest.raises(ValueError, match="was written by another stage"):
        stage.check_resume((tmp_path, plain), prune.PruneConfig())
    stage.check_resume((tmp_path, pruned), prune.PruneConfig())
    stage.check_resume((tmp_path, plain), train.TrainConfig())


def test_a_structured_checkpoint_is_read_by_sample_hellaswag_export_and_train(start, token_data, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    result = run(start, token_data, tmp_path / "s", "--method=structured", "--sparsity=0.5", "--importance=taylor",
                 "--calib-batches=2")
    path = result["checkpoint"]
    model = GPT.from_checkpoint(path).eval()
    assert (model.config.n_head, model.config.head_size, model.config.mlp_hidden) == (2, 8, 64)
    assert result["val"]["sparsity"] == 0.5
    enc, prompt = get_tokenizer(), "Return the"
    texts = sample.main(["--ckpt", path, "--prompt", prompt, "--max-new-tokens=6", "--num-samples=1",
                         "--temperature=0", "--device=cpu"])
    greedy = generate.sample(model, torch.tensor([enc.encode(prompt)]), 6, temperature=0.0)[0, -6:].tolist()
    assert texts == [enc.decode(greedy)]
    assert hellaswag.main(["--ckpt", path, "--data", str(HELLASWAG), "--limit=4", "--device=cpu"])["n"] == 4
    export.main(["--ckpt", path, "--export-hf", str(tmp_path / "hf")])
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    assert (hf.config.n_head, hf.config.n_inner) == (4, 64)  # GPT-2's heads are n_embd / n_head wide: 2 come back as 0
    idx = torch.randint(0, 50257, (2, 16))
    with torch.no_grad():
        ours = model(idx)[0][..., :50257]
        torch.testing.assert_close(hf(idx).logits, ours, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(GPT.from_pretrained(str(tmp_path / "hf")).eval()(idx)[0], ours, atol=1e-4, rtol=1e-4)
    tuned = train.main(["--init-from", path, "--data", str(token_data), "--out-dir", str(tmp_path / "t"),
                        "--max-steps=1", "--batch-size=2", "--seq-len=16", "--total-batch-size=32", "--eval-every=0",
                        "--hellaswag=off", "--sample-every=0", "--warmup-steps=0"])
    config = load_checkpoint(tuned["checkpoint"])["model_config"]
    assert (config["n_head"], config["head_size"], config["mlp_hidden"]) == (2, 8, 64)
    # no "its zeros fill in again" note: structured pruning left no zeros, its cut units are gone from the tensors
    assert "was pruned" not in capsys.readouterr().out
    # magnitude's zeros do fill in again outside prune.py: said once
    zeroed = run(start, token_data, tmp_path / "m", "--method=magnitude")["checkpoint"]
    train.main(["--init-from", zeroed, "--data", str(token_data), "--out-dir", str(tmp_path / "u"), "--max-steps=1",
                "--batch-size=2", "--seq-len=16", "--total-batch-size=32", "--eval-every=0", "--hellaswag=off"])
    assert capsys.readouterr().out.count(f"note: --init-from {zeroed} was pruned (magnitude): this stage trains every "
                                         "weight, so its zeros fill in again") == 1


def test_out_of_gpu_memory_in_recovery_says_what_to_change(start, token_data, tmp_path, monkeypatch, capsys):
    # stage.main's message read rl.py's --rollout-batch off any config not a StageArgs: prune.py's got a traceback
    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr("stage.train_step", oom)
    with pytest.raises(SystemExit) as e:
        run(start, token_data, tmp_path / "out", "--max-steps=1")
    assert e.value.code == 1
    assert capsys.readouterr().err.splitlines()[0] == (
        "error: out of GPU memory at --batch-size 2: lower it (gradient accumulation keeps the batch: raise "
        "--grad-accum), or add --recompute mlp (every stage takes it); the README's 'Micro-batch by GPU memory' has "
        "starting points")


def test_nodes_whose_init_from_was_saved_with_another_dropout_stop_naming_it(start, token_data, tmp_path):
    # each node's --init-from (a LOCAL path) holds the same weights, SMALL's dropout 0.1 in one copy's config only:
    # the pruned weights' digest matched, and DDP recovered one replica with dropout, the other without
    ckpt = torch.load(start, weights_only=False)
    ckpt["model_config"]["dropout"] = 0.0
    torch.save(ckpt, tmp_path / "plain.pt")
    args = ["--data", token_data, "--out-dir", tmp_path / "out", "--batch-size=2", "--seq-len=16", "--max-steps=1"]
    done = run_nodes([["prune.py", *map(str, args), f"--init-from={init}"] for init in (start, tmp_path / "plain.pt")])
    assert [(r.returncode, r.stderr.splitlines()[-1:]) for r in done] == [(1, [
        f"error: rank 1 built its model from --init-from {tmp_path}/plain.pt with dropout 0.0 (rank 0: 0.1): every "
        "node must build the same model (its checkpoint's options, where no flag sets them)"])] * 2
