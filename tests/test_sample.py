"""sample.py: end to end from a checkpoint and an HF directory, seeds, KV cache vs none, prompts, streaming, errors."""

import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sample as sample_py
from common import EOT, _field_help, get_tokenizer
from generate import sample
from model import GPT, MODEL_PRESETS
from sample import SampleConfig, generate_text, main, read_prompt

ROOT = Path(__file__).resolve().parents[1]
SPEED = re.compile(r"^(\d+) tokens in ([\d.]+) s \(([\d.]+) tok/s\)$", re.M)
SEP = "\n---------------\n"
BREAK = "\n--- end of document ---\n"


@pytest.fixture(scope="module")
def enc():
    return get_tokenizer()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(MODEL_PRESETS["tiny"]()).eval()  # block_size 64


@pytest.fixture(scope="module")
def ckpt(model, tmp_path_factory):
    """A checkpoint in train.py's format."""
    path = tmp_path_factory.mktemp("ckpt") / "ckpt_000000.pt"
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config), "step": 0}, path)
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "sample.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


# ----------------------------------------------------------------------------------------------------------------------
# end to end


def test_main_from_checkpoint_streams_samples_and_speed(ckpt, capsys):
    texts = main(["--ckpt", str(ckpt), "--prompt", "Hello", "--num-samples", "2", "--max-new-tokens", "5",
                  "--device", "cpu"])
    out, err = capsys.readouterr()
    assert len(texts) == 2 and all(texts)
    assert out == "Hello" + texts[0] + SEP + "Hello" + texts[1] + SEP
    n, seconds, rate = SPEED.search(err).groups()
    assert int(n) == 10
    # the rate is n over the unrounded time; the printed time is rounded to 0.01 s
    assert 10 / (float(seconds) + 0.005) - 0.05 <= float(rate) <= 10 / max(float(seconds) - 0.005, 1e-3) + 0.05


def test_checkpoint_and_hf_dir_agree_with_generate(model, ckpt, hf_dir, enc, capsys):
    """Greedy text from main() equals model.generate on the same weights, for both ways of loading."""
    prompt = "The cat sat on"
    idx = torch.tensor([enc.encode(prompt)])
    hf_model = GPT.from_pretrained(str(hf_dir))
    for flag, weights, ref_model, extra in (("--ckpt", ckpt, model, []),
                                            ("--init-from", hf_dir, hf_model, ["--no-cache"])):
        (text,) = main([flag, str(weights), "--prompt", prompt, "--num-samples", "1", "--max-new-tokens", "12",
                        "--temperature", "0", "--device", "cpu", *extra])
        expected = sample(ref_model, idx, 12, temperature=0.0)[0, idx.size(1):].tolist()
        assert text == enc.decode(expected)
    assert SPEED.search(capsys.readouterr().err).group(1) == "12"


