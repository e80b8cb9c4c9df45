"""prefs.py: the three pair schemas from local files (the hub's layouts through the same datasets call), one-line
errors naming bad rows, the PairLoader's masks, resume and rank shares, the Bradley–Terry and DPO losses against
closed forms and falling on one batch through parallel.train_step; and model.py's value head."""

import contextlib
import dataclasses
import gzip
import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from chat_format import ASSISTANT_END
from common import EOT, get_tokenizer, iter_log, load_checkpoint, parse_config
from conftest import one_line_error, run_nodes, run_torchrun
from fineweb import DataError
from model import GPT, MODEL_PRESETS, GPTConfig
from parallel import Objective, StepArgs, build_trainable, frozen_copy, rewards, sequence_logprobs, train_step
from prefs import PairLoader, bradley_terry, dpo, dpo_metrics, evaluate_pairs, parse_pair, reward_model_metrics
from tasks import synthetic_pairs

LN2 = math.log(2)


def tiny(value_head: bool = False) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=48, n_layer=2, n_head=4, n_embd=64, value_head=value_head))


def text_rows(n: int) -> list[dict]:
    return [{"prompt": f"What is {i} + {i}?", "chosen": f"It is {2 * i}.", "rejected": f"It is {2 * i + 1}."}
            for i in range(n)]


def conversation(prompt: str, reply: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply}]


def transcript(*turns: str) -> str:
    return "".join(f"\n\n{'Human' if i % 2 == 0 else 'Assistant'}: {t}" for i, t in enumerate(turns))


def replies(loader: PairLoader, batch: tuple[torch.Tensor, torch.Tensor]) -> list[str]:
    """Each row's masked tokens, decoded."""
    ids, mask = batch
    return [get_tokenizer().decode([t for t in row[m].tolist() if t != ASSISTANT_END]) + "<|assistant_end|>"
            * int(ASSISTANT_END in row[m].tolist()) for row, m in zip(ids, mask, strict=True)]


# ----------------------------------------------------------------------------------------------------------------------
# rows


def test_each_schema_parses_to_prompt_messages_and_two_replies():
    assert parse_pair(text_rows(1)[0]) == ([{"role": "user", "content": "What is 0 + 0?"}], "It is 0.", "It is 1.")
    uf = {"prompt": "Hi?", "chosen": conversation("Hi?", "Hello!"), "rejected": conversation("Hi?", "Go away.")}
    assert parse_pair(uf) == ([{"role": "user", "content": "Hi?"}], "Hello!", "Go away.")
    # hh-rlhf: two turns shared, the last replies differ; a pair that diverges one turn earlier keeps the rest in its
    # replies (their shared prefix ends at the first assistant turn)
    hh = {"chosen": transcript("Hi", "Hello.", "Name a color", "Blue."),
          "rejected": transcript("Hi", "Hello.", "Name a color", "No.")}
    prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
              {"role": "user", "content": "Name a color"}]
    assert parse_pair(hh) == (prompt, "Blue.", "No.")
    early = {"chosen": transcript("Hi", "Hello.", "Bye"), "rejected": transcript("Hi", "Go.", "Bye")}
    assert parse_pair(early) == ([{"role": "user", "content": "Hi"}], "Hello.\n\nHuman: Bye", "Go.\n\nHuman: Bye")
    # replies that differ only in trailing whitespace are two replies (TRL keeps them), not 'chosen == rejected'
    spaced = {"chosen": transcript("Hi", "Hello. "), "rejected": transcript("Hi", "Hello.")}
    assert parse_pair(spaced) == ([{"role": "user", "content": "Hi"}], "Hello. ", "Hello.")
    # TRL's conversational format with its prompt apart: the replies are lists of the assistant's message (the prompt
    # was dropped, and the row refused as starting with an assistant message)
    trl = {"prompt": [{"role": "user", "content": "Hi?"}], "chosen": conversation("Hi?", "Hello!")[1:],
           "rejected": conversation("Hi?", "Go away.")[1:]}
    assert parse_pair(trl) == ([{"role": "user", "content": "Hi?"}], "Hello!", "Go away.")
    # Dahoas/rm-static's: hh-rlhf's prompt apart, as a transcript up to the last "Assistant:" (one user message before)
    static = {"prompt": transcript("Hi", "Hello.", "Name a color") + "\n\nAssistant:", "chosen": " Blue.",
              "rejected": " No."}
    assert parse_pair(static) == (prompt, "Blue.", "No.")
    # and its prompt as text: it was dropped, and the row refused as starting with the assistant
    assert parse_pair({**trl, "prompt": "Hi?"}) == ([{"role": "user", "content": "Hi?"}], "Hello!", "Go away.")


def test_multi_turn_conversations_keep_every_earlier_turn_and_a_prompts_spaces():
    # ultrafeedback-style whole conversations of two turns: the prompt is all but the last message, not the first one
    history = [*conversation("Hi", "Hello."), {"role": "user", "content": "Name a color"}]
    multi = {"chosen": [*history, {"role": "assistant", "content": "Blue."}],
             "rejected": [*history, {"role": "assistant", "content": "No."}]}
    assert parse_pair(multi) == (history, "Blue.", "No.")
    # hh-rlhf transcripts that part at the first reply: the cut is the shared prefix's last "Assistant:", not chosen's
    early = {"chosen": transcript("Hi", "Hello.", "Bye", "Ciao."), "rejected": transcript("Hi", "Go.", "Bye", "Later.")}
    assert parse_pair(early) == ([{"role": "user", "content": "Hi"}], "Hello.\n\nHuman: Bye\n\nAssistant: Ciao.",
                                 "Go.\n\nHuman: Bye\n\nAssistant: Later.")
    # hh-rlhf's turns lose only the one space after "Human:": the prompt's own spaces are its text
    hh = {"chosen": transcript("  Hi there ", "Sure."), "rejected": transcript("  Hi there ", "No.")}
    assert parse_pair(hh) == ([{"role": "user", "content": "  Hi there "}], "Sure.", "No.")
    # a text prompt that opens like a transcript but does not end with "\n\nAssistant:" is one user message, whole
    text = {"prompt": transcript("What is 2 + 2?"), "chosen": "4", "rejected": "5"}
    assert parse_pair(text) == ([{"role": "user", "content": transcript("What is 2 + 2?")}], "4", "5")


@pytest.mark.parametrize("row, message", [
    ({"prompt": "p", "chosen": "a"}, "missing field 'rejected'"),
    # sft.py's data given to prefs.py: "missing field 'chosen'" alone
    ({"messages": [{"role": "user", "content": "p"}, {"role": "assistant", "content": "a"}]},
     "missing field 'chosen': a row with 'messages' is a conversation, sft.py's data; a pair is {\"prompt\", "
     "\"chosen\", \"rejected\"} (tasks.py --pairs writes them)"),
    ({"chosen": "one reply", "rejected": "another"}, "no 'prompt' field, and chosen and rejected are not"),
    ({"prompt": "p", "chosen": conversation("a", "x"), "rejected": conversation("b", "y")},
     "chosen and rejected continue different conversations"),
    ({"prompt": "p", "chosen": 3, "rejected": "y"}, "expected the prompt as text or messages"),
    # a user's last message is not an assistant's reply; a transcript's text before its first turn is not dropped
    ({"chosen": [{"role": "user", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]},
     "expected the prompt as text or messages, chosen and rejected as text or conversations that end with"),
    # a reply as content parts (OpenAI's, and sft.py's for tool calls): pairs take its text, and say so
    ({"prompt": "p", "chosen": [{"role": "assistant", "content": [{"type": "text", "text": "a"}]}],
      "rejected": [{"role": "assistant", "content": "b"}]}, "expected the prompt as text or messages, chosen and "
     "rejected as text or conversations that end with the assistant's reply as a string, not a list of parts"),
    # a reply's reasoning beside its text: parse_pair keeps the text, so the pair was scored without it
    ({"chosen": [*conversation("p", "a")[:1], {"role": "assistant", "content": "a", "reasoning_content": "r"}],
      "rejected": conversation("p", "b")}, "message 1 (assistant) has 'reasoning_content', which the chat format does "
     "not render: move it into the content"),
    ({"chosen": "Be kind." + transcript("Hi", "Hello."), "rejected": "Be kind." + transcript("Hi", "Go.")},
     "the transcripts start with 'Be kind.', text before their first '\\n\\nHuman:' turn"),
    # TRL's RewardTrainer subtracts a row's margin from the reward gap: training without it was another objective
    ({**text_rows(1)[0], "margin": 1.5}, "a 'margin' field, which prefs.py's losses do not take (TRL's "
     "RewardTrainer subtracts it from the reward gap): drop the field to train without it"),
])
def test_a_bad_row_is_one_line_naming_it(tmp_path, row, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [text_rows(1)[0], row]))
    with pytest.raises(DataError) as e:
        PairLoader(str(path), "train", 1, 48)
    assert str(e.value).startswith(f"{path} row 1 (0-based, not a line number): {message}")
    assert "\n" not in str(e.value)


