"""Supervised fine-tuning on the engine (sft.py): the loss covers the assistant's tokens only, a
resume is bitwise, 2 gloo ranks equal 1 process, an HF GPT-2 is padded for the chat tokens, --task scores replies."""

import json
import math
import sys
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import engine
import sft
import stage
import tasks
from chat_format import ASSISTANT_END, ASSISTANT_START, ConversationLoader, render
from common import get_tokenizer, iter_log, load_checkpoint
from conftest import one_line_error, run_nodes, run_torchrun
from model import GPT


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    """tasks.py's addition problems as a train/test JSONL directory, 512 and 64 of them."""
    out = tmp_path_factory.mktemp("addition")
    for split, n in (("train", 512), ("test", 64)):
        rows = tasks.Addition().examples(split)[:n]
        (out / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return out


def flags(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--preset", "sft-demo", "--init-from=", "--model=tiny", "--data", str(data), "--out-dir", str(out),
            "--seq-len=64", "--batch-size=4", "--total-batch-size=512", "--warmup-steps=2", "--eval-tokens=512",
            "--task=", *extra]


def test_a_data_error_stops_the_run_in_one_line(tmp_path, capsys):
    # a loader's DataError through the CLI: a trim of same_verdict once made it a TypeError traceback
    (tmp_path / "c.jsonl").write_text('{"text": "hi"}\n' * 40)
    assert one_line_error(capsys, sft.main, flags(tmp_path / "c.jsonl", tmp_path / "out")) == (
        f"error: {tmp_path / 'c.jsonl'} row 1 (0-based, not a line number): no 'messages' or 'conversations' (columns "
        'text); a conversation is {"messages": [{"role": ..., "content": ...}, ...]}, or "prompt" and "completion" as '
        'lists of such messages: convert other schemas')


def test_a_fresh_model_too_small_for_the_chat_tokens_names_the_flag_that_made_it(conversations, tmp_path, capsys):
    # it said "start from a model with at least 50267": an --init-from is padded for them, a fresh model only is short
    assert one_line_error(capsys, sft.main, flags(conversations, tmp_path, "--vocab-size=50257")) == (
        f"error: {conversations}: the chat format uses token ids up to 50262, but the model has only 50257 embedding "
        "rows; pass --vocab-size 50267 or more (the default: 50304)")


@pytest.mark.parametrize("datasets_installed", [True, False])
def test_a_local_copy_of_ultrachat_reads_its_sft_splits(tmp_path, monkeypatch, datasets_installed):
    """ultrachat_200k's layout has train_sft/test_sft/train_gen/test_gen and no train: a local copy was refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not datasets_installed:
        for name in ["datasets", *(m for m in list(sys.modules) if m.startswith("datasets."))]:
            monkeypatch.setitem(sys.modules, name, None)  # an import of it raises; find_spec says None
    chat = lambda i: [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    (tmp_path / "data").mkdir()
    for split, first, n in (("train_sft", 0, 30), ("test_sft", 30, 4), ("train_gen", 40, 7), ("test_gen", 50, 5)):
        table = pa.Table.from_pylist([{"messages": chat(i)} for i in range(first, first + n)])
        pq.write_table(table, tmp_path / "data" / f"{split}-00000-of-00001.parquet")
    train, val = (ConversationLoader(str(tmp_path), split, 1, 63, family=sft.SPLITS) for split in ("train", "val"))
    assert train.tokens == sum(len(render(chat(i))[0]) for i in range(30))
    assert val.tokens == sum(len(render(chat(i))[0]) for i in range(30, 34))


def test_setup_wires_the_chat_loader_the_label_smoothing_and_both_evaluations(monkeypatch):
    # the Run sft.setup builds, without building it: conversations for the data-parallel rank under sft.SPLITS'
    # fallback names, the chat vocabulary, --label-smoothing in the step, the val loss and the task evaluations
    seen = {}

    class FakeSetup:
        def __init__(self, cfg, ctx, loader, chat=False, vocab=0):
            seen.update(loader=loader, chat=chat, vocab=vocab)
            self.cfg, self.built, self.next_batch, self.grad_accum, self.guard = cfg, "model", "batches", 3, "guard"

        def build(self):
            seen["built"] = True

        def run(self, step_fn, evals):
            return step_fn, evals

    monkeypatch.setattr(stage, "Setup", FakeSetup)
    monkeypatch.setattr(stage, "lm_step", lambda *args, **kw: seen.update(step=(args[1:5], kw)) or "step")
    monkeypatch.setattr(stage, "val_evals", lambda cfg, setup: ["val"])
    monkeypatch.setattr(stage, "task_evals", lambda cfg, setup: ["task"])
    monkeypatch.setattr(sft, "ConversationLoader", lambda *args: args)
    cfg = sft.SFTConfig(model="tiny", seq_len=64, batch_size=4, seed=7, label_smoothing=0.1, data="d")
    assert sft.setup(cfg, SimpleNamespace()) == ("step", ["val", "task"])
    assert seen["built"] and seen["chat"] and seen["vocab"] == sft.CHAT_VOCAB
    assert seen["step"] == (("model", "batches", 3, "guard"), {"label_smoothing": 0.1})
    data = SimpleNamespace(rank=1, world=2, device="cpu")
    assert seen["loader"]("val", data) == ("d", "val", 4, 64, 1, 2, 7, "cpu", ("train_sft", "test_sft"))
    with pytest.raises(ValueError, match=r"--label-smoothing must be in \[0, 1\); got 1.0"):
        sft.SFTConfig(label_smoothing=1.0)


def test_one_task_is_scored_every_task_every_steps_on_its_held_out_problems(monkeypatch):
    # --task-every, not --eval-every, is the task's cadence; the score is tasks.accuracy of this rank among the world
    ctx = engine.Context(rank=1, world=2)
    said = []
    setup = SimpleNamespace(ctx=ctx, built=SimpleNamespace(autocast="ac"), raw="model",
                            log=SimpleNamespace(say=said.append))
    cfg = sft.SFTConfig(task="addition", task_limit=4, task_every=7, eval_every=3, seq_len=64)
    evaluation, (problems,) = stage.task_eval(cfg, setup)
    assert (evaluation.name, evaluation.every, len(problems)) == ("task", 7, 4)
    assert problems == tasks.Addition().examples("test")[:4]  # the held-out split's first problems, not train's
    calls = []
    monkeypatch.setattr(tasks, "accuracy", lambda *args: calls.append(args) or {"acc": 0.5, "n": 4})
    assert evaluation.fn(9) == {"acc": 0.5, "n": 4}
    assert calls[0][0] == "model" and calls[0][2] is problems and calls[0][3:] == (1, 2, "ac")
    assert said == ["step      9 | addition accuracy 0.5000 (4 held-out problems)"]
    with pytest.raises(ValueError, match="--seq-len 8 or more"):
        stage.task_eval(replace(cfg, seq_len=8), setup)


def test_the_loss_is_the_mean_over_the_assistants_tokens(conversations):
    loader = ConversationLoader(str(conversations), "train", 4, 64)
    x, y = loader.next_batch()
    torch.manual_seed(0)
    model = GPT(stage.model_config(sft.SFTConfig(model="tiny", seq_len=64)))
    _, loss = model(x, y)
    logits, _ = model(x)
    learned = y != -1
    # every learned target is a reply's token or its end, never the prompt: "What is ..." and the markers around it
    reply_tokens = sum(sum(render(row["messages"])[1]) for row in map(json.loads, open(conversations / "train.jsonl")))
    assert 0 < learned.sum() < 0.5 * learned.numel() and reply_tokens > 0
    want = F.cross_entropy(logits[learned].float(), y[learned])
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)


def test_a_ppo_policys_critic_is_left_behind(conversations, tmp_path):
    # it was carried into the SFT model untrained, and under DDP its missing gradient stopped the run at step 1
    torch.manual_seed(0)
    model = GPT(replace(stage.model_config(sft.SFTConfig(model="tiny", seq_len=64)), value_head=True))
    ppo = tmp_path / "ppo.pt"
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "train_config": {"algo": "ppo"},
                "step": 0}, ppo)
    sft.main([*flags(conversations, tmp_path / "out", "--max-steps=1", "--eval-every=0"), "--init-from", str(ppo)])
    saved = load_checkpoint(tmp_path / "out" / "ckpt_000001.pt")
    assert not saved["model_config"]["value_head"] and not any(k.startswith("value_head.") for k in saved["model"])


def test_sft_resumes_bitwise_and_logs_the_task_accuracy(conversations, tmp_path):
    extra = ["--max-steps=6", "--ckpt-every=3", "--eval-every=3", "--task=addition", "--task-every=3",
             "--task-limit=8"]
    full = sft.main(flags(conversations, tmp_path / "full", *extra))
    sft.main(flags(conversations, tmp_path / "split", *extra, "--max-steps=3"))
    rest = sft.main(flags(conversations, tmp_path / "split", *extra, "--resume=auto"))
    losses = [r["loss"] for r in iter_log(tmp_path / "split" / "log.jsonl") if r["type"] == "train"]
    assert losses == full["losses"] and len(losses) == 6 and losses[-1] < losses[0]  # bitwise
    assert rest["val_loss"] == full["val_loss"]
    assert rest["losses"] == full["losses"][3:]  # it resumed at step 3: a restart from 0 matched the full run too
    scored = [r for r in iter_log(tmp_path / "full" / "log.jsonl") if r["type"] == "task"]
    assert [r["step"] for r in scored] == [0, 3, 6] and all(r["n"] == 8 and 0 <= r["acc"] <= 1 for r in scored)
    ckpt = load_checkpoint(tmp_path / "full" / "ckpt_000006.pt")
    assert ckpt["chat"] is True  # chat.py and export.py tell a chat checkpoint from a base one by this


def test_a_task_whose_check_raises_mid_run_saves_the_steps_done_and_the_fixed_run_goes_on_bitwise(conversations,
                                                                                                  tmp_path, capsys):
    # the task eval at step 2 (after val's) lost steps 0 and 1; the resumed run evaluates step 2 again, as if unstopped
    from test_tasks import flaky_task

    (tmp_path / "t.py").write_text(flaky_task(2))  # step 0's eval scored its one problem
    task, split, full = f"{tmp_path}/t.py:Flaky", tmp_path / "split", tmp_path / "full"
    extra = ["--max-steps=3", "--ckpt-every=0", "--eval-every=2", f"--task={task}", "--task-every=2", "--task-limit=1",
             "--total-batch-size=256", "--eval-tokens=256"]
    assert one_line_error(capsys, sft.main, flags(conversations, split, *extra)) == (
        f"error: --task {task}: check() raised KeyError: 'boom' at step 2; {split}/ckpt_000002.pt holds the steps "
        "before it: fix that, then --resume auto goes on from there")
    (tmp_path / "t.py").write_text(flaky_task(0))
    rest = sft.main(flags(conversations, split, *extra, "--resume=auto"))
    assert rest["losses"] == sft.main(flags(conversations, full, *extra))["losses"][2:]
    timeless = lambda out: [{k: v for k, v in r.items() if k not in ("ms", "tok_s")}
                            for r in iter_log(out / "log.jsonl") if r["type"] != "config"]
    assert timeless(split) == timeless(full) and [r["type"] for r in timeless(full)].count("task") == 3  # 0, 2, 3


@pytest.mark.slow
def test_sft_and_train_py_refuse_each_others_checkpoints(tmp_path):
    """sft.py --resume of a pretraining checkpoint passed the stage check (both objectives "lm") and, with matching
    flags, went on as SFT; train.py's of an SFT one too. Each resumes its own, and train.py's SFT ones of old."""
    import train

    pretrained, tuned = ({"step": 0, "train_config": asdict(c)} for c in (train.TrainConfig(), sft.SFTConfig()))
    for ckpt, cfg in ((pretrained, sft.SFTConfig()), (tuned, train.TrainConfig())):
        with pytest.raises(ValueError, match=f"^--resume {tmp_path} was written by another stage or --objective, "
                           f"which this run cannot continue: start a new run from its weights with --init-from "
                           f"{tmp_path}$"):
            stage.check_resume((tmp_path, ckpt), cfg)
    # train.py's before sft.py split from it: --data-kind chat was SFT, tokens pretraining
    old = {kind: {"step": 0, "train_config": {**asdict(train.TrainConfig()), "objective": "lm", "data_kind": kind}}
           for kind in ("chat", "tokens")}
    for ckpt, cfg in ((pretrained, train.TrainConfig()), (tuned, sft.SFTConfig()), (old["chat"], sft.SFTConfig()),
                      (old["tokens"], train.TrainConfig())):
        stage.check_resume((tmp_path, ckpt), cfg)


def test_an_out_dir_of_another_stages_checkpoints_is_not_to_be_continued_with_resume_auto(tmp_path):
    """sft.py into train.py's --out-dir was told to continue it with --resume auto, which then refused the checkpoint
    as another stage's: the way out is a new --out-dir."""
    import engine
    import train

    ckpt = tmp_path / "ckpt_000002.pt"
    torch.save({"model": {}, "model_config": {}, "step": 2, "train_config": asdict(train.TrainConfig())}, ckpt)
    with pytest.raises(ValueError) as e:
        engine.Checkpointer(sft.SFTConfig(out_dir=str(tmp_path))).find_resume()
    assert str(e.value) == (f"--out-dir {tmp_path} holds another stage's or --objective's checkpoints (ckpt_000002.pt "
                            f"the last written), which this run cannot continue: start it in a new --out-dir (from "
                            f"their weights: --init-from {ckpt})")
    with pytest.raises(ValueError, match="continue that run with --resume auto"):  # its own stage's: as before
        engine.Checkpointer(train.TrainConfig(out_dir=str(tmp_path))).find_resume()


def test_sft_on_two_ranks_equals_one_process(conversations, tmp_path):
    common = ["--max-steps=4", "--eval-every=0", "--ckpt-every=4"]
    single = sft.main(flags(conversations, tmp_path / "single", *common))["losses"]
    run_torchrun(["sft.py", *flags(conversations, tmp_path / "ddp", *common)], nproc=2)
    losses = [r["loss"] for r in iter_log(tmp_path / "ddp" / "log.jsonl") if r["type"] == "train"]
    assert losses == pytest.approx(single, abs=1e-5)


def test_the_step_loss_is_every_targets_mean_however_the_batch_is_split(conversations, tmp_path):
    # packed rows hold unequal numbers of assistant tokens, so the mean of the micro-batches' means weighed a token by
    # its micro-batch: --batch-size 4 (2 micro-steps a step) trained otherwise than 8 (one), 4e-3 apart by step 3
    loader = ConversationLoader(conversations, "train", 4, 64, seed=1337)  # the run's first step, in 2 micro-batches
    assert len({int((loader.next_batch()[1] != -1).sum()) for _ in range(2)}) == 2
    common = ["--max-steps=3", "--eval-every=0"]
    two = sft.main(flags(conversations, tmp_path / "two", *common))["losses"]
    one = sft.main(flags(conversations, tmp_path / "one", *common, "--batch-size=8"))["losses"]
    assert two == pytest.approx(one, abs=2e-6) and len(one) == 3


def test_several_tasks_are_scored_as_chatcore(conversations, tmp_path, capsys):
    from test_tasks import ARC_ROWS, GSM8K_ROWS, MMLU_ROWS, chat_bigram, write_rows

    model, ckpt = chat_bigram(), tmp_path / "chat.pt"  # replies "B 4" to anything
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "step": 0}, ckpt)
    files = (("mmlu", MMLU_ROWS), ("arc-easy", ARC_ROWS), ("gsm8k", GSM8K_ROWS))
    spec = ",".join(f"{name}={write_rows(tmp_path / f'{name}.jsonl', rows)}" for name, rows in files)
    record = sft.main(flags(conversations, tmp_path / "out", f"--init-from={ckpt}", "--model=", f"--task={spec}",
                            "--task-limit=4", "--eval-only"))["chatcore"]
    # the letters' logits say B: 2 of 4 MMLU answers, 1 of 2 ARC's; "B 4" holds 2 of 3 GSM8K answers; centered by
    # chance (1/4, 1/4, 0): 1/3, 1/3, 2/3, whose mean is ChatCORE
    assert record["results"] == pytest.approx({"mmlu": 0.5, "arc-easy": 0.5, "gsm8k": 2 / 3})
    assert record["chatcore"] == pytest.approx(4 / 9)
    # one task from a local copy is a list of one, as the guide says: a chatcore record
    one = sft.SFTConfig(task=f"mmlu={tmp_path / 'mmlu.jsonl'}", task_limit=4)
    setup = SimpleNamespace(ctx=engine.Context(), built=SimpleNamespace(autocast=None))
    assert stage.task_eval(one, setup)[0].name == "chatcore"
    assert "| ChatCORE 0.4444 | mmlu 0.5000 | arc-easy 0.5000 | gsm8k 0.6667" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--task must be one of .*got 'nope'"):
        sft.SFTConfig(task="mmlu,nope")
    with pytest.raises(ValueError, match="^--task mmlu,: an empty item; list each task once$"):
        sft.SFTConfig(task="mmlu,")
    with pytest.raises(ValueError, match="^--task mmlu=a.jsonl,mmlu: mmlu twice; list each task once$"):
        sft.SFTConfig(task="mmlu=a.jsonl,mmlu")  # the first would be dropped from ChatCORE
    # a user's task is labelled by its name; an '=' in its path is part of the path
    assert tasks.task_list("/x/a=b/t.py:T,mmlu") == {"T": "/x/a=b/t.py:T", "mmlu": "mmlu"}
    assert tasks.parse_spec("/x/a=b/t.py:T") == ("/x/a=b/t.py:T", "")