def test_a_chat_model_gets_a_note_pointing_to_chat_py_and_the_same_text(ckpt, hf_dir, tmp_path, capsys):
    # its prompt is continued as raw text, not wrapped in the chat format's turns: chat.py is the way to talk to it
    torch.save({**torch.load(ckpt), "chat": True}, chat := tmp_path / "chat.pt")
    shutil.copytree(hf_dir, export := tmp_path / "hf")
    (export / "tokenizer_config.json").write_text(json.dumps({"chat_template": "<|assistant_start|>..."}))
    args = ["--prompt", "Hi", "--num-samples", "1", "--max-new-tokens", "3", "--device", "cpu"]
    for flag, plain, chatty in (("--ckpt", ckpt, chat), ("--init-from", hf_dir, export)):
        assert main([flag, str(plain), *args]) == main([flag, str(chatty), *args])
        out, err = capsys.readouterr()
        assert out[:len(out) // 2] == out[len(out) // 2:]
        assert [line for line in err.splitlines() if not SPEED.match(line)] == [
            f"note: {chatty} is a chat model (fine-tuned on conversations): sample.py continues the prompt as raw "
            "text; chat.py sends it as a user message and streams the reply"]


def test_cli_subprocess_exit_codes(hf_dir, tmp_path):
    ok = run_cli("--init-from", str(hf_dir), "--num-samples", "1", "--max-new-tokens", "4", "--device", "cpu")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("Hello, I'm a language model,") and ok.stdout.endswith(SEP)
    assert SPEED.search(ok.stderr).group(1) == "4"
    bad = run_cli("--ckpt", str(tmp_path / "missing.pt"))
    assert bad.returncode == 1
    assert bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith(f"error: checkpoint {tmp_path / 'missing.pt'} does")
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    text = run_cli("--ckpt", str(tmp_path / "notes.txt"))  # was a traceback ending in KeyError
    assert (text.returncode, text.stdout) == (1, "")
    assert text.stderr.count("\n") == 1 and text.stderr.startswith(f"error: {tmp_path / 'notes.txt'} is not a PyTorch")


# ----------------------------------------------------------------------------------------------------------------------
# determinism and the KV cache


def test_same_seed_same_text_other_seed_other_text(model, enc, capsys):
    cfg = SampleConfig(prompt="Once upon a time", num_samples=2, max_new_tokens=16, temperature=1.0, top_k=None)
    first = generate_text(model, enc, cfg, "cpu")
    again = generate_text(model, enc, cfg, "cpu")
    other = generate_text(model, enc, dataclasses.replace(cfg, seed=cfg.seed + 1), "cpu")
    assert first == again
    assert first[0] != first[1]  # the samples continue one generator: they differ from each other
    assert first != other


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.0, None, None), (0.9, 50, 0.9)])
def test_cache_and_no_cache_give_identical_text(model, enc, capsys, monkeypatch, temperature, top_k, top_p):
    # 80 new tokens after an 8-token prompt overflow the 64-token window: the cache is refilled from the crop
    import generate

    cfg = SampleConfig(prompt="Hello, I'm a language model,", num_samples=1, max_new_tokens=80,
                       temperature=temperature, top_k=top_k, top_p=top_p)
    forwards, real = [], generate.last_logits  # each forward's (tokens fed, cache given): the two paths really differ
    monkeypatch.setattr(generate, "last_logits", lambda m, idx, cache: forwards.append((idx.size(1), cache is not None))
                        or real(m, idx, cache))
    cached = generate_text(model, enc, cfg, "cpu")
    fed, forwards[:] = forwards[:], []
    uncached = generate_text(model, enc, dataclasses.replace(cfg, no_cache=True), "cpu")
    assert cached == uncached
    assert forwards == [(min(8 + i, 64), False) for i in range(80)]  # the whole (cropped) context each token
    # one token a step until the window is full, then each step refills the cache from the cropped window
    assert fed == [(8, True), *[(1, True)] * 56, *[(64, True)] * 23]
    assert SPEED.findall(capsys.readouterr().err)[0][0] == "80"


def test_sampling_options_reach_the_model(model, enc, monkeypatch, capsys):
    # top_k = 1, or a nucleus smaller than the top token's probability, at temperature 1 is greedy decoding: if either
    # option were dropped on its way to sample_stream the text would be a random sample instead
    base = SampleConfig(prompt="Once upon a time", num_samples=1, max_new_tokens=12, temperature=0.0, top_k=None)
    (greedy,) = generate_text(model, enc, base, "cpu")
    for opts in (dict(top_k=1), dict(top_p=1e-9)):
        assert generate_text(model, enc, dataclasses.replace(base, temperature=1.0, **opts), "cpu") == [greedy], opts
    # --no-cache reaches sample_stream (a spy that runs the real one: the text cannot tell the two apart)
    seen = []
    stream = sample_py.sample_stream
    monkeypatch.setattr(sample_py, "sample_stream", lambda *a, **kw: seen.append(kw["use_cache"]) or stream(*a, **kw))
    for no_cache in (False, True):
        assert generate_text(model, enc, dataclasses.replace(base, no_cache=no_cache), "cpu") == [greedy]
    assert seen == [True, False]


def test_empty_prompt_starts_a_document_and_special_tokens_are_tokens(model, enc, capsys):
    # "" continues <|endoftext|> (a new document), and "<|endoftext|>" in a prompt is that token, not its 13 characters
    for prompt, tokens in (("", [EOT]), ("Hi.<|endoftext|>The", [*enc.encode("Hi."), EOT, *enc.encode("The")])):
        cfg = SampleConfig(prompt=prompt, num_samples=1, max_new_tokens=6, temperature=0.0)
        (text,) = generate_text(model, enc, cfg, "cpu")
        expected = sample(model, torch.tensor([tokens]), 6, temperature=0.0)[0, len(tokens):].tolist()
        assert text == enc.decode(expected), prompt