def test_each_schema_loads_from_local_files_and_hub_layouts(tmp_path):
    pd = pytest.importorskip("pandas")
    # text: a local JSONL file, its every 20th row (row 0 here) held out as val, as chat_format's conversations
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in text_rows(5)))
    loader = PairLoader(str(path), "train", 4, 48, shuffle=False)
    assert loader.num_pairs == 4 and replies(loader, loader.next_batch())[:2] == ["It is 2.<|assistant_end|>",
                                                                                  "It is 4.<|assistant_end|>"]
    assert PairLoader(str(path), "val", 1, 48).num_pairs == 1
    # ultrafeedback_binarized: parquet files under data/ named by its splits, extra columns as on the hub
    uf = tmp_path / "uf" / "data"
    uf.mkdir(parents=True)
    for split, n in (("train_prefs", 6), ("test_prefs", 3)):
        rows = [{"prompt": f"Q{i}", "chosen": conversation(f"Q{i}", f"good {i}"),
                 "rejected": conversation(f"Q{i}", f"bad {i}"), "score_chosen": 9.0, "score_rejected": 2.0}
                for i in range(n)]
        pd.DataFrame(rows).to_parquet(uf / f"{split}-00000-of-00001.parquet")
    loader = PairLoader(str(uf.parent), "test_prefs", 3, 48, shuffle=False)
    assert loader.num_pairs == 3
    assert replies(loader, loader.next_batch()) == [f"{w} {i}<|assistant_end|>" for w in ("good", "bad")
                                                    for i in range(3)]
    # hh-rlhf: one gzipped JSONL per subset and split
    for subset, n in (("harmless-base", 2), ("helpful-base", 3)):
        (tmp_path / "hh" / subset).mkdir(parents=True)
        with gzip.open(tmp_path / "hh" / subset / "train.jsonl.gz", "wt") as f:
            for i in range(n):
                f.write(json.dumps({"chosen": transcript(f"{subset} {i}", "Sure."),
                                    "rejected": transcript(f"{subset} {i}", "No.")}) + "\n")
    loader = PairLoader(str(tmp_path / "hh"), "train", 5, 48, shuffle=False)
    assert loader.num_pairs == 5
    assert sorted(replies(loader, loader.next_batch())) == ["No.<|assistant_end|>"] * 5 + ["Sure.<|assistant_end|>"] * 5


