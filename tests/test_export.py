"""export.py: HF round trips (GPT-2 and LLaMA layouts), a plain export's exact bytes, a chat model's tokenizer, template
and stop token, refused architectures, and a failed export that leaves nothing behind (a file as target, a foreign
directory, no permission, a full disk)."""

import contextlib
import dataclasses
import hashlib
import json
import re
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_chat import sft_checkpoint
from test_model import _perturbed, tiny

import chat_format as cf
import export
from common import EOT, GPT2_VOCAB, get_tokenizer
from conftest import ROOT
from export import export_hf
from generate import generate, sample
from model import GPT, GPTConfig


def test_export_hf_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=4, n_embd=32)).eval()
    with torch.no_grad():  # biases and LayerNorms away from their init, so their export is checked too
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    export_hf(model, tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    back = GPT.from_pretrained(str(tmp_path)).eval()
    # the padding is cropped: HF's vocabulary is the tokenizer's, and its logits are ours for the real ids
    assert (hf.config.vocab_size, back.config.vocab_size, len(tok := transformers.AutoTokenizer.from_pretrained(
        tmp_path))) == (GPT2_VOCAB, GPT2_VOCAB, GPT2_VOCAB)
    idx = torch.randint(0, GPT2_VOCAB, (2, 32))
    with torch.no_grad():
        ours, _ = model(idx)
        assert ours.shape[-1] == 50304
        torch.testing.assert_close(hf(idx).logits, ours[..., :GPT2_VOCAB], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(back(idx)[0], ours[..., :GPT2_VOCAB], atol=0, rtol=0)
    assert tok("Hello, I'm a language model,")["input_ids"] == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    # the model's dropout (0 for pretraining), not HF's default 0.1, for whoever fine-tunes the export
    assert (hf.config.resid_pdrop, hf.config.embd_pdrop, hf.config.attn_pdrop) == (0.0, 0.0, 0.0)
    for kw, keys in ((dict(), ("resid_pdrop", "embd_pdrop", "attn_pdrop")),  # and a model's own rate, in either layout
                     (dict(mlp="swiglu", pos="rope", norm="rmsnorm"), ("attention_dropout",))):
        config = json.loads((export_hf(GPT(tiny(dropout=0.2, **kw)), tmp_path / keys[0]) / "config.json").read_text())
        assert [config[k] for k in keys] == [0.2] * len(keys)
    modes = {f.name: f.stat().st_mode & 0o777 for f in tmp_path.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # readable by whoever may read the config


def test_export_hf_keeps_a_vocabulary_smaller_than_gpt2s(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    export_hf(model, tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert hf.config.vocab_size == model.config.vocab_size < GPT2_VOCAB
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], atol=1e-5, rtol=1e-5)


PLAIN_SHA256 = {  # a plain export's files, byte for byte, as they were before chat exports came
    "config.json": "fac1ec4f8baf073d4c8306b7a97c56569ea4adead991c43e518c26a25ff0f0e6",
    "merges.txt": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "model.safetensors": "a5d49a951f49eae4cee1b9f782a05adefb7a0e010cb642429d6c8e05be685a6c",
    "tokenizer_config.json": "ee259bec389b020dff4c56f1978821b7072a4becc8063247659f8498f0a2dac4",
    "vocab.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


def test_a_plain_export_keeps_its_bytes(tmp_path):
    model = GPT(tiny(vocab_size=50304, n_layer=1))
    with torch.no_grad():  # weights from no RNG, so the bytes are the same on every machine
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel()).reshape(p.shape) % (7 + i) / 10)
    export_hf(model, tmp_path)
    assert {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in tmp_path.iterdir()} == PLAIN_SHA256


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> Path:
    return sft_checkpoint(tmp_path_factory.mktemp("sft"))


# spaces and newlines at the edges of each piece: joined wrongly (stripped, or tokenized across a special token), the
# ids differ
CONVERSATION = [
    {"role": "system", "content": " You are terse.\n"},
    {"role": "user", "content": "  hi\nthere  "},
    {"role": "assistant", "content": "\n Hello!  "},
    {"role": "user", "content": "what's 6*7?\n\n"},
    {"role": "assistant", "content": [{"type": "text", "text": " Let me see"}, {"type": "tool", "text": " 6*7"},
                                      {"type": "output", "text": "42"}, {"type": "text", "text": " It's 42.\n"}]},
    {"role": "user", "content": " thanks"},
    {"role": "assistant", "content": "  you're welcome"},
]


def test_a_chat_export_renders_as_chat_format_and_stops_at_assistant_end(sft, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    export.main(["--ckpt", str(sft), "--export-hf", str(out)])
    assert capsys.readouterr().out.startswith(f"exported {sft} to {out} as a chat model (")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    for end in (2, 4, 6):  # a prompt for each reply, and each conversation up to and with it
        messages = CONVERSATION[:end]
        assert tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False) == \
            cf.render_prompt(messages)
        whole = CONVERSATION[:end + 1]
        assert tok.apply_chat_template(whole, return_dict=False) == cf.render(whole)[0]
    for bad in ([{"role": "developer", "content": "x"}], [{"role": "user", "content": "x"}] * 2,
                [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]):  # rendered as text or markers
        with pytest.raises(Exception, match=f"message {len(bad) - 1} is from {bad[-1]['role']}, expected"):
            tok.apply_chat_template(bad, return_dict=False)
    # and what render and render_prompt refuse in the messages themselves, with their messages
    user, part = {"role": "user", "content": "x"}, {"type": "image", "text": "x"}
    for bad, prompt in (([user, {"role": "assistant", "content": "y"}], True),  # two assistant turns in a row
                        ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], True),
                        ([{"role": "system", "content": " \n"}, user], True),
                        ([user, {"role": "assistant", "content": ""}], False),
                        ([user, {"role": "assistant", "content": [part]}], False),
                        ([user, {"role": "assistant", "content": [{"type": "tool", "text": ""}]}], False)):
        with pytest.raises(ValueError) as ours:
            (cf.render_prompt if prompt else cf.render)(bad)
        with pytest.raises(Exception, match=f"^{re.escape(str(ours.value))}$"):
            tok.apply_chat_template(bad, add_generation_prompt=prompt, return_dict=False)
    assert (len(tok), tok.eos_token_id, tok.decode([cf.TOOL_START, cf.OUTPUT_END])) == \
        (cf.CHAT_VOCAB + 1, cf.ASSISTANT_END, "<|tool_start|><|output_end|>")  # and the pad, <|pad|>
    # all 50,304 rows, the chat tokens' logits ours; generate stops at <|assistant_end|>, as generate.py does
    hf, model = transformers.AutoModelForCausalLM.from_pretrained(out).eval(), GPT.from_checkpoint(sft).eval()
    enc = get_tokenizer()
    ids = torch.tensor([cf.render_prompt([{"role": "user", "content": "3+4?"}]) + [
        cf.TOOL_START, *enc.encode("6*7"), cf.TOOL_END, cf.OUTPUT_START, *enc.encode("42"), cf.OUTPUT_END]])
    with torch.no_grad():
        assert hf.config.vocab_size == 50304
        torch.testing.assert_close(hf(ids).logits, model(ids)[0], atol=1e-5, rtol=1e-5)
        theirs = hf.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:].tolist()
    ours = generate(model, ids.tolist(), 10, temperature=0.0, stop_ids=[cf.ASSISTANT_END], vocab=cf.CHAT_VOCAB)
    assert theirs == ours[0].tokens == [*enc.encode(" Hi!"), cf.ASSISTANT_END]
    assert hf.generation_config.eos_token_id == cf.REPLY_STOPS
    # a plain export over it leaves no chat generation_config.json behind
    export_hf(GPT(tiny()), out)
    assert sorted(p.name for p in out.iterdir()) == sorted(PLAIN_SHA256)


