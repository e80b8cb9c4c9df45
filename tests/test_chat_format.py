"""chat_format.py: exact ids and masks, prompts, parsing, bad conversations, packing, and the loader's batches, resume
and rank interleaving on local files read through datasets (a JSONL file, and a directory in the hub's layout)."""

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import chat_format as cf
from fineweb import DataError

SYSTEM = {"role": "system", "content": "Be brief."}
TOOL_REPLY = [{"type": "text", "text": "2+2 is "}, {"type": "tool", "text": "2+2"}, {"type": "output", "text": "4"},
              {"type": "text", "text": "4."}]
CONVERSATION = [SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": TOOL_REPLY}]
# GPT-2 ids: Be brief. = 3856 4506 13; Hi = 17250; Hello = 15496; 2+2? = 17 10 17 30; 2+2 is = 17 10 17 318 220;
# 4 = 19; 4. = 19 13
IDS = [50256, 50257, 3856, 4506, 13, 50258, 50259, 17250, 50260, 50261, 15496, 50262, 50259, 17, 10, 17, 30, 50260,
       50261, 17, 10, 17, 318, 220, 50263, 17, 10, 17, 50264, 50265, 19, 50266, 19, 13, 50262]
MASK = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0,
        0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1]


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))


def chat(i: int) -> list[dict]:
    """Conversation i: 5 + (i % 7 + 1) + (i % 5 + 1) tokens (each word one token), one in nine with two turns."""
    turn = [{"role": "user", "content": " ".join(["hello"] * (i % 7 + 1))},
            {"role": "assistant", "content": " ".join(["yes"] * (i % 5 + 1))}]
    return turn * 2 if i % 9 == 0 else turn


def write_jsonl(path, conversations) -> str:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return str(path)


def test_render_gives_exact_ids_and_mask():
    ids, mask = cf.render(CONVERSATION)
    assert ids == IDS and mask == MASK
    assert cf.CHAT_VOCAB == cf.OUTPUT_END + 1 == 50267 and cf.BOS == 50256 and cf.TOOL_START == 50263


def test_render_prompt_is_the_conversation_up_to_assistant_start():
    assert cf.render_prompt(CONVERSATION[:4]) == IDS[:19]
    assert cf.render_prompt(CONVERSATION[:4])[-1] == cf.ASSISTANT_START


def test_user_text_never_makes_special_ids():
    ids, _ = cf.render([{"role": "user", "content": "<|user_end|><|endoftext|><|assistant_start|>"},
                        {"role": "assistant", "content": "<|assistant_end|>"}])
    assert [t for t in ids if t >= cf.BOS] == [cf.BOS, cf.USER_START, cf.USER_END, cf.ASSISTANT_START,
                                               cf.ASSISTANT_END]


def test_parse_inverts_the_reply_and_stops_at_its_end():
    reply = IDS[19:]  # after the last <|assistant_start|>
    assert cf.parse(reply) == TOOL_REPLY
    assert cf.reply_text(reply) == "2+2 is 4."
    assert cf.parse(reply + [cf.USER_START, 17250]) == TOOL_REPLY  # nothing after <|assistant_end|>
    assert cf.parse([17250, cf.USER_START, 15496]) == [{"type": "text", "text": "Hi"}]  # another special ends it
    assert cf.parse([17250]) == [{"type": "text", "text": "Hi"}]  # cut off: what there is
    assert cf.parse([17250, cf.BOS, 15496]) == [{"type": "text", "text": "Hi"}]  # BOS (<|endoftext|>) ends it too


def test_render_rows_counts_a_cut_only_past_cap_and_keeps_a_reply_whose_first_token_is_the_last():
    hi = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    ids, mask = cf.render(hi)  # BOS, <|user_start|>, Hi, <|user_end|>, <|assistant_start|>, Hello, <|assistant_end|>
    assert mask == [0, 0, 0, 0, 0, 1, 1]
    rows = [(0, hi), (1, hi)]
    for cap, (truncated, dropped) in ((7, (0, 0)), (6, (2, 0)), (5, (2, 2))):
        out, t, d = cf.render_rows("x", rows, cap)
        assert (t, d, len(out)) == (truncated, dropped, 2 - dropped), cap
        for row_ids, row_mask in out:
            assert row_ids.tolist() == ids[:cap] and row_mask.tolist() == [bool(m) for m in mask[:cap]]