@pytest.mark.parametrize("datasets_installed", [True, False])
def test_a_local_copy_of_ultrafeedback_reads_its_prefs_splits(tmp_path, monkeypatch, datasets_installed):
    """The hub name read train_prefs/test_prefs, but its local copy (no train split) was refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not datasets_installed:
        for name in ["datasets", *(m for m in list(sys.modules) if m.startswith("datasets."))]:
            monkeypatch.setitem(sys.modules, name, None)  # an import of it raises; find_spec says None
    (tmp_path / "data").mkdir()
    for split, n in (("train_prefs", 6), ("test_prefs", 3), ("train_sft", 5), ("train_gen", 4)):
        rows = [{"prompt": f"Q{i}", "chosen": conversation(f"Q{i}", f"good {i}"),
                 "rejected": conversation(f"Q{i}", f"bad {i}")} for i in range(n)]
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data" / f"{split}-00000-of-00001.parquet")
    assert [PairLoader(str(tmp_path), split, 1, 48).num_pairs for split in ("train", "val")] == [6, 3]


def test_a_hub_dataset_without_train_and_test_reads_the_stages_splits(tmp_path, monkeypatch):
    """As its local copy does: HuggingFaceH4/ultrafeedback_binarized was a name in prefs.py, ultrachat_200k unknown to
    sft.py. The hub is this directory here, read by datasets' own code."""
    datasets = pytest.importorskip("datasets")
    (tmp_path / "data").mkdir()
    for split, n in (("train_prefs", 6), ("test_prefs", 3), ("train_gen", 4)):
        rows = [{"prompt": f"Q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(n)]
        (tmp_path / "data" / f"{split}-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for real in (datasets.get_dataset_split_names, datasets.load_dataset):
        monkeypatch.setattr(datasets, real.__name__, lambda _, *a, real=real, **k: real(str(tmp_path), *a, **k))
    assert [PairLoader("someone/prefs", split, 1, 48).num_pairs for split in ("train", "val")] == [6, 3]


def test_a_glob_of_pair_files_is_read_as_one_file(tmp_path, capsys):
    for name, n in (("a.jsonl", 25), ("b.jsonl", 15)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in text_rows(n)))
    pattern = str(tmp_path / "*.jsonl")
    assert [PairLoader(pattern, split, 1, 48).num_pairs for split in ("train", "val")] == [38, 2]  # rows 0, 20 val
    assert capsys.readouterr().out.startswith(f"{pattern} train: 38 pairs; 0 with a side over 48 tokens and 0 ties "
                                              "or empty replies dropped; "
                                              "every 20th row from row 0 is held out as val, with --eval-every 0 "
                                              "too\n")


def test_ties_and_empty_replies_are_dropped_and_counted_not_a_stop(capsys):
    # a hub set's tie or empty reply stopped the run, with no file to edit; they prefer nothing, so TRL's users filter
    moot = [{"prompt": "p", "chosen": "same", "rejected": "same"}, {"prompt": "p", "chosen": "a", "rejected": "  "},
            {"prompt": "p", "chosen": "", "rejected": "b"}]
    loader = PairLoader(text_rows(4) + moot, "train", 1, 48, shuffle=False)
    assert loader.num_pairs == 4 and "4 pairs; 0 with a side over 48 tokens and 3 ties or empty replies dropped" in \
        capsys.readouterr().out
    with pytest.raises(DataError, match=r"0 pairs of at most T = 48 tokens \(0 longer, 3 ties or empty dropped\)"):
        PairLoader(moot, "train", 1, 48)


def test_an_empty_reply_in_a_conversation_is_dropped_as_in_text():
    # UltraFeedback's and TRL's conversational rows: check_messages refused the blank reply before the pair was dropped
    blank = [{"chosen": conversation("p", "a"), "rejected": conversation("p", " ")},
             {"prompt": [{"role": "user", "content": "p"}], "chosen": [{"role": "assistant", "content": ""}],
              "rejected": [{"role": "assistant", "content": "b"}]}]
    assert PairLoader(text_rows(2) + blank, "train", 1, 48, shuffle=False).num_pairs == 2


def test_batches_pad_to_t_with_the_mask_on_the_replies_and_overlong_pairs_dropped(capsys):
    rows = text_rows(4) + [{"prompt": "long " * 60, "chosen": "a", "rejected": "b"}]
    loader = PairLoader(rows, "train", 2, 24, shuffle=False)
    assert loader.num_pairs == 4 and loader.num_windows == 2  # the long pair is dropped
    assert capsys.readouterr().out.startswith("<5 rows> train: 4 pairs; 1 with a side over 24 tokens and 0 ties or "
                                              "empty replies dropped")  # and counted
    ids, mask = loader.next_batch()
    assert ids.shape == mask.shape == (4, 24) and ids.dtype == torch.int64 and mask.dtype == torch.bool
    enc, starts = get_tokenizer(), []
    for row, reply in enumerate(["It is 0.", "It is 2.", "It is 1.", "It is 3."]):  # chosen rows, then rejected
        first, last = int(mask[row].nonzero()[0]), int(mask[row].nonzero()[-1])
        assert ids[row, first:last + 1].tolist() == enc.encode_ordinary(reply) + [ASSISTANT_END]
        assert mask[row, first:last + 1].all() and (ids[row, last + 1:] == EOT).all()
        starts.append(first)
    for c in (0, 1):  # a pair's two rows share the prompt up to the reply
        assert starts[c] == starts[c + 2] and torch.equal(ids[c, :starts[c]], ids[c + 2, :starts[c]])
    loader.check_vocab(50263)  # ids up to 50262: 50263 rows hold them, 50262 do not
    with pytest.raises(DataError, match="uses token ids up to 50262, but the model has only 50262"):
        loader.check_vocab(50262)


def test_a_multi_turn_pairs_mask_is_its_last_reply_only_and_a_side_of_exactly_t_tokens_is_kept():
    # BOS <|user_start|> Hi <|user_end|> <|assistant_start|> Hello <|assistant_end|> <|user_start|> Hi <|user_end|>
    # <|assistant_start|> Hello|Yes <|assistant_end|>: 13 tokens a side, the reply at 11 and 12
    prompt = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
              {"role": "user", "content": "Hi"}]
    rows = [{"prompt": prompt, "chosen": "Hello", "rejected": "Yes"},
            {"prompt": prompt, "chosen": "Hello", "rejected": "Yes yes"}]  # its rejected side, 14 tokens: dropped
    loader = PairLoader(rows, "train", 1, 13, shuffle=False)
    assert loader.num_pairs == 1 and loader.starts.tolist() == [[11, 11]]
    ids, mask = loader.next_batch()
    assert mask.tolist() == [[False] * 11 + [True] * 2] * 2  # not the earlier assistant turn at 5 and 6
    assert replies(loader, (ids, mask)) == ["Hello<|assistant_end|>", "Yes<|assistant_end|>"]


def test_resume_is_bitwise_ranks_take_disjoint_shares_and_epochs_reshuffle():
    rows = text_rows(12)
    loader = PairLoader(rows, "train", 3, 40, seed=1)
    served = [loader.next_batch() for _ in range(9)]  # 27 pairs: into the third epoch
    resumed = PairLoader(rows, "train", 3, 40, seed=1)
    again = PairLoader(rows, "train", 3, 40, seed=1)
    for _ in range(4):
        again.next_batch()
    resumed.load_state_dict(again.state_dict())
    for want in served[4:]:
        got = resumed.next_batch()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    chosen = [[r for r in replies(loader, b)[:3]] for b in served]
    epoch0, epoch1 = sum(chosen[:4], []), sum(chosen[4:8], [])
    assert sorted(epoch0) == sorted(epoch1) and len(set(epoch0)) == 12 and epoch0 != epoch1
    # two ranks: one epoch between them, none twice; rank r's s-th batch is the stream's batch 2s + r
    shares = [PairLoader(rows, "train", 3, 40, rank, 2, seed=1) for rank in (0, 1)]
    seen = [sum((replies(s, s.next_batch())[:3] for _ in range(2)), []) for s in shares]
    assert not set(seen[0]) & set(seen[1]) and sorted(seen[0] + seen[1]) == sorted(epoch0)
    assert seen[1][:3] == chosen[1] and seen[0][3:] == chosen[2]
    state = dict(again.state_dict(), seed=2)
    with pytest.raises(DataError, match="cannot resume the train loader of <12 rows>: seed=2 in the checkpoint but 1"):
        resumed.load_state_dict(state)


def test_resume_on_pairs_whose_chosen_and_rejected_were_swapped_is_refused():
    """The same rows relabeled: as many pairs and tokens, so only the tokens' CRC tells them apart."""
    loader = PairLoader(text_rows(12), "train", 3, 40, seed=1)
    loader.next_batch()
    state = loader.state_dict()
    swapped = PairLoader([{**r, "chosen": r["rejected"], "rejected": r["chosen"]} for r in text_rows(12)], "train", 3,
                         40, seed=1)
    assert (swapped.tokens, swapped.num_pairs) == (loader.tokens, loader.num_pairs) == (state["shard_tokens"][0], 12)
    with pytest.raises(DataError) as e:
        swapped.load_state_dict(state)
    assert str(e.value) == ("cannot resume the train loader of <12 rows>: <12 rows> holds other tokens than the "
                            "checkpoint's under the same name and size; resume with the checkpoint's --data or start "
                            "a fresh run")
    swapped.load_state_dict({k: v for k, v in state.items() if k != "shard_crc32"})  # a checkpoint from before the CRC
    assert swapped.step == 1


def test_synthetic_pairs_from_a_task_prefer_the_right_answer():
    class Doubling:  # tasks.py's protocol: examples, check and wrong
        def examples(self, split: str) -> list[dict]:
            return [{"messages": conversation(f"Double {k}?", str(2 * k)), "answer": str(2 * k)} for k in range(10, 40)]

        def check(self, reply: str, answer: str) -> bool:
            return reply == answer

        def wrong(self, answer: str, rng: random.Random) -> str:
            return str(int(answer) + rng.choice([-1, 1]))

    pairs = synthetic_pairs(Doubling(), "train", 8, seed=3)  # the first 8 problems, the wrong replies seeded
    assert pairs == synthetic_pairs(Doubling(), "train", 8, seed=3) != synthetic_pairs(Doubling(), "train", 8, seed=4)
    assert len(synthetic_pairs(Doubling(), "train")) == 30
    for pair in pairs:
        k = int(pair["prompt"][0]["content"].split()[1].rstrip("?"))
        assert pair["chosen"] == str(2 * k) and abs(int(pair["rejected"]) - 2 * k) == 1
    assert PairLoader(pairs, "train", 4, 32).num_pairs == 8


# ----------------------------------------------------------------------------------------------------------------------
# objectives


def test_bradley_terry_and_dpo_against_closed_forms():
    out = bradley_terry(torch.tensor([0.0, 2.0, -1.0]), torch.tensor([0.0, 1.0, 1.0]))  # margins 0, 1, -2
    want = (LN2 + math.log1p(math.exp(-1)) + math.log1p(math.exp(2))) / 3
    assert abs(out["loss"].item() - want) < 1e-6 and abs(out["accuracy"].item() - 1 / 3) < 1e-6
    assert abs(out["margin"].item() + 1 / 3) < 1e-6
    # implicit rewards beta * (policy - ref): chosen 0.5 * (-1 + 2) = 0.5, rejected 0.5 * (-3 + 2) = -0.5
    out = dpo(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.5)
    assert abs(out["loss"].item() - math.log1p(math.exp(-1))) < 1e-6 and out["accuracy"].item() == 1.0
    assert abs(out["chosen_reward"].item() - 0.5) < 1e-6 and abs(out["rejected_reward"].item() + 0.5) < 1e-6
    assert abs(dpo(*torch.tensor([[-1.0], [-3.0], [-2.0], [-2.0]]))["margin"].item() - 0.2) < 1e-6  # beta 0.1
    # each side against its own reference: chosen 0.5 * (-1 + 2) = 0.5, rejected 0.5 * (-3 + 1.5) = -0.75
    out = dpo(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-1.5]), beta=0.5)
    assert abs(out["loss"].item() - math.log1p(math.exp(-1.25))) < 1e-6 and abs(out["margin"].item() - 1.25) < 1e-6
    assert abs(out["chosen_reward"].item() - 0.5) < 1e-6 and abs(out["rejected_reward"].item() + 0.75) < 1e-6


# two pairs by hand, beta 0.5: log-ratios log(policy / reference) chosen 0.5 and -1, rejected -1 and 1, over replies of
# 2 and 4 (chosen), 1 and 3 (rejected) tokens; TRL's logits (chosen - rejected log-ratio) 1.5 and -2
PAIRS = [torch.tensor(v) for v in ([-4.0, -6.0], [-5.0, -3.0], [-4.5, -5.0], [-4.0, -4.0])]
LENGTHS = (torch.tensor([2, 4]), torch.tensor([1, 3]))