class ScriptedModel:
    """Stands in for a GPT: emits fixed tokens, so the streamed text can be checked byte for byte."""

    def __init__(self, tokens: list[int], block_size: int = 64):
        self.tokens = tokens
        self.config = MODEL_PRESETS["tiny"]()
        assert self.config.block_size == block_size


@pytest.fixture
def scripted(monkeypatch):
    """sample.py's decoding loop, for a ScriptedModel, yields its tokens instead."""
    real = sample_py.sample_stream

    def stream(model, idx, max_new_tokens, **kw):
        if not isinstance(model, ScriptedModel):
            return real(model, idx, max_new_tokens, **kw)
        return (torch.tensor([[t]]) for t in model.tokens[:max_new_tokens])

    monkeypatch.setattr(sample_py, "sample_stream", stream)


def test_streaming_joins_utf8_split_across_tokens(enc, scripted):
    text = " naïve 日本語 über 🙂"
    tokens = enc.encode(text)
    pieces = [enc.decode_single_token_bytes(t) for t in tokens]
    broken = [p for p in pieces if not _is_utf8(p)]
    assert len(broken) >= 2  # the test is only meaningful if some tokens hold part of a character
    out = io.StringIO()
    cfg = SampleConfig(prompt="A", num_samples=1, max_new_tokens=len(tokens))
    (result,) = generate_text(ScriptedModel(tokens), enc, cfg, "cpu", out=out)
    assert result == text
    assert out.getvalue() == "A" + text + SEP
    assert "\ufffd" not in out.getvalue()


def test_a_sample_that_ends_inside_a_character_ends_in_a_replacement_character(enc, scripted):
    """The bytes of a character that the last token leaves unfinished are not dropped: the decoder's final flush
    turns them into U+FFFD, as tiktoken's decode of the same tokens does."""
    text = " 日本語"
    tokens = enc.encode(text)
    cut = next(i for i in range(1, len(tokens) + 1) if not _is_utf8(b"".join(map(enc.decode_single_token_bytes,
                                                                                   tokens[:i]))))
    out = io.StringIO()
    cfg = SampleConfig(prompt="A", num_samples=1, max_new_tokens=cut)
    (result,) = generate_text(ScriptedModel(tokens), enc, cfg, "cpu", out=out)
    assert result == enc.decode(tokens[:cut]) and result.endswith("\ufffd")
    assert out.getvalue() == "A" + result + SEP


def test_a_document_end_is_a_visible_break_and_stop_at_eot_ends_the_sample_there(enc, capsys, scripted):
    first, second = enc.encode("return x\n"), enc.encode("def f")
    model = ScriptedModel([*first, EOT, *second, EOT, *first])
    cfg = SampleConfig(prompt="A", num_samples=1, max_new_tokens=40)
    out = io.StringIO()
    texts = generate_text(model, enc, cfg, "cpu", out=out)
    assert out.getvalue() == "A" + "return x\n" + BREAK + "def f" + BREAK + "return x\n" + SEP
    assert texts == ["return x\n<|endoftext|>def f<|endoftext|>return x\n"]  # the text itself, for --corpus
    out = io.StringIO()
    texts = generate_text(model, enc, dataclasses.replace(cfg, num_samples=2, stop_at_eot=True), "cpu", out=out)
    assert out.getvalue() == ("A" + "return x\n" + BREAK + SEP) * 2
    assert texts == ["return x\n<|endoftext|>"] * 2
    assert SPEED.findall(capsys.readouterr().err)[-1][0] == str(2 * (len(first) + 1))


