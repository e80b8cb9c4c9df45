"""The post-training stages as a new user meets them: chat and pair data read exactly as written, an exported chat model
that answers in transformers as in chat.py, the chat format kept through SFT -> DPO -> RL -> export, and one line (with
nothing written) for what cannot work."""

import gzip
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_chat import sft

import chat
import chat_format as cf
import datarows
import export
import prefs
import rl
import tasks
from common import get_tokenizer, iter_log, load_checkpoint
from conftest import ROOT, TINY, one_line_error
from fineweb import DataError, source_kind
from generate import generate
from model import GPT
from prefs import PairLoader

__all__ = ["sft"]  # the module-scoped SFT checkpoint fixture of test_chat

QUOTED, NUMBER, BOOLEAN = '"To be"', "42", "true"  # valid replies that JSON type inference rewrites


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def chat_rows() -> list[dict]:
    """String contents and part lists mixed in one file, as both are valid."""
    parts = [{"type": "text", "text": "It is "}, {"type": "tool", "text": "6*7"}, {"type": "output", "text": "42"}]
    replies = [QUOTED, NUMBER, BOOLEAN, parts]
    return [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": reply}]}
            for i, reply in enumerate(replies * 6)]


def test_chat_rows_reach_the_tokenizer_byte_for_byte(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", chat_rows())
    read = [messages for _, messages in cf.read_conversations(str(path), "train")]
    assert read == [row["messages"] for i, row in enumerate(chat_rows()) if i % cf.VAL_EVERY]
    loader = cf.ConversationLoader(str(path), "train", 1, 64)
    # each packed row holds whole conversations, each starting with BOS: the rows' tokens are exactly the renders
    rendered = sorted(tuple(cf.render(m)[0]) for m in read)
    conversations = sorted(tuple(seq) for seq in split_packed(loader))
    assert conversations == rendered
    enc = get_tokenizer()
    replies = {enc.decode([t for t in seq if t < cf.BOS]) for seq in conversations}
    assert {f"q1{NUMBER}", f"q4{QUOTED}", f"q2{BOOLEAN}"} <= replies  # row 0 is val


def test_jsonl_lines_end_at_newlines_only_and_a_byte_order_mark_is_skipped(tmp_path):
    # json.dumps(ensure_ascii=False) leaves U+2028 and U+0085 unescaped; str.splitlines() cut rows there
    rows = [{"messages": [{"role": "user", "content": "a\u2028b"}, {"role": "assistant", "content": "c\x85d"}]}] * 3
    path = tmp_path / "chat.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode())
    assert datarows.load_rows(str(path), "train") == rows


def split_packed(loader: cf.ConversationLoader) -> list[list[int]]:
    """The conversations in a loader's packed rows: each starts at a BOS, the row's padding (BOS, masked) dropped."""
    out = []
    for ids, mask in zip(loader.ids.tolist(), loader.mask.tolist(), strict=True):
        starts = [i for i, t in enumerate(ids) if t == cf.BOS] + [len(ids)]
        for a, b in zip(starts, starts[1:], strict=False):
            if any(mask[a:b]):
                out.append(ids[a:b])
    return out


def test_pair_replies_reach_the_tokenizer_as_written(tmp_path):
    rows = [{"prompt": f"p{i}", "chosen": QUOTED, "rejected": NUMBER if i % 2 else BOOLEAN} for i in range(8)]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    loader = PairLoader(str(path), "train", 2, 32, shuffle=False)
    enc = get_tokenizer()
    texts = {enc.decode([t for t in side[start:] if t < cf.BOS]) for pair, starts in zip(loader.ids, loader.starts,
                                                                                          strict=True)
             for side, start in zip(pair, starts, strict=True)}
    assert texts == {QUOTED, NUMBER, BOOLEAN}


@pytest.mark.parametrize("content, message", [
    (42, "message 1 (assistant) has content of type int, expected a string or a list of parts"),
    ("  \n ", "message 1 (assistant) is empty or only whitespace"),
])
def test_a_bad_content_is_refused_naming_its_row(tmp_path, content, message):
    rows = chat_rows()
    rows[5]["messages"][1]["content"] = content
    path = tmp_path / "chat.jsonl"
    path.write_text("\n\n".join(map(json.dumps, rows)))  # row 5 is on line 11: "row 5" was opened at line 5
    with pytest.raises(DataError) as e:
        cf.ConversationLoader(str(path), "train", 1, 64)
    assert str(e.value) == f"{path} row 5 (0-based, not a line number): {message}"


def test_a_directory_s_bad_row_is_counted_over_its_split_s_files_in_path_order(tmp_path):
    pytest.importorskip("datasets")  # its patterns find b-train.jsonl and a-train.jsonl, in another order
    rows = chat_rows()
    rows[5]["messages"][1]["content"] = 42
    write_jsonl(tmp_path / "a-train.jsonl", rows[:4])
    write_jsonl(tmp_path / "b-train.jsonl", rows[4:])
    with pytest.raises(DataError) as e:
        cf.ConversationLoader(str(tmp_path), "train", 1, 64)
    assert str(e.value) == f"{tmp_path} row 5 (0-based, over its files in sorted order): message 1 " \
        "(assistant) has content of type int, expected a string or a list of parts"


def test_a_row_of_another_schema_is_one_line_naming_its_columns(tmp_path):
    # such rows were "expected a non-empty list of messages, got None", naming no column (ShareGPT's are read now)
    rows = chat_rows()
    rows[3] = {"prompt": "hi", "completion": "hello", "id": 7}  # TRL's text prompt/completion: no roles
    path = write_jsonl(tmp_path / "completion.jsonl", rows)
    with pytest.raises(DataError) as e:
        cf.ConversationLoader(str(path), "train", 1, 64)
    assert str(e.value) == f"{path} row 3 (0-based, not a line number): no 'messages' or 'conversations' (columns " \
        'prompt, completion, id); a conversation is {"messages": [{"role": ..., "content": ...}, ...]}, or ' \
        '"prompt" and "completion" as lists of such messages: convert other schemas'


def test_json_over_several_lines_reads_as_datasets_reads_it_and_columns_are_one_line(tmp_path):
    # a pretty-printed object was "line 1: not valid JSON"; datasets reads objects one after another as rows
    row, path = chat_rows()[0], tmp_path / "chat.json"
    path.write_text(json.dumps(row, indent=2) + "\n" + json.dumps(row, indent=2))
    assert datarows.load_rows(str(path), "train") == [row, row]
    # columns (json.dump(dataset[:]), pandas' to_json) were read as one row: "message 0 has role None"
    for columns in ({"messages": [row["messages"]] * 2}, {"messages": {"0": row["messages"]}}):
        path.write_text(json.dumps(columns, indent=2))
        with pytest.raises(DataError) as e:
            datarows.load_rows(str(path), "train")
        assert str(e.value) == f"{path}: one object of columns (messages), not rows; expected a list of objects, or " \
            "one object per line"
    # rows inside one object ({"data": [rows]}, as SQuAD's files hold theirs) were one row: "train: no conversations"
    path.write_text(json.dumps({"version": 2, "data": [row] * 3}))
    with pytest.raises(DataError) as e:
        datarows.load_rows(str(path), "train")
    assert str(e.value) == f"{path}: one object whose 'data' holds 3 objects, read as one row; if those are the " \
        "rows, save that list alone (datasets reads them with field='data')"
    path.write_text(json.dumps({**row, "tools": [{"type": "function", "function": {"name": "f"}}]}))  # a row: read
    assert len(datarows.load_rows(str(path), "train")) == 1
    # a line cut short runs into the next, where the decoder stops: the line its value began on is named too
    path.write_text('{"messages": 1}\n{"messages": [1\n{"messages": 2}\n')
    with pytest.raises(DataError) as e:
        datarows.load_rows(str(path), "train")
    assert str(e.value) == f"{path} line 3: not valid JSON (Expecting ',' delimiter; in the value from line 2)"


def test_a_stray_file_beside_a_split_is_left_out_naming_it(tmp_path, capsys):
    pytest.importorskip("datasets")  # its patterns match my-train-notes.txt too, and read_local took it for JSON
    write_jsonl(tmp_path / "my-train.jsonl", chat_rows())
    (tmp_path / "my-train-notes.txt").write_text("notes\n")
    for source in (str(tmp_path), str(tmp_path / "*")):  # a glob's files too: it read the notes as JSON
        assert datarows.load_rows(source, "train") == chat_rows()
        assert capsys.readouterr().out == f"note: {source} (split train): 1 file(s) left out, not " \
            ".jsonl/.json/.parquet/.gz: my-train-notes.txt\n"
    cf.ConversationLoader(source, "val", 1, 64)  # the glob's val is its train's files read again: the note was twice
    assert "note:" not in capsys.readouterr().out


def test_a_flat_copy_of_ultrachat_reads_the_stages_splits_alone(tmp_path):
    """datasets' patterns take train_sft.jsonl and train_gen.jsonl for one train split: both were read, in silence."""
    pytest.importorskip("datasets")
    rows = chat_rows()
    for split, part in (("train_sft", rows[:3]), ("train_gen", rows[3:5]), ("test_sft", rows[5:6]), ("test_gen", rows)):
        write_jsonl(tmp_path / f"{split}.jsonl", part)
    assert datarows.load_rows(str(tmp_path), "train", fallback="train_sft") == rows[:3]
    assert datarows.load_rows(str(tmp_path), "test", fallback="test_sft") == rows[5:6]
    write_jsonl(tmp_path / "train.jsonl", rows[6:8])  # the plain split wins alone: datasets read train_sft.jsonl too
    assert datarows.load_rows(str(tmp_path), "train", fallback="train_sft") == rows[6:8]


def test_a_directory_named_with_glob_characters_is_read_by_datasets_layouts(tmp_path):
    pytest.importorskip("datasets")  # its patterns took runs[v2] for a glob and found nothing: "no train split"
    (tmp_path / "runs[v2]").mkdir()
    write_jsonl(tmp_path / "runs[v2]" / "my-train.jsonl", chat_rows())
    assert datarows.load_rows(str(tmp_path / "runs[v2]"), "train", fallback="train_sft") == chat_rows()


def test_a_file_named_with_glob_characters_is_that_file_and_a_glob_s_rows_are_counted_over_it(tmp_path):
    odd = write_jsonl(tmp_path / "conv[v2].jsonl", chat_rows())  # was "no such file": taken for a glob
    assert datarows.load_rows(str(odd), "train") == chat_rows()
    rows = chat_rows()
    rows[5]["messages"] = []
    (tmp_path / "g").mkdir()
    write_jsonl(tmp_path / "g" / "b.jsonl", rows[2:])
    write_jsonl(tmp_path / "g" / "a.jsonl", rows[:2])
    with pytest.raises(DataError, match=r"/g/\*\.jsonl row 5 \(0-based, over its files in sorted order\): "):
        cf.ConversationLoader(str(tmp_path / "g" / "*.jsonl"), "train", 1, 64)  # it named no position


def test_a_hub_dataset_without_a_test_split_says_how_to_go_on(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    write_jsonl(tmp_path / "train.jsonl", chat_rows())  # the hub, read by datasets' own code
    for real in (datasets.get_dataset_split_names, datasets.load_dataset):
        monkeypatch.setattr(datasets, real.__name__, lambda _, *a, real=real, **k: real(str(tmp_path), *a, **k))
    with pytest.raises(DataError) as e:
        datarows.load_rows("someone/chat", "test", fallback="test_sft")
    assert str(e.value) == "cannot read someone/chat (split test or test_sft), taken as a hub dataset as no local " \
        "path of that name exists: Unknown split \"test_sft\". Should be one of ['train'].; a held-out split " \
        "missing, --eval-every 0 skips the val loss"
    with pytest.raises(DataError) as e:  # a train split: no --eval-every 0 hint, it cannot help
        datarows.load_rows("someone/chat", "train_prefs")
    assert str(e.value).endswith("Unknown split \"train_prefs\". Should be one of ['train'].")


def test_empty_non_utf8_and_missing_files_are_one_line(tmp_path, monkeypatch):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=f"^{empty} \\(split train\\) holds no rows$"):
        cf.ConversationLoader(str(empty), "train", 1, 64)
    with pytest.raises(DataError, match=f"^{empty} \\(split train\\) holds no rows$"):
        PairLoader(str(empty), "train", 1, 64)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"messages": []}\n{"messages": [{"role": "user", "content": "caf\xe9"}]}\n')
    with pytest.raises(DataError, match=f"^{latin} line 2: not UTF-8 \\(byte 0xe9\\); save the file as UTF-8$"):
        datarows.load_rows(str(latin), "train")
    with pytest.raises(DataError, match="no such file or directory: .*missing.jsonl \\(taken as a local path\\)"):
        datarows.load_rows(str(tmp_path / "missing.jsonl"), "train")
    whole = gzip.compress(json.dumps({"messages": []}).encode() * 50)
    for name, data, why in (("cut", whole[:-12], "Compressed file ended before the end-of-stream marker was reached"),
                            ("plain", b"no", "Not a gzipped file (b'no')"),
                            ("bad", whole[:10] + b"\xff" * 9, "Error -3 while decompressing data: invalid block type")):
        (tmp_path / f"{name}.jsonl.gz").write_bytes(data)  # an EOFError traceback, or an error naming no file
        with pytest.raises(DataError, match=f"^{tmp_path}/{name}.jsonl.gz: not a whole gzip file \\({re.escape(why)}"):
            datarows.load_rows(str(tmp_path / f"{name}.jsonl.gz"), "train")
    (tmp_path / "runs" / "a").mkdir(parents=True)  # was "holds no rows"
    with pytest.raises(DataError, match=f"^{tmp_path}/runs/\\* \\(split train\\) matched no .jsonl/.json/.parquet/.gz "
                                        "files$"):
        datarows.load_rows(str(tmp_path / "runs" / "*"), "train")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    assert source_kind("data/addition") == "local" and source_kind("someone/dataset") == "hub"
    assert source_kind("missing.jsonl.gz") == "local"  # was a hub name: ~25 s of retries, then blamed on the hub