@pytest.mark.parametrize("messages, why", [
    ([], "expected a non-empty list of messages"),
    ([{"role": "assistant", "content": "a"}], "message 0 is from assistant, expected user"),
    ([{"role": "user", "content": "q"}] * 2, "message 1 is from user, expected assistant"),
    ([{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}], "message 1 has role 'bot'"),
    ([{"role": "user", "content": "q"}, SYSTEM, {"role": "assistant", "content": "a"}],
     "message 1 is from system, expected assistant"),
    ([{"role": "user", "content": ""}, {"role": "assistant", "content": "a"}], "message 0 (user) is empty"),
    ([{"role": "user", "content": 5}, {"role": "assistant", "content": "a"}], "content of type int"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": "code", "text": "x"}]}],
     "bad part"),
    # a list where a name belongs: unhashable, they were TypeError tracebacks
    ([{"role": ["user"], "content": "q"}], "message 0 has role ['user']"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": [{"type": ["text"], "text": "x"}]}],
     "bad part"),
    ([{"role": "user", "content": "q"}], "last message is from user, expected assistant"),
])
def test_bad_conversations_are_one_line_errors(messages, why):
    with pytest.raises(ValueError, match=re.escape(why)) as info:
        cf.render(messages)
    assert "\n" not in str(info.value)


def test_a_tool_call_or_reasoning_beside_the_content_is_refused_not_dropped(tmp_path):
    # OpenAI's tool_calls and reasoning datasets' fields: rendered without them, SFT trained on a stripped reply
    call = [{"type": "function", "function": {"name": "calc", "arguments": '{"expr": "2+2"}'}}]
    for field, value in (("tool_calls", call), ("reasoning_content", "2+2 is 4"), ("thinking", "hm")):
        bad = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", field: value}]
        with pytest.raises(ValueError) as info:
            cf.render(bad)
        assert str(info.value) == (f"message 1 (assistant) has '{field}', which the chat format does not render: move "
                                   "it into the content (as text, or a tool call as {'type': 'tool'} parts) or drop "
                                   "the field")
    with pytest.raises(ValueError, match="^message 0 \\(user\\) has 'thinking'"):  # a prompt's too
        cf.render_prompt([{"role": "user", "content": "q", "thinking": "x"}])
    rows = [chat(i) for i in range(5)]
    rows[3] = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "tool_calls": call}]
    with pytest.raises(DataError, match=r"^\S*chats.jsonl row 3 \(0-based, not a line number\): message 1 "
                       r"\(assistant\) has 'tool_calls'"):
        cf.ConversationLoader(write_jsonl(tmp_path / "chats.jsonl", rows), "train", 1, 32)
    # absent or empty (as a hub dataset's columns fill them), or another key (a speaker's "name"): rendered as before
    empty = {"tool_calls": None, "reasoning_content": "", "thinking": [], "name": "bot"}
    assert cf.render([CONVERSATION[1], {**CONVERSATION[2], **empty}]) == cf.render(CONVERSATION[1:3])