def test_help_describes_every_option_and_names_the_demo_checkpoint(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    helps = _field_help(SampleConfig)
    assert [f.name for f in dataclasses.fields(SampleConfig) if helps.get(f.name)] == \
        [f.name for f in dataclasses.fields(SampleConfig)]
    assert all(f"--{name.replace('_', '-')}" in out and text in out for name, text in helps.items())
    steps = re.search(r'steps="\$\{DEMO_STEPS:-(\d+)\}"', (ROOT / "demo.sh").read_text())[1]
    assert re.findall(r"out/demo/ckpt_\d+\.pt", out) == [f"out/demo/ckpt_{int(steps):06d}.pt"]


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


# ----------------------------------------------------------------------------------------------------------------------
# prompts


def test_prompt_from_file_and_stdin_equal_literal(ckpt, tmp_path, monkeypatch, capsys):
    prompt = "Roses are red,\nviolets are"
    common = ["--ckpt", str(ckpt), "--num-samples", "1", "--max-new-tokens", "6", "--temperature", "0",
              "--device", "cpu"]
    literal = main([*common, "--prompt", prompt])
    (tmp_path / "prompt.txt").write_text(prompt)
    from_file = main([*common, "--prompt", f"@{tmp_path / 'prompt.txt'}"])
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompt))
    from_stdin = main([*common, "--prompt", "-"])
    assert literal == from_file == from_stdin
    assert capsys.readouterr().out.count(prompt) == 3
    with pytest.raises(SystemExit, match=r"^error: \[Errno 2\] No such file or directory: '.*nope.txt'$"):
        main([*common, "--prompt", f"@{tmp_path / 'nope.txt'}"])
    # only a leading @ names a file, and only a lone - is stdin: other prompts are the text itself
    for text in ("mail me at a@b.c", " @notes.txt", "-", "--", "- a list", ""):
        assert read_prompt(text, stdin=io.StringIO("from stdin")) == ("from stdin" if text == "-" else text)


