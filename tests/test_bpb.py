"""Bits per byte on every validation evaluation: train.py's val_bpb against an independent computation from the val
shard's bytes, on one process and on 2 gloo ranks; ignored targets and chat tokens count in neither sum."""

import contextlib
import math
import re
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import engine
import train
from common import EOT, get_tokenizer, token_bytes
from conftest import run_torchrun
from fineweb import TokenLoader, write_shard

# documents with multi-byte characters (2, 3 and 4 bytes in UTF-8), so tokens and bytes differ in count
DOCS = ["Return the café's menu — in full, with prices in €.", "Raise ValueError if the naïve key is missing 🙂.",
        "A list of (name, value) pairs; the values are strings or None."]


@pytest.fixture(scope="module")
def text_shards(tmp_path_factory):
    """A val shard of real text, documents separated by <|endoftext|> as fineweb.py writes them (enough windows)."""
    enc, out = get_tokenizer(), tmp_path_factory.mktemp("text")
    tokens = [t for _ in range(12) for doc in DOCS for t in [EOT, *enc.encode_ordinary(doc)]]
    write_shard(out / "text_val_000000.bin", np.array(tokens, dtype=np.uint16))
    return out


def independent_bpb(hf_dir, data, windows: int, B: int, T: int) -> float:
    """transformers' GPT-2 on the first `windows` val windows: the nats of every target that is not <|endoftext|>,
    over the UTF-8 bytes those targets decode to, all at once."""
    from transformers import GPT2LMHeadModel

    hf, enc = GPT2LMHeadModel.from_pretrained(hf_dir).eval(), get_tokenizer()
    loader = TokenLoader(str(data), "val", B, T, 0, 1, 1337, torch.device("cpu"))
    nats, text = 0.0, b""
    with torch.no_grad():
        for x, y in (loader.next_batch() for _ in range(windows)):
            losses = F.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten(), reduction="none")
            kept = y.flatten() != EOT
            nats += losses[kept].double().sum().item()
            text += enc.decode_bytes(y.flatten()[kept].tolist())
    return nats / math.log(2) / len(text)


def eval_args(data, hf_dir, out, *extra: str) -> list[str]:
    return ["--init-from", str(hf_dir), "--data", str(data), "--out-dir", str(out), "--eval-only", "--seq-len=32",
            "--batch-size=2", "--eval-tokens=192", "--hellaswag=off", "--sample-every=0", *extra]


def test_val_bpb_is_the_targets_nats_over_their_bytes(text_shards, hf_dir, tmp_path, capsys):
    result = train.main(eval_args(text_shards, hf_dir, tmp_path / "out"))  # 192 tokens: 3 windows of 2 x 32
    want = independent_bpb(hf_dir, text_shards, 3, 2, 32)
    assert result["val_bpb"] == pytest.approx(want, rel=1e-5)
    # nats per token over bytes per token: bpb is far below the loss in bits (the random model's ~15.6 bits a token)
    assert 1.0 < result["val_bpb"] < result["val_loss"] / math.log(2) / 2
    assert re.search(rf"val loss {result['val_loss']:.4f} \| bpb {result['val_bpb']:.4f}", capsys.readouterr().out)


def test_token_bytes_count_special_and_padded_ids_as_zero():
    enc = get_tokenizer()
    table = token_bytes(50304)
    assert table.shape == (50304,) and table[EOT] == 0 and table[50257:].sum() == 0
    assert table[enc.encode_ordinary(" the")[0]] == 4 and table[enc.encode_ordinary("€")].sum() == 3
    assert table[:EOT].min() >= 1 and table.sum() == sum(len(enc.decode_single_token_bytes(i)) for i in range(EOT))
    # a vocabulary smaller than the tokenizer's: one entry an id; the table made on the device it is asked for
    assert token_bytes(256).tolist() == [len(enc.decode_single_token_bytes(i)) for i in range(256)]
    assert token_bytes(8, "meta").device.type == "meta"


class FixedBatch:
    """A val loader of one window: x, and targets with ignored (-1) and chat-token (50,258) positions."""

    rank, device = 0, torch.device("cpu")

    def __init__(self, x, y):
        self.x, self.y = x, y

    def reset(self):
        pass

    def next_batch(self):
        return self.x, self.y


def test_ignored_targets_and_chat_tokens_count_in_neither_sum():
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    enc = get_tokenizer()
    ids = enc.encode_ordinary("The naïve café — open 🙂 on Sundays; the menu lists its prices in € and £.")[:15]
    x = torch.tensor([[EOT, *ids]])
    y = torch.tensor([[*ids, EOT]])
    y[0, :4], y[0, 6] = -1, 50258  # a prompt (ignored) and an assistant-end token
    got = engine.val_metrics(model, FixedBatch(x, y), 1, contextlib.nullcontext(), 1, token_bytes(50304))
    with torch.no_grad():
        losses = F.cross_entropy(model(x)[0][0], y[0].clamp(min=0), reduction="none")
    kept = [t for t in range(16) if y[0, t] >= 0 and y[0, t] < EOT]
    assert len(kept) == 10  # 16 targets less 4 ignored, the chat token and <|endoftext|>
    nbytes = len(enc.decode_bytes([y[0, t].item() for t in kept]))
    assert got["bpb"] == pytest.approx(losses[kept].double().sum().item() / math.log(2) / nbytes, rel=1e-5)
    assert got["loss"] == pytest.approx(losses[y[0] >= 0].mean().item(), rel=1e-5)  # the loss keeps the chat token