def test_an_hf_gpt2_is_padded_for_the_chat_tokens(conversations, hf_dir, tmp_path):
    result = sft.main(flags(conversations, tmp_path / "out", f"--init-from={hf_dir}", "--model=", "--max-steps=2",
                          "--eval-every=0", "--seq-len=32", "--total-batch-size=256", "--batch-size=8"))
    assert len(result["losses"]) == 2 and all(math.isfinite(loss) for loss in result["losses"])
    ckpt = load_checkpoint(tmp_path / "out" / "ckpt_000002.pt")
    wte = ckpt["model"]["transformer.wte.weight"]
    assert ckpt["model_config"]["vocab_size"] == wte.shape[0] == 50304
    hf = GPT.load(None, str(hf_dir)).transformer.wte.weight
    # the new rows started as the mean of GPT-2's, and two small steps moved every row a little at most
    assert torch.allclose(wte[:50257], hf, atol=0.01) and torch.allclose(wte[50257:], hf.mean(0).expand(47, -1),
                                                                          atol=0.01)


def test_one_task_is_scored_on_replies_as_long_as_in_chatcore(conversations, tmp_path):
    # --task T scored replies cut at 32 tokens, --task T,addition (ChatCORE) at 512: the same weights' accuracy on T
    # was 0 alone and 1 in the list when T's replies give the answer after 40 tokens, as GSM8K's do
    from conftest import bigram_model

    task = tmp_path / "long.py"
    task.write_text('''class Long:
    def examples(self, split):
        return [{"messages": [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "x"}], "answer": "4"}]

    def check(self, reply, answer):
        return reply.endswith(" #### 4")
''')
    chain = [ASSISTANT_START, *range(1000, 1040), *get_tokenizer().encode_ordinary(" #### 4"), ASSISTANT_END]
    model, ckpt = bigram_model(dict(zip(chain, chain[1:], strict=False))), tmp_path / "long.pt"
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "step": 0}, ckpt)
    for spec, key in ((f"{task}:Long", "task"), (f"{task}:Long,addition", "chatcore")):
        result = sft.main(flags(conversations, tmp_path / "out", f"--init-from={ckpt}", "--model=", f"--task={spec}",
                                "--task-limit=1", "--eval-only"))[key]
        assert (result["acc"] if key == "task" else result["results"]["Long"]) == 1.0