def test_prompt_file_errors_say_what_is_wrong(ckpt, tmp_path):
    common = ["--ckpt", str(ckpt), "--num-samples", "1", "--max-new-tokens", "1", "--device", "cpu"]
    with pytest.raises(SystemExit) as e:
        main([*common, "--prompt", f"@{tmp_path}"])
    assert str(e.value) == f"error: [Errno 21] Is a directory: '{tmp_path}'"
    with pytest.raises(SystemExit) as e:
        main([*common, "--prompt", "@"])  # names no file: the current directory
    assert str(e.value) == "error: [Errno 21] Is a directory: '.'"
    (tmp_path / "latin1.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(SystemExit) as e:
        main([*common, "--prompt", f"@{tmp_path / 'latin1.txt'}"])
    assert str(e.value) == (f"error: prompt file {tmp_path / 'latin1.txt'} is not UTF-8 text (unexpected end of "
                            "data at byte 3); save it as UTF-8")


def test_long_prompt_is_cropped_with_notice(model, enc, capsys):
    prompt = "".join(f" w{i}" for i in range(50))  # 100 tokens: " w" and the number
    assert len(enc.encode(prompt)) == 100
    cfg = SampleConfig(prompt=prompt, num_samples=1, max_new_tokens=3, temperature=0.0)
    (text,) = generate_text(model, enc, cfg, "cpu")
    out, err = capsys.readouterr()
    assert "notice: the prompt has 100 tokens, more than block_size - 1 = 63; keeping the last 63" in err
    kept = enc.encode(prompt)[-63:]
    assert out.startswith(enc.decode(kept)) and not out.startswith(prompt)
    expected = sample(model, torch.tensor([kept]), 3, temperature=0.0)[0, 63:].tolist()
    assert text == enc.decode(expected)


def test_cropped_prompt_starts_at_a_whole_character(model, enc, capsys):
    prompt = " 𝔘𝔫𝔦𝔠𝔬𝔡𝔢" * 12  # 4-byte characters, each split over 2-3 tokens
    tokens = enc.encode(prompt)
    assert len(tokens) == 264 and enc.decode(tokens[-63:])[0] == "\ufffd"  # cropping to 63 cuts a character
    cfg = SampleConfig(prompt=prompt, num_samples=1, max_new_tokens=3, temperature=0.0)
    (text,) = generate_text(model, enc, cfg, "cpu")
    out, err = capsys.readouterr()
    assert ("notice: the prompt has 264 tokens, more than block_size - 1 = 63; keeping the last 62 (from the first "
            "whole character)") in err
    kept = tokens[-62:]  # one token less: the one holding the last byte of the cut character
    shown = enc.decode(kept)
    assert shown == "𝔫𝔦𝔠𝔬𝔡𝔢" + " 𝔘𝔫𝔦𝔠𝔬𝔡𝔢" * 2 and out.startswith(shown)
    # the model continues exactly the text shown
    expected = sample(model, torch.tensor([kept]), 3, temperature=0.0)[0, 62:].tolist()
    assert text == enc.decode(expected)


def test_cropped_prompt_drops_every_leading_continuation_token(model, enc, capsys):
    # " ab." shifts the cut so that the last 63 tokens start with two tokens of continuation bytes (94, ab: the tail
    # of a 4-byte character split f09d | 94 | ab): both must go, not just the first
    prompt = " 𝔘𝔫𝔦𝔠𝔬𝔡𝔢" * 12 + " ab."
    tokens = enc.encode(prompt)
    assert [enc.decode_single_token_bytes(t).hex() for t in tokens[-63:-60]] == ["94", "ab", "f09d"]
    cfg = SampleConfig(prompt=prompt, num_samples=1, max_new_tokens=3, temperature=0.0)
    (text,) = generate_text(model, enc, cfg, "cpu")
    out, err = capsys.readouterr()
    assert "keeping the last 61 (from the first whole character)" in err
    kept = tokens[-61:]
    assert out.startswith(enc.decode(kept)) and "\ufffd" not in enc.decode(kept)
    expected = sample(model, torch.tensor([kept]), 3, temperature=0.0)[0, 61:].tolist()
    assert text == enc.decode(expected)


# ----------------------------------------------------------------------------------------------------------------------
# errors


def test_model_errors_are_one_line(model, ckpt, tmp_path):
    other = tmp_path / "other_arch.pt"
    config = {**dataclasses.asdict(model.config), "n_experts": 8}
    torch.save({"model": model.state_dict(), "model_config": config, "step": 0}, other)
    with pytest.raises(SystemExit, match=r"^error: checkpoint .*other_arch.pt: its model_config does not match this "
                                         r"GPTConfig"):
        main(["--ckpt", str(other)])
    with pytest.raises(SystemExit, match=r"^error: pass either --ckpt or --init-from, not both"):
        main(["--ckpt", str(ckpt), "--init-from", "gpt2"])
    with pytest.raises(SystemExit, match=r"^error: no model given: pass --ckpt PATH .* or --init-from gpt2"):
        main([])
    with pytest.raises(SystemExit, match=r"^error: top_p must be in \(0, 1\] or None, got 1.5"):
        main(["--ckpt", str(ckpt), "--top-p", "1.5"])


@pytest.mark.parametrize("flag, value, message", [
    ("--temperature", "-0.5", "temperature must be >= 0 (0 is greedy), got -0.5"),
    ("--top-k", "0", "top_k must be >= 1 or None, got 0"),
    ("--top-p", "0", "top_p must be in (0, 1] or None, got 0.0"),
    ("--temperature", "nan", "temperature must be >= 0 (0 is greedy), got nan"),
    ("--top-p", "nan", "top_p must be in (0, 1] or None, got nan"),
    ("--seed", str(2**64), f"--seed must be in [0, 2**64), got {2**64}"),  # torch.Generator's range, not a traceback
])
def test_sampling_settings_are_checked_before_loading(flag, value, message):
    # one line naming the flag, before any model is loaded (none is given here)
    with pytest.raises(SystemExit) as e:
        main([flag, value])
    assert str(e.value) == "error: " + message


@pytest.fixture
def bad_inputs(model, ckpt, hf_dir, tmp_path) -> Path:
    """Things passed to --ckpt / --init-from by mistake, in tmp_path."""
    (tmp_path / "notes.txt").write_text("step 100: loss 3.2\nstep 200: loss 3.0\n")
    (tmp_path / "random.bin").write_bytes(bytes(range(7, 256)) * 4)
    (tmp_path / "empty_dir").mkdir()
    run = tmp_path / "run"
    run.mkdir()
    for step in (2, 10):
        (run / f"ckpt_{step:06d}.pt").write_bytes(ckpt.read_bytes())
    config = {**dataclasses.asdict(model.config), "n_embd": 32}  # the weights are 64 wide
    torch.save({"model": model.state_dict(), "model_config": config, "step": 0}, tmp_path / "mismatch.pt")
    return tmp_path


@pytest.mark.parametrize("args, message", [
    (["--ckpt", "notes.txt"], "notes.txt is not a PyTorch checkpoint (it starts with b'step 100', not the zip "
                              "archive torch.save writes); pass a .pt file that train.py, sft.py, prefs.py or "
                              "rl.py wrote (e.g. out/<run>/ckpt_000100.pt)"),
    (["--ckpt", "random.bin"], "random.bin is not a PyTorch checkpoint (it starts with b'\\x07\\x08\\t\\n\\x0b\\x0c\\r"
                               "\\x0e', not the zip archive torch.save writes); pass a .pt file that train.py, "
                               "sft.py, prefs.py or rl.py wrote (e.g. out/<run>/ckpt_000100.pt)"),
    (["--ckpt", "run"], "checkpoint run is a directory, not a file; pass a checkpoint file in it (the latest is "
                        "run/ckpt_000010.pt)"),
    (["--ckpt", "empty_dir"], "checkpoint empty_dir is a directory, not a file; pass a .pt file that train.py, sft.py, "
                              "prefs.py or rl.py wrote "
                              "(e.g. out/<run>/ckpt_000100.pt); an HF GPT-2 directory (config.json + "
                              "model.safetensors) loads with --init-from instead"),
    (["--ckpt", "{hf}"], "checkpoint {hf} is a directory, not a file; it has a config.json, so it looks like an HF "
                         "GPT-2 directory: load it with --init-from {hf} where the script has one; export.py "
                         "and rl.py take a checkpoint of this project (sft.py --init-from it first)"),
    (["--init-from", "run/ckpt_000002.pt"], "--init-from run/ckpt_000002.pt is a file; for a checkpoint train.py "
                                            "wrote, use --ckpt run/ckpt_000002.pt"),
    (["--init-from", "run/nope.pt"], "--init-from run/nope.pt: no such file or directory (nor a hub name)"),
    (["--init-from", "./nope_dir"], "--init-from ./nope_dir: no such file or directory (nor a hub name)"),
    (["--init-from", "empty_dir"], "--init-from empty_dir has no config.json, so it is not a local HF GPT-2 "
                                   "directory (config.json + model.safetensors)"),
    (["--init-from", "run"], "--init-from run has no config.json, so it is not a local HF GPT-2 directory "
                             "(config.json + model.safetensors); it holds train.py checkpoints: pass --ckpt "
                             "run/ckpt_000010.pt"),
])
def test_wrong_model_paths_say_what_they_are_and_what_to_pass(bad_inputs, hf_dir, monkeypatch, args, message):
    monkeypatch.chdir(bad_inputs)  # the paths as a user types them, relative to the working directory
    flag, value = args
    with pytest.raises(SystemExit) as e:
        main([flag, value.format(hf=hf_dir), "--device", "cpu"])
    assert str(e.value) == "error: " + message.format(hf=hf_dir)


def test_weights_that_do_not_fit_their_config_are_summarized(bad_inputs):
    with pytest.raises(SystemExit) as e:
        main(["--ckpt", str(bad_inputs / "mismatch.pt"), "--device", "cpu"])
    # every one of the 29 tensors has the wrong shape: the two first are named, the rest counted
    assert str(e.value) == (
        f"error: checkpoint {bad_inputs / 'mismatch.pt'}: the weights do not fit its model_config: 29 tensors do not "
        "fit (transformer.wte.weight is (50304, 64), the config makes it (50304, 32); transformer.h.0.ln_1.weight is "
        "(64,), the config makes it (32,); and 27 more); pass a checkpoint as train.py wrote it")


def test_damaged_and_foreign_checkpoints(model, ckpt, tmp_path):
    truncated = tmp_path / "truncated.pt"
    data = ckpt.read_bytes()
    truncated.write_bytes(data[:len(data) // 2])
    with pytest.raises(SystemExit) as e:
        main(["--ckpt", str(truncated)])
    assert str(e.value) == (f"error: checkpoint {truncated} is corrupt or truncated (RuntimeError: "
                            "PytorchStreamReader failed reading zip archive: failed finding central directory); pass "
                            "an intact copy, or an earlier checkpoint of the run")
    truncated.write_bytes(data[:5000])  # torch fails differently here: OSError, which used to lose the path
    with pytest.raises(SystemExit, match=rf"^error: checkpoint {re.escape(str(truncated))} is corrupt or truncated "
                                         r"\(OSError: \[Errno 22\] Invalid argument\); pass an intact copy"):
        main(["--ckpt", str(truncated)])
    bare = tmp_path / "state_dict.pt"
    torch.save(model.state_dict(), bare)  # the weights alone, without model_config
    with pytest.raises(SystemExit) as e:
        main(["--ckpt", str(bare)])
    assert str(e.value) == (f"error: {bare} is not a checkpoint of this project (expected keys 'model' and "
                            "'model_config', got keys 'transformer.wte.weight', 'transformer.h.0.ln_1.weight', "
                            "'transformer.h.0.ln_1.bias', 'transformer.h.0.attn.c_attn.weight'); pass a .pt file "
                            "that train.py, sft.py, prefs.py or rl.py wrote (e.g. out/<run>/ckpt_000100.pt)")
    # torch.save(..., _use_new_zipfile_serialization=False)'s format, which no train.py run writes, is refused
    legacy = tmp_path / "legacy.pt"
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config)}, legacy,
               _use_new_zipfile_serialization=False)
    with pytest.raises(SystemExit, match=rf"^error: {re.escape(str(legacy))} is not a PyTorch checkpoint \(it starts "):
        main(["--ckpt", str(legacy)])