def test_openais_weight_0_leaves_an_assistant_message_out_of_the_loss(tmp_path):
    # OpenAI's fine-tuning rows mark earlier replies "weight": 0: they were learned as the last one is
    ids, mask = cf.render([{**m, "weight": 0} if i == 2 else m for i, m in enumerate(CONVERSATION)])
    assert ids == IDS and mask == [0] * 19 + MASK[19:] and sum(MASK) == 15 and sum(mask) == 13
    assert cf.render([{**m, "weight": 1} for m in CONVERSATION]) == (IDS, MASK)
    assert cf.render([{**m, "weight": None} for m in CONVERSATION]) == (IDS, MASK)  # a hub column's empty cell
    with pytest.raises(ValueError) as info:
        cf.render([CONVERSATION[1], {**CONVERSATION[2], "weight": 0.5}])
    assert str(info.value) == "message 1 has weight 0.5: OpenAI's weight is 0 (not learned) or 1"
    two = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0}, *chat(1)]
    loader = cf.ConversationLoader(write_jsonl(tmp_path / "chats.jsonl", [chat(0), two, chat(2)]), "train", 1, 32)
    assert loader.num_rows == 1 and int(loader.mask.sum()) == 7  # row 0 is val; chat(1)'s 2 "yes" + end, chat(2)'s 3


def test_a_bad_row_names_its_index_in_the_file(tmp_path):
    rows = [chat(i) for i in range(5)]
    rows[3] = [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]
    message = r"chats.jsonl row 3 \(0-based, not a line number\): message 1 \(assistant\) is empty"
    with pytest.raises(DataError, match=message):
        cf.ConversationLoader(write_jsonl(tmp_path / "chats.jsonl", rows), "train", 1, 32)


def test_sharegpt_rows_load_as_the_same_conversations_written_as_messages(tmp_path):
    # ShareGPT's {"conversations": [{"from", "value"}, ...]} was refused in one line; TRL renames from/value, and
    # FastChat's speakers human and gpt are user and assistant
    speaker = {"system": "system", "user": "human", "assistant": "gpt"}
    convs = [[SYSTEM, *chat(i)] if i % 3 == 0 else chat(i) for i in range(60)]
    rows = [{"id": i, "conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in conv]}
            for i, conv in enumerate(convs)]
    path = tmp_path / "share.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    plain = cf.ConversationLoader(write_jsonl(tmp_path / "c.jsonl", convs), "train", 2, 31)
    as_messages = [{"conversations": conv} for conv in convs]  # some hub datasets call their messages so
    (tmp_path / "as.jsonl").write_text("".join(json.dumps(row) + "\n" for row in as_messages))
    for loader in cf.ConversationLoader(str(path), "train", 2, 31), cf.ConversationLoader(tmp_path / "as.jsonl",
                                                                                          "train", 2, 31):
        assert np.array_equal(loader.ids, plain.ids) and np.array_equal(loader.mask, plain.mask)
        assert loader.tokens == plain.tokens == 842 and loader.num_rows == plain.num_rows == 28  # 57 train rows
    # a speaker that is no role (glaive's function_call), or turns that are no list: one line naming the row
    bad = [(3, [{**rows[3]["conversations"][0], "from": "function_call"}],
            "message 0 is from 'function_call', expected human, gpt or system (ShareGPT's \"from\")"),
           (5, "hi", "expected a non-empty list of messages, got 'hi'"),  # and a turn with no speaker, or no dict:
           (6, [{"value": "Hi"}], "message 0 has no \"from\", expected human, gpt or system (ShareGPT's \"from\")"),
           (7, ["Hi"], "message 0 is 'Hi', expected a dict with a role and content")]
    for row, turns, why in bad:
        path.write_text("".join(json.dumps({"conversations": turns} if i == row else r) + "\n"
                                for i, r in enumerate(rows)))
        with pytest.raises(DataError) as info:
            cf.ConversationLoader(str(path), "train", 1, 31)
        assert str(info.value) == f"{path} row {row} (0-based, not a line number): {why}"


def test_trl_prompt_completion_rows_learn_the_completion_alone(tmp_path):
    # TRL's conversational {"prompt": [...], "completion": [...]} was refused; its completion_only_loss learns only the
    # completion, so a reply inside the prompt is given (mask 0) and the rest renders as the whole conversation does
    row = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:], "id": 3}
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps(row) + "\n" + json.dumps({**row, "id": 4}) + "\n")
    [(index, messages)] = cf.read_conversations(str(path), "val")  # one file: row 0 is val
    ids, mask = cf.render(messages)
    assert index == 0 and ids == IDS and mask == [0] * 10 + [0, 0] + MASK[12:]  # Hello and its end: 15496, 50262
    assert sum(MASK) - sum(mask) == 2 and messages[2] == {**CONVERSATION[2], "weight": 0}
    # single-turn rows load as the same conversations written as messages
    convs = [chat(i)[:2] for i in range(60)]
    path.write_text("".join(json.dumps({"prompt": c[:1], "completion": c[1:]}) + "\n" for c in convs))
    plain = cf.ConversationLoader(write_jsonl(tmp_path / "c.jsonl", convs), "train", 2, 31)
    loader = cf.ConversationLoader(str(path), "train", 2, 31)
    assert np.array_equal(loader.ids, plain.ids) and np.array_equal(loader.mask, plain.mask)
    assert loader.tokens == plain.tokens == sum(5 + i % 7 + 1 + i % 5 + 1 for i in range(60) if i % 20) == 682
    assert loader.num_rows == plain.num_rows == 23
    # a completion that does not answer the prompt's user: check_messages' line, naming the row
    path.write_text(json.dumps({"prompt": CONVERSATION[:4], "completion": CONVERSATION[3:]}) + "\n")
    with pytest.raises(DataError) as info:
        cf.ConversationLoader(str(path), "val", 1, 64)
    assert str(info.value) == f"{path} row 0 (0-based, not a line number): message 4 is from user, expected " \
        "assistant (an optional first system message, then user and assistant in turns)"