def test_one_task_is_scored_on_the_problems_and_by_the_method_tasks_py_eval_uses(conversations, tmp_path):
    # sft.py --task T took T's first --task-limit problems and scored them by replies; tasks.py --eval took a seeded
    # random --limit and scored multiple choice by its letters: one checkpoint, two accuracies (a reviewer's)
    from test_tasks import SUBCLASSES, chat_bigram

    (tmp_path / "t.py").write_text(SUBCLASSES + '''

class Ordered:  # 50 problems, only the first two right whatever the reply
    def examples(self, split):
        return [{"messages": [{"role": "user", "content": f"{k}?"}, {"role": "assistant", "content": str(k)}],
                 "answer": str(k)} for k in range(50)]

    def check(self, reply, answer):
        return answer in ("0", "1")
''')
    model, ckpt = chat_bigram(), tmp_path / "chat.pt"  # replies "B 4" to anything
    torch.save({"model": model.state_dict(), "model_config": asdict(model.config), "step": 0}, ckpt)
    for name, acc in (("Ordered", 0.5), ("Letters", 0.5)):  # Letters: no reply is right, the letters' logits 2 of 4
        spec = f"{tmp_path / 't.py'}:{name}"
        alone = sft.main(flags(conversations, tmp_path / name, f"--init-from={ckpt}", "--model=", f"--task={spec}",
                               "--task-limit=4", "--eval-only"))["task"]
        assert alone["acc"] == acc and alone["n"] == 4
        assert tasks.main(["--eval", str(ckpt), "--tasks", spec, "--limit", "4", "--max-new-tokens", "4",
                           "--device", "cpu"])["results"] == {name: acc}
    # a hub dataset's problems come in nanochat's order (its shuffle, seed 42): the same list for both
    assert tasks.held_out(tasks.MMLU(), list(range(4)), 3) == [3, 2, 1]