@pytest.mark.parametrize("loss, want", [
    ("sigmoid", (math.log1p(math.exp(-0.75)) + math.log1p(math.exp(1.0))) / 2),  # -log sigmoid(beta * logits)
    ("hinge", (0.25 + 2.0) / 2),  # relu(1 - beta * logits): 1 - 0.75, 1 + 1
    # TRL's ipo on per-token means: logits 0.5/2 + 1/1 = 1.25 and -1/4 - 1/3 = -7/12, less 1 / (2 beta) = 1, squared
    ("ipo", ((1.25 - 1) ** 2 + (-7 / 12 - 1) ** 2) / 2),
])
def test_each_dpo_loss_against_trls_formula_by_hand(loss, want):
    out = dpo(*PAIRS, beta=0.5, loss=loss, tokens=LENGTHS)
    assert out["loss"].item() == pytest.approx(want, rel=1e-6)
    # the logged rewards, margin and accuracy are the summed log-ratios' whatever the loss, as TRL (v0.29 on) logs them
    assert [out[k].item() for k in ("accuracy", "margin", "chosen_reward", "rejected_reward")] == pytest.approx(
        [0.5, (0.75 - 1.0) / 2, (0.25 - 0.5) / 2, (-0.5 + 0.5) / 2])


def test_hinge_adds_nothing_for_a_pair_past_its_margin():
    # relu(1 - beta * logits), TRL's: logits 3 (beta * 3 = 1.5 > 1) gives 0, logits 1 gives 1 - 0.5; without the relu
    # the first would give -0.5 and the mean 0
    out = dpo(*map(torch.tensor, ([-1.0, -1.0], [-4.0, -2.0], [-1.0, -1.0], [-1.0, -1.0])), beta=0.5, loss="hinge")
    assert out["loss"].item() == pytest.approx((0.0 + 0.5) / 2, rel=1e-6)


def test_ipo_takes_each_replys_token_count_from_the_mask():
    # the per-token means divide by each side's reply tokens: the masked targets after position 0, as TRL's
    rows = [{"prompt": "What is 1 + 1?", "chosen": "It is 2.", "rejected": "I think it is three, or so."},
            {"prompt": "What is 2 + 2?", "chosen": "Four, of course: two and two.", "rejected": "5"}]
    ids, mask = PairLoader(rows, "train", 2, 40, shuffle=False).next_batch()
    model, ref = tiny(), frozen_copy(tiny())
    with torch.no_grad():
        ref.transformer.h[0].mlp.c_fc.weight.add_(0.5 * torch.randn_like(ref.transformer.h[0].mlp.c_fc.weight))
    logs = [F.log_softmax(m(ids)[0].float(), -1) for m in (model, ref)]
    mean = [[sum(lp[r, t - 1, ids[r, t]].item() for t in range(1, 40) if mask[r, t]) / int(mask[r, 1:].sum())
             for r in range(4)] for lp in logs]  # policy's and reference's, rows: chosen 0, 1, rejected 2, 3
    logits = [(mean[0][p] - mean[1][p]) - (mean[0][p + 2] - mean[1][p + 2]) for p in (0, 1)]
    want = sum((x - 1 / (2 * 0.25)) ** 2 for x in logits) / 2
    assert mask[:, 1:].sum(1).tolist() == [5, 10, 10, 2]  # sides of other lengths: sums would give another loss
    assert dpo_metrics(model, (ids, mask), ref, beta=0.25, loss="ipo")["loss"].item() == pytest.approx(want, rel=1e-4)
    mask[:, 0] = True  # no target: sequence_logprobs scores positions 1 on, so the count must too (not 6, 11, 11, 3)
    assert dpo_metrics(model, (ids, mask), ref, beta=0.25, loss="ipo")["loss"].item() == pytest.approx(want, rel=1e-4)


def test_reward_is_the_value_at_the_last_reply_token_and_sequence_logprobs_sum_the_reply():
    model = tiny(value_head=True)
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    ids, mask = PairLoader(text_rows(2), "train", 2, 40, shuffle=False).next_batch()
    values = model(ids, values=True, return_logits=False)[1]
    assert values.shape == (4, 40) and values.dtype == torch.float32
    last = [int(m.nonzero()[-1]) for m in mask]
    torch.testing.assert_close(rewards(model, ids, mask), values[torch.arange(4), last])
    logp = F.log_softmax(model(ids)[0].float(), -1)
    want = [sum(logp[r, t - 1, ids[r, t]].item() for t in range(1, 40) if mask[r, t]) for r in range(4)]
    torch.testing.assert_close(sequence_logprobs(model, ids, mask), torch.tensor(want), rtol=1e-5, atol=1e-4)
    counts = [sum(int(mask[r, t]) for t in range(1, 40)) for r in range(4)]  # the reply's tokens, BOS never one
    mean = torch.tensor(want) / torch.tensor(counts)
    torch.testing.assert_close(rewards(model, ids, mask, logprob=True), values[torch.arange(4), last] + mean,
                               rtol=1e-5, atol=1e-4)


def train_pairs(raw: GPT, objective: Objective, batch: tuple, steps: int) -> list[dict]:
    """`steps` AdamW steps on one batch through parallel.train_step; the metrics of each."""
    args = StepArgs(device="cpu", max_lr=3e-3, weight_decay=0.0)
    built = build_trainable(raw, args, torch.device("cpu"), use_compile=False, verbose=False)
    out = []
    for _ in range(steps):
        train_step(built.model, built.optimizer, lambda: batch, 1, built.autocast, 1.0, objective=objective)
        out.append({k: v.item() for k, v in objective.last.items()})
    return out


def test_the_logged_accuracy_and_margin_are_the_steps_not_its_last_micro_batchs():
    metrics = iter([{"loss": torch.tensor(1.0), "accuracy": torch.tensor(a), "margin": torch.tensor(m)}
                    for a, m in ((1.0, 0.5), (0.5, -0.25), (0.0, 1.0), (0.25, 0.0))])
    objective = Objective(lambda model, batch: next(metrics), summarised=("accuracy", "margin"))
    for _ in range(2):  # two micro-batches a step: the logged numbers cover both, as the loss does
        objective(None, None)
    assert objective.summary() == {"accuracy": 0.75, "margin": 0.125}
    for _ in range(2):
        objective(None, None)
    assert objective.summary() == {"accuracy": 0.125, "margin": 0.5} and objective.last["margin"].item() == 0.0


def test_reward_model_starts_at_ln2_and_learns_one_batch():
    loader = PairLoader(text_rows(4), "train", 4, 40)
    batch = loader.next_batch()
    model = tiny(value_head=True)
    start = reward_model_metrics(model, batch)
    assert start["loss"].item() == pytest.approx(LN2, abs=1e-7) and start["accuracy"].item() == 0.0  # zero head
    log = train_pairs(model, Objective(reward_model_metrics), batch, 15)
    assert log[0]["loss"] == pytest.approx(LN2, abs=1e-6) and log[-1]["loss"] < 0.1 and log[-1]["accuracy"] == 1.0
    held = evaluate_pairs(model, loader, 1, reward_model_metrics, torch.autocast("cpu", enabled=False), 1)
    assert held == pytest.approx({k: v.item() for k, v in reward_model_metrics(model, batch).items()})


def test_dpo_starts_at_ln2_against_its_reference_and_learns_one_batch():
    batch = PairLoader(text_rows(4), "train", 4, 40).next_batch()
    model = tiny()
    ref = frozen_copy(model)
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    objective = Objective(lambda m, b: dpo_metrics(m, b, ref, beta=0.1))
    log = train_pairs(model, objective, batch, 10)
    assert log[0]["loss"] == pytest.approx(LN2, abs=1e-6) and log[0]["margin"] == 0.0
    end = log[-1]
    assert end["loss"] < 0.4 and end["accuracy"] == 1.0 and end["chosen_reward"] > end["rejected_reward"]
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), tiny().parameters(), strict=True))  # frozen