@pytest.fixture(scope="module")
def random_chat(tmp_path_factory) -> tuple[GPT, Path]:
    """A random tiny chat model and its export: greedy tokens that hang on every input id and position."""
    model = _perturbed(tiny(vocab_size=50304, n_layer=1), scale=0.5)
    return model, export_hf(model, tmp_path_factory.mktemp("chat") / "hf", chat=True)


def test_adjacent_text_parts_render_as_the_template_joins_them_and_tool_calls_apart(random_chat):
    # the template hands HF's tokenizer "foobar" (6513, 30973); render encoded "foo" and "bar" apart (21943, 5657)
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(random_chat[1])
    parts = [{"type": "text", "text": "foo"}, {"type": "text", "text": "bar"}, *[{"type": "tool", "text": "1+1"}] * 2]
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": parts}]
    ids, mask = cf.render(messages)
    assert tok.apply_chat_template(messages, return_dict=False) == ids
    call = [cf.TOOL_START, 16, 10, 16, cf.TOOL_END]
    assert ids[ids.index(cf.ASSISTANT_START):] == [cf.ASSISTANT_START, 6513, 30973, *call, *call, cf.ASSISTANT_END]
    assert sum(mask) == 13  # all but <|assistant_start|>
    # the chat tokens are special: skip_special_tokens (pipelines, batch_decode of replies) drops them with the BOS
    assert tok.decode(ids, skip_special_tokens=True) == "xfoobar1+11+1"