def test_a_task_prompt_longer_than_the_context_is_refused_before_training(conversations, tmp_path, capsys):
    # generate() refused it in the task eval, by default only after the whole training, in a line naming no flag
    task = tmp_path / "wordy.py"
    task.write_text('''class Wordy:
    def examples(self, split):
        return [{"messages": [{"role": "user", "content": "word " * 70}, {"role": "assistant", "content": "x"}],
                 "answer": "x"}]

    def check(self, reply, answer):
        return True
''')
    for seq_len in (64, 75):  # a prompt that fills the context leaves room for a 1-token reply at most
        with pytest.raises(SystemExit):
            sft.main(flags(conversations, tmp_path / "out", f"--task={task}:Wordy", "--max-steps=1",
                           f"--seq-len={seq_len}", f"--total-batch-size={4 * seq_len}"))
        out = capsys.readouterr()
        assert "val loss" not in out.out  # refused before step 0
        assert out.err.endswith(f"\nerror: --task {task}:Wordy: a prompt takes 75 tokens, --seq-len {seq_len} or "
                                "more (the model's context): raise --seq-len where the model allows (not "
                                "past --init-from's context, nor on a resume), or score another task\n")


@pytest.mark.slow
def test_a_task_one_rank_cannot_load_stops_every_rank_with_its_line(conversations, tmp_path):
    # each rank loaded --task's problems alone, after setup's checks: the others went on to train and got a lost
    # peer's traceback (across nodes under NCCL, a wait of --dist-timeout)
    (tmp_path / "t.py").write_text(
        "import os\nimport tasks\nclass T:\n    def examples(self, split):\n"
        "        if os.environ['RANK'] == '1':\n            open('/no/such/problems.jsonl')\n"
        "        return tasks.Addition().examples(split)\n    def check(self, reply, answer):\n        return True\n")
    args = flags(conversations, tmp_path / "out", "--max-steps=1", f"--task={tmp_path}/t.py:T")
    done = run_nodes([["sft.py", *args]] * 2)  # a node each: one torchrun would end the other rank at once
    line = (f"--task {tmp_path}/t.py:T: examples() raised FileNotFoundError: [Errno 2] No such file or directory: "
            "'/no/such/problems.jsonl'")
    assert [[e for e in r.stderr.splitlines() if e.startswith("error:")] for r in done] == [[f"error: rank 1: {line}"],
                                                                                            [f"error: {line}"]]
    # a task file that differs between the nodes: each rank scored its share of its own held-out problems, silently
    (tmp_path / "u.py").write_text("import os\nimport tasks\nclass T:\n    def examples(self, split):\n"
                                   "        return tasks.Addition().examples(split)[::1 if os.environ['RANK'] == '0' "
                                   "else -1]\n    def check(self, reply, answer):\n        return True\n")
    done = run_nodes([["sft.py", *flags(conversations, tmp_path / "u", "--max-steps=1", f"--task={tmp_path}/u.py:T")]]
                     * 2)
    assert [[e for e in r.stderr.splitlines() if e.startswith("error:")] for r in done] == [
        ["error: rank 1's --task data differs from rank 0's: every node must hold the same --task data"]] * 2


def test_without_a_preset_sft_runs_the_sft_recipe_not_pretrainings():
    # the bare defaults were pretraining's: 19,073 steps at lr 6e-4 of 524,288 tokens, into train.py's out/gpt2-124m
    bare = sft.SFTConfig()
    assert replace(bare, init_from="gpt2") == sft.PRESETS["sft"]()
    assert (bare.max_steps, bare.max_lr, bare.total_batch_size, bare.warmup_steps, bare.eval_tokens, bare.out_dir) == \
        (2000, 3e-5, 32768, 20, 327680, "out/sft")