LLAMA_FLAGS = ["--pos=rope", "--mlp=swiglu", "--n-kv-head=2", "--norm=rmsnorm", "--bias=false"]  # llama-124m's choices


@pytest.mark.parametrize("arch", [[], LLAMA_FLAGS])
def test_sample_and_hellaswag_from_a_checkpoint_train_py_wrote(token_data, tmp_path, capsys, arch):
    import hellaswag
    import train

    train.main(["--preset", "tiny", "--data", str(token_data), "--out-dir", str(tmp_path), "--max-steps=2",
                "--eval-every=0", *arch])
    ckpt = tmp_path / "ckpt_000002.pt"
    assert GPT.from_checkpoint(ckpt).config.norm == ("rmsnorm" if arch else "layernorm")
    capsys.readouterr()
    texts = main(["--ckpt", str(ckpt), "--temperature", "0", "--num-samples", "1", "--max-new-tokens", "6"])
    trained = GPT.from_checkpoint(ckpt)
    enc = get_tokenizer()
    prompt = enc.encode(SampleConfig().prompt)
    expected = sample(trained, torch.tensor([prompt]), 6, temperature=0.0)[0, len(prompt):].tolist()
    assert texts == [enc.decode(expected)]
    result = hellaswag.main(["--ckpt", str(ckpt), "--data", str(ROOT / "tests/data/hellaswag_tiny.jsonl")])
    assert result["n"] == len(hellaswag.load_examples(ROOT / "tests/data/hellaswag_tiny.jsonl"))
    assert "acc_norm" in capsys.readouterr().out


