"""chat.py on a chat model that train.py fine-tunes here (a tiny GPT, 40 steps on one fixed reply): the reply is
generate.py's greedy decode of chat_format.render_prompt, streamed with the calculator's call and forced result in
brackets; /clear, EOF, Ctrl-C, the context crop, the base-model warning and one-line errors."""

import contextlib
import functools
import io
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import chat
import chat_format as cf
import prefs
import stage
from common import get_tokenizer
from conftest import ROOT, TINY, one_line_error
from export import main as export_main
from generate import generate
from model import GPT, MODEL_PRESETS, GPTConfig
from sft import SFTConfig
from sft import main as sft_main

# every conversation: a question, then this reply (a calculator call, its result, text)
REPLY = [{"type": "tool", "text": "6*7"}, {"type": "output", "text": "42"}, {"type": "text", "text": " Hi!"}]
SHOWN = "[calc 6*7][= 42] Hi!\n"  # how chat.py streams it
GREEDY = ["--temperature", "0", "--max-new-tokens", "12"]


def sft_checkpoint(out: Path) -> Path:
    """sft.py on 60 conversations: a chat checkpoint whose greedy reply to a question is REPLY."""
    with open(out / "chat.jsonl", "w") as f:
        for i in range(60):
            messages = [{"role": "user", "content": f"{i % 10}+{i // 10}?"}, {"role": "assistant", "content": REPLY}]
            f.write(json.dumps({"messages": messages}) + "\n")
    sft_main([*TINY, "--data", str(out / "chat.jsonl"), "--batch-size", "2", "--total-batch-size", "128",
              "--max-steps", "40", "--eval-every", "0", "--max-lr", "1e-2", "--out-dir", str(out / "run"),
              "--lr-schedule", "cosine", "--min-lr-frac", "0.1"])  # the schedule this recipe was found with
    return out / "run" / "ckpt_000040.pt"


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    return sft_checkpoint(tmp_path_factory.mktemp("sft"))


def run(argv: list[str], stdin: str | io.StringIO, monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin) if isinstance(stdin, str) else stdin)
    return chat.main(argv)


def greedy(model: GPT, messages: list[dict], max_new_tokens: int = 12) -> list[int]:
    return generate(model, [cf.render_prompt(messages)], max_new_tokens, temperature=0.0, stop_ids=cf.REPLY_STOPS,
                    vocab=cf.CHAT_VOCAB, calculator=chat.calculator())[0].tokens


def test_a_prompt_gets_generate_pys_greedy_reply_streamed(sft, capsys, monkeypatch):
    system = {"role": "system", "content": "Be brief."}
    messages = run(["--ckpt", str(sft), "--prompt", "3+4?", "--system", "Be brief.", *GREEDY], "", monkeypatch)
    out, err = capsys.readouterr()
    expected = greedy(GPT.from_checkpoint(sft), [system, {"role": "user", "content": "3+4?"}])
    enc = get_tokenizer()
    assert expected == [cf.TOOL_START, *enc.encode("6*7"), cf.TOOL_END, cf.OUTPUT_START, *enc.encode("42"),
                        cf.OUTPUT_END, *enc.encode(" Hi!"), cf.ASSISTANT_END]
    assert (out, err) == (SHOWN, "")  # a chat checkpoint: no warning
    assert messages == [system, {"role": "user", "content": "3+4?"}, {"role": "assistant", "content": REPLY}]
    assert cf.parse(expected) == REPLY


def test_turns_clear_and_eof(sft, capsys, monkeypatch):
    model = GPT.from_checkpoint(sft)
    messages = run(["--ckpt", str(sft), *GREEDY], "1+2?\n\n8+9?\n", monkeypatch)
    out, err = capsys.readouterr()  # EOF after the second turn: a clean exit (main returns)
    first = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": cf.parse(greedy(model, [
        {"role": "user", "content": "1+2?"}]))}]
    second = cf.parse(greedy(model, [*first, {"role": "user", "content": "8+9?"}]))
    assert messages == [*first, {"role": "user", "content": "8+9?"}, {"role": "assistant", "content": second}]
    assert first[1]["content"] == REPLY and out.startswith("> " + SHOWN + "> > ") and out.endswith("> \n")
    assert out.count("> ") == 4 and err == "/clear starts a new conversation; Ctrl-D or Ctrl-C quits\n"
    messages = run(["--ckpt", str(sft), *GREEDY], "1+2?\n8+9?\n/clear\n5+5?\n", monkeypatch)
    assert messages == [{"role": "user", "content": "5+5?"}, {"role": "assistant", "content": REPLY}]
    assert capsys.readouterr().err.endswith("(a new conversation)\n")


