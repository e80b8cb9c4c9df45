"""core.py: DCLM's CORE on a small bundle made here, scored by a GPT whose weights make it a bigram table, so that
each row's verdict and every task's accuracy follow by hand; one process, 2 gloo ranks, and the download path on a
local zip."""

import contextlib
import json
import random
import runpy
import shutil
import zipfile
from dataclasses import asdict

import pytest
import torch

import core
import plot
import train
from common import get_tokenizer, iter_log
from conftest import ROOT, bigram_model, run_torchrun
from model import GPT

# the table: after the first token the model predicts the second with probability ~1; a token with no row of its own
# predicts nothing (uniform logits), so a language_modeling row ending there is wrong
SUCCESSOR = {" is": " blue", " dog": " runs", " two": " three", " five": " six", " six": " seven"}

MC = [  # " is" -> " blue": the rows whose gold choice is blue are right
    {"query": "The sky is", "choices": ["blue", "green"], "gold": 0},  # right
    {"query": "The grass is", "choices": ["blue", "green"], "gold": 1},  # wrong
    {"query": "The sea is", "choices": ["green", "blue"], "gold": 1},  # right
    {"query": "My car is", "choices": ["red", "blue", "green"], "gold": 0},  # wrong
]
SCHEMA = [  # " dog" -> " runs": the continuation is likeliest after the dog
    {"context_options": ["The cat", "The dog"], "continuation": "runs", "gold": 1},  # right
    {"context_options": ["The dog", "The cat"], "continuation": "runs", "gold": 1},  # wrong
    {"context_options": ["A dog", "A cat"], "continuation": "runs", "gold": 0},  # right
]
LM = [
    {"context": "one two ", "continuation": "three"},  # right (the context's trailing space is trimmed)
    {"context": "four five", "continuation": "six seven"},  # right: two greedy tokens
    {"context": "eight nine", "continuation": "ten"},  # wrong: nine has no row
]
# accuracy 2/4, 2/3, 2/3 against baselines of 25%, 50%, 0%: centered 1/3, 1/3, 2/3; CORE their mean, 4/9
EXPECTED = {"results": {"mc": 0.5, "schema": 2 / 3, "lm": 2 / 3},
            "centered_results": {"mc": 1 / 3, "schema": 1 / 3, "lm": 2 / 3}, "core_metric": 4 / 9}


def flat(result: dict) -> dict[str, float]:
    """{"results/mc": 0.5, ..., "core_metric": 4 / 9}: pytest.approx compares flat mappings only."""
    return {f"{k}/{label}" if isinstance(v, dict) else k: x for k, v in result.items()
            for label, x in (v.items() if isinstance(v, dict) else [(k, v)])}


def bigram_gpt(successor: dict[str, str], block_size: int = 64) -> GPT:
    enc = get_tokenizer()
    ids = {word: enc.encode_ordinary(word) for pair in successor.items() for word in pair}
    assert all(len(t) == 1 for t in ids.values())  # each word one token, as the rows' verdicts assume
    return bigram_model({ids[word][0]: ids[nxt][0] for word, nxt in successor.items()}, block_size)


def write_bundle(root, tasks: dict[str, tuple[str, int, float, list[dict]]], delimiters: dict[str, str]) -> None:
    """A bundle in DCLM's layout: core.yaml, eval_meta_data.csv and eval_data/<kind>/<label>.jsonl."""
    lines = ["icl_tasks:"]
    meta = ["Eval Task,Task Category,Random baseline"]
    for label, (kind, shots, baseline, rows) in tasks.items():
        (root / "eval_data" / kind).mkdir(parents=True, exist_ok=True)
        (root / "eval_data" / kind / f"{label}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        lines += [f"- label: {label}", f"  dataset_uri: {kind}/{label}.jsonl", f"  num_fewshot: [{shots}]",
                  f"  icl_task_type: {kind}"]
        lines += [f"  continuation_delimiter: {json.dumps(delimiters[label])}"] if label in delimiters else []
        meta.append(f"{label},test,{baseline}")
    (root / "core.yaml").write_text("\n".join(lines) + "\n")
    (root / "eval_meta_data.csv").write_text("\n".join(meta) + "\n")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("bundle") / "eval_bundle"
    write_bundle(root, {"mc": ("multiple_choice", 0, 25.0, MC), "schema": ("schema", 1, 50.0, SCHEMA),
                        "lm": ("language_modeling", 1, 0.0, LM)}, {"mc": " ", "lm": " "})
    return root


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model, path = bigram_gpt(SUCCESSOR), tmp_path_factory.mktemp("ckpt") / "bigram.pt"
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "step": 0}, path)
    return path