@pytest.mark.parametrize("datasets_installed", [True, False])
def test_a_directory_s_splits_are_found_with_or_without_datasets(tmp_path, monkeypatch, datasets_installed):
    """The GPU image has no `datasets`: sft.py there found no split (2026-11-28). Its two usual layouts are globbed."""
    if not datasets_installed:
        for name in ["datasets", *(m for m in sys.modules if m.startswith("datasets."))]:
            monkeypatch.setitem(sys.modules, name, None)  # an import of it raises; find_spec says None
    flat, hub, hh = tmp_path / "flat", tmp_path / "hub", tmp_path / "hh"
    for f in (flat / "train.jsonl", flat / "test.jsonl", flat / ".test.jsonl.swp",
              hub / "data" / "train-00000-of-00002.parquet", hub / "data" / "train-00001-of-00002.parquet",
              hub / "data" / "test-00000-of-00001.parquet", hh / "helpful-base" / "train.jsonl.gz",
              hh / "harmless-base" / "train.jsonl.gz", hh / "harmless-base" / "test.jsonl.gz"):
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"")
    assert [f.name for f in datarows.local_split(flat, "test")] == ["test.jsonl"]
    assert [f.parent.name for f in datarows.local_split(hh, "train")] == ["harmless-base", "helpful-base"]  # HH-RLHF's
    names = ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    assert [f.name for f in datarows.local_split(hub, "train")] == names
    with pytest.raises(DataError, match=f"^{flat} has no validation split: expected files named like validation.jsonl"
                                        ".*; a held-out split missing, --eval-every 0 skips the val loss$"):
        datarows.local_split(flat, "validation")  # the way out was not named
    with pytest.raises(DataError, match=f"^{flat} has no validation or test_sft split: "):  # test_sft was not named
        datarows.local_split(flat, "validation", "test_sft")
    # ultrafeedback_binarized's layout: train_prefs, train_sft and train_gen are splits of their own, not train's
    # (globbed as train's, its 120 rows were read three times over)
    uf = tmp_path / "uf" / "data"
    uf.mkdir(parents=True)
    for split in ("train_prefs", "train_sft", "train_gen", "test_prefs"):
        (uf / f"{split}-00000-of-00001.parquet").write_bytes(b"")
    assert [f.name for f in datarows.local_split(uf.parent, "train_prefs")] == ["train_prefs-00000-of-00001.parquet"]
    has = "it has test_prefs, train_gen, train_prefs, train_sft" if datasets_installed else "`datasets` is not"
    with pytest.raises(DataError, match=f"^{uf.parent} has no train split: .*parquet \\({has}.*\\)$"):  # what is;
        datarows.local_split(uf.parent, "train")  # no --eval-every 0 hint: it cannot help a missing train split


