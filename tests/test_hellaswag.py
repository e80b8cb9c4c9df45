"""hellaswag.py: loading and validation, rendering, batched and 2-rank scoring against a per-example reference, CLI."""

import dataclasses
import gc
import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import EOT, GPT2_VOCAB, get_tokenizer
from hellaswag import (
    HellaSwagError,
    describe_provenance,
    download,
    evaluate,
    load_examples,
    main,
    make_batch,
    render_example,
    score_batch,
)
from model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "hellaswag_tiny.jsonl"
LABELS = [2, 0, 1, 3, 1, 0]  # the fixture's labels, in file order
RESULT = re.compile(r"^hellaswag: acc (\d\.\d{4}) acc_norm (\d\.\d{4}) n (\d+) \(([\d.]+) examples/s\)$", re.M)


@pytest.fixture(scope="module")
def enc():
    return get_tokenizer()


@pytest.fixture(scope="module")
def examples():
    return load_examples(FIXTURE)


def tiny_gpt(block_size: int = 64, dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    # vocab 50304: the padded table, so the test also covers that padded ids are left out of the softmax
    return GPT(GPTConfig(block_size=block_size, n_layer=2, n_head=4, n_embd=32, dropout=dropout)).eval()


def reference_losses(model, example: dict, enc, block_size: int) -> list[tuple[float, float]]:
    """Per ending, one unpadded forward of ctx + ending (cropped from the left to block_size): (sum, mean) of the
    negative log-likelihood of the ending tokens that have a token before them. `model` is a GPT or an HF
    GPT2LMHeadModel (both give the logits first when indexed with [0])."""
    ctx = enc.encode_ordinary(example["ctx"])
    out = []
    with torch.no_grad():
        for ending in example["endings"]:
            end = enc.encode_ordinary(" " + ending)
            seq = (ctx + end)[-block_size:]
            n_scored = min(len(end), len(seq) - 1)
            logits = model(torch.tensor([seq]))[0]  # (1, T, V)
            logp = logits[0, :-1, :GPT2_VOCAB].double().log_softmax(-1)  # (T-1, V)
            nll = -logp[torch.arange(len(seq) - 1), torch.tensor(seq[1:])][-n_scored:]
            out.append((nll.sum().item(), nll.mean().item()))
    return out


def reference_correct(model, examples: list[dict], enc, block_size: int) -> list[tuple[bool, bool]]:
    """Per example: is the lowest summed loss (acc) / lowest mean loss (acc_norm) the labelled ending?"""
    out = []
    for ex in examples:
        losses = reference_losses(model, ex, enc, block_size)
        by_sum = min(range(4), key=lambda i: losses[i][0])
        by_mean = min(range(4), key=lambda i: losses[i][1])
        out.append((by_sum == ex["label"], by_mean == ex["label"]))
    return out


# A model and examples on which summed and mean loss disagree. The model's next-token logits are a fixed table (plus
# the small context-dependent logits of a random tiny GPT): 5 for the "fair" words, 7 for the "good" words, 0 for the
# rest of the vocabulary, so a token costs about 5.9, 3.9 or 10.9 nats. In each example, by sum, one fair word (5.9)
# beats three good words (11.7) and the neutral endings (10.9, 21.8); by mean, the three good words (3.9) win.
FAIR, GOOD = ("cold", "mild"), ("sunny", "warm", "bright", "clear")
SHORT, LONG, NEUTRAL, NEUTRAL2 = "cold", "sunny warm bright", "purple", "elephant banana"
DESIGNED = [  # (ctx, endings, label): acc right on 1 3 5 7, acc_norm right on 2 5 6
    ("The forecast for tomorrow says it will be", [LONG, SHORT, NEUTRAL, NEUTRAL2], 1),  # label by sum
    ("In the morning the sky looked", [NEUTRAL2, LONG, SHORT, NEUTRAL], 1),  # label by mean
    ("She opened the window because it was", [SHORT, NEUTRAL, NEUTRAL2, LONG], 0),  # by sum
    ("The old man told us the summer had been", [NEUTRAL, SHORT, LONG, NEUTRAL2], 3),  # neither
    ("He checked the weather and it was", ["violin", "mild warm", "clear", "kettle seven"], 2),  # both: one good word
    ("By noon the beach was", [LONG, NEUTRAL2, NEUTRAL, SHORT], 0),  # by mean
    ("They said the water would be", [NEUTRAL2, NEUTRAL, LONG, SHORT], 3),  # by sum
]
DESIGNED_VERDICTS = [(True, False), (False, True), (True, False), (False, False), (True, True), (False, True),
                     (True, False)]
TABLE_SCALE = 100.0  # the table lives in one embedding dimension, scaled down so it barely changes the input


def designed_examples() -> list[dict]:
    return [{"ctx": ctx, "endings": endings, "label": label} for ctx, endings, label in DESIGNED]


def word_logits(enc) -> dict[int, float]:
    """Token id -> logit for the fair and good words (each one token after a space)."""
    table = {}
    for words, logit in ((FAIR, 5.0), (GOOD, 7.0)):
        for w in words:
            (tok,) = enc.encode(" " + w)
            table[tok] = logit
    return table


def table_gpt(enc) -> GPT:
    """tiny_gpt whose logits are word_logits(enc) plus its own small (about 0.1) context-dependent logits: the final
    LayerNorm emits TABLE_SCALE in dimension 0 (weight 0, bias TABLE_SCALE), and the tied wte/lm_head holds the
    table / TABLE_SCALE there."""
    model = tiny_gpt()
    with torch.no_grad():
        wte, ln_f = model.transformer.wte.weight, model.transformer.ln_f  # wte: (V, C)
        wte[:, 0] = 0.0
        for tok, logit in word_logits(enc).items():
            wte[tok, 0] = logit / TABLE_SCALE
        ln_f.weight[0], ln_f.bias[0] = 0.0, TABLE_SCALE
    return model


def table_verdicts(examples: list[dict], enc) -> list[tuple[bool, bool]]:
    """The verdicts of the table alone, in float64, without running a model: a token costs logsumexp - logit."""
    table = torch.zeros(GPT2_VOCAB, dtype=torch.float64)
    for tok, logit in word_logits(enc).items():
        table[tok] = logit
    cost = torch.logsumexp(table, 0) - table  # (V,)
    out = []
    for ex in examples:
        costs = [cost[enc.encode_ordinary(" " + e)] for e in ex["endings"]]
        by_sum = min(range(4), key=lambda i: costs[i].sum().item())
        by_mean = min(range(4), key=lambda i: costs[i].mean().item())
        out.append((by_sum == ex["label"], by_mean == ex["label"]))
    return out


# ----------------------------------------------------------------------------------------------------------------------
# loading


def test_load_examples_reads_the_fixture(examples, tmp_path):
    assert len(examples) == 6
    assert [ex["label"] for ex in examples] == LABELS
    assert all(ex["ctx"] == " ".join(s for s in (ex["ctx_a"], ex["ctx_b"]) if s) for ex in examples)
    assert len(load_examples(FIXTURE, limit=2)) == 2
    # without `ctx`, it is built the way HellaSwag builds it: ctx_a, a space, ctx_b
    line = {k: v for k, v in examples[0].items() if k != "ctx"}
    path = tmp_path / "no_ctx.jsonl"
    path.write_text(json.dumps(line) + "\n\n")
    (loaded,) = load_examples(path)
    assert loaded["ctx"] == "A woman stands at a kitchen sink full of plates. she"


@pytest.mark.parametrize("line, message", [
    ('{"ctx": "a", "endings": ["a", "b", "c", "d"], "label": 0', "not valid JSON"),
    ('["ctx", "endings"]', "expected a JSON object, got list"),
    ('{"endings": ["a", "b", "c", "d"], "label": 0}', "missing key 'ctx' (or 'ctx_a' and 'ctx_b')"),
    ('{"ctx": "a", "label": 0}', "missing key 'endings'"),
    ('{"ctx": "a", "endings": ["a", "b", "c"], "label": 0}', "'endings' must be a list of 4 strings, got 3 items"),
    ('{"ctx": "a", "endings": ["a", "b", "c", 4], "label": 0}', "'endings' must be a list of 4 strings"),
    ('{"ctx": "a", "endings": ["a", "b", "c", "d"]}', "missing key 'label'"),
    ('{"ctx": "a", "endings": ["a", "b", "c", "d"], "label": 4}', "'label' must be an integer 0..3, got 4"),
    ('{"ctx": "a", "endings": ["a", "b", "c", "d"], "label": "one"}', "'label' must be an integer 0..3, got 'one'"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(FIXTURE.read_text().splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(HellaSwagError) as e:
        load_examples(path)
    assert str(e.value).startswith(f"{path}:2: ")
    assert message in str(e.value)


@pytest.mark.parametrize("fields", [{"ctx": ""}, {"ctx": "  "}, {"ctx_a": "", "ctx_b": ""}])
def test_empty_context_names_file_and_line(tmp_path, fields):
    path = tmp_path / "empty_ctx.jsonl"
    line = json.dumps({**fields, "endings": ["a", "b", "c", "d"], "label": 0})
    path.write_text(FIXTURE.read_text().splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(HellaSwagError) as e:
        load_examples(path)
    assert str(e.value) == f"{path}:2: empty context ('ctx', or 'ctx_a' and 'ctx_b', hold no text)"


def test_byte_order_mark_is_skipped(tmp_path, examples):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + FIXTURE.read_bytes())
    assert load_examples(path) == examples
    # only at the start of the file: elsewhere it is a stray character, and the line is not JSON
    lines = FIXTURE.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b"\xef\xbb\xbf" + lines[1])
    with pytest.raises(HellaSwagError, match=rf"^{re.escape(str(path))}:2: not valid JSON"):
        load_examples(path)


def test_a_gzipped_file_is_read(tmp_path, examples):
    # was "error: 'utf-8' codec can't decode byte 0x8b in position 1", naming no file (the shared subset is a .gz)
    path = tmp_path / "hellaswag_val.jsonl.gz"
    path.write_bytes(gzip.compress(FIXTURE.read_bytes()))
    assert load_examples(path) == examples


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl does not exist; pass the validation jsonl with --data"):
        load_examples(tmp_path / "nope.jsonl")
    with pytest.raises(IsADirectoryError) as e:
        load_examples(tmp_path)
    assert str(e.value) == (f"HellaSwag file {tmp_path} is a directory; pass the validation jsonl itself with --data "
                            f"PATH (e.g. {tmp_path / 'hellaswag_val.jsonl'})")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(HellaSwagError, match="empty.jsonl: no examples"):
        load_examples(tmp_path / "empty.jsonl")


def test_download_caches_and_explains_failure(tmp_path):
    # a file:// URL runs the real urllib download path without a network
    path = download(tmp_path / "cache", url=FIXTURE.as_uri())
    assert path == tmp_path / "cache" / "hellaswag_val.jsonl"
    assert path.read_bytes() == FIXTURE.read_bytes()
    assert [p.name for p in path.parent.iterdir()] == ["hellaswag_val.jsonl"]  # the temp file is gone
    assert download(tmp_path / "cache", url=(tmp_path / "gone").as_uri()) == path  # cached: no second download
    with pytest.raises(ConnectionError, match="could not download HellaSwag.*pass --data PATH"):
        download(tmp_path / "other", url=(tmp_path / "gone").as_uri())
    assert list((tmp_path / "other").iterdir()) == []


# ----------------------------------------------------------------------------------------------------------------------
# rendering


def test_render_and_batch_shapes_and_masks(examples, enc):
    rendered = [render_example(ex, enc) for ex in examples[1:3]]
    for ex, r in zip(examples[1:3], rendered, strict=True):
        assert r.ctx == enc.encode(ex["ctx"])
        assert r.endings == [enc.encode(" " + e) for e in ex["endings"]]
        assert all(enc.decode(e).startswith(" ") for e in r.endings)
        assert r.label == ex["label"]
    tokens, mask = make_batch(rendered, rows=12, block_size=64)
    longest = max(len(r.ctx) + len(e) for r in rendered for e in r.endings)
    assert longest == 40
    assert tokens.shape == mask.shape == (12, 64)  # 2 examples x 4 + 4 dummy rows; 40 rounded up to 64
    for j, r in enumerate(rendered):
        for i, end in enumerate(r.endings):
            row, n = 4 * j + i, len(r.ctx) + len(end)
            assert tokens[row, :n].tolist() == r.ctx + end
            assert (tokens[row, n:] == EOT).all()
            assert mask[row].tolist() == [0] * len(r.ctx) + [1] * len(end) + [0] * (64 - n)
    assert (mask[8:] == 0).all()
    # a longest candidate that is a multiple of 32 is already a padded length: T is 32, not 64
    r = render_example({"ctx": " ".join(["word"] * 31), "endings": ["a", "b", "c", "d"], "label": 0}, enc)
    assert max(len(r.ctx) + len(e) for e in r.endings) == 32
    assert make_batch([r], rows=4, block_size=None)[0].shape == (4, 32)


def test_endoftext_in_the_text_is_ordinary_text(examples, enc):
    """A context or ending that contains the text <|endoftext|> is scored as those characters, not as EOT."""
    ex = {"ctx": "The page ended with <|endoftext|> and then", "label": 1,
          "endings": ["a new page began.", "<|endoftext|>", "the <|endoftext|> token was printed.", "nothing."]}
    r = render_example(ex, enc)
    assert r.ctx == enc.encode("The page ended with <|endoftext|> and then", disallowed_special=())
    assert r.endings[1] == enc.encode(" <|endoftext|>", disallowed_special=())
    assert len(r.endings[1]) == 7 and EOT not in r.ctx + [t for e in r.endings for t in e]
    assert enc.decode(r.ctx) == ex["ctx"] and enc.decode(r.endings[2]) == " " + ex["endings"][2]
    model = tiny_gpt()
    mixed = [ex, *examples[:3]]
    ref = reference_correct(model, mixed, enc, 64)
    result = evaluate(model, mixed, "cpu", batch_size=2, enc=enc)
    assert (result["acc"], result["acc_norm"]) == (sum(a for a, _ in ref) / 4, sum(b for _, b in ref) / 4)


def test_batch_crops_from_the_left_keeping_the_ending(examples, enc):
    r = render_example(examples[2], enc)  # the longest example: 40 tokens
    tokens, mask = make_batch([r], rows=4, block_size=24)
    assert tokens.shape == (4, 24)  # 40 -> 64 by rounding, capped at the block size
    for i, end in enumerate(r.endings):
        assert tokens[i].tolist()[-len(end):] == end
        seq = (r.ctx + end)[-24:]
        assert tokens[i, :len(seq)].tolist() == seq
        assert mask[i, :len(seq)].sum().item() == len(end)


# ----------------------------------------------------------------------------------------------------------------------
# scoring


def test_score_batch_equals_per_ending_reference(examples, enc):
    model = tiny_gpt()
    rendered = [render_example(ex, enc) for ex in examples]
    tokens, mask = make_batch(rendered, rows=28, block_size=64)
    with torch.no_grad():
        sums, means = score_batch(model, tokens, mask, torch.device("cpu"))
    ref = torch.tensor([loss for ex in examples for loss in reference_losses(model, ex, enc, 64)])  # (24, 2)
    torch.testing.assert_close(sums[:24], ref[:, 0].float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(means[:24], ref[:, 1].float(), rtol=1e-5, atol=1e-5)
    assert (sums[24:] == 0).all() and (means[24:] == 0).all()  # dummy rows
    assert ref[:, 1].min() > 10.0  # untrained: about ln(50257) = 10.8 per token


def test_an_ending_longer_than_the_block_is_averaged_over_its_scored_tokens(enc):
    # a block of 4 holds only ending tokens: the first has no token before it, so 3 are scored and the mean is over 3
    ex = {"ctx": "He said", "endings": ["one two three four five six", "yes", "no", "a b c d e"], "label": 0}
    model = tiny_gpt(block_size=4)
    tokens, mask = make_batch([render_example(ex, enc)], rows=4, block_size=4)
    assert mask[0].tolist() == [1, 1, 1, 1]
    with torch.no_grad():
        sums, means = score_batch(model, tokens, mask, torch.device("cpu"))
    ref = torch.tensor(reference_losses(model, ex, enc, 4))  # (4, 2)
    torch.testing.assert_close(sums, ref[:, 0].float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(means, ref[:, 1].float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [64, 24])  # 24 crops the long examples from the left
def test_evaluate_equals_per_example_reference(examples, enc, block_size):
    model = tiny_gpt(block_size)
    ref = reference_correct(model, examples, enc, block_size)
    expected_acc = sum(a for a, _ in ref) / 6
    expected_norm = sum(b for _, b in ref) / 6
    for batch_size in (1, 4):  # 4: the second batch has 2 examples and 8 dummy rows
        result = evaluate(model, examples, "cpu", batch_size=batch_size, enc=enc)
        assert result["n"] == 6
        assert result["acc"] == expected_acc and result["acc_norm"] == expected_norm
        assert result["examples_per_sec"] > 0
    # one example at a time: each verdict, not only the totals, matches the reference
    for ex, (ok, ok_norm) in zip(examples, ref, strict=True):
        one = evaluate(model, [ex], "cpu", batch_size=1, enc=enc)
        assert (one["acc"], one["acc_norm"]) == (float(ok), float(ok_norm))
    assert evaluate(model, examples, "cpu", limit=2, batch_size=2, enc=enc)["n"] == 2
    assert not model.training  # a model given in eval mode is left in eval mode, not switched to training


def test_evaluate_checks_examples_made_in_python(examples, enc):
    # examples that never went through load_examples: the same checks, named by their index, not a silently shifted
    # group of 4 rows or a KeyError; the HF dataset's string labels and ctx_a/ctx_b-only examples are fine
    model = tiny_gpt()
    hf_style = [{"ctx_a": ex["ctx"], "ctx_b": "", "endings": ex["endings"], "label": str(ex["label"])}
                for ex in examples]
    got, want = (evaluate(model, exs, "cpu", batch_size=4, enc=enc) for exs in (hf_style, examples))
    assert [got[k] for k in ("acc", "acc_norm", "n")] == [want[k] for k in ("acc", "acc_norm", "n")]
    three = [*examples[:2], {**examples[2], "endings": examples[2]["endings"][:3]}]
    with pytest.raises(HellaSwagError, match=r"^example 2: 'endings' must be a list of 4 strings, got 3 items$"):
        evaluate(model, three, "cpu", enc=enc)
    small = GPT(GPTConfig(block_size=64, vocab_size=256, n_layer=1, n_head=1, n_embd=8))
    with pytest.raises(ValueError, match="the model has 256 embedding rows, fewer than the tokenizer's 50257"):
        evaluate(small, examples, "cpu", enc=enc)


def test_evaluate_acc_and_acc_norm_differ_and_equal_reference(enc):
    """The summed-loss verdict (acc) is checked on examples where it is right and acc_norm wrong, and the reverse."""
    examples = designed_examples()
    assert table_verdicts(examples, enc) == DESIGNED_VERDICTS  # the design: sum and mean pick different endings
    model = table_gpt(enc)
    ref = reference_correct(model, examples, enc, 64)
    assert ref == DESIGNED_VERDICTS  # the random part of the logits (about 0.1) is too small to flip a verdict
    for batch_size in (1, 3, 7):  # 3: batches of 3, 3 and 1 (with 8 dummy rows)
        result = evaluate(model, examples, "cpu", batch_size=batch_size, enc=enc)
        assert (result["acc"], result["acc_norm"], result["n"]) == (4 / 7, 3 / 7, 7)
    for ex, (ok, ok_norm) in zip(examples, ref, strict=True):
        one = evaluate(model, [ex], "cpu", batch_size=1, enc=enc)
        assert (one["acc"], one["acc_norm"]) == (float(ok), float(ok_norm))


class CountingModel(torch.nn.Module):
    """A GPT that counts its forward passes and records the dtypes of the logits they return."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model, self.config, self.calls, self.dtypes = model, model.config, 0, set()

    def forward(self, idx):
        self.calls += 1
        out = self.model(idx)
        self.dtypes.add(out[0].dtype)
        return out


def test_evaluate_compiled_ddp_model_in_training_mode(examples, enc, tmp_path):
    """train.py passes torch.compile(DDP(model)) in training mode: evaluate scores it in eval mode (dropout off) and
    restores training mode. DDP's forward (like FSDP's) is a collective, so every rank must also run the same number
    of forwards when the examples do not split evenly."""
    import torch.distributed as dist

    model = tiny_gpt(dropout=0.5)
    ref = reference_correct(model, examples, enc, 64)  # eval mode
    model.train()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        # the eager backend: dynamo's wrapper and tracing, without needing a C++ compiler
        wrapped = torch.compile(torch.nn.parallel.DistributedDataParallel(model), backend="eager")
        result = evaluate(wrapped, examples, "cpu", rank=0, world_size=1, batch_size=6, enc=enc)  # one batch
        assert model.training and wrapped.training
        # DDP's reducer holds the process group: it must go before the group does, or a later garbage collection
        # destroys the group twice and hangs joining gloo's threads
        del wrapped
        gc.collect()
        model.eval()
        # a group of one, told it is one of 4 ranks: ranks 0-1 get 2 examples, ranks 2-3 get 1; all run 2 forwards
        calls = []
        for rank in range(4):
            counting = CountingModel(model)
            evaluate(counting, examples, "cpu", rank=rank, world_size=4, batch_size=1, enc=enc)
            calls.append(counting.calls)
            assert counting.dtypes == {torch.float32}  # bf16 autocast is for CUDA: on the CPU, scores are fp32
    finally:
        dist.destroy_process_group()
    assert result["n"] == 6
    assert result["acc"] == sum(a for a, _ in ref) / 6 and result["acc_norm"] == sum(b for _, b in ref) / 6
    assert calls == [2, 2, 2, 2]


# ----------------------------------------------------------------------------------------------------------------------
# CLI, one rank and two


def test_cli_on_hf_directory_matches_hf_reference(hf_dir, examples, enc, capsys):
    """The CLI's numbers on an HF directory equal a per-example reference on transformers' own model."""
    transformers = pytest.importorskip("transformers")
    result = main(["--data", str(FIXTURE), "--init-from", str(hf_dir), "--batch-size", "2", "--device", "cpu"])
    out, err = capsys.readouterr()
    # provenance is one readable line, not a Python dict
    header = re.search(r"^hellaswag: (.*), ([\d,]+) params, 6 examples; git ([0-9a-f]{12}|unknown)(\+dirty)?, "
                       r"python 3\.[\d.]+, torch [^,]+, (triton [^,]+, )?(cuda [^,]+, )?cpu \(\d+ cores\), 1 rank$",
                       err, re.M)  # a CUDA build of torch names its CUDA even when the run is on the CPU
    assert header is not None, err
    assert header.group(1) == str(hf_dir) and "{" not in err
    acc, acc_norm, n, _ = RESULT.search(out).groups()
    assert (float(acc), float(acc_norm), int(n)) == (round(result["acc"], 4), round(result["acc_norm"], 4), 6)
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    ref = reference_correct(hf, examples, enc, 64)
    assert result["acc"] == sum(a for a, _ in ref) / 6 and result["acc_norm"] == sum(b for _, b in ref) / 6


def test_cli_reads_the_cached_download_and_limits_the_examples(hf_dir, examples, tmp_path, capsys):
    """Without --data the CLI evaluates <--cache-dir>/hellaswag_val.jsonl (a file already there is not downloaded
    again), and --limit N is the first N examples: the numbers evaluate() gives on them. A cache that cannot be made
    is one error line, in a single process too."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "hellaswag_val.jsonl").write_bytes(FIXTURE.read_bytes())
    result = main(["--init-from", str(hf_dir), "--cache-dir", str(cache), "--limit", "3", "--batch-size", "2",
                   "--device", "cpu"])
    ref = evaluate(GPT.from_pretrained(str(hf_dir)), examples[:3], "cpu", batch_size=2)
    assert (result["acc"], result["acc_norm"], result["n"]) == (ref["acc"], ref["acc_norm"], 3)
    assert ", 3 examples; " in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        main(["--init-from", str(hf_dir), "--cache-dir", str(tmp_path / "file"), "--device", "cpu"])
    assert str(e.value) == f"error: [Errno 17] File exists: '{tmp_path / 'file'}'"
    assert capsys.readouterr().err == ""  # the line alone
    with pytest.raises(SystemExit, match=r"^error: --limit must be >= 1 or none, got 0$"):
        main(["--init-from", str(hf_dir), "--data", str(FIXTURE), "--limit", "0"])


def test_cli_two_ranks_equal_one_rank(enc, tmp_path):
    """torchrun with 2 gloo ranks (4 and 3 examples) prints the acc, acc_norm and n of one process, on the designed
    examples, where acc (4/7) and acc_norm (3/7) are both nonzero and differ."""
    model = table_gpt(enc)
    ckpt = tmp_path / "ckpt_000000.pt"
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "step": 0}, ckpt)
    data = tmp_path / "designed.jsonl"
    data.write_text("".join(json.dumps(ex) + "\n" for ex in designed_examples()))
    one = evaluate(model, designed_examples(), "cpu", batch_size=2, enc=enc)
    assert (one["acc"], one["acc_norm"], one["n"]) == (4 / 7, 3 / 7, 7)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "hellaswag.py",
           "--data", str(data), "--ckpt", str(ckpt), "--batch-size", "2", "--device", "cpu"]
    two = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=120)
    assert two.returncode == 0, two.stderr
    lines = RESULT.findall(two.stdout)
    assert len(lines) == 1  # only rank 0 prints
    acc, acc_norm, n, _ = lines[0]
    assert (acc, acc_norm, int(n)) == ("0.5714", "0.4286", 7)


def test_cli_two_ranks_a_failed_download_stops_both_with_its_reason(hf_dir, tmp_path):
    # rank 0 downloads while rank 1 waits; its failure must reach rank 1 as the reason, not as a lost-peer gloo error.
    # A cache "directory" that is a file makes the download fail without touching the network
    (tmp_path / "cache").write_text("")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "hellaswag.py",
           "--init-from", str(hf_dir), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu"]
    two = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=120)
    assert two.returncode != 0
    # each rank prints the reason, rank 1 naming the rank it came from (lines may interleave: two processes, one pipe)
    reason = f"[Errno 17] File exists: '{tmp_path / 'cache'}'"
    assert two.stderr.count(f"error: {reason}") == 1 and two.stderr.count(f"error: rank 0: {reason}") == 1, \
        two.stderr[-3000:]
    assert "gloo" not in two.stderr.lower(), two.stderr[-3000:]