def test_dpo_sft_adds_the_chosen_replies_mean_token_nll():
    ids, mask = PairLoader(text_rows(2), "train", 2, 40, shuffle=False).next_batch()
    model, ref = tiny(), frozen_copy(tiny())
    logp = F.log_softmax(model(ids)[0].float(), -1)
    # the chosen rows are the batch's first half; a reply's tokens are the masked targets after position 0
    nll = -sum(logp[r, t - 1, ids[r, t]].item() for r in range(2) for t in range(1, 40) if mask[r, t])
    count = int(mask[:2, 1:].sum())
    plain, rpo = dpo_metrics(model, (ids, mask), ref), dpo_metrics(model, (ids, mask), ref, sft=0.5)
    assert count > 4 and rpo["nll"].item() == pytest.approx(nll / count, rel=1e-5)
    assert rpo["loss"].item() == pytest.approx(plain["loss"].item() + 0.5 * nll / count, rel=1e-5)
    assert "nll" not in plain and rpo["margin"] == plain["margin"]


def test_dpo_metrics_take_their_beta_and_each_side_against_the_reference():
    ids, mask = PairLoader(text_rows(2), "train", 2, 40, shuffle=False).next_batch()
    model, ref = tiny(), frozen_copy(tiny())
    with torch.no_grad():
        ref.transformer.h[0].mlp.c_fc.weight.add_(0.5 * torch.randn_like(ref.transformer.h[0].mlp.c_fc.weight))
    pc, pr = sequence_logprobs(model, ids, mask).chunk(2)
    rc, rr = sequence_logprobs(ref, ids, mask).chunk(2)
    out = dpo_metrics(model, (ids, mask), ref, beta=0.5)
    want = 0.5 * ((pc - rc) - (pr - rr))
    assert abs(want.mean().item()) > 1e-3  # the reference differs: beta shows
    assert out["margin"].item() == pytest.approx(want.mean().item(), rel=1e-5)
    assert out["loss"].item() == pytest.approx(-F.logsigmoid(want).mean().item(), rel=1e-5)


def test_reward_model_metrics_pass_logprob_on_to_the_score():
    batch = PairLoader(text_rows(2), "train", 2, 40, shuffle=False).next_batch()
    model = tiny(value_head=True)  # a zero head: without the log-probs every margin is 0
    chosen, rejected = rewards(model, *batch, logprob=True).chunk(2)
    out = reward_model_metrics(model, batch, logprob=True)
    assert abs((chosen - rejected).mean().item()) > 1e-4
    assert out["margin"].item() == pytest.approx((chosen - rejected).mean().item(), rel=1e-5)