def test_the_chat_template_refuses_list_content_where_render_does():
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    parts = [{"type": "text", "text": "x"}]
    for messages in ([{"role": "system", "content": parts}, {"role": "user", "content": "y"}],
                     [{"role": "user", "content": parts}]):
        with pytest.raises(ValueError) as ours:
            cf.render_prompt(messages)
        with pytest.raises(Exception, match=f"^{re.escape(str(ours.value))}$"):
            utils.render_jinja_template([messages], chat_template=export.CHAT_TEMPLATE, add_generation_prompt=True)


def test_the_chat_template_refuses_an_empty_conversation_with_renders_message():
    # transformers 5 refuses [] before the template runs; 4.x, and whatever else renders the template, did not: an
    # UndefinedError with a generation prompt, a lone BOS without
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    with pytest.raises(ValueError) as ours:
        cf.render([])
    for prompt in (False, True):
        with pytest.raises(Exception, match=f"^{re.escape(str(ours.value))}$"):
            utils.render_jinja_template([[]], chat_template=export.CHAT_TEMPLATE, add_generation_prompt=prompt)


def test_a_chat_exports_config_stops_at_assistant_end_and_never_samples_a_padded_row(tmp_path):
    # what HF's generate, and whatever reads config.json's eos, go by: no transformers needed to read them
    export_hf(GPT(tiny(vocab_size=50304, n_layer=1)), tmp_path, chat=True)
    config, generation = (json.loads((tmp_path / f).read_text()) for f in ("config.json", "generation_config.json"))
    assert (config["vocab_size"], config["eos_token_id"], config["bos_token_id"]) == (50304, cf.ASSISTANT_END, EOT)
    assert generation == {"bos_token_id": EOT, "eos_token_id": cf.REPLY_STOPS, "pad_token_id": cf.CHAT_VOCAB,
                          "suppress_tokens": list(range(cf.CHAT_VOCAB, 50304))}  # the padded rows (the pad's too)


def test_a_batch_of_prompts_of_two_lengths_generates_each_rows_own_reply(random_chat):
    # tok(prompts, padding=True) + generate, as pipeline and batched evals do: padded on the right, the short row went
    # on from its pads
    transformers = pytest.importorskip("transformers")
    model, out = random_chat
    tok, hf = transformers.AutoTokenizer.from_pretrained(out), transformers.AutoModelForCausalLM.from_pretrained(out)
    chats = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "what is 6 times 7, please?"}]]
    batch = tok([tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats], padding=True,
                return_tensors="pt")
    with torch.no_grad():
        theirs = hf.eval().generate(**batch, max_new_tokens=4, do_sample=False)[:, batch["input_ids"].shape[1]:]
    alone = [generate(model, [cf.render_prompt(c)], 4, temperature=0.0, vocab=cf.CHAT_VOCAB)[0].tokens for c in chats]
    assert theirs.tolist() == alone
    assert batch["attention_mask"].tolist()[0] == [0] * 7 + [1] * 5  # the pads, on the left, unseen