@pytest.mark.parametrize("script, args", [
    ("sample", ["--device", "cpu"]),  # failed in torch.multinomial
    ("sample", ["--device", "cpu", "--temperature", "0"]),  # printed "!!!!": the argmax of NaN logits is token 0
    ("hellaswag", ["--device", "cpu", "--data", str(ROOT / "tests/data/hellaswag_tiny.jsonl")]),  # scored as chance
    ("export", ["--export-hf", "{tmp}/hf"]),  # wrote the NaNs
])
def test_nonfinite_weights_and_a_checkpoint_set_aside_as_diverged_are_refused(model, tmp_path, script, args):
    import export
    import hellaswag

    config = dataclasses.asdict(model.config)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    weights["transformer.h.1.attn.c_proj.weight"][3, 5] = float("nan")
    weights["transformer.ln_f.bias"][0] = float("-inf")
    torch.save({"model": weights, "model_config": config}, bad := tmp_path / "bad.pt")
    # a NaN stop's checkpoint can hold finite weights (huge ones, whose loss was not): its name is what tells
    torch.save({"model": model.state_dict(), "model_config": config}, aside := tmp_path / "ckpt_000008.pt.diverged")
    run = {"sample": main, "hellaswag": hellaswag.main, "export": export.main}[script]
    for path, message in (
            (bad, f"checkpoint {bad} holds non-finite weights (NaN or inf in 2 of 29 tensors, the first "
                  "transformer.h.1.attn.c_proj.weight), as a run that diverged leaves them; use an earlier checkpoint "
                  "of the run"),
            (aside, f"checkpoint {aside} is the one a NaN stop set aside: its weights gave a NaN or inf loss or "
                    "gradient norm in training; use the checkpoint before it (--resume auto takes that one)")):
        with pytest.raises(SystemExit) as e:
            run(["--ckpt", str(path), *(a.format(tmp=tmp_path) for a in args)])
        assert str(e.value) == "error: " + message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.pt", "ckpt_000008.pt.diverged"]