def scoring_model(dropout: float = 0.0) -> GPT:
    """A tiny reward model whose head tells pairs apart: each batch has its own metrics."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=48, n_layer=2, n_head=4, n_embd=64, value_head=True, dropout=dropout))
    torch.nn.init.normal_(model.value_head.weight, std=0.1)
    return model


def test_evaluate_pairs_scores_the_first_batches_once_across_ranks_from_the_start_in_eval_mode(monkeypatch):
    import prefs

    model, off = scoring_model(), contextlib.nullcontext()
    rows = text_rows(8)
    one = PairLoader(rows, "val", 1, 40, shuffle=False)
    want = evaluate_pairs(model, one, 3, reward_model_metrics, off, 1)
    one.reset()
    by_batch = [reward_model_metrics(model, one.next_batch()) for _ in range(4)]
    assert want == pytest.approx({k: sum(m[k].item() for m in by_batch[:3]) / 3 for k in want})
    assert by_batch[3]["loss"].item() != pytest.approx(want["loss"])  # a 4th batch would show
    assert evaluate_pairs(model, one, 3, reward_model_metrics, off, 1) == want  # from the split's start again
    # dropout off while it scores, and the model's training mode back after
    noisy = scoring_model(dropout=0.5).train()
    held = evaluate_pairs(noisy, one, 1, reward_model_metrics, off, 1)
    assert noisy.training
    one.reset()
    with torch.no_grad():
        batch = one.next_batch()
        assert held == pytest.approx({k: v.item() for k, v in reward_model_metrics(noisy.eval(), batch).items()})
    # two ranks (rank r's s-th batch is the stream's 2s + r): 2 turns each, rank 1's second (batch 3) left out
    shares = [PairLoader(rows, "val", 1, 40, rank, 2, shuffle=False) for rank in (0, 1)]
    other = []
    monkeypatch.setattr(prefs, "all_sum", lambda t, world: other.append(t.clone()) or t)
    evaluate_pairs(model, shares[1], 3, reward_model_metrics, off, 2)
    monkeypatch.setattr(prefs, "all_sum", lambda t, world: t + other[0])  # rank 0's sum plus rank 1's
    assert evaluate_pairs(model, shares[0], 3, reward_model_metrics, off, 2) == pytest.approx(want)


def test_pair_evals_log_the_held_out_loss_accuracy_and_margin():
    from types import SimpleNamespace as NS

    import prefs

    model, off, said = scoring_model(), contextlib.nullcontext(), []
    loader = PairLoader(text_rows(4), "val", 2, 40, shuffle=False)
    setup = NS(val_loader=loader, built=NS(model=model, autocast=off), ctx=NS(master=True, world=1),
               log=NS(say=said.append))
    [val] = prefs.pair_evals(NS(eval_every=5, eval_tokens=160), setup, Objective(reward_model_metrics))
    want = evaluate_pairs(model, loader, 2, reward_model_metrics, off, 1)  # 160 tokens: both windows of 2 x 40
    assert len(set(want.values())) == 3 and val.every == 5
    assert val.fn(3) == {"val_loss": want["loss"], "val_accuracy": want["accuracy"], "val_margin": want["margin"]}
    assert said == [f"step      3 | val loss {want['loss']:.4f} | pairs ranked right {want['accuracy']:.4f}"]


def test_dpos_pair_evals_log_its_held_out_rewards_and_sft_term_as_trl_does():
    # TRL's eval_rewards/chosen and /rejected: both falling is what --dpo-sft is there to stop, so the log shows them
    from types import SimpleNamespace as NS

    import prefs

    model, off = tiny(), contextlib.nullcontext()
    ref = frozen_copy(model)
    with torch.no_grad():
        ref.transformer.h[0].mlp.c_fc.weight.add_(0.5 * torch.randn_like(ref.transformer.h[0].mlp.c_fc.weight))
    loader = PairLoader(text_rows(4), "val", 2, 40, shuffle=False)
    setup = NS(val_loader=loader, built=NS(model=model, autocast=off), ctx=NS(master=True, world=1),
               log=NS(say=lambda line: None))
    metrics = lambda m, b: dpo_metrics(m, b, ref, sft=1.0)
    [val] = prefs.pair_evals(NS(eval_every=5, eval_tokens=160), setup, Objective(metrics))
    want = evaluate_pairs(model, loader, 2, metrics, off, 1)
    assert val.fn(3) == {f"val_{k}": v for k, v in want.items()} and len(want) == 6


# ----------------------------------------------------------------------------------------------------------------------
# model.py's value head


def test_value_head_loads_from_weights_without_it(hf_dir):
    plain = tiny()
    ckpt = {"model_config": dataclasses.asdict(plain.config), "model": plain.state_dict()}
    assert "value_head" not in str(list(ckpt["model"])) and not plain.config.value_head
    model = GPT.from_checkpoint(ckpt, value_head=True)
    assert model.value_head.weight.abs().sum() == 0 and model.value_head.bias.abs().sum() == 0
    ids = torch.randint(0, 50257, (2, 9))
    torch.testing.assert_close(model(ids)[0], plain(ids)[0])  # the same language model underneath
    assert torch.equal(model(ids, values=True)[0], model(ids)[0]) and model(ids, values=True)[1].abs().sum() == 0
    again = GPT.from_checkpoint({"model_config": dataclasses.asdict(model.config), "model": model.state_dict()})
    assert again.config.value_head and set(again.state_dict()) == set(model.state_dict())
    hf = GPT.from_pretrained(str(hf_dir), value_head=True)
    assert hf.value_head.weight.shape == (1, hf.config.n_embd)


# ----------------------------------------------------------------------------------------------------------------------
# on the engine: prefs.py --objective reward / dpo


@pytest.fixture(scope="module")
def addition_pairs(tmp_path_factory) -> Path:
    from tasks import main as tasks_main

    out = tmp_path_factory.mktemp("tasks") / "addition"
    tasks_main(["--task=addition", f"--out-dir={out}", "--pairs", "--limit=256"])
    return out.with_name("addition_pairs")


def pairs_run(data: Path, out: Path, preset: str, *extra: str) -> list[str]:
    return ["--preset", preset, "--init-from=", "--model=tiny", "--data", str(data), "--out-dir", str(out),
            "--total-batch-size=384", "--batch-size=8", "--eval-tokens=384", "--task=", "--warmup-steps=2", *extra]


@pytest.fixture(scope="module")
def random_start(tmp_path_factory) -> Path:
    """A random tiny model saved as a checkpoint: DPO needs --init-from, its reference."""
    path = tmp_path_factory.mktemp("start") / "tiny.pt"
    torch.manual_seed(0)
    model = GPT(MODEL_PRESETS["tiny"]())
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config)}, path)
    return path


# DPO starts from a tie (a policy equal to its reference): log 2, or IPO's (0 - 1 / (2 beta))^2 = 25; the reward
# model's zero head adds nothing to the random model's near-uniform log-probs of two replies
@pytest.mark.parametrize("preset, loss, start", [("rm-demo", "sigmoid", pytest.approx(LN2, abs=1e-2)),
                                                 ("dpo-demo", "sigmoid", pytest.approx(LN2, abs=1e-6)),
                                                 ("dpo-demo", "ipo", pytest.approx(25.0, abs=1e-4))])
def test_reward_model_and_dpo_train_on_the_engine_and_resume_bitwise(addition_pairs, random_start, tmp_path, preset,
                                                                     loss, start, capsys):
    import prefs

    extra = ["--max-steps=4", "--ckpt-every=2", "--eval-every=2", "--dpo-sft=0"]  # DPO's tie below: no SFT term
    extra += [f"--init-from={random_start}", f"--dpo-loss={loss}"] if preset == "dpo-demo" else []
    full = prefs.main(pairs_run(addition_pairs, tmp_path / "full", preset, *extra))
    # a pair is two sequences: the header counted one (384), log.jsonl both
    assert "768 tokens/step = 2 x 8 pairs x 24 x 1 ranks x 2 accum" in capsys.readouterr().out
    assert [r["tokens"] for r in iter_log(tmp_path / "full" / "log.jsonl") if r["type"] == "train"] == [768, 1536,
                                                                                                      2304, 3072]
    prefs.main(pairs_run(addition_pairs, tmp_path / "split", preset, *extra, "--max-steps=2"))
    rest = prefs.main(pairs_run(addition_pairs, tmp_path / "split", preset, *extra, "--resume=auto"))
    losses = [r["loss"] for r in iter_log(tmp_path / "split" / "log.jsonl") if r["type"] == "train"]
    # bitwise: for DPO this also shows the resumed run's reference is the starting weights, not the resumed ones
    assert losses == full["losses"] and rest["val"] == full["val"]
    assert rest["losses"] == full["losses"][2:]  # it resumed at step 2: a restart from 0 matched the full run too
    assert full["losses"][0] == start and all(map(math.isfinite, full["losses"] + list(full["val"].values())))
    records = [r for r in iter_log(tmp_path / "full" / "log.jsonl") if r["type"] in ("train", "val", "config")]
    assert [r["config"]["dpo_loss"] for r in records if r["type"] == "config"] == [loss]  # the log says which loss
    assert all(0 <= r["accuracy"] <= 1 for r in records if r["type"] == "train")
    assert [r["step"] for r in records if r["type"] == "val"] == [0, 2, 4]
    assert all(0 <= r["val_accuracy"] <= 1 for r in records if r["type"] == "val")
    ckpt = load_checkpoint(tmp_path / "full" / "ckpt_000004.pt")
    assert ("value_head.weight" in ckpt["model"]) == (preset == "rm-demo") and ckpt["chat"] is True


def test_dpo_on_two_ranks_logs_what_one_process_logs(addition_pairs, random_start, tmp_path):
    # the two ranks' micro-batches are the one process's two accumulation steps: the same losses, and the logged
    # accuracy and margin the mean of the ranks' means (their sum logged an accuracy above 1)
    import prefs

    extra = ["--max-steps=3", "--eval-every=0", "--ckpt-every=0", f"--init-from={random_start}"]
    prefs.main(pairs_run(addition_pairs, tmp_path / "single", "dpo-demo", *extra))
    run_torchrun(["prefs.py", *pairs_run(addition_pairs, tmp_path / "ddp", "dpo-demo", *extra)], nproc=2)
    logged = [[r[key] for r in iter_log(tmp_path / out / "log.jsonl") if r["type"] == "train"
               for key in ("loss", "accuracy", "margin")] for out in ("single", "ddp")]
    assert len(logged[0]) == 9 and logged[1] == pytest.approx(logged[0], abs=1e-5)
    assert logged[0][4] == 0.625  # step 1's accuracy: 10 of its 16 pairs


def test_the_stage_hands_its_flags_to_the_objective_and_shuffles_the_train_pairs_alone(addition_pairs, random_start,
                                                                                        tmp_path, monkeypatch):
    import prefs

    seen, loaders = set(), set()  # --dpo-sft, --dpo-beta, --dpo-loss and --reward-logprob: each handed on
    dpo_metrics, reward_metrics, loader = prefs.dpo_metrics, prefs.reward_model_metrics, prefs.PairLoader
    monkeypatch.setattr(prefs, "dpo_metrics", lambda model, batch, ref, **kw: seen.add(("dpo", *sorted(kw.items())))
                        or dpo_metrics(model, batch, ref, **kw))
    monkeypatch.setattr(prefs, "reward_model_metrics", lambda model, batch, **kw: seen.add(
        ("reward", *sorted(kw.items()))) or reward_metrics(model, batch, **kw))
    monkeypatch.setattr(prefs, "PairLoader", lambda *a, **kw: loaders.add((a[1], kw["shuffle"])) or loader(*a, **kw))
    extra = ["--max-steps=1", "--eval-every=1", "--ckpt-every=0"]  # and the held-out pairs scored
    prefs.main(pairs_run(addition_pairs, tmp_path / "dpo", "dpo-demo", *extra, f"--init-from={random_start}",
                         "--dpo-sft=0.5", "--dpo-beta=0.2", "--dpo-loss=hinge"))
    prefs.main(pairs_run(addition_pairs, tmp_path / "rm", "rm-demo", *extra))  # its preset: --reward-logprob
    assert seen == {("dpo", ("beta", 0.2), ("loss", "hinge"), ("sft", 0.5)), ("reward", ("logprob", True))}
    assert loaders == {("train", True), ("val", False)}


def test_a_fresh_reward_model_too_small_for_the_chat_tokens_names_the_flag_that_made_it(addition_pairs, tmp_path,
                                                                                       capsys):
    import prefs

    # it said "start from a model with more": an --init-from is padded for the chat tokens, a fresh model only is short
    assert one_line_error(capsys, prefs.main, pairs_run(addition_pairs, tmp_path, "rm-demo", "--vocab-size=50257")) \
        == (f"error: {addition_pairs}: the chat format uses token ids up to 50262, but the model has only 50257 "
            "embedding rows; pass --vocab-size 50267 or more (the default: 50304)")


def test_a_dpo_resume_from_other_starting_weights_is_refused_they_are_its_reference(addition_pairs, random_start,
                                                                                    tmp_path, capsys):
    import prefs

    extra = ["--max-steps=2", "--ckpt-every=1", "--eval-every=0"]
    first = prefs.main(pairs_run(addition_pairs, tmp_path / "run", "dpo-demo", *extra, f"--init-from={random_start}",
                                 "--max-steps=1", "--eval-every=1"))
    other = tmp_path / "other.pt"
    torch.manual_seed(1)
    model = GPT(MODEL_PRESETS["tiny"]())
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(model.config)}, other)
    resumed = pairs_run(addition_pairs, tmp_path / "run", "dpo-demo", *extra, f"--init-from={other}", "--resume=auto")
    refusal = (f"error: the run resumed took its DPO reference from the weights of --init-from {random_start}, not "
               f"{other}'s: pass its --init-from, or start a new run")
    assert one_line_error(capsys, prefs.main, resumed) == refusal  # it trained on against another reference, silently
    # --eval-only scored the DPO losses against the other reference, silently; with its own, it scores
    scored = [*resumed, "--eval-only", "--eval-every=1"]
    assert one_line_error(capsys, prefs.main, scored) == refusal
    assert prefs.main([*scored, f"--init-from={random_start}"])["val"] == first["val"]


def dpo_run(data: Path, out: Path, *extra: str) -> list[str]:
    """A 2-step dpo-demo run with no --init-from of its own: the preset's default, or what `extra` gives."""
    return [arg for arg in pairs_run(data, out, "dpo-demo", "--max-steps=2", "--ckpt-every=1", "--eval-every=2", *extra)
            if arg != "--init-from="]