def test_a_hub_name_says_it_was_taken_for_one():
    code = ("import datarows\ntry:\n    datarows.load_rows('someone/no-such-dataset', 'train')\n"
            "except Exception as e:\n    print(type(e).__name__, e)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}).stdout
    assert out.startswith("DataError cannot read someone/no-such-dataset (split train), taken as a hub dataset as no "
                          "local path of that name exists: "), out


def test_conversations_all_longer_than_seq_len_are_one_line(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "word " * 40}, {"role": "assistant", "content": "ok"}]}] * 4
    path = write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(DataError, match="none of its 3 conversations has an assistant token within T\\+1 = 17 tokens"):
        cf.ConversationLoader(str(path), "train", 1, 16)


def test_a_chat_export_saved_again_by_transformers_is_still_one(sft, tmp_path):
    # transformers 4.43+ saves the template as chat_template.jinja: the copy lost its chat mark, and its next export
    # cropped the chat tokens' rows
    transformers = pytest.importorskip("transformers")
    export.main(["--ckpt", str(sft), "--export-hf", str(tmp_path / "hf")])
    for part in (transformers.AutoModelForCausalLM, transformers.AutoTokenizer):
        part.from_pretrained(tmp_path / "hf").save_pretrained(tmp_path / "again")
    assert cf.exported_chat(str(tmp_path / "hf")) and cf.exported_chat(str(tmp_path / "again"))
    assert not cf.exported_chat(str(tmp_path))