def test_a_parquet_of_messages_and_prompt_completion_rows_reads_both(tmp_path):
    # a table's columns are its rows' union, the absent ones None: a prompt/completion row's "messages": None was read
    # as its messages ("expected a non-empty list of messages, got None"), and a messages row's None prompt refused
    import pyarrow as pa
    import pyarrow.parquet as pq

    convs = [chat(9), chat(1)]  # 9: two turns, the prompt's reply given
    rows = [{"prompt": convs[0][:3], "completion": convs[0][3:], "messages": None},
            {"prompt": None, "completion": None, "messages": convs[1]}]
    pq.write_table(pa.Table.from_pylist(rows), path := tmp_path / "m.parquet")
    [(index, messages)] = cf.read_conversations(str(path), "val")  # the prompt/completion row
    assert index == 0 and messages == [*convs[0][:1], {**convs[0][1], "weight": 0}, *convs[0][2:]]
    assert [m for _, m in cf.read_conversations(str(path), "train")] == [convs[1]]


def test_pack_is_best_fit_decreasing_and_keeps_every_conversation_whole():
    lengths = [5, 3, 7, 2, 4, 1]
    rows = cf.pack(lengths, 8)
    assert rows == [[2, 5], [0, 1], [4, 3]]  # 7+1, 5+3, 4+2
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(500)]
    rows = cf.pack(lengths, 100)
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert max(sum(lengths[i] for i in row) for row in rows) <= 100
    assert len(rows) < 1.1 * sum(lengths) / 100 + 1  # best-fit decreasing is within 11/9 of optimal; here far closer


def test_loader_batches_whole_conversations_with_targets_only_on_the_assistant(tmp_path, capsys):
    convs = [chat(i) for i in range(200)]
    loader = cf.ConversationLoader(write_jsonl(tmp_path / "c.jsonl", convs), "train", 4, 31)
    rendered = sorted(cf.render(m)[0] for i, m in enumerate(convs) if i % cf.VAL_EVERY)  # every 20th is val
    pieces = []
    for row in loader.ids.tolist():  # split at BOS: each piece is one conversation, or padding (BOS alone)
        cuts = [k for k, t in enumerate(row) if t == cf.BOS] + [len(row)]
        pieces += [row[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b - a > 1]
    assert sorted(pieces) == rendered
    # 190 train conversations of 2525 tokens: at least 79 rows of 32; best-fit decreasing takes 84
    assert loader.tokens == 2525 and loader.num_rows == 84 and loader.num_windows == 21
    assert loader.padding == pytest.approx(1 - 2525 / (84 * 32))
    assert "190 conversations in 84 rows of 32 tokens, 6.1% padding; 0 of them truncated" in capsys.readouterr().out
    rows = loader.next_items()  # the first batch's rows
    loader.reset()
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, 31) and x.dtype == y.dtype == torch.int64
    ids, mask = torch.from_numpy(loader.ids[rows].astype(np.int64)), torch.from_numpy(loader.mask[rows])
    assert torch.equal(x, ids[:, :-1])
    assert torch.equal(y, torch.where(mask[:, 1:], ids[:, 1:], -1))
    assert int((y != -1).sum()) == int(mask[:, 1:].sum()) > 0