def test_a_dpo_resume_without_init_from_takes_its_runs_start_not_the_presets(addition_pairs, random_start, tmp_path,
                                                                            monkeypatch, capsys):
    # it read dpo-demo's default (out/sft-demo-1200/ckpt_001200.pt) as the reference: "no such file", or another
    # model's weights refused; the checkpoint records the run's --init-from, the only source of its reference
    import prefs

    monkeypatch.chdir(tmp_path)  # the preset's relative default: no such file here
    full = prefs.main(dpo_run(addition_pairs, tmp_path / "full", f"--init-from={random_start}"))
    prefs.main(dpo_run(addition_pairs, tmp_path / "split", f"--init-from={random_start}", "--max-steps=1"))
    capsys.readouterr()
    rest = prefs.main(dpo_run(addition_pairs, tmp_path / "split", "--resume=auto"))
    note = f"note: --init-from {random_start}, the resumed run's start (its checkpoint records it; none given here)"
    assert note in capsys.readouterr().out.splitlines()
    assert rest["losses"] == full["losses"][1:] and rest["val"] == full["val"]  # bitwise: the same reference
    assert prefs.main(dpo_run(addition_pairs, tmp_path / "split", "--resume=auto", "--eval-only"))["val"] == full["val"]


def test_a_dpo_resume_whose_recorded_start_is_not_found_names_it(addition_pairs, random_start, tmp_path, monkeypatch,
                                                                 capsys):
    # a relative --init-from, resumed from another directory: the error named the preset's default, not the run's;
    # a run without a preset still needs --init-from to resume (its flags are checked before any checkpoint is read)
    import prefs

    monkeypatch.chdir(random_start.parent)
    prefs.main(dpo_run(addition_pairs, tmp_path / "run", f"--init-from={random_start.name}", "--max-steps=1"))
    monkeypatch.chdir(tmp_path)
    assert one_line_error(capsys, prefs.main, dpo_run(addition_pairs, tmp_path / "run", "--resume=auto")) == (
        f"error: --init-from {random_start.name}: no such file or directory (nor a hub name)")
    bare = ["--objective=dpo", "--model=tiny", "--data", str(addition_pairs), "--out-dir", str(tmp_path / "run"),
            "--resume=auto"]
    assert one_line_error(capsys, prefs.main, bare) == (
        "error: --objective dpo moves a model away from its starting weights, its reference: pass --init-from a "
        "fine-tuned model (a random one prefers nothing)")


def test_a_dpo_resume_whose_reference_is_built_with_other_options_is_refused(addition_pairs, random_start, tmp_path,
                                                                             capsys):
    # the policy kept the checkpoint's --half-residual, the reference (--init-from loaded again) took --init-from's
    import prefs

    extra = ["--max-steps=2", "--ckpt-every=1", "--eval-every=0", f"--init-from={random_start}"]
    prefs.main(pairs_run(addition_pairs, tmp_path / "run", "dpo-demo", *extra, "--half-residual=true", "--max-steps=1"))
    assert one_line_error(capsys, prefs.main, pairs_run(addition_pairs, tmp_path / "run", "dpo-demo", *extra,
                                                        "--resume=auto")) == (
        f"error: the run resumed took its DPO reference from --init-from {random_start} built with half_residual True, "
        "this run with half_residual False: pass --half-residual True, or start a new run")


def test_a_dpo_resume_whose_reference_file_has_another_architecture_names_no_flag_that_cannot_set_it(
        addition_pairs, random_start, tmp_path, capsys):
    # a copy saved with head_size 16 (GPT-2's None: the same weights) said "pass --head-size None", which
    # check_architecture then refuses against the file; no flag sets an --init-from's architecture: the file does
    import prefs

    ckpt = torch.load(random_start, weights_only=False)
    ckpt["model_config"]["head_size"] = 16
    torch.save(ckpt, copy := tmp_path / "copy.pt")
    extra = ["--max-steps=2", "--ckpt-every=1", "--eval-every=0", "--half-residual=true"]
    prefs.main(pairs_run(addition_pairs, tmp_path / "run", "dpo-demo", *extra, f"--init-from={random_start}",
                         "--max-steps=1"))
    assert one_line_error(capsys, prefs.main, pairs_run(addition_pairs, tmp_path / "run", "dpo-demo", *extra[:3],
                                                        f"--init-from={copy}", "--model=", "--resume=auto")) == (
        f"error: the run resumed took its DPO reference from --init-from {random_start} built with half_residual True, "
        "head_size None, this run with half_residual False, head_size 16: pass --half-residual True and the "
        "--init-from it was built from, or start a new run")


def test_a_dpo_resume_whose_reference_file_differs_in_the_lm_losss_speed_options_goes_on(addition_pairs, random_start,
                                                                                         tmp_path):
    # an --init-from saved with --loss-chunk 8 (or --fused-ce), a copy without: "pass --loss-chunk 8", which prefs.py
    # then refuses ("does not use --loss-chunk"); the reference's forward computes no loss, so neither changes it
    import prefs

    ckpt = torch.load(random_start, weights_only=False)
    ckpt["model_config"].update(loss_chunk=8, fused_ce=True)
    torch.save(ckpt, chunked := tmp_path / "chunked.pt")
    extra = ["--max-steps=2", "--ckpt-every=1", "--eval-every=0"]
    prefs.main(pairs_run(addition_pairs, tmp_path / "run", "dpo-demo", *extra, f"--init-from={chunked}",
                         "--max-steps=1"))
    prefs.main(pairs_run(addition_pairs, tmp_path / "run", "dpo-demo", *extra, f"--init-from={random_start}",
                         "--resume=auto"))
    assert [r["step"] for r in iter_log(tmp_path / "run" / "log.jsonl") if r["type"] == "train"] == [0, 1]


@pytest.mark.slow
@pytest.mark.parametrize("option, value, code, last", [
    ("half_residual", True, 1, ["error: rank 1's DPO reference differs from rank 0's: every node must hold the same "
                                "DPO reference"]),
    ("dropout", 0.1, 0, [])])  # off in eval mode, as one node's resume ignores it: it stopped both ranks
def test_nodes_whose_dpo_references_were_saved_with_other_options_stop_on_resume(addition_pairs, random_start,
                                                                                 tmp_path, option, value, code, last):
    # a resume builds the policy from the checkpoint and the reference from each node's --init-from (a LOCAL path):
    # one saved with --half-residual held the same weights, and that node trained against another reference, silently
    import prefs

    extra = ["--max-steps=2", "--ckpt-every=1", "--eval-every=0"]
    prefs.main(pairs_run(addition_pairs, tmp_path / "run", "dpo-demo", *extra, f"--init-from={random_start}",
                         "--max-steps=1"))
    ckpt = torch.load(random_start, weights_only=False)
    ckpt["model_config"][option] = value
    torch.save(ckpt, half := tmp_path / "half.pt")
    done = run_nodes([["prefs.py", *pairs_run(addition_pairs, tmp_path / "run", "dpo-demo", *extra, "--resume=auto",
                                              f"--init-from={start}")] for start in (random_start, half)])
    assert [(r.returncode, r.stderr.splitlines()[-1:] if code else []) for r in done] == [(code, last)] * 2


@pytest.mark.slow
def test_a_node_that_cannot_load_the_dpo_reference_on_resume_stops_every_node(addition_pairs, random_start, tmp_path):
    # a resume loads its policy from the checkpoint, so the reference's load was each node's own: the node without
    # the file stopped alone, and the other was left in the next collective
    import prefs

    extra = ["--max-steps=2", "--ckpt-every=1", "--eval-every=0"]
    prefs.main(pairs_run(addition_pairs, tmp_path / "run", "dpo-demo", *extra, f"--init-from={random_start}",
                         "--max-steps=1"))
    missing = tmp_path / "missing.pt"
    done = run_nodes([["prefs.py", *pairs_run(addition_pairs, tmp_path / "run", "dpo-demo", *extra, "--resume=auto",
                                              f"--init-from={start}")] for start in (random_start, missing)])
    line = f"--init-from {missing}: no such file or directory (nor a hub name)"
    assert [[e for e in r.stderr.splitlines() if e.startswith("error:")] for r in done] == [[f"error: rank 1: {line}"],
                                                                                            [f"error: {line}"]]