def test_an_exported_chat_model_answers_as_chat_py(sft, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    export.main(["--ckpt", str(sft), "--export-hf", str(out)])
    hf, model = transformers.AutoModelForCausalLM.from_pretrained(out).eval(), GPT.from_checkpoint(sft).eval()
    differed_before = 0  # the old export's pad (the BOS every prompt starts with) masked it out
    for i, question in enumerate(["3+4?", "What is 2+2?", "hello", "9+1?", "Why is the sky blue?"]):
        ids = cf.render_prompt([{"role": "user", "content": question}])
        ours = generate(model, [ids], 12, temperature=0.0, stop_ids=cf.REPLY_STOPS, vocab=cf.CHAT_VOCAB)[0].tokens
        x = torch.tensor([ids])
        with torch.no_grad():
            plain = hf.generate(x, max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
            masked = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12,
                                 do_sample=False)[0, len(ids):].tolist()
            old = hf.generate(x, attention_mask=(x != cf.BOS).long(), max_new_tokens=12,
                              do_sample=False)[0, len(ids):].tolist()
        assert plain == masked == ours, (i, question)
        differed_before += old != ours
    assert differed_before >= 1


@pytest.mark.slow
def test_the_chat_format_follows_the_weights_through_dpo_and_rl_to_export(sft, tmp_path, capsys):
    rows = [{"prompt": f"{i}+1?", "chosen": "yes", "rejected": "no"} for i in range(40)]
    pairs = write_jsonl(tmp_path / "pairs.jsonl", rows)
    prefs.main([*TINY, "--init-from", str(sft), "--data", str(pairs), "--objective", "dpo", "--batch-size", "2",
                "--total-batch-size", "128", "--max-steps", "2", "--eval-every", "0", "--out-dir",
                str(tmp_path / "dpo")])
    dpo = tmp_path / "dpo" / "ckpt_000002.pt"
    policy = ["--init-from", str(dpo), "--algo", "ppo", "--prompts=2", "--samples=2", "--rollout-batch=1",
              "--max-new-tokens=4", "--eval-limit=2", "--pass-k=0", "--max-steps=1", "--device=cpu"]
    rl.main([*policy, "--out-dir", str(tmp_path / "rl")])
    ppo = tmp_path / "rl" / "ckpt_000001.pt"
    transformers = pytest.importorskip("transformers")
    prompt = cf.render_prompt([{"role": "user", "content": "3+1?"}])
    for ckpt in (dpo, ppo):
        assert cf.is_chat(load_checkpoint(ckpt))
        export.main(["--ckpt", str(ckpt), "--export-hf", str(tmp_path / f"hf_{ckpt.parent.name}")])
        tok = transformers.AutoTokenizer.from_pretrained(tmp_path / f"hf_{ckpt.parent.name}")
        config = json.loads((tmp_path / f"hf_{ckpt.parent.name}" / "config.json").read_text())
        assert (config["vocab_size"], len(tok), tok.chat_template is not None) == (50304, cf.CHAT_VOCAB + 1, True)
        # and HF answers as this project does, whatever each stage saved beside the weights
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"hf_{ckpt.parent.name}").eval()
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
        ours = generate(GPT.from_checkpoint(ckpt), [prompt], 6, temperature=0.0, stop_ids=cf.REPLY_STOPS,
                        vocab=cf.CHAT_VOCAB)[0].tokens
        assert theirs == ours, ckpt.parent.name
    capsys.readouterr()
    chat.main(["--ckpt", str(ppo), "--prompt", "hi", "--max-new-tokens", "2"])
    assert "never fine-tuned" not in capsys.readouterr().err
    # a PPO policy's value head is a critic, not a reward model; and a resume cannot change --algo
    log = (tmp_path / "rl" / "log.jsonl").read_text()
    assert one_line_error(capsys, rl.main, [*policy, "--algo", "grpo", "--reward-model", str(ppo), "--out-dir",
                                            str(tmp_path / "rl2")]) == \
        (f"error: --reward-model {ppo} is a PPO policy, whose value head is a critic, not a reward model: train one "
         "with prefs.py --objective reward")
    assert one_line_error(capsys, rl.main, [*policy, "--algo", "grpo", "--max-steps=2", "--resume=auto", "--out-dir",
                                            str(tmp_path / "rl")]).startswith(
        f"error: --resume {ppo} was trained with --algo ppo, whose optimizer state this run's --algo grpo cannot "
        "take: pass --algo ppo")
    assert (tmp_path / "rl" / "log.jsonl").read_text() == log and len(list((tmp_path / "rl").glob("ckpt_*"))) == 1
    assert [r["type"] for r in iter_log(tmp_path / "rl" / "log.jsonl")][0] == "config"