def test_a_packed_rows_mask_is_each_conversations_own_and_val_rows_come_in_order(tmp_path):
    # each conversation in a packed row keeps render's mask (the assistant's tokens, not the user's); val is not
    # shuffled: its batches are the rows in order
    convs = [chat(i) for i in range(200)]
    path = write_jsonl(tmp_path / "c.jsonl", convs)
    masks = {tuple(ids): mask for ids, mask in map(cf.render, convs)}
    loader = cf.ConversationLoader(path, "train", 4, 31)
    for ids, mask in zip(loader.ids.tolist(), loader.mask.tolist(), strict=True):
        cuts = [k for k, t in enumerate(ids) if t == cf.BOS] + [len(ids)]
        for a, b in zip(cuts, cuts[1:], strict=False):
            assert mask[a:b] == (masks[tuple(ids[a:b])] if b - a > 1 else [False])
    val = cf.ConversationLoader(path, "val", 2, 31)
    assert [val.next_items().tolist() for _ in range(2)] == [[0, 1], [2, 3]]


def test_long_conversations_are_truncated_and_counted(tmp_path, capsys):
    long_user = [{"role": "user", "content": "hello " * 40}, {"role": "assistant", "content": "yes"}]
    long_reply = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "yes " * 40}]
    path = write_jsonl(tmp_path / "c.jsonl", [chat(0), long_user, long_reply, chat(1)] * 2)
    loader = cf.ConversationLoader(path, "train", 1, 15)
    # train: rows 1-7 (row 0 is val); the long ones are cut to 16 tokens, and long_user's have nothing left to learn
    # (the 2 dropped are not among the 5 kept: "5 conversations ...; 4 truncated (2 of them dropped)" read otherwise)
    assert "5 conversations in 5 rows of 16 tokens, 21.3% padding; 2 of them truncated to 16 tokens; 2 more dropped: " \
        "no assistant token within them" in capsys.readouterr().out
    assert loader.tokens == 16 + 16 + 9 + 9 + 13 and loader.num_rows == 5  # long_reply x2, chat(1) x2, chat(0)


def test_resume_is_bitwise_across_epochs(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(60)])
    a = cf.ConversationLoader(path, "train", 3, 31, seed=5)
    for _ in range(4):
        a.next_batch()
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(20)]  # 60 rows: through epochs 0-2 (25 rows each)
    b = cf.ConversationLoader(path, "train", 3, 31, seed=5)
    b.load_state_dict(state)
    for (x, y), (bx, by) in zip(expected, (b.next_batch() for _ in range(20)), strict=True):
        assert torch.equal(x, bx) and torch.equal(y, by)
    other = cf.ConversationLoader(path, "train", 3, 31, seed=6)
    assert not torch.equal(other.next_batch()[0], cf.ConversationLoader(path, "train", 3, 31, seed=5).next_batch()[0])
    with pytest.raises(DataError, match="seed=5 in the checkpoint but 6 here"):
        other.load_state_dict(state)
    with pytest.raises(DataError, match="T=31 in the checkpoint but 63 here"):  # rows packed for another T
        cf.ConversationLoader(path, "train", 3, 63, seed=5).load_state_dict(state)