@pytest.mark.parametrize("main, flags, message", [
    ("prefs", ["--objective=lm"], "--objective must be reward or dpo, --dpo-loss one of sigmoid, ipo, hinge and "
                                  "--dpo-sft >= 0; got 'lm', 'sigmoid' and 0.0"),
    ("prefs", ["--init-from=x.pt", "--dpo-loss=kto"], "--objective must be reward or dpo, --dpo-loss one of sigmoid, "
                                                      "ipo, hinge and --dpo-sft >= 0; got 'dpo', 'kto' and 0.0"),
    # a reward model trains on Bradley-Terry alone: DPO's loss would be ignored
    ("prefs", ["--objective=reward", "--dpo-loss=ipo"], "--objective reward does not use --dpo-loss: drop it"),
    ("prefs", ["--objective=reward", "--value-head=false"], "--objective reward trains a value head"),
    ("prefs", ["--objective=dpo", "--init-from=x.pt", "--parallel=fsdp"], "--objective dpo keeps a whole frozen"),
    ("prefs", ["--objective=reward", "--dpo-sft=1"], "--objective reward does not use --dpo-sft: drop it"),
    # a reward model's greedy replies were scored as task accuracy: its logits are not what it trains (tasks.py --eval
    # refuses one), with --reward-logprob too: they are half of its score
    ("prefs", ["--objective=reward", "--task=addition"], "--objective reward does not use --task: drop it"),
    ("prefs", ["--objective=reward", "--reward-logprob", "--task=addition"], "--objective reward does not use --task"),
    ("prefs", ["--objective=dpo", "--init-from=x.pt", "--reward-logprob"], "--objective dpo does not use --reward-log"),
    ("prefs", ["--objective=dpo", "--init-from=x.pt", "--loss-chunk=64"], "--objective dpo does not use --loss-chunk"),
    # a value head neither trains: it stayed zero, and under DDP its missing gradient stops the run
    ("prefs", ["--objective=dpo", "--init-from=x.pt", "--value-head=true"],
     "--objective dpo trains no value head: drop --value-head true"),
    ("sft", ["--value-head=true"], "sft.py trains no value head: drop --value-head true"),
    # sft-demo sets --task: the way out named only ddp and zero1, and --task-every 0 was refused all the same
    ("sft", ["--parallel=fsdp", "--task=addition"], "--task generates replies, which --parallel fsdp cannot: use ddp "
                                                    "or zero1, or --task ''"),
    ("train", ["--preset=tiny", "--value-head=true"], "train.py trains no value head: drop --value-head true"),
    # a negative beta trains towards the rejected replies while its accuracy reads as right; NaN stops at step 0
    ("prefs", ["--objective=dpo", "--init-from=x.pt", "--dpo-beta=-0.1"],
     "--dpo-beta must be a positive number; got -0.1"),
    ("prefs", ["--objective=dpo", "--init-from=x.pt", "--dpo-beta=nan"],
     "--dpo-beta must be a positive number; got nan"),
    # a NaN, negative or infinite peak gives a NaN, negative or zero MFU in log.jsonl; 0 fell back to the table
    ("sft", ["--peak-tflops=nan"], "--peak-tflops must be a positive number; got nan"),
    ("train", ["--preset=tiny", "--peak-tflops=0"], "--peak-tflops must be a positive number; got 0.0"),
    # pretraining takes no flag of the post-training stages: refused, not silently ignored
    ("train", ["--preset=tiny", "--objective=dpo"], "unknown option --objective"),
    ("train", ["--preset=tiny", "--task=addition"], "unknown option --task"),
    ("prefs", ["--preload"], "unknown option --preload"),
    ("prefs", ["--label-smoothing=0.1"], "unknown option --label-smoothing"),
    ("sft", ["--shuffle=shards"], "unknown option --shuffle"),
    # TRL's DPOConfig names: --beta was offered AdamW's --beta2, --max-length the learning rate --max-lr
    ("prefs", ["--beta=0.1"], "unknown option --beta; did you mean --dpo-beta?"),
    ("prefs", ["--rpo-alpha=1"], "unknown option --rpo-alpha; did you mean --dpo-sft?"),
    ("prefs", ["--max-length=512"], "unknown option --max-length; did you mean --seq-len?"),
    # HF's per-device micro-batch was offered the total batch; nanoGPT's names had no hint at all
    ("sft", ["--per-device-train-batch-size=8"], "unknown option --per-device-train-batch-size; did you mean "
                                                 "--batch-size?"),
    ("sft", ["--gradient-accumulation-steps=4"], "unknown option --gradient-accumulation-steps; did you mean "
                                                 "--total-batch-size?"),
    ("train", ["--lr-decay-iters=600000"], "unknown option --lr-decay-iters; did you mean --max-steps?"),
    ("train", ["--log-interval=10"], "unknown option --log-interval; did you mean --log-every?"),
    # HF Trainer's were offered wrong ones (--save-steps --max-steps, --eval-steps --eval-tokens, --epochs --pos)
    ("sft", ["--save-steps=500"], "unknown option --save-steps; did you mean --ckpt-every?"),
    ("sft", ["--eval-steps=500"], "unknown option --eval-steps; did you mean --eval-every?"),
    ("sft", ["--logging-steps=10"], "unknown option --logging-steps; did you mean --log-every?"),
    ("sft", ["--epochs=2"], "unknown option --epochs; did you mean --max-steps?"),
    ("sft", ["--num-train-epochs=2"], "unknown option --num-train-epochs; did you mean --max-steps?"),
    ("sft", ["--lr=1e-3"], "unknown option --lr; did you mean --max-lr?"),
    ("prefs", ["--loss-type=ipo"], "unknown option --loss-type; did you mean --dpo-loss?"),  # rl.py's: --loss-agg
])
def test_a_flag_a_stage_cannot_honour_is_one_line(main, flags, message):
    import importlib

    with pytest.raises(SystemExit) as e:
        importlib.import_module(main).main(flags)
    assert str(e.value.code).startswith(f"error: {message}")


def test_without_a_preset_prefs_runs_dpo_on_its_own_schedule_at_trls_lr():
    # the bare defaults were pretraining's (lr 6e-4 for DPO, 19,073 steps, out/gpt2-124m); TRL's lr by objective
    from prefs import PrefsConfig
    cfg, rm = PrefsConfig(init_from="x.pt"), parse_config(PrefsConfig, ["--objective", "reward"])
    assert (cfg.max_lr, rm.max_lr, cfg.max_steps, cfg.total_batch_size, cfg.batch_size, cfg.out_dir) == \
        (1e-6, 1e-4, 955, 65536, 8, "out/prefs")
    assert PrefsConfig(objective="reward", max_lr=3e-4).max_lr == 3e-4  # a given lr is kept


def test_a_preset_given_the_other_objective_is_made_once_with_the_flags():
    # the preset was made, then replaced: rm-demo's value head (its objective's default) stayed under --objective dpo,
    # "drop --value-head true", never given; and an lr filled in for the preset's objective stayed under the other
    import functools

    from prefs import PRESETS, PrefsConfig
    cfg = parse_config(PrefsConfig, ["--preset", "rm-demo", "--objective", "dpo", "--reward-logprob", "false"], PRESETS)
    assert (cfg.objective, cfg.arch.get("value_head"), cfg.max_lr, cfg.seq_len) == ("dpo", None, 1e-4, 24)
    presets = {"mine": functools.partial(PrefsConfig, seq_len=24, arch={"n_layer": 2})}
    cfg = parse_config(PrefsConfig, ["--preset", "mine", "--objective", "reward", "--n-head", "2"], presets)
    assert (cfg.max_lr, cfg.arch) == (1e-4, {"n_layer": 2, "n_head": 2, "value_head": True})