def test_the_command_line_reads_stdin_and_exits_0_at_its_end(sft):
    proc = subprocess.run([sys.executable, "chat.py", "--ckpt", str(sft), *GREEDY], cwd=ROOT, input="1+2?\n",
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (0, "> " + SHOWN + "> \n")


def test_prompt_dash_reads_stdin_and_at_reads_a_file_as_sample_py_does(sft, tmp_path, capsys, monkeypatch):
    # `--prompt -` was the message "-" itself, answered without a word
    (tmp_path / "q.txt").write_text("3+4?\n")
    for prompt, stdin in (("-", "3+4?\n"), (f"@{tmp_path / 'q.txt'}", "")):
        messages = run(["--ckpt", str(sft), "--prompt", prompt, *GREEDY], stdin, monkeypatch)
        assert messages == [{"role": "user", "content": "3+4?"}, {"role": "assistant", "content": REPLY}]
    assert capsys.readouterr().out == SHOWN * 2
    assert one_line_error(capsys, chat.main, ["--ckpt", str(sft), "--prompt", f"@{tmp_path / 'no.txt'}"]) == (
        f"error: [Errno 2] No such file or directory: '{tmp_path / 'no.txt'}'")


class CtrlC(io.StringIO):
    def readline(self, *args) -> str:
        line = super().readline(*args)
        if not line:
            raise KeyboardInterrupt
        return line


def test_ctrl_c_exits_in_one_line(sft, capsys, monkeypatch):
    messages = run(["--ckpt", str(sft), *GREEDY], CtrlC("1+2?\n"), monkeypatch)
    assert len(messages) == 2 and capsys.readouterr().out == "> " + SHOWN + "> \n"


def test_the_oldest_turns_are_cropped_to_the_context(sft, capsys, monkeypatch):
    # block_size 64 and a reply's room of min(--max-new-tokens, 32) = 12: a prompt keeps at most 52 tokens
    messages = run(["--ckpt", str(sft), "--system", "Be brief.", *GREEDY], "1+2?\n3+4?\n5+6?\n7+8?\n", monkeypatch)
    system, first = messages[0], [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": REPLY}]
    assert [m["content"] for m in messages if m["role"] != "assistant"] == ["Be brief.", "3+4?", "5+6?", "7+8?"]
    assert capsys.readouterr().err.splitlines()[1:] == [
        "(the conversation outgrew the model's context of 64 tokens: its oldest 1 turn(s) dropped)"]
    assert len(cf.render_prompt(messages[:-1])) <= 52 < len(cf.render_prompt([system, *first, *messages[1:-1]]))
    with pytest.raises(SystemExit) as e:
        run(["--ckpt", str(sft), "--prompt", "one two three " * 20, *GREEDY], "", monkeypatch)
    assert str(e.value) == "error: the message takes 65 tokens, the model's context only 64; say less"
    with pytest.raises(SystemExit) as e:  # a long --system is counted: the line says so
        run(["--ckpt", str(sft), "--system", "one two three " * 20, "--prompt", "hi", *GREEDY], "", monkeypatch)
    assert str(e.value) == "error: the message takes 68 tokens with --system, the model's context only 64; say less"


def test_a_cut_or_an_empty_reply_is_said_on_stderr(capsys):
    # a reply cut at --max-new-tokens read as a whole one, and an empty one dropped the user's message without a word
    from conftest import bigram_model

    hi, cfg, cpu = get_tokenizer().encode_ordinary("hi")[0], chat.ChatConfig(temperature=0, max_new_tokens=3), "cpu"
    bot = chat.Chat(bigram_model({cf.ASSISTANT_START: hi, hi: hi}), cfg, torch.device(cpu))
    bot.reply("x")
    assert capsys.readouterr() == ("hihihi\n", "(the reply was cut at --max-new-tokens or the model's context)\n")
    bot = chat.Chat(bigram_model({cf.ASSISTANT_START: cf.ASSISTANT_END}), cfg, torch.device(cpu))
    bot.reply("x")
    assert bot.messages == [] and capsys.readouterr() == ("\n", "(no reply: your message is left out of the "
                                                          "conversation)\n")


def test_a_reply_ended_by_another_special_token_is_whole_and_not_printed(capsys):
    # <|endoftext|> ends a reply as <|assistant_end|> does (REPLY_STOPS): not a cut reply, and not shown as its text
    from conftest import bigram_model

    hi, cfg = get_tokenizer().encode_ordinary("hi")[0], chat.ChatConfig(temperature=0, max_new_tokens=3)
    # after <|endoftext|> the model says "hi" again: a decode that ran on past it would end "hi", a cut reply
    bot = chat.Chat(bigram_model({cf.ASSISTANT_START: hi, hi: cf.BOS, cf.BOS: hi}), cfg, torch.device("cpu"))
    bot.reply("x")
    assert capsys.readouterr() == ("hi\n", "") and bot.messages[-1]["content"] == [{"type": "text", "text": "hi"}]


def test_the_seed_and_top_k_decide_the_sampled_reply():
    # --seed's generator, not the global RNG, draws the tokens; --top-k 1 leaves one token to draw whatever the seed
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, n_layer=1, n_head=1, n_embd=16)).eval()
    replies = []
    for seed, top_k, global_seed in ((5, None, 0), (5, None, 1), (5, 1, 0), (6, 1, 1)):
        torch.manual_seed(global_seed)
        bot = chat.Chat(model, chat.ChatConfig(temperature=1.0, top_k=top_k, seed=seed, max_new_tokens=2),
                        torch.device("cpu"))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            bot.reply("x")
        replies.append(bot.messages)
    assert replies[0] == replies[1] != replies[2] == replies[3]