def test_core_equals_the_scores_by_hand(bundle):
    tasks = core.load_tasks(bundle)
    assert [(t.label, t.kind, t.shots, t.delimiter, t.baseline) for t in tasks] == [
        ("mc", "multiple_choice", 0, " ", 25.0), ("schema", "schema", 1, " ", 50.0),
        ("lm", "language_modeling", 1, " ", 0.0)]  # schema's delimiter is the default
    assert flat(core.evaluate(bigram_gpt(SUCCESSOR), tasks)) == pytest.approx(flat(EXPECTED), abs=1e-12)
    # a context of 6 tokens crops every few-shot prompt from the left; the scored tokens stay, so do the verdicts
    assert flat(core.evaluate(bigram_gpt(SUCCESSOR, block_size=6), tasks)) == pytest.approx(flat(EXPECTED), abs=1e-12)


def test_a_model_in_training_mode_is_scored_without_dropout_and_left_training(bundle):
    model = bigram_gpt(SUCCESSOR)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.9  # dropout on the embeddings would turn most tokens' rows into uniform logits
    torch.manual_seed(0)
    model.train()
    assert flat(core.evaluate(model, core.load_tasks(bundle))) == pytest.approx(flat(EXPECTED), abs=1e-12)
    assert model.training


def test_rows_are_shuffled_then_cut_and_prompts_render_as_nanochat_does(bundle):
    # nanochat's order: random.Random(1337).shuffle of the file's rows, then the first --max-per-task
    order = list(range(4))
    random.Random(1337).shuffle(order)
    assert order == [1, 0, 3, 2]
    mc = core.load_tasks(bundle, max_per_task=2)[0]
    assert mc.rows == [MC[1], MC[0]]
    schema, lm = core.load_tasks(bundle)[1:]  # 3 rows: the shuffle keeps their order
    # row i's shot: random.Random(1234 + i).sample of the other rows, its gold answer in, then a blank line
    assert core.prompts(schema, 0) == ["A dog runs\n\nThe cat runs", "A dog runs\n\nThe dog runs"]
    assert core.prompts(lm, 1) == ["eight nine ten\n\nfour five", "eight nine ten\n\nfour five six seven"]
    assert core.prompts(lm, 0)[0] == "eight nine ten\n\none two"  # the context's trailing space trimmed
    assert core.prompts(mc, 0) == ["The grass is blue", "The grass is green"]


def test_each_shot_is_its_gold_answer_and_each_row_draws_its_own_shots():
    # 5 rows, 2 shots: row 4 draws rows 0 and 1 (random.Random(1238)), row 1 draws rows 4 and 3 (random.Random(1235))
    assert [random.Random(1234 + i).sample([j for j in range(5) if j != i], 2) for i in (4, 1)] == [[0, 1], [4, 3]]
    golds = [2, 1, 0, 1, 0]  # no shot's gold is its first option
    mc = core.CoreTask("mc", "multiple_choice", [{"query": f"Q{k}", "choices": [f"a{k}", f"b{k}", f"c{k}"], "gold": g}
                                                 for k, g in enumerate(golds)], 2, ": ", 25.0)
    assert core.prompts(mc, 4) == [f"Q0: c0\n\nQ1: b1\n\nQ4: {c}4" for c in "abc"]
    assert core.prompts(mc, 1)[0] == "Q4: a4\n\nQ3: b3\n\nQ1: a1"
    schema = core.CoreTask("schema", "schema", [{"context_options": [f"x{k}", f"y{k}", f"z{k}"],
                                                 "continuation": f"w{k}", "gold": g} for k, g in enumerate(golds)],
                           2, " ", 50.0)
    assert core.prompts(schema, 4) == [f"z0 w0\n\ny1 w1\n\n{c}4 w4" for c in "xyz"]
    schema.delimiter = " => "  # the row's delimiter, not only its shots'
    assert core.prompts(schema, 4) == [f"z0 => w0\n\ny1 => w1\n\n{c}4 => w4" for c in "xyz"]
    lm = core.CoreTask("lm", "language_modeling", [{"context": f" c{k} ", "continuation": f"d{k}"} for k in range(5)],
                       2, " ", 0.0)  # each shot's context trimmed too, not only the row's
    assert core.prompts(lm, 4) == ["c0 d0\n\nc1 d1\n\nc4", "c0 d0\n\nc1 d1\n\nc4 d4"]