def test_a_chat_exports_pad_is_its_own_token_so_a_collator_learns_assistant_end(random_chat):
    # HF's collator masks the pad id out of the labels: as <|assistant_end|>, Trainer never learned to end a reply
    transformers = pytest.importorskip("transformers")
    model, out = random_chat
    tok, hf = transformers.AutoTokenizer.from_pretrained(out), transformers.AutoModelForCausalLM.from_pretrained(out)
    short, long = (tok.apply_chat_template(CONVERSATION[:n], return_dict=False) for n in (3, 5))
    labels = transformers.DataCollatorForLanguageModeling(tok, mlm=False)([{"input_ids": short}, {"input_ids": long}])
    assert labels["labels"].tolist() == [[-100] * (len(long) - len(short)) + short, long]
    assert (tok.pad_token, tok.pad_token_id, hf.generation_config.pad_token_id) == ("<|pad|>", 50267, 50267)
    # generate infers no mask hiding a real token (a BOS, an <|assistant_end|>) from the pad
    prompt = torch.tensor([tok.apply_chat_template(CONVERSATION[1:4], add_generation_prompt=True, return_dict=False)])
    with torch.no_grad():
        unmasked = hf.eval().generate(prompt, max_new_tokens=4, do_sample=False)
        masked = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    assert unmasked.tolist() == masked.tolist()


def test_a_narrower_mlp_exports_its_width_as_n_inner(tmp_path):
    for hidden, n_inner in ((None, None), (48, 48)):  # 4 x n_embd is GPT-2's own: None
        export_hf(GPT(tiny(mlp_hidden=hidden)), tmp_path / str(hidden))
        assert json.loads((tmp_path / str(hidden) / "config.json").read_text())["n_inner"] == n_inner


def test_a_pruned_gpt2s_narrow_heads_export_padded_with_zero_heads_to_the_same_logits(tmp_path):
    # prune.py's GPT-2 with 4 heads of 4 channels: HF's GPT-2 has n_embd / n_head, so 8 heads, the 4 cut out zeros
    transformers = pytest.importorskip("transformers")
    model = _perturbed(tiny(head_size=4), scale=0.05)
    export_hf(model, tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert hf.config.n_head == 8
    idx = torch.randint(0, model.config.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], atol=1e-5, rtol=1e-5)


def _llama_tiny(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(block_size=32, vocab_size=50304, n_layer=2, n_head=4, n_embd=32, n_kv_head=2,
                               mlp="swiglu", pos="rope", norm="rmsnorm", bias=False, rope_theta=500.0), **kw})