@pytest.mark.slow
def test_val_bpb_sums_over_ranks(text_shards, hf_dir, tmp_path):
    # 3 windows on 2 ranks: rank 1's second turn runs for the collectives and is left out of both sums
    proc = run_torchrun(["train.py", *eval_args(text_shards, hf_dir, tmp_path / "ddp")], nproc=2)
    bpb = float(re.search(r"\| bpb (\d+\.\d+)", proc.stdout).group(1))
    assert bpb == pytest.approx(independent_bpb(hf_dir, text_shards, 3, 2, 32), abs=1e-4)


@pytest.mark.parametrize("chunk", [0, 5])
def test_one_forward_a_window_gives_the_loss_and_the_bits(chunk):
    # the model's per-token losses (the head 5 rows at a time, or all at once) against two forwards' means
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, loss_chunk=chunk))
    x, y = torch.randint(0, EOT, (2, 16)), torch.randint(0, EOT, (2, 16))
    y[0, :3], y[1, 5], y[1, 9] = -1, EOT, 50258
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    got = engine.val_metrics(model, FixedBatch(x, y), 1, contextlib.nullcontext(), 1, token_bytes(50304))
    assert len(forwards) == 1
    with torch.no_grad():
        mean = model(x, y)[1].item()
        counted = torch.where((y >= 0) & (y < EOT), y, -1)
        nats = model(x, counted)[1].double().item() * int((counted >= 0).sum())
    nbytes = len(get_tokenizer().decode_bytes(counted[counted >= 0].tolist()))
    assert got["loss"] == pytest.approx(mean, rel=1e-6)
    assert got["bpb"] == pytest.approx(nats / math.log(2) / nbytes, rel=1e-6)


class Windows:
    """A val loader of distinct windows, one per next_batch, as rank `rank` of a data-parallel run reads them."""

    device = torch.device("cpu")

    def __init__(self, batches, rank):
        self.batches, self.rank, self.i = batches, rank, 0

    def reset(self):
        self.i = 0

    def next_batch(self):
        self.i += 1
        return self.batches[self.i - 1]


def test_each_rank_scores_its_own_windows_and_runs_the_same_number_of_forwards():
    # 3 windows on 2 ranks (no process group, so each rank's share before the all-reduce): rank 0 scores windows 0 and
    # 2, rank 1 window 1 and then a turn past the 3 that runs (FSDP's collectives) and is left out; both divide by 3
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    batches = [(torch.randint(0, EOT, (1, 16)), torch.randint(0, EOT, (1, 16))) for _ in range(2)]
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with torch.no_grad():
        means = [model(x, y)[1].double().item() for x, y in batches]
    forwards.clear()
    for rank, want in ((0, (means[0] + means[1]) / 3), (1, means[0] / 3)):
        got = engine.val_metrics(model, Windows(batches, rank), 3, contextlib.nullcontext(), 2, token_bytes(50304))
        assert got["loss"] == pytest.approx(want, rel=1e-6) and len(forwards) == 2, rank
        forwards.clear()


def test_sharded_models_two_forwards_give_the_same_three_sums():
    # --tp/--pp's shards (parallelize.Sharded: a forward_backward, and a forward that returns the mean loss alone) take
    # a second forward on the counted targets for the nats: the same sums as one forward's per-token losses
    from model import GPT, GPTConfig

    class MeanOnly(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward_backward(self):
            raise AssertionError("not called by an evaluation")

        def forward(self, x, y):
            return None, self.model(x, y)[1]

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    x, y = torch.randint(0, EOT, (2, 16)), torch.randint(0, EOT, (2, 16))
    y[0, :3], y[1, 5], y[1, 9] = -1, EOT, 50258
    with torch.no_grad():
        one, two = (engine.window_sums(m, x, y, token_bytes(50304)) for m in (model, MeanOnly(model)))
    torch.testing.assert_close(two, one, rtol=1e-6, atol=0)
    assert two[1] > 0 and two[2] > 0
    # a window whose targets are all ignored or special: no nats and no bytes, not the NaN of a mean over no targets
    y[:] = -1
    y[:, 4], y[1, 7] = EOT, 50258
    with torch.no_grad():
        one, two = (engine.window_sums(m, x, y, token_bytes(50304)) for m in (model, MeanOnly(model)))
    assert one[1:].tolist() == two[1:].tolist() == [0.0, 0.0]


def test_each_evaluation_scores_the_first_windows_without_dropout_and_gives_back_a_training_model():
    # the step-0 evaluation comes before the first step: a model left in eval mode would train without its dropout
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32, dropout=0.5))
    batches = [(torch.randint(0, EOT, (1, 16)), torch.randint(0, EOT, (1, 16))) for _ in range(2)]
    with torch.no_grad():
        want = model.eval()(*batches[0])[1].item()
    loader = Windows(batches, 0)
    for _ in range(2):  # the second evaluation reads window 0 again, not the next one
        model.train()
        got = engine.val_metrics(model, loader, 1, contextlib.nullcontext(), 1, token_bytes(50304))
        assert got["loss"] == pytest.approx(want, rel=1e-6) and model.training


def test_tensor_parallel_copies_of_a_window_count_once(monkeypatch):
    # --tp 2 on one data-parallel rank: the all-reduce adds the two ranks' copies of each window's sums; the loss is
    # divided back, bpb (a ratio) needs nothing
    from model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=32))
    batches = [(torch.randint(0, EOT, (1, 16)), torch.randint(0, EOT, (1, 16)))]
    one = engine.val_metrics(model, Windows(batches, 0), 1, contextlib.nullcontext(), 1, token_bytes(50304))
    monkeypatch.setattr(engine, "dist", types.SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: 2,
                                                              all_reduce=lambda t: t.mul_(2)))
    two = engine.val_metrics(model, Windows(batches, 0), 1, contextlib.nullcontext(), 1, token_bytes(50304))
    assert two == pytest.approx(one, rel=1e-12)