def test_fit_keeps_room_for_the_reply_and_refuses_a_message_that_fills_the_context():
    # the prompt keeps at most block_size - min(--max-new-tokens, block_size // 2) tokens; Chat.fit reads only the
    # model's block_size
    turn = [{"role": "user", "content": "1+2?"}, {"role": "assistant", "content": "3"}]
    msgs = [*turn, *turn, {"role": "user", "content": "5+6?"}]
    n, last = len(cf.render_prompt(msgs)), len(cf.render_prompt(msgs[-1:]))
    model = types.SimpleNamespace(config=types.SimpleNamespace(block_size=0))

    def fit(block_size: int, max_new_tokens: int, messages: list[dict]) -> list[dict]:
        model.config.block_size = block_size
        with contextlib.redirect_stderr(io.StringIO()):
            return chat.Chat(model, chat.ChatConfig(max_new_tokens=max_new_tokens), torch.device("cpu")).fit(
                messages)[0]

    assert fit(n + 12, 12, msgs) == msgs  # exactly the room: nothing dropped
    assert fit(n + 11, 12, msgs) == msgs[2:]  # a token short: the oldest turn goes
    assert fit(2 * n, 256, msgs) == msgs  # a --max-new-tokens past the context leaves half of it for the reply
    assert fit(last + 1, 12, msgs) == msgs[-1:]  # one token of room: the message alone, still answered
    with pytest.raises(ValueError, match=f"^the message takes {last} tokens, the model's context only {last}; say"):
        fit(last, 12, msgs)  # no room at all: refused


def test_a_base_model_is_warned_about_and_an_hf_gpt2_padded(sft, hf_dir, tmp_path, capsys, monkeypatch):
    torch.manual_seed(0)
    base = GPT(MODEL_PRESETS["tiny"]())
    torch.save({"model": base.state_dict(), "model_config": base.config.__dict__,
                "train_config": {"data_kind": "tokens"}}, ckpt := tmp_path / "base.pt")
    for flag, source in (("--ckpt", ckpt), ("--init-from", hf_dir)):
        messages = run([flag, str(source), "--prompt", "hello", "--max-new-tokens", "3", "--seed", "1"], "",
                       monkeypatch)
        assert capsys.readouterr().err == (
            f"warning: {source} was never fine-tuned on conversations (sft.py), so it does not "
            "know the chat format: its replies may be gibberish\n(the reply was cut at --max-new-tokens or the "
            "model's context)\n")
        assert messages[0] == {"role": "user", "content": "hello"}
    model, fine_tuned = chat.load_model(chat.ChatConfig(init_from=str(hf_dir)))
    assert (model.config.vocab_size, fine_tuned) == (50304, False)
    assert chat.load_model(chat.ChatConfig(ckpt=str(sft)))[1]