@pytest.mark.parametrize("kw", [dict(), dict(bias=True), dict(n_kv_head=None, rope_theta=10000.0)])
def test_export_hf_llama_round_trip(tmp_path, kw):
    # the LLaMA layout (GQA, a theta other than HF's default, biases or none) as LlamaForCausalLM; every weight
    # perturbed, norms and biases included, so each tensor has to land in its place
    transformers = pytest.importorskip("transformers")
    model = _perturbed(_llama_tiny(**kw), scale=0.05)
    export_hf(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    cfg = model.config
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert (hf.config.vocab_size, hf.config.num_key_value_heads, hf.config.intermediate_size, hf.config.head_dim,
            hf.config.rms_norm_eps, hf.config.rope_parameters["rope_theta"], hf.config.tie_word_embeddings,
            hf.config.attention_bias, hf.config.mlp_bias, hf.config.max_position_embeddings) == \
        (GPT2_VOCAB, cfg.kv_heads, 128, 8, 1e-5, cfg.rope_theta, True, cfg.bias, cfg.bias, 32)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # tied, as ours
    idx = torch.randint(0, GPT2_VOCAB, (2, 32))
    with torch.no_grad():
        ours, _ = model(idx)
        torch.testing.assert_close(hf(idx).logits, ours[..., :GPT2_VOCAB], atol=1e-5, rtol=1e-5)
        # HF's own KV-cache decoding of the export agrees with ours, token for token
        theirs = hf.generate(idx[:1, :8], max_new_tokens=12, do_sample=False, pad_token_id=EOT)
    assert torch.equal(theirs, sample(model, idx[:1, :8], 12, temperature=0.0))
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert tok("Hello, I'm a language model,")["input_ids"] == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    modes = {f.name: f.stat().st_mode & 0o777 for f in tmp_path.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes


def test_export_cli_writes_a_llama_checkpoint_as_llama(tmp_path, capsys):
    model = GPT(_llama_tiny())
    torch.save({"model": model.state_dict(), "model_config": model.config.__dict__, "step": 1}, tmp_path / "c.pt")
    export.main(["--ckpt", str(tmp_path / "c.pt"), "--export-hf", str(tmp_path / "hf")])
    assert capsys.readouterr().out == f"exported {tmp_path / 'c.pt'} to {tmp_path / 'hf'} (load with " \
        "transformers.AutoModelForCausalLM.from_pretrained)\n"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["architectures"], config["rms_norm_eps"], config["intermediate_size"]) == \
        (["LlamaForCausalLM"], 1e-5, 128)
    # theta 500, not HF's default 10000, where either transformers looks: 4.x's rope_theta, 5.x's rope_parameters
    assert (config["rope_theta"], config["rope_parameters"]) == (500.0, {"rope_type": "default", "rope_theta": 500.0})


@pytest.mark.parametrize("kw, gpt2_lacks, llama_lacks", [
    (dict(norm="rmsnorm"), "RMSNorm", "GELU MLP, learned positions"),
    (dict(mlp="swiglu", pos="rope"), "SwiGLU MLP, rotary positions", "LayerNorm"),
    (dict(pos="rope", norm="rmsnorm", n_kv_head=2, bias=False),
     "rotary positions, RMSNorm, grouped-query attention, bias-free layers", "GELU MLP"),
    (dict(mlp="swiglu", norm="rmsnorm"), "SwiGLU MLP, RMSNorm", "learned positions"),
])
def test_export_hf_refuses_a_mix_of_gpt2_and_llama_in_one_line(tmp_path, kw, gpt2_lacks, llama_lacks):
    with pytest.raises(ValueError) as e:
        export_hf(GPT(tiny(**kw)), tmp_path / "x")
    message = str(e.value)
    assert "\n" not in message and message.startswith("export_hf supports only the plain GPT-2 architecture")
    assert message.endswith(f": GPT2LMHeadModel has no {gpt2_lacks}, and LlamaForCausalLM no {llama_lacks}")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("kw", [dict(mlp="swiglu"), dict(pos="rope"), dict(n_kv_head=2), dict(bias=False),
                                dict(head_size=16)])  # 4 heads of 16: wider than GPT-2's 32 / 4
def test_export_hf_refuses_other_architectures(tmp_path, kw):
    # each of these would write a model HF loads with missing or misread weights, or computes differently
    with pytest.raises(ValueError, match="only the plain GPT-2"):
        export_hf(GPT(tiny(**kw)), tmp_path)
    assert not (tmp_path / "model.safetensors").exists()


def test_a_gptconfig_field_export_py_was_not_taught_is_refused_not_exported_as_plain_gpt2():
    # a user's new model option (QK-norm, say): its checkpoint must not export as a GPT-2 that computes another model
    new = dataclasses.make_dataclass("WithQKNorm", [("qk_norm", bool, False)], bases=(GPTConfig,), frozen=True)
    assert export.hf_class(new()) == "GPT2LMHeadModel"  # at its default it is the plain model
    with pytest.raises(ValueError, match=r"^export.py does not know GPTConfig.qk_norm \(True here\)"):
        export.hf_class(new(qk_norm=True))


def test_cli_exports_a_checkpoint_to_hf(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(block_size=32, vocab_size=50304, n_layer=2, n_head=4, n_embd=32)).eval()
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": gpt.state_dict(), "model_config": gpt.config.__dict__, "step": 1}, ckpt)
    export.main(["--ckpt", str(ckpt), "--export-hf", str(tmp_path / "hf")])
    assert "exported" in capsys.readouterr().out
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, GPT2_VOCAB, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, gpt(idx)[0][..., :GPT2_VOCAB], atol=1e-5, rtol=1e-5)
    for argv in (["--export-hf", str(tmp_path / "x")], [], ["--ckpt", str(ckpt)]):  # not an untrained sample
        with pytest.raises(SystemExit) as e:
            export.main(argv)
        assert str(e.value) == "error: pass --ckpt PATH (a checkpoint of this project) and --export-hf DIR"
    # a checkpoint that cannot be exported is one error line, and no output directory is left behind
    with pytest.raises(SystemExit) as e:
        export.main(["--ckpt", str(tmp_path / "missing.pt"), "--export-hf", str(tmp_path / "x")])
    assert str(e.value).startswith(f"error: checkpoint {tmp_path / 'missing.pt'} does not exist; pass a .pt file")
    swiglu = GPT(GPTConfig(block_size=32, vocab_size=96, n_layer=1, n_head=4, n_embd=32, mlp="swiglu"))
    torch.save({"model": swiglu.state_dict(), "model_config": swiglu.config.__dict__}, tmp_path / "swiglu.pt")
    with pytest.raises(SystemExit, match="^error: export_hf supports only the plain GPT-2 architecture"):
        export.main(["--ckpt", str(tmp_path / "swiglu.pt"), "--export-hf", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------------------------------------------------
# where the export goes, and a write that fails


def save_ckpt(path: Path, config: GPTConfig, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = GPT(config)
    torch.save({"model": model.state_dict(), "model_config": model.config.__dict__, "step": 1}, path)
    return path


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_file_a_path_under_one_or_a_directory_as_ckpt_is_one_line(tmp_path):
    ckpt = save_ckpt(tmp_path / "c.pt", tiny())
    (tmp_path / "notes.txt").write_text("x")
    for target in ("notes.txt", "notes.txt/hf", "notes.txt/a/hf"):
        with pytest.raises(SystemExit) as e:
            export.main(["--ckpt", str(ckpt), "--export-hf", str(tmp_path / target)])
        assert str(e.value) == (f"error: --export-hf {tmp_path / target}: {tmp_path / 'notes.txt'} is a file, not a "
                                "directory; pass a new directory, or an earlier export to replace")
    with pytest.raises(SystemExit) as e:
        export.main(["--ckpt", str(tmp_path), "--export-hf", str(tmp_path / "hf")])
    assert str(e.value) == (f"error: checkpoint {tmp_path} is a directory, not a file; pass a .pt file that train.py, "
                            "sft.py, prefs.py or rl.py wrote (e.g. out/<run>/ckpt_000100.pt); an HF GPT-2 directory "
                            "(config.json + model.safetensors) loads with --init-from instead")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt", "notes.txt"]


def test_an_earlier_export_is_replaced_and_a_foreign_directory_refused(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    export.main(["--ckpt", str(save_ckpt(tmp_path / "a.pt", tiny(n_layer=1))), "--export-hf", str(hf)])
    # a tokenizer.json left by another model is what AutoTokenizer would load, not the export's GPT-2 files
    (hf / "tokenizer.json").write_text("{}")
    before = contents(hf)
    b = save_ckpt(tmp_path / "b.pt", tiny(n_layer=3))
    with pytest.raises(SystemExit) as e:
        export.main(["--ckpt", str(b), "--export-hf", str(hf)])
    assert str(e.value) == (f"error: --export-hf {hf} holds files export.py does not write (tokenizer.json), which "
                            "transformers would read with the export; pass a new or empty directory, or an earlier "
                            "export to replace")
    assert contents(hf) == before
    (hf / "tokenizer.json").unlink()
    capsys.readouterr()
    export.main(["--ckpt", str(b), "--export-hf", str(hf)])
    assert capsys.readouterr().out == f"exported {b} to {hf} (load with " \
        "transformers.AutoModelForCausalLM.from_pretrained)\n"
    assert sorted(contents(hf)) == sorted(PLAIN_SHA256)  # no staging folder left
    assert json.loads((hf / "config.json").read_text())["n_layer"] == 3
    assert transformers.GPT2LMHeadModel.from_pretrained(hf).config.n_layer == 3


def test_a_killed_exports_staging_files_never_join_the_next(tmp_path):
    # a chat export killed mid-write left its generation_config.json in the staging folder; a plain export took it
    (tmp_path / export.STAGING).mkdir()
    (tmp_path / export.STAGING / "generation_config.json").write_text("{}")
    export_hf(GPT(tiny()), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(PLAIN_SHA256)


def test_a_clone_of_a_hub_repo_keeps_its_git_files_and_a_foreign_file_is_still_refused(tmp_path):
    # git clone https://huggingface.co/me/model; export into it; git push
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tmp_path / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n")
    before = {p.name: p.read_bytes() for p in (tmp_path / ".gitattributes", tmp_path / "README.md")}
    export_hf(GPT(tiny()), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*PLAIN_SHA256, ".git", ".gitattributes", "README.md"])
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert [p.name for p in (tmp_path / ".git").iterdir()] == ["HEAD"]
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"holds files export.py does not write \(tokenizer.json\)"):
        export_hf(GPT(tiny()), tmp_path)


def unwritable(tmp_path: Path) -> tuple[Path, str]:
    """An empty directory this process cannot write in, and the reason mkdir there gives: chmod 555, or for root,
    whom chmod does not stop, an empty sysfs directory."""
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    for folder in (ro, *sorted(Path("/sys/kernel").glob("*"))):
        with contextlib.suppress(OSError):
            if not folder.is_dir() or any(folder.iterdir()):
                continue
        try:
            (folder / "probe").mkdir()
        except OSError as e:
            return folder, e.strerror
        (folder / "probe").rmdir()
    pytest.skip("no empty directory here refuses this process's writes")


def test_an_unwritable_target_is_one_line_and_gets_nothing(tmp_path):
    ckpt = save_ckpt(tmp_path / "c.pt", tiny())
    folder, reason = unwritable(tmp_path)
    for target in (folder, folder / "hf"):  # an existing directory, and a new one
        with pytest.raises(SystemExit) as e:
            export.main(["--ckpt", str(ckpt), "--export-hf", str(target)])
        assert str(e.value) == (f"error: cannot write the HF export to {target} ({reason}); nothing of it is left "
                                "there: free some space, or pass a directory you can write to")
        assert not any(folder.iterdir())


@pytest.mark.parametrize("limit, target", [
    (50_000, "new/hf"),  # model.safetensors (113 kB) fails in safetensors' writer
    (600_000, "earlier"),  # model.safetensors fits, vocab.json (1.04 MB) fails in Python's
])
def test_a_full_disk_leaves_nothing_behind(tmp_path, limit, target):
    # a real limit: files this process writes stop at `limit` bytes (RLIMIT_FSIZE; the write fails with EFBIG)
    ckpt = save_ckpt(tmp_path / "c.pt", tiny())
    out = tmp_path / target
    if target == "earlier":
        export.main(["--ckpt", str(save_ckpt(tmp_path / "old.pt", tiny(), seed=1)), "--export-hf", str(out)])
    before = contents(out) if out.exists() else None

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails instead of the process being killed

    proc = subprocess.run([sys.executable, "export.py", "--ckpt", str(ckpt), "--export-hf", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == (f"error: cannot write the HF export to {out} (File too large); nothing of it is left "
                           "there: free some space, or pass a directory you can write to\n")
    if before is None:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]  # new/ and new/hf are gone too
    else:
        assert contents(out) == before  # the earlier export, untouched


def test_a_reward_model_is_refused_and_a_critics_head_left_out(tmp_path, capsys):
    """A reward model's score (its value head) has no HF class here: exported, it loaded as a plain LM, its head's
    tensors ignored. A PPO policy's critic head is not the policy's: its export carries no value_head tensors."""
    safetensors = pytest.importorskip("safetensors.torch")
    model = GPT(GPTConfig(block_size=16, vocab_size=96, n_layer=1, n_head=2, n_embd=16, value_head=True))
    for objective, trained in (("reward", {"objective": "reward"}), ("ppo", {"algo": "ppo"})):
        torch.save({"model": model.state_dict(), "model_config": model.config.__dict__, "train_config": trained,
                    "chat": False}, ckpt := tmp_path / f"{objective}.pt")
        if objective == "reward":
            with pytest.raises(SystemExit, match=f"^error: --ckpt {ckpt} is a reward model: HF's classes have no"):
                export.main(["--ckpt", str(ckpt), "--export-hf", str(tmp_path / objective)])
            assert not (tmp_path / objective).exists()
        else:
            export.main(["--ckpt", str(ckpt), "--export-hf", str(tmp_path / objective)])
            assert not [k for k in safetensors.load_file(tmp_path / objective / "model.safetensors") if "value" in k]
            # said, not done in silence
            assert capsys.readouterr().out.strip().endswith("; its PPO value head is left out: HF's classes have no "
                                                            "place for it")
