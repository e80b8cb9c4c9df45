"""sample.py --quantize int8 (torchao weight-only INT8) and bench.py's int8 suite: which weights become int8, the
logits against fp32 and against the dequantized weights, greedy agreement on a trained model, the CLI end to end,
and a missing torchao."""

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench
from bench import BenchConfig, bench_int8
from common import get_tokenizer
from generate import sample
from model import GPT, MODEL_PRESETS
from sample import main, quantize_int8, weight_bytes

pytest.importorskip("torchao")

ROOT = Path(__file__).resolve().parents[1]
BLOCK_LINEARS = [f"transformer.h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                      "mlp.c_proj")]
PERIOD = 29  # the trained model's sequence repeats every PERIOD tokens


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a tensor subclass stores (torchao's int8 weight: data, scales, zero points)."""
    if not hasattr(t, "__tensor_flatten__"):
        return [t]
    return [x for name in t.__tensor_flatten__()[0] for x in inner_tensors(getattr(t, name))]


def int8_parts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 data of w's shape, per-row scales (rows, 1), per-row zero points (rows, 1)) of a quantized weight."""
    inner = inner_tensors(w)
    (q,) = [x for x in inner if x.dtype == torch.int8 and x.shape == w.shape]
    (scale,) = [x for x in inner if x.is_floating_point()]
    zero = [x for x in inner if x.dtype == torch.int8 and x.shape != w.shape]
    return q, scale.reshape(-1, 1), zero[0].reshape(-1, 1) if zero else torch.zeros_like(scale.reshape(-1, 1))


def tiny(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(dataclasses.replace(MODEL_PRESETS["tiny"](), **overrides)).eval()


@pytest.fixture(scope="module")
def trained():
    """A tiny GPT (vocabulary 128) trained to continue a random sequence of period PERIOD: its logits have the
    margins of a trained model, which random weights lack (their greedy tokens flip on any rounding)."""
    model = tiny(vocab_size=128).train()
    seq = torch.randint(0, 128, (PERIOD,), generator=torch.Generator().manual_seed(1)).repeat(10)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    starts = torch.randint(0, PERIOD, (100, 4), generator=torch.Generator().manual_seed(2))
    for step in range(100):
        batch = torch.stack([seq[s:s + 65] for s in starts[step]])
        model(batch[:, :-1], batch[:, 1:])[1].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.eval(), seq


def test_the_blocks_linear_weights_become_int8_and_the_tied_embedding_stays():
    model = tiny()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    idx = torch.randint(0, 50257, (2, 16), generator=torch.Generator().manual_seed(0))
    emb = model.transformer.wte(idx)
    fp32_bytes = weight_bytes(model)
    assert fp32_bytes == 4 * model.num_params(non_embedding=False)
    assert quantize_int8(model) == BLOCK_LINEARS  # every nn.Linear but the tied lm_head
    saved = 0
    for name in BLOCK_LINEARS:
        w = model.get_submodule(name).weight
        q, scale, zero = int8_parts(w)
        assert q.dtype == torch.int8 and q.shape == before[name + ".weight"].shape
        assert scale.dtype == torch.float32 and scale.shape == (w.shape[0], 1) and not zero.any()  # symmetric
        assert q.short().abs().amax(dim=1).min() >= 127  # each row's largest weight maps to the end of the range
        saved += 3 * q.numel() - 5 * w.shape[0]  # 4 bytes -> 1, plus a 4-byte scale and a 1-byte zero per row
    assert weight_bytes(model) == fp32_bytes - saved
    # the tied matrix: still one fp32 parameter, embedding and un-embedding, with its values
    assert model.lm_head.weight is model.transformer.wte.weight and type(model.lm_head.weight) is torch.nn.Parameter
    assert torch.equal(model.lm_head.weight, before["transformer.wte.weight"])
    assert torch.equal(model.transformer.wte(idx), emb)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n.rsplit(".", 1)[0] not in
               BLOCK_LINEARS or n.endswith(".bias"))


def test_int8_logits_are_the_dequantized_weights_logits_and_close_to_fp32(trained):
    model, seq = trained
    idx = seq[None, :64]
    fp32_logits = model(idx)[0]
    quantized = copy.deepcopy(model)
    quantize_int8(quantized)
    int8_logits = quantized(idx)[0]
    # the same model with each int8 weight dequantized by hand, (q - zero) * scale, as an fp32 matrix
    dequantized = copy.deepcopy(model)
    for name in BLOCK_LINEARS:
        q, scale, zero = int8_parts(quantized.get_submodule(name).weight)
        dequantized.get_submodule(name).weight.data = (q.float() - zero.float()) * scale
    spread = fp32_logits.abs().max().item()
    torch.testing.assert_close(int8_logits, dequantized(idx)[0], atol=1e-5 * spread, rtol=0)
    # rounding each weight to 1/127 of its row's largest moves the logits by well under 2% of their range
    err = (int8_logits - fp32_logits).abs().max().item()
    assert 0 < err < 0.02 * spread


def test_greedy_int8_tokens_equal_fp32_on_a_trained_model(trained):
    model, seq = trained
    prompt = seq[None, :5]
    fp32 = sample(model, prompt, 128, temperature=0.0)[0, 5:]
    assert (fp32 == seq[5:133]).float().mean() >= 0.9  # it learned the sequence: its greedy choices have margins
    assert len(set(fp32.tolist())) >= 20
    quantized = copy.deepcopy(model)
    quantize_int8(quantized)
    for use_cache in (True, False):  # the KV-cache path and the full recompute
        int8 = sample(quantized, prompt, 128, temperature=0.0, use_cache=use_cache)[0, 5:]
        assert (int8 == fp32).float().mean() >= 0.95


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model = tiny()
    path = tmp_path_factory.mktemp("int8") / "ckpt_000007.pt"
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "step": 7,
                "train_config": {"sample_prompt": "def "}}, path)
    return path, model