@pytest.mark.parametrize("cast, dtype", [(lambda m: m.to(torch.bfloat16), torch.bfloat16),
                                         (lambda m: m.half().float(), torch.float32)])
def test_casting_the_model_keeps_the_fp32_rope_tables(cast, dtype):
    # sample.py casts to bf16 on CUDA; the RoPE tables must stay the fp32 ones training used (autocast leaves buffers
    # alone), bit for bit, not a round trip through bf16 or fp16
    torch.manual_seed(0)
    cfg = dataclasses.replace(MODEL_PRESETS["tiny"](), pos="rope", block_size=64, vocab_size=96)
    model = GPT(cfg).eval()
    cos, sin = model.rope_cos.clone(), model.rope_sin.clone()
    assert not torch.equal(cos.bfloat16().float(), cos)  # so a round trip would show
    cast(model)
    assert model.lm_head.weight.dtype == model.transformer.h[0].attn.c_attn.weight.dtype == dtype
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)
    out = sample(model, torch.randint(0, 96, (1, 5)), 8, temperature=0.0)  # bf16 queries rotated by fp32 tables
    assert out.shape == (1, 13)


def test_corpus_check_counts_known_words_and_blank_lines(ckpt, enc, tmp_path, capsys, monkeypatch):
    from fineweb import write_shard
    from sample import corpus_check, corpus_words

    corpus = "def read_file(path):\n    return open(path).read()\n"
    write_shard(tmp_path / "c_val_000000.bin", enc.encode_ordinary("unused words"))
    write_shard(tmp_path / "c_train_000001.bin", [EOT] + enc.encode_ordinary(corpus))
    seen = corpus_words(str(tmp_path))
    assert seen == {"def", "read_file", "path", "return", "open", "read"}  # the val shard is not the corpus
    texts = ["(path) return reed_file\n   \n", "\nopen it<|endoftext|>\n\nread"]  # 4 of 6 words known; 2 of 5 blank
    assert corpus_check(texts, seen) == {"words": 6, "known": 4 / 6, "lines": 5, "blank": 2 / 5}
    assert len(corpus_words(str(tmp_path), max_tokens=3)) == 2  # EOT, "def", " read": a capped prefix of the corpus
    main(["--ckpt", str(ckpt), "--prompt", "def", "--max-new-tokens", "4", "--num-samples", "1",
          "--corpus", str(tmp_path)])
    assert re.search(r"^corpus check: \d+% of \d+ sampled words occur in .*'s train shards; \d+% of 1 sampled lines "
                     r"are whitespace only$", capsys.readouterr().err, re.M)
    # the random model's words are none of the corpus's: the line's numbers, from texts whose counts are known above
    monkeypatch.setattr(sample_py, "generate_text", lambda *args, **kwargs: texts)
    assert main(["--ckpt", str(ckpt), "--corpus", str(tmp_path)]) == texts
    assert f"corpus check: 67% of 6 sampled words occur in {tmp_path}'s train shards; 40% of 5 sampled lines are " \
           "whitespace only\n" in capsys.readouterr().err
    with pytest.raises(SystemExit, match=r"--corpus .*nope is not a directory"):
        main(["--ckpt", str(ckpt), "--corpus", str(tmp_path / "nope")])