def test_tasks_py_refuses_bad_numbers_and_unwritable_targets_in_one_line(tmp_path, capsys):
    assert one_line_error(capsys, tasks.main, ["--limit=-5"]) == "error: --limit must be >= 0 (0: all); got -5"
    blocker = tmp_path / "file"
    blocker.write_text("")
    message = one_line_error(capsys, tasks.main, ["--task=addition", "--pairs", f"--out-dir={blocker}/addition"])
    assert message.startswith(f"error: cannot write {blocker}/addition") and message.endswith("pass another --out-dir")
    assert blocker.read_text() == "" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_tasks_py_offline_is_one_line_and_writes_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "tasks.py", "--task=arc-easy", f"--out-dir={tmp_path}/arc"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 1 and proc.stderr.startswith("error: cannot read allenai/ai2_arc (split train), taken "
                                                           "as a hub dataset") and proc.stderr.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_an_empty_prompt_and_dpo_without_a_start_are_refused(capsys):
    assert one_line_error(capsys, chat.main, ["--init-from", "gpt2", "--prompt", " "]) == \
        "error: --prompt is empty: pass a message, or leave --prompt out to chat interactively"
    assert one_line_error(capsys, chat.main, ["--init-from", "gpt2", "--system", "  ", "--prompt", "hi"]) == \
        "error: --system is empty: pass a message, or leave --system out"  # it failed at the first reply
    assert one_line_error(capsys, prefs.main, [*TINY, "--objective=dpo"]) == \
        ("error: --objective dpo moves a model away from its starting weights, its reference: pass --init-from a "
         "fine-tuned model (a random one prefers nothing)")


def test_the_ctrl_c_tests_pass_when_the_suite_ignores_sigint():
    # `nohup bash test.sh &` starts the suite with SIGINT ignored; each Ctrl-C test sets the handler it needs
    test = "tests/test_train.py::test_first_ctrl_c_asks_for_a_stop_and_a_ctrl_c_after_any_signal_quits_at_once"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", test], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:]
