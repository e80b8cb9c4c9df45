"""Export a train.py checkpoint as an HF GPT2LMHeadModel directory, for transformers and lm-eval-harness.

Usage:
    python export.py --ckpt out/gpt2-124m/ckpt_019073.pt --export-hf out/gpt2-124m-hf
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from common import EOT, GPT2_VOCAB, gpt2_bpe_dir, parse_config
from model import GPT, HF_CONV1D


@dataclass
class ExportConfig:
    """Write a train.py checkpoint as an HF GPT2LMHeadModel directory (config.json, model.safetensors, tokenizer)."""

    ckpt: str = ""  # a train.py checkpoint to export
    export_hf: str = ""  # output directory for the HF export (for transformers / lm-eval-harness)


def export_hf(model: GPT, out_dir: str | os.PathLike) -> Path:
    """Write an HF `GPT2LMHeadModel` directory (config.json, model.safetensors, tokenizer files) for lm-eval etc.
    A vocabulary padded past GPT-2's 50,257 ids is cropped to them (as llm.c does): the padded rows are never tokens,
    and HF's generate, which knows nothing of our padding, could otherwise sample them."""
    cfg = model.config
    if cfg.mlp != "gelu" or cfg.pos != "learned" or cfg.kv_heads != cfg.n_head or not cfg.bias:
        raise ValueError("export_hf supports only the plain GPT-2 architecture (mlp='gelu', pos='learned', "
                         f"n_kv_head=n_head, bias=True); this model has mlp={cfg.mlp!r}, pos={cfg.pos!r}, "
                         f"n_kv_head={cfg.kv_heads}, bias={cfg.bias}")
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab = GPT2_VOCAB if cfg.vocab_size > GPT2_VOCAB else cfg.vocab_size  # tiny test vocabularies stay as they are
    sd = {}
    for key, p in model.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied: HF re-ties lm_head to wte on load
        p = p.detach().float().cpu()
        if key == "transformer.wte.weight":
            p = p[:vocab]
        sd[key] = (p.t() if key.endswith(HF_CONV1D) else p).contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
        "n_positions": cfg.block_size, "n_ctx": cfg.block_size, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
        "n_head": cfg.n_head, "n_inner": None, "activation_function": "gelu_new", "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout, "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02, "bos_token_id": EOT, "eos_token_id": EOT, "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    # safetensors writes its file 0600 (a private temporary renamed); give it the mode every other file here gets
    # from the umask, or other users of a shared filesystem could read the config but not the weights
    shutil.copymode(out / "config.json", out / "model.safetensors")
    try:  # the GPT-2 tokenizer files too, so AutoTokenizer.from_pretrained(out_dir) works offline
        data = gpt2_bpe_dir()
        (out / "vocab.json").write_bytes((data / "encoder.json").read_bytes())
        (out / "merges.txt").write_bytes((data / "vocab.bpe").read_bytes())
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "GPT2Tokenizer", "model_max_length": cfg.block_size, "bos_token": "<|endoftext|>",
             "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}))
    except ImportError:
        pass
    return out


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config(ExportConfig, sys.argv[1:] if argv is None else argv, doc=__doc__)
    if not cfg.export_hf:
        if cfg.ckpt:  # sampling a checkpoint is sample.py's job
            raise SystemExit(f"error: --ckpt is only read with --export-hf DIR; to sample from it: python sample.py "
                             f"--ckpt {cfg.ckpt}")
        raise SystemExit("error: pass --ckpt PATH (a checkpoint train.py wrote) and --export-hf DIR")
    if not cfg.ckpt:
        raise SystemExit("error: --export-hf needs --ckpt PATH (a checkpoint train.py wrote)")
    try:
        out = export_hf(GPT.from_checkpoint(cfg.ckpt), cfg.export_hf)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}") from None
    print(f"exported {cfg.ckpt} to {out} (load with transformers.GPT2LMHeadModel.from_pretrained)")


if __name__ == "__main__":
    main()