def test_a_choice_is_scored_by_its_mean_loss_on_bos_prompts_padded_on_the_right():
    # costs a token: ~0 when the table predicts it, ln(50257) after a token with no row (uniform), ~113 otherwise.
    # Row 0: " sky" costs 10.8 (mean 10.8); " hat dog runs runs runs runs" 10.8 + 10.8 + 0 x 4 (sum 21.6, mean 3.6):
    # the mean picks the long choice, the sum the short one. Row 1: " blue" follows " is" (0); " green dog runs" costs
    # 113 + 10.8 + 0
    rows = [{"query": "My cup", "choices": ["sky", "hat dog runs runs runs runs"], "gold": 1},
            {"query": "The dog dog dog is", "choices": ["blue", "green dog runs"], "gold": 0}]
    task, model, enc = core.CoreTask("mc", "multiple_choice", rows, 0, " ", 50.0), bigram_gpt(SUCCESSOR), \
        get_tokenizer()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].tolist()))
    verdicts = [core.is_right(model, enc, task, i, torch.device("cpu"), contextlib.nullcontext()) for i in range(2)]
    assert verdicts == [True, True]
    bos, (sky,), long = enc.eot_token, enc.encode_ordinary(" sky"), enc.encode_ordinary(" hat dog runs runs runs runs")
    head = enc.encode_ordinary("My cup")
    assert len(long) == 6 and seen[0] == [[bos, *head, sky] + [bos] * 5, [bos, *head, *long]]  # BOS first, pad right
    # a padded vocabulary row is no token: the model's id 50300 outscores " three" after " two", but is not the greedy
    # continuation (ids past the tokenizer's 50257 are out of the argmax)
    lm = core.CoreTask("lm", "language_modeling", [{"context": "one two", "continuation": "three"}], 0, " ", 0.0)
    assert core.is_right(model, enc, lm, 0, torch.device("cpu"), contextlib.nullcontext())
    with torch.no_grad():
        (three,) = enc.encode_ordinary(" three")
        model.transformer.wte.weight[50300] = 1.01 * model.transformer.wte.weight[three]
    assert core.is_right(model, enc, lm, 0, torch.device("cpu"), contextlib.nullcontext())


def test_rank_r_of_world_scores_rows_r_r_plus_world(bundle, monkeypatch):
    # its own rows' hits and count go to the sum over ranks: shuffled, mc's rows are MC[1] (wrong), MC[0], MC[3]
    # (wrong), MC[2]; schema's stay in file order (right, wrong, right); rank 1 of 2 gets a padding forward there
    monkeypatch.setattr(core, "summed", lambda right, n, device, world: {"acc": (right, n)})
    mc, schema, _ = core.load_tasks(bundle)
    model, enc, cpu, calls = bigram_gpt(SUCCESSOR), get_tokenizer(), torch.device("cpu"), []
    model.register_forward_pre_hook(lambda module, args: calls.append(1))
    got, forwards = [], []
    for task in (mc, schema):
        for rank in (0, 1):
            calls.clear()
            got.append(core.accuracy(model, enc, task, rank, 2, cpu, contextlib.nullcontext()))
            forwards.append(len(calls))
    assert got == [(0, 2), (2, 2), (2, 2), (0, 1)]
    assert forwards == [2, 2, 2, 2]  # as many forwards on every rank: an FSDP forward is a collective


def test_spans_and_crop():
    ids = [[9, 1, 2, 3, 4], [9, 1, 2, 5], [9, 1, 2, 6, 7, 8]]
    assert core.spans(ids, "multiple_choice") == (ids, [3, 3, 3], [5, 4, 6])  # after the common prefix
    assert core.spans([[9, 1, 3, 4], [9, 2, 3, 4]], "schema")[1:] == ([2, 2], [4, 4])  # the common suffix
    assert core.spans([[9, 1, 2], [9, 1, 2, 3, 4]], "language_modeling") == ([[9, 1, 2, 3, 4]], [3], [5])
    # the rows keep their last 4 tokens, the spans move with them (the third's first scored token is now at 1)
    assert core.crop(ids, [3, 3, 3], [5, 4, 6], 4) == ([[1, 2, 3, 4], [9, 1, 2, 5], [2, 6, 7, 8]], [2, 3, 1], [4, 4, 4])
    # a continuation longer than the context: its first kept token has no token before it, so scoring starts at 1
    assert core.crop([[9, 1, 2, 6, 7, 8]], [3], [6], 2) == ([[7, 8]], [1], [2])