def test_sample_quantize_int8_generates_the_quantized_models_tokens(ckpt, capsys):
    path, model = ckpt
    (text,) = main(["--ckpt", str(path), "--quantize", "int8", "--prompt", "The cat", "--num-samples", "1",
                    "--max-new-tokens", "12", "--temperature", "0", "--device", "cpu"])
    enc = get_tokenizer()
    idx = torch.tensor([enc.encode("The cat")])
    quantized = copy.deepcopy(model)
    quantize_int8(quantized)
    assert text == enc.decode(sample(quantized, idx, 12, temperature=0.0)[0, idx.size(1):].tolist())
    err = capsys.readouterr().err
    assert "int8: 8 nn.Linear weights quantized, weights 13.3 MB -> 13.0 MB (the tied wte/lm_head stays float32)" in err


def test_the_cli_prints_the_text_and_two_lines_of_its_own(ckpt):
    # a fresh process imports torchao, which logs a line per prebuilt CUDA extension that does not load here
    out = subprocess.run([sys.executable, "sample.py", "--ckpt", str(ckpt[0]), "--quantize", "int8", "--num-samples",
                          "1", "--max-new-tokens", "4", "--device", "cpu"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 2 and lines[0].startswith("int8: 8 nn.Linear weights quantized") and "tok/s" in lines[1]
    # the text on stdout: the default prompt, then the continuation main returns for the same flags (on one thread,
    # as the child runs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        (text,) = main(["--ckpt", str(ckpt[0]), "--quantize", "int8", "--num-samples", "1", "--max-new-tokens", "4",
                        "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)
    assert text and "<|endoftext|>" not in text
    assert out.stdout == f"Hello, I'm a language model,{text}\n---------------\n"


def test_a_missing_torchao_is_one_line_before_the_model_loads(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` now raises ImportError
    with pytest.raises(SystemExit) as e:
        main(["--ckpt", "no/such/ckpt.pt", "--quantize", "int8"])  # the missing file would be the other error
    assert str(e.value) == "error: --quantize int8 needs torchao: pip install torchao"
    assert capsys.readouterr().err == ""  # the line alone
    with pytest.raises(SystemExit, match=r"^error: --quantize must be none or int8, got 'int4'$"):
        main(["--quantize", "int4"])


# ----------------------------------------------------------------------------------------------------------------------
# bench.py --suite int8


def test_bench_int8_rows_on_random_weights_and_on_a_checkpoint(ckpt, tmp_path):
    rows = bench_int8(BenchConfig(device="cpu", decode_model="tiny", int8_tokens=16))
    assert [(r["name"], r["status"]) for r in rows] == [("fp32", "ok"), ("int8 weight-only", "ok")]
    assert rows[0]["weights"] == "random tiny, std 0.1 (untrained: the agreement means little)"
    assert rows[0]["prompt_text"] == "Hello, I'm a language model," and rows[0]["prompt"] == 8
    fp32, int8 = rows
    assert (fp32["same_frac"], fp32["same_prefix"]) == (None, None)
    same = [a == b for a, b in zip(int8["tokens"], fp32["tokens"], strict=True)]
    assert len(same) == 16 and int8["same_frac"] == sum(same) / 16
    assert int8["same_prefix"] == (same.index(False) if False in same else 16)
    shapes = ((192, 64), (64, 64), (256, 64), (64, 256))  # c_attn, attn.c_proj, c_fc, mlp.c_proj; 2 layers
    assert fp32["weight_bytes"] - int8["weight_bytes"] == 2 * sum(3 * r * c - 5 * r for r, c in shapes)
    assert all(r["tok_per_s"] * r["ms_per_token"] == pytest.approx(1000) for r in rows)
    # a checkpoint: its weights, named in the rows, and the prompt its run sampled with
    path, model = ckpt
    result = bench.main(["--suite", "int8", "--device", "cpu", "--ckpt", str(path), "--int8-tokens", "8", "--out",
                         str(tmp_path / "b.json")])
    fp32, int8 = result["int8"]
    assert fp32["weights"] == f"checkpoint {path}, step 7" and fp32["prompt_text"] == "def "
    enc = get_tokenizer()
    idx = torch.tensor([enc.encode("def ")])
    assert fp32["tokens"] == sample(model, idx, 8, temperature=0.0)[0, idx.size(1):].tolist()
    assert int8["status"] == "ok" and f"int8: 3.3M params, checkpoint {path}, step 7" in result["table"]
    assert "int8 weight-only      8" in result["table"]


def test_bench_int8_without_torchao_keeps_the_fp32_row(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` now raises ImportError
    rows = bench_int8(BenchConfig(device="cpu", decode_model="tiny", int8_tokens=4))
    assert [(r["name"], r["status"]) for r in rows] == [("fp32", "ok"), ("int8 weight-only", "skipped")]
    assert rows[1]["reason"] == "--quantize int8 needs torchao: pip install torchao"


@pytest.mark.parametrize("argv, message", [
    (["--ckpt", "a.pt", "--init-from", "gpt2"], "pass either --ckpt or --init-from"),
    (["--ckpt", "no/such.pt"], "--ckpt no/such.pt: no such file"),
    (["--int8-tokens", "0"], "--int8-tokens, --batched-rows and --batched-tokens must be >= 1"),
])
def test_bench_int8_flags_are_checked_first(argv, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(["--device", "cpu", "--suite", "int8", *argv])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_int8_on_cuda_runs_after_the_bf16_cast(ckpt, capsys):
    rows = bench_int8(BenchConfig(device="cuda", decode_model="tiny", int8_tokens=16))
    assert [(r["name"], r["status"]) for r in rows] == [("fp32", "ok"), ("bf16", "ok"), ("int8 weight-only", "ok")]
    (text,) = main(["--ckpt", str(ckpt[0]), "--quantize", "int8", "--num-samples", "1", "--max-new-tokens", "8",
                    "--device", "cuda"])
    assert text and "the tied wte/lm_head stays bfloat16" in capsys.readouterr().err
