"""Export a checkpoint of this project as an HF directory for transformers and lm-eval-harness: a GPT2LMHeadModel for
the GPT-2 architecture, a LlamaForCausalLM for the LLaMA one (RoPE, SwiGLU, RMSNorm; with or without GQA and biases).
A chat model (sft.py, prefs.py, rl.py) keeps its padded rows and carries chat_format.py's special tokens, a
chat_template (apply_chat_template gives render_prompt's ids) and <|assistant_end|> as generate's eos_token_id.

Usage:
    python export.py --ckpt out/gpt2-124m/ckpt_019073.pt --export-hf out/gpt2-124m-hf
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from chat_format import ASSISTANT_END, CHAT_VOCAB, REPLY_STOPS, SYSTEM_START, is_chat
from common import EOT, GPT2_VOCAB, gpt2_bpe_dir, is_reward_model, load_checkpoint, parse_config, user_errors
from model import GPT, HF_CONV1D, NORM_EPS, RUN_OPTIONS, GPTConfig


@dataclass
class ExportConfig:
    """Write a checkpoint of this project as an HF GPT2LMHeadModel or LlamaForCausalLM directory."""

    ckpt: str = ""  # a checkpoint of this project to export (train.py, sft.py, prefs.py, rl.py)
    export_hf: str = ""  # output directory for the HF export (for transformers / lm-eval-harness)


def hf_class(cfg: GPTConfig) -> str:
    """The HF class that computes exactly this model, or a one-line ValueError naming what each lacks."""
    known = (*RUN_OPTIONS, *"vocab_size n_layer n_head n_embd n_kv_head bias mlp pos rope_theta norm head_size "
             "mlp_hidden".split())  # what the files below write, model.RUN_OPTIONS too; a user's new field: refused
    if new := next((f.name for f in fields(cfg) if f.name not in known and getattr(cfg, f.name) != f.default), None):
        raise ValueError(f"export.py does not know GPTConfig.{new} ({getattr(cfg, new)!r} here), which HF's classes "
                         "would compute without: teach export.py's hf_class how to write it")
    gpt2_lacks = [what for on, what in ((cfg.mlp == "swiglu", "SwiGLU MLP"), (cfg.pos == "rope", "rotary positions"),
                                        (cfg.norm == "rmsnorm", "RMSNorm"),
                                        (cfg.kv_heads != cfg.n_head, "grouped-query attention"),
                                        (not cfg.bias, "bias-free layers"),
                                        (cfg.n_embd % cfg.head_dim or cfg.n_head * cfg.head_dim > cfg.n_embd,
                                         "heads wider than n_embd / n_head or not dividing n_embd")) if on]
    llama_lacks = [what for on, what in ((cfg.mlp == "gelu", "GELU MLP"), (cfg.pos == "learned", "learned positions"),
                                         (cfg.norm == "layernorm", "LayerNorm")) if on]
    for name, lacks in (("GPT2LMHeadModel", gpt2_lacks), ("LlamaForCausalLM", llama_lacks)):
        if not lacks:
            return name
    raise ValueError("export_hf supports only the plain GPT-2 architecture and the LLaMA one: GPT2LMHeadModel has no "
                     f"{', '.join(gpt2_lacks)}, and LlamaForCausalLM no {', '.join(llama_lacks)}")


HF_FILES = ("config.json", "model.safetensors", "vocab.json", "merges.txt", "tokenizer_config.json",
            "generation_config.json")
STAGING = ".export-partial"  # written here first, then moved into place: a failed export leaves nothing behind
HUB_FILES = (".git", ".gitattributes", "README.md")  # a clone of a Hub repo's own, which transformers never reads


def export_hf(model: GPT, out_dir: str | os.PathLike, chat: bool = False) -> Path:
    """Write an HF GPT2LMHeadModel or LlamaForCausalLM directory. A vocabulary padded past GPT-2's 50,257 ids is cropped
    to them (as llm.c does: HF's generate could sample the padded rows); a chat model keeps them (the chat tokens) and
    gets the chat tokenizer. An earlier export is replaced; a failed write is one OSError line and changes nothing."""
    cfg = model.config
    name = hf_class(cfg)  # before any write
    model_type, files = {"GPT2LMHeadModel": ("gpt2", _gpt2_files), "LlamaForCausalLM": ("llama", _llama_files)}[name]
    out = check_target(Path(out_dir))
    vocab = cfg.vocab_size if chat else min(cfg.vocab_size, GPT2_VOCAB)  # a tiny test vocabulary stays
    # no lm_head: it is tied, and HF re-ties it to wte on load; no PPO critic's head: HF has no place for it
    sd = {k: p.detach().float().cpu() for k, p in model.state_dict().items()
          if k != "lm_head.weight" and not k.startswith("value_head.")}
    sd["transformer.wte.weight"] = sd["transformer.wte.weight"][:vocab]
    sd, own = files(cfg, sd, model.transformer.h[0].mlp.c_proj.in_features)
    config = {"model_type": model_type, "architectures": [name], "vocab_size": vocab, **own, "initializer_range": 0.02,
              "bos_token_id": EOT, "eos_token_id": EOT, "tie_word_embeddings": True, "torch_dtype": "float32"}
    made = [p for p in (out, *out.parents) if not p.exists()]  # the directories this export creates
    staging = out / STAGING
    try:
        shutil.rmtree(staging, ignore_errors=True)  # a killed export's files (a chat export's) never join this one
        staging.mkdir(parents=True, exist_ok=True)
        _write(staging, sd, config, cfg.block_size, chat)
        for name in HF_FILES:  # what this export lacks goes too (a chat export's generation_config.json)
            if (staging / name).exists():
                os.replace(staging / name, out / name)
            else:
                (out / name).unlink(missing_ok=True)
        staging.rmdir()
    except (OSError, SafetensorError) as e:
        shutil.rmtree(made[-1] if made else staging, ignore_errors=True)
        code = re.search(r"(?:\[Errno|os error|code:) (\d+)", str(e))  # an OSError's errno, or a SafetensorError's
        reason = os.strerror(int(code[1])) if code else str(e)
        raise OSError(f"cannot write the HF export to {out} ({reason}); nothing of it is left there: free some "
                      "space, or pass a directory you can write to") from None
    return out


def check_target(out: Path) -> Path:
    """Refuse an --export-hf that is a file or lies under one, or a directory holding files export.py does not write:
    transformers would read them with the export (AutoTokenizer takes a stray tokenizer.json over our GPT-2 files)."""
    above = next(p for p in (out, *out.parents) if p.exists())
    if not above.is_dir():
        raise ValueError(f"--export-hf {out}: {above} is a file, not a directory; pass a new directory, or an earlier "
                         "export to replace")
    if above == out and (foreign := sorted({p.name for p in out.iterdir()} - {*HF_FILES, STAGING, *HUB_FILES})):
        raise ValueError(f"--export-hf {out} holds files export.py does not write ({', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}), which transformers would read with the export; "
                         "pass a new or empty directory, or an earlier export to replace")
    return out


def _write(out: Path, sd: dict[str, torch.Tensor], config: dict[str, Any], block_size: int, chat: bool) -> None:
    tokenizer = {"tokenizer_class": "GPT2Tokenizer", "model_max_length": block_size, "bos_token": "<|endoftext|>",
                 "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    if chat:  # HF's generate then answers as chat.py does, and the tokenizer knows the chat tokens
        config, tokenizer = {**config, "eos_token_id": ASSISTANT_END}, {**tokenizer, **CHAT_TOKENIZER}
        # generate's settings: chat.py's stop tokens, and never a padded row. The pad is <|pad|>, never in input: the
        # BOS was hidden by generate's guessed attention mask, the eos by HF's collator from the labels (never learned)
        generation = {"bos_token_id": EOT, "eos_token_id": REPLY_STOPS, "pad_token_id": CHAT_VOCAB,
                      "suppress_tokens": list(range(CHAT_VOCAB, config["vocab_size"]))}
        (out / "generation_config.json").write_text(json.dumps(generation))
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    # safetensors writes its file 0600 (a private temporary renamed); give it the mode every other file here gets
    # from the umask, or other users of a shared filesystem could read the config but not the weights
    shutil.copymode(out / "config.json", out / "model.safetensors")
    data = gpt2_bpe_dir()  # the GPT-2 tokenizer files too, so AutoTokenizer.from_pretrained(out_dir) works offline
    (out / "vocab.json").write_bytes((data / "encoder.json").read_bytes())
    (out / "merges.txt").write_bytes((data / "vocab.bpe").read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer))


# chat_format.py's special tokens by name, in id order from SYSTEM_START, then the pad at CHAT_VOCAB; lstrip/rstrip
# off, so text keeps the spaces and newlines that touch them
CHAT_TOKENS = [f"<|{role}_{edge}|>" for role in ("system", "user", "assistant", "tool", "output")
               for edge in ("start", "end")] + ["<|pad|>"]
# render(): BOS, then each message as <|role_start|> content <|role_end|>, an assistant's tool parts in their markers;
# what render and render_prompt refuse (no messages, roles out of turn, blank or listed content, a late prompt) raises
CHAT_TEMPLATE = (
    "{% if not messages %}{{ raise_exception('expected a non-empty list of messages, got []') }}{% endif %}"
    "{% set o = 1 if messages[0].role == 'system' else 0 %}<|endoftext|>{% for m in messages %}"
    "{% set i = loop.index0 %}{% set want = 'system' if i < o else ['user', 'assistant'][(i - o) % 2] %}"
    "{% if m.role != want %}{{ raise_exception('message ' ~ i ~ ' is from ' ~ m.role ~ ', expected ' ~ want"
    " ~ ' (an optional first system message, then user and assistant in turns)') }}{% endif %}"
    "{% if not m.content or m.content is string and not m.content | trim %}"
    "{{ raise_exception('message ' ~ i ~ ' (' ~ m.role ~ ') is empty or only whitespace') }}{% endif %}"
    "{% if m.content is not string and m.role != 'assistant' %}"
    "{{ raise_exception('message ' ~ i ~ ' (' ~ m.role ~ ') has content of type list, expected a string') }}{% endif %}"
    "<|{{ m.role }}_start|>{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type not in ['text', 'tool', 'output'] or p.text is not string or not p.text %}{{ raise_exception("
    "'message ' ~ i ~ ' (assistant) has a bad part ' ~ p ~ \": expected {'type': 'text' | 'tool' | 'output', "
    "'text': a non-empty string}\") }}{% endif %}{% if p.type != 'text' %}<|{{ p.type }}_start|>{% endif %}{{ p.text }}"
    "{% if p.type != 'text' %}<|{{ p.type }}_end|>{% endif %}{% endfor %}{% endif %}<|{{ m.role }}_end|>"
    "{% endfor %}{% if add_generation_prompt %}{% if messages[-1].role != 'user' %}{{ raise_exception("
    "\"the conversation's last message is from \" ~ messages[-1].role ~ ', expected user') }}{% endif %}"
    "<|assistant_start|>{% endif %}")
CHAT_TOKENIZER = {
    "eos_token": "<|assistant_end|>", "pad_token": "<|pad|>", "chat_template": CHAT_TEMPLATE,
    "padding_side": "left",  # a batch's prompts end where generate goes on, as HF expects of decoder-only models
    "added_tokens_decoder": {str(i): {"content": name, "special": True, "lstrip": False, "rstrip": False,
                                      "normalized": False, "single_word": False}
                             for i, name in zip(range(SYSTEM_START, CHAT_VOCAB + 1), CHAT_TOKENS, strict=True)}}


def _gpt2_files(cfg: GPTConfig, sd: dict[str, torch.Tensor],
                hidden: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """GPT2LMHeadModel's tensors (our names; Conv1D matmuls transposed) and config fields of its own. A pruned model's
    heads are narrower than GPT-2's n_embd // n_head: the heads pruning cut out come back as zeros, adding nothing."""
    n_head = cfg.n_embd // cfg.head_dim
    missing = (n_head - cfg.n_head) * cfg.head_dim  # channels of each of q, k, v and of c_proj's input; 0 if unpruned
    for key, p in sd.items():
        if key.endswith("attn.c_proj.weight"):
            p = torch.cat([p, p.new_zeros(p.size(0), missing)], dim=1)
        elif key.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            p = torch.cat([t for part in p.chunk(3) for t in (part, part.new_zeros(missing, *part.shape[1:]))])
        sd[key] = (p.t() if key.endswith(HF_CONV1D) else p).contiguous()
    return sd, {"n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
                "n_head": n_head, "n_inner": None if hidden == 4 * cfg.n_embd else hidden,
                "activation_function": "gelu_new", "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout,
                "attn_pdrop": cfg.dropout, "layer_norm_epsilon": NORM_EPS}


def _llama_files(cfg: GPTConfig, sd: dict[str, torch.Tensor],
                 hidden: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """LlamaForCausalLM's tensors and config fields: the fused c_attn split into q/k/v_proj, c_fc into gate/up_proj.
    Our RoPE rotates channel pairs (i, i + hs/2), HF Llama's rotate_half convention, so no q/k rows are permuted."""
    kv_dim = cfg.kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": sd["transformer.wte.weight"],
           "model.norm.weight": sd["transformer.ln_f.weight"]}
    for i in range(cfg.n_layer):
        ours, theirs = f"transformer.h.{i}.", f"model.layers.{i}."
        out[theirs + "input_layernorm.weight"] = sd[ours + "ln_1.weight"]
        out[theirs + "post_attention_layernorm.weight"] = sd[ours + "ln_2.weight"]
        for kind in ("weight", "bias") if cfg.bias else ("weight",):
            q, k, v = sd[f"{ours}attn.c_attn.{kind}"].split([cfg.n_head * cfg.head_dim, kv_dim, kv_dim])
            gate, up = sd[f"{ours}mlp.c_fc.{kind}"].chunk(2)  # gate first, as MLP.forward splits it
            parts = {"self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v,
                     "self_attn.o_proj": sd[f"{ours}attn.c_proj.{kind}"], "mlp.gate_proj": gate, "mlp.up_proj": up,
                     "mlp.down_proj": sd[f"{ours}mlp.c_proj.{kind}"]}
            out.update({f"{theirs}{name}.{kind}": t for name, t in parts.items()})
    config = {
        "hidden_size": cfg.n_embd, "intermediate_size": hidden, "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.block_size, "rms_norm_eps": NORM_EPS,
        # rope_theta for transformers 4.x, rope_parameters for 5.x
        "rope_theta": cfg.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": cfg.bias, "mlp_bias": cfg.bias, "attention_dropout": cfg.dropout,
    }
    return {k: t.contiguous() for k, t in out.items()}, config


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(ExportConfig, argv, doc=__doc__)
    if not (cfg.ckpt and cfg.export_hf):
        raise SystemExit("error: pass --ckpt PATH (a checkpoint of this project) and --export-hf DIR")
    with user_errors(OSError, ValueError):
        check_target(Path(cfg.export_hf))  # before a large checkpoint takes its time to load
        ckpt = load_checkpoint(cfg.ckpt, mmap=True)
        if is_reward_model(ckpt):  # its score would be silently dropped
            raise ValueError(f"--ckpt {cfg.ckpt} is a reward model: HF's classes have no place for its score (a value "
                             "head with a bias, read at <|assistant_end|>), so an export would load as a plain "
                             "language model; score with it here (rl.py --reward-model)")
        chat = is_chat(ckpt)
        out = export_hf(GPT.from_checkpoint(cfg.ckpt), cfg.export_hf, chat)
    critic = any(k.startswith("value_head.") for k in ckpt["model"])  # a PPO policy's
    print(f"exported {cfg.ckpt} to {out}{' as a chat model' * chat} (load with "
          "transformers.AutoModelForCausalLM.from_pretrained)"
          + "; its PPO value head is left out: HF's classes have no place for it" * critic)


if __name__ == "__main__":
    main()