def test_describe_provenance():
    prov = {"git_sha": "0123456789abcdef0123456789abcdef01234567", "git_dirty": True, "python": "3.11.9",
            "torch": "2.6.0+cu124", "triton": "3.2.0", "cuda": "12.4", "device": "NVIDIA H100 80GB HBM3",
            "world_size": 8}
    assert describe_provenance(prov) == ("git 0123456789ab+dirty, python 3.11.9, torch 2.6.0+cu124, triton 3.2.0, "
                                         "cuda 12.4, NVIDIA H100 80GB HBM3, 8 ranks")
    cpu = {**prov, "git_sha": None, "git_dirty": None, "triton": None, "cuda": None, "device": "cpu (2 cores)",
           "world_size": 1}
    assert describe_provenance(cpu) == "git unknown, python 3.11.9, torch 2.6.0+cu124, cpu (2 cores), 1 rank"


def test_cli_errors_are_one_line(tmp_path, hf_dir, capsys):
    with pytest.raises(SystemExit, match=r"^error: HellaSwag file .*nope.jsonl does not exist"):
        main(["--data", str(tmp_path / "nope.jsonl"), "--init-from", str(hf_dir)])
    with pytest.raises(SystemExit, match=rf"^error: HellaSwag file {re.escape(str(tmp_path))} is a directory; pass"):
        main(["--data", str(tmp_path), "--init-from", str(hf_dir)])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "a", "endings": ["a"], "label": 0}\n')
    with pytest.raises(SystemExit, match=rf"^error: {re.escape(str(bad))}:1: 'endings' must be a list of 4"):
        main(["--data", str(bad), "--init-from", str(hf_dir)])
    not_ckpt = tmp_path / "not_ckpt.pt"
    torch.save({"weights": torch.zeros(2)}, not_ckpt)
    with pytest.raises(SystemExit, match=r"^error: .*not_ckpt.pt is not a checkpoint of this project"):
        main(["--data", str(FIXTURE), "--ckpt", str(not_ckpt)])
    with pytest.raises(SystemExit, match=r"^error: no model given: pass --ckpt PATH"):
        main(["--data", str(FIXTURE)])
    with pytest.raises(SystemExit, match=rf"^error: --init-from {re.escape(str(not_ckpt))} is a file; for a "
                                         rf"checkpoint train.py wrote, use --ckpt {re.escape(str(not_ckpt))}$"):
        main(["--data", str(FIXTURE), "--init-from", str(not_ckpt)])
    with pytest.raises(SystemExit, match=rf"^error: checkpoint {re.escape(str(hf_dir))} is a directory, not a file; "
                                         "it has a config.json, so it looks like an HF GPT-2 directory: load it with "
                                         rf"--init-from {re.escape(str(hf_dir))} where the script has one"):
        main(["--data", str(FIXTURE), "--ckpt", str(hf_dir)])
    assert capsys.readouterr().err == ""  # the line alone: no traceback or other output before any of them