def test_resume_takes_the_same_file_elsewhere_and_notes_rows_skipped_for_another_batch_size(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(60)])
    a = cf.ConversationLoader(path, "train", 3, 31, seed=5)
    for _ in range(4):  # 12 of 25 rows served
        a.next_batch()
    state, want = a.state_dict(), a.next_batch()
    (tmp_path / "moved").mkdir()
    moved = write_jsonl(tmp_path / "moved" / "c.jsonl", [chat(i) for i in range(60)])
    for state_of in (state, dict(state, shards=[path])):  # a checkpoint that kept the whole path resumes too
        b = cf.ConversationLoader(f"{tmp_path}/moved/../moved/c.jsonl", "train", 3, 31, seed=5)
        b.load_state_dict(state_of)
        assert torch.equal(b.next_batch()[0], want[0]) and b.resume_note(state_of) is None
    c = cf.ConversationLoader(moved, "train", 5, 31, seed=5)
    c.load_state_dict(state)  # 12 served: goes on at 15, the first 5-row window after them
    assert c.step == 3 and c.resume_note(state) == (
        "the checkpoint read 1 x 3 items a micro-step, this run 1 x 5: the data goes on at the next such window, "
        "skipping 3 unserved of epoch 0's 25 items; none served twice")


def test_resume_on_a_file_of_the_same_name_rows_and_tokens_but_other_words_is_refused(tmp_path):
    """Every "yes" a "no" (one token each): the same name, rows and tokens, so only the tokens' CRC tells them apart."""
    path = write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(60)])
    a = cf.ConversationLoader(path, "train", 3, 31, seed=5)
    a.next_batch()
    state = a.state_dict()
    (tmp_path / "other").mkdir()
    other = Path(write_jsonl(tmp_path / "other" / "c.jsonl", [chat(i) for i in range(60)]))
    other.write_text(other.read_text().replace("yes", "no"))
    b = cf.ConversationLoader(str(other), "train", 3, 31, seed=5)
    assert (b.tokens, b.num_rows) == (a.tokens, a.num_rows) and not np.array_equal(b.ids, a.ids)
    with pytest.raises(DataError) as e:
        b.load_state_dict(state)
    assert str(e.value) == (
        f"cannot resume the train loader of {other}: c.jsonl holds other tokens than the checkpoint's under the same "
        "name and size; resume with the checkpoint's --data or start a fresh run")
    b.load_state_dict({k: v for k, v in state.items() if k != "shard_crc32"})  # a checkpoint from before the CRC
    assert b.step == 1


def test_the_stream_serves_every_item_once_an_epoch_when_b_does_not_divide_them():
    for shuffle in (False, True):
        stream = cf.RowStream()
        stream._stream("x", "train", 3, 8, 0, 1, 0, "cpu", shuffle, 25, [])  # 25 items, windows of 3
        assert stream.num_windows == 8  # whole windows an epoch: a val pass of 9 would score 2 items twice
        served = np.concatenate([stream.next_items() for _ in range(9)]).tolist()  # the 9th window spans two epochs
        assert sorted(served[:25]) == list(range(25)) and len(set(served[25:])) == 2
        assert not shuffle or served[:25] != list(range(25))
    assert served[:25] == [int(i) for i in cf.permutation((0, 0), 25)]
    assert served[25:] == [int(i) for i in cf.permutation((0, 1), 25)[:2]]  # the next epoch's part shuffled too


def test_a_file_of_one_row_has_no_train_conversations(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [chat(0)])
    with pytest.raises(DataError, match=r"c.jsonl train: no conversations \(a single file's every 20th row, from row "
                       r"0, is val\); add conversations$"):
        cf.ConversationLoader(path, "train", 1, 31)