def test_an_hf_chat_export_is_not_warned_about_and_replies_as_its_checkpoint(sft, tmp_path, capsys, monkeypatch):
    export_main(["--ckpt", str(sft), "--export-hf", str(tmp_path / "hf")])
    capsys.readouterr()
    messages = run(["--init-from", str(tmp_path / "hf"), "--prompt", "3+4?", *GREEDY], "", monkeypatch)
    assert capsys.readouterr() == (SHOWN, "") and messages[-1] == {"role": "assistant", "content": REPLY}


def test_a_reward_model_is_refused_where_a_model_writes_or_is_scored(tmp_path):
    # its trunk and logits were trained to score replies (value head), not to write them: chat, sample, hellaswag,
    # core and tasks.py --eval all load through GPT.load, which read it as a language model without a word
    model = GPT(GPTConfig(block_size=16, vocab_size=96, n_layer=1, n_head=2, n_embd=16, value_head=True))
    ckpt = tmp_path / "rm.pt"
    torch.save({"model": model.state_dict(), "model_config": model.config.__dict__,
                "train_config": {"objective": "reward"}, "chat": True}, ckpt)
    with pytest.raises(ValueError, match=f"^{ckpt} is a reward model \\(prefs.py --objective reward\\): it scores"):
        GPT.load(str(ckpt), None)
    # and where a stage starts from it: SFT and DPO (policy and reference) would train its logits as a policy's
    # (both refuse --value-head true itself: a head they never train); only a reward model's own stage starts from one
    for config in (SFTConfig, functools.partial(prefs.PrefsConfig, objective="dpo")):
        with pytest.raises(ValueError, match=f"^--init-from {ckpt} is a reward model \\(prefs.py --objective"):
            stage.load_init(config(init_from=str(ckpt), seq_len=16))
    assert stage.load_init(prefs.PrefsConfig(objective="reward", init_from=str(ckpt), seq_len=16)).config.value_head
    proc = subprocess.run([sys.executable, "chat.py", "--ckpt", str(ckpt), "--prompt", "hi"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == (f"error: {ckpt} is a reward model (prefs.py --objective reward): it scores replies, and its "
                           "logits were never trained to write them; load a policy, or score with it in rl.py "
                           "--reward-model\n")


def test_a_bad_flag_or_model_is_one_line(capsys):
    for args, message in (
            (["--temprature", "0"], "error: unknown option --temprature; did you mean --temperature?"),
            (["--temperature", "-1"], "error: temperature must be >= 0 (0 is greedy), got -1.0"),
            (["--max-new-tokens", "0"], "error: --max-new-tokens must be >= 1, got 0"),
            (["--seed", str(2**64)], f"error: --seed must be in [0, 2**64), got {2**64}"),
            (["--ckpt", "missing.pt"], "error: checkpoint missing.pt does not exist; pass a .pt file that train.py, "
                                       "sft.py, prefs.py or rl.py wrote (e.g. out/<run>/ckpt_000100.pt)")):
        assert one_line_error(capsys, chat.main, args) == message
    # as a script: exit 1 and that line alone (one interpreter: each costs ~1.5 s of the suite)
    proc = subprocess.run([sys.executable, "chat.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", message + "\n")


def test_a_corrupt_tokenizer_config_of_an_hf_export_is_named(sft, tmp_path):
    export_main(["--ckpt", str(sft), "--export-hf", str(hf := tmp_path / "hf")])
    (hf / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match=f"^{hf / 'tokenizer_config.json'} is not a JSON file"):
        chat.load_model(chat.ChatConfig(init_from=str(hf)))