def test_the_bundle_downloads_once_from_a_zip_url(bundle, ckpt, tmp_path):
    archive = tmp_path / "eval_bundle.zip"
    with zipfile.ZipFile(archive, "w") as z:
        for path in bundle.rglob("*"):
            z.write(path, path.relative_to(bundle.parent))  # eval_bundle/... as nanochat's zip holds it
    url, cache = archive.as_uri(), tmp_path / "cache"
    out = tmp_path / "new" / "core.json"  # its folder made (it was a traceback after the whole evaluation)
    result = core.main(["--ckpt", str(ckpt), "--bundle", url, "--cache-dir", str(cache), "--json", str(out)])
    assert flat(result) == pytest.approx(flat(EXPECTED), abs=1e-12) and json.loads(out.read_text()) == result
    (kept,) = cache.iterdir()  # unzipped once and kept, under a name of its URL
    assert kept.name.startswith("eval_bundle-") and (kept / "core.yaml").read_text() == \
        (bundle / "core.yaml").read_text()
    archive.unlink()
    assert core.fetch_bundle(url, cache) == kept
    with pytest.raises(SystemExit, match="could not download the eval bundle from file://.*; offline, copy an "):
        core.main(["--ckpt", str(ckpt), "--bundle", url + ".gone", "--cache-dir", str(cache)])
    with pytest.raises(SystemExit, match="has no core.yaml"):
        core.main(["--ckpt", str(ckpt), "--bundle", str(tmp_path)])
    # a zip whose member rotted in transit passes zipfile.is_zipfile; unzipping it is the same one line
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_STORED) as z:
        z.writestr("eval_bundle/core.yaml", "x" * 100)
    data = bytearray(archive.read_bytes())
    data[data.find(b"xxxx")] = ord("y")
    archive.write_bytes(bytes(data))
    with pytest.raises(ConnectionError, match=r"could not unzip the eval bundle from file://.* \(Bad CRC-32"):
        core.fetch_bundle(url, tmp_path / "other")
    assert list((tmp_path / "other").iterdir()) == []  # the temporary folder is gone


@pytest.mark.slow
def test_core_on_two_ranks_equals_one(bundle, ckpt, tmp_path):
    # 4, 3 and 3 rows on 2 ranks: rank 1 runs a padding forward in the two odd tasks
    out = tmp_path / "core.json"
    run_torchrun(["core.py", "--ckpt", str(ckpt), "--bundle", str(bundle), "--json", str(out)], nproc=2)
    assert flat(json.loads(out.read_text())) == pytest.approx(flat(EXPECTED), abs=1e-12)


def test_a_bundle_task_of_another_kind_is_one_line(bundle, tmp_path):
    shutil.copytree(bundle, tmp_path / "b")
    yaml = tmp_path / "b" / "core.yaml"
    yaml.write_text(yaml.read_text().replace("icl_task_type: schema", "icl_task_type: generation_task_with_answers"))
    with pytest.raises(ValueError, match="task schema has icl_task_type 'generation_task_with_answers'"):
        core.load_tasks(tmp_path / "b")


def test_train_scores_core_as_an_engine_eval(bundle, token_data, tmp_path, capsys):
    out = tmp_path / "run"
    result = train.main(["--preset", "tiny", "--data", str(token_data), "--out-dir", str(out), "--max-steps=4",
                         "--core-every=2", "--core-bundle", str(bundle)])
    records = [r for r in iter_log(out / "log.jsonl") if r["type"] == "core"]
    assert [r["step"] for r in records] == [2, 4]  # not at step 0, as nanochat's base_train: untrained weights
    assert f"step      4 | CORE {records[-1]['core_metric']:.4f} (3 tasks, at most 500 rows each)" in \
        capsys.readouterr().out
    scored = core.main(["--ckpt", str(out / "ckpt_000004.pt"), "--bundle", str(bundle)])  # the final weights
    assert flat(records[-1]) == pytest.approx(flat({"type": "core", "step": 4, "tokens": 4 * 512, **scored}), abs=1e-12)
    assert result["core_metric"] == records[-1]["core_metric"]
    png = plot.main(["--log", str(out / "log.jsonl")]).read_bytes()
    assert int.from_bytes(png[16:20], "big") == 2750  # 4 panels: loss, bits per byte, lr and CORE


HELLASWAG = ROOT.parent / "shared" / "data" / "hellaswag_val_subset1000.jsonl.gz"