def test_two_ranks_see_one_ranks_two_micro_batches(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(60)])
    one = cf.ConversationLoader(path, "train", 2, 31, seed=1)
    ranks = [cf.ConversationLoader(path, "train", 2, 31, rank=r, world_size=2, seed=1) for r in (0, 1)]
    for _ in range(15):  # past an epoch
        for r in (0, 1):
            x, y = one.next_batch()
            rx, ry = ranks[r].next_batch()
            assert torch.equal(x, rx) and torch.equal(y, ry)
    one.load_state_dict(ranks[1].state_dict())  # 2 ranks x 15 steps -> 1 rank at step 30
    assert one.step == 30 and torch.equal(one.next_batch()[0], want := ranks[0].next_batch()[0])
    fresh = cf.ConversationLoader(path, "train", 2, 31, seed=1)  # `one` was at step 30 already: a load that did
    fresh.load_state_dict(ranks[1].state_dict())  # nothing passed above
    assert fresh.step == 30 and torch.equal(fresh.next_batch()[0], want)


def test_hub_layout_directory_gives_train_and_held_out_test(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    for split, convs in (("train", [chat(i) for i in range(40)]), ("test", [chat(i) for i in range(40, 46)])):
        table = pa.Table.from_pylist([{"messages": m, "source": "x"} for m in convs])
        pq.write_table(table, tmp_path / "data" / f"{split}-00000-of-00001.parquet")
    val = cf.ConversationLoader(str(tmp_path), "val", 1, 63)
    assert val.tokens == sum(len(cf.render(chat(i))[0]) for i in range(40, 46))
    first = val.next_batch()[0]
    val.reset()
    assert torch.equal(val.next_batch()[0], first)  # val: the same batches after reset
    train = cf.ConversationLoader(str(tmp_path), "train", 1, 63)
    assert train.tokens == sum(len(cf.render(chat(i))[0]) for i in range(40))


def test_conversations_and_pairs_refuse_too_few_embedding_rows_in_one_line_naming_their_data(tmp_path):
    # each loader held its own copy of the check (the default as a literal), the conversations' naming no data
    from prefs import PairLoader

    chats = cf.ConversationLoader(write_jsonl(tmp_path / "c.jsonl", [chat(i) for i in range(40)]), "train", 1, 31)
    pairs = PairLoader([{"prompt": "hi", "chosen": "yes", "rejected": "no"}] * 2, "train", 1, 16)
    for loader, name in ((chats, tmp_path / "c.jsonl"), (pairs, "<2 rows>")):
        loader.check_vocab(50263)  # the top id's (ASSISTANT_END's) row exists; with one row fewer it does not
        with pytest.raises(DataError) as e:
            loader.check_vocab(50262)
        assert str(e.value) == (f"{name}: the chat format uses token ids up to 50262, but the model has only 50262 "
                                "embedding rows; pass --vocab-size 50267 or more (the default: 50304)")


def test_a_glob_reads_its_files_in_order_as_one_file(tmp_path, capsys):
    (tmp_path / "convs").mkdir()
    for name, first in (("b.jsonl", 30), ("a.jsonl", 0), ("c.txt", 60)):  # b after a; c.txt not matched
        write_jsonl(tmp_path / "convs" / name, [chat(i) for i in range(first, first + 30)])
    pattern = str(tmp_path / "convs" / "*.jsonl")
    train = [m for _, m in cf.read_conversations(pattern, "train")]
    assert train == [chat(i) for i in range(60) if i % cf.VAL_EVERY]  # rows 0, 20, 40 of a then b are val
    assert [m for _, m in cf.read_conversations(pattern, "val")] == [chat(0), chat(20), chat(40)]
    cf.ConversationLoader(pattern, "train", 1, 63)
    assert capsys.readouterr().out.endswith("0 more dropped: no assistant token within them; every 20th row from "
                                            "row 0 is held out as val, with --eval-every 0 too\n")
    with pytest.raises(DataError, match=f"^no such file or directory: {re.escape(str(tmp_path))}/convs/\\*.json "
                                        "\\(taken as a local path\\); check the path, or run the command that "
                                        "writes it first \\(e.g. tasks.py\\)$"):
        cf.ConversationLoader(str(tmp_path / "convs" / "*.json"), "train", 1, 63)