@pytest.mark.skipif(not HELLASWAG.is_file(), reason=f"needs the real HellaSwag subset at {HELLASWAG}")
def test_a_bundle_of_the_real_hellaswag_examples(tmp_path):
    runpy.run_path(str(ROOT / "scripts" / "hellaswag_bundle.py"))["main"](str(HELLASWAG), str(tmp_path))
    zero, ten = core.load_tasks(tmp_path, max_per_task=100)
    assert [(t.label, t.kind, t.shots, t.baseline, len(t.rows)) for t in (zero, ten)] == [
        ("hellaswag_zeroshot", "multiple_choice", 0, 25.0, 100), ("hellaswag", "multiple_choice", 10, 25.0, 100)]
    assert zero.rows == ten.rows  # one file, one shuffle: the same 100 rows
    first = json.loads((tmp_path / "eval_data" / "language_understanding" / "hellaswag.jsonl").open().readline())
    assert first == {"query": "Pole vault: Pole vault is a sport where you run with a pole and stop and swing your "
                              "body. A few women", "gold": 3,
                     "choices": ["go down a rock and stop.", "watch from around a pole vault.", "are in the wading "
                                 "pool.", "are in the gym practicing to do this pole vault, trying to do their best."]}
    shots, question = core.prompts(ten, 0)[0].rsplit("\n\n", 1)
    assert shots.count("\n\n") == 9 and question.startswith(ten.rows[0]["query"] + " ")


def test_a_bad_task_file_is_one_line_naming_it(bundle, tmp_path):
    # each was a traceback mid-evaluation, a JSON error naming no file, or a silent accuracy of 0 (no rows)
    root = tmp_path / "b"
    shutil.copytree(bundle, root)
    mc = root / "eval_data" / "multiple_choice" / "mc.jsonl"
    row = '{"query": "a", "choices": ["x", "y"]'
    for text, message in [(row + ', "gold": 0}\n{"query": "b", "choi', "mc.jsonl line 2: not valid JSON"),
                          (row + "}\n", "mc.jsonl row 0 \\(0-based, not a line number\\): no 'gold' "
                                         "\\(a multiple_choice row of task mc\\)"),
                          (row + ', "gold": "1"}\n', "number\\): 'gold' is '1', not an index into its 2 options"),
                          (row + ', "gold": 2}\n', "number\\): 'gold' is 2, not an index into its 2 options"),
                          (row + ', "gold": true}\n', "number\\): 'gold' is True, not an index into its 2 options"),
                          ("", "task mc is 0-shot, but has 0 rows")]:
        mc.write_text(text)
        with pytest.raises(ValueError, match=message):
            core.load_tasks(root)
    with pytest.raises(ValueError, match=r"task schema is 1-shot, but has 1 rows .*: it needs at least 2"):
        core.load_tasks(bundle, max_per_task=1)  # no other row to draw its example from
    shutil.copy(bundle / "eval_data" / "multiple_choice" / "mc.jsonl", mc)
    yaml = root / "core.yaml"  # a bundle of one's own: num_fewshot a number, not DCLM's list (was a TypeError)
    yaml.write_text(yaml.read_text().replace("num_fewshot: [1]", "num_fewshot: 1"))
    assert [t.shots for t in core.load_tasks(root)] == [0, 1, 1]
    yaml.write_text(yaml.read_text().replace("num_fewshot: 1", "num_fewshot: [1, 2]"))
    assert [t.shots for t in core.load_tasks(root)] == [0, 1, 1]  # a list's first, as nanochat scores it
    yaml.write_text(yaml.read_text().replace("  dataset_uri: language_modeling/lm.jsonl\n", ""))
    with pytest.raises(ValueError, match=r"core.yaml: icl_tasks item 2 has no dataset_uri$"):
        core.load_tasks(root)


def test_a_continuation_that_joins_the_contexts_last_token_is_one_line(tmp_path):
    # "19" + "84" is the one token "1984": the span scored was empty, so any model got the row right (nanochat asserts)
    ok = {"context": "one two", "continuation": " three"}
    for bad in [{"context": "In the year 19", "continuation": "84"}, {"context": "one", "continuation": ""}]:
        write_bundle(tmp_path, {"lm": ("language_modeling", 0, 0.0, [ok, bad])}, {"lm": ""})
        with pytest.raises(ValueError, match=r"lm.jsonl row 1 .*: its continuation joins the context's last token"):
            core.load_tasks(tmp_path)


def test_a_language_modeling_row_that_is_not_text_is_one_line(tmp_path):
    # the continuation join check (commit 1f3688b) called .strip() on the row's fields: a null was a traceback at load
    row = {"context": "one", "continuation": None}
    write_bundle(tmp_path, {"lm": ("language_modeling", 0, 0.0, [row])}, {"lm": ""})
    with pytest.raises(ValueError, match=r"lm.jsonl row 0 .*: 'context' and 'continuation' must be strings, not str "
                                         r"and NoneType"):
        core.load_tasks(tmp_path)
