"""generate.py: ragged batches against one prompt at a time, stops, seeds, log-probs, the calculator tool."""

import contextlib

import pytest
import torch
from torch import nn

from common import GPT2_VOCAB, get_tokenizer
from generate import Calculator, _Row, calculate, check_sampling, generate, generate_stream, next_token, sample
from model import GPT, GPTConfig, KVCache

# the chat format's special ids (chat_format.py): GPT-2's unused padded-vocabulary rows
ASSISTANT_END, TOOL_START, TOOL_END, OUTPUT_START, OUTPUT_END = 50262, 50263, 50264, 50265, 50266
CHAT_VOCAB = 50267
PROMPTS = [[5, 9], [1, 2, 3, 4, 5, 6, 7], [40, 2, 33, 17, 8, 8, 60, 12, 3, 1, 50, 21], [7] + list(range(30, 50))]


@pytest.fixture(scope="module", params=[{}, {"pos": "rope", "n_kv_head": 2}], ids=["learned", "rope-gqa"])
def model(request):
    """A small model trained 40 steps on x[t] = (x[t-1] + x[t-2]) % 64: its greedy output depends on more than the
    last token and differs between prompts."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=64, n_layer=2, n_head=4, n_embd=64, **request.param))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same weights on any number of cores (a thread count changes the sums' order)
    try:
        for _ in range(40):
            seq = torch.randint(0, 64, (16, 2))
            for _ in range(30):
                seq = torch.cat((seq, (seq[:, -1:] + seq[:, -2:-1]) % 64), dim=1)
            _, loss = model(seq[:, :-1], seq[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def alone(model, prompt, n, **kw):
    """sample.py's path: GPT.generate on this one prompt."""
    return sample(model, torch.tensor([prompt]), n, **kw)[0, len(prompt):].tolist()


def test_padded_rows_get_the_logits_of_each_prompt_alone(model):
    T = max(map(len, PROMPTS))
    pad = torch.tensor([T - len(p) for p in PROMPTS])
    cache = KVCache(model.config, len(PROMPTS), pad)
    with torch.no_grad():
        batched = [model(torch.tensor([[0] * (T - len(p)) + p for p in PROMPTS]), cache=cache)[0][:, -1]]
        batched += [model(torch.full((len(PROMPTS), 1), t), cache=cache)[0][:, -1] for t in (3, 14, 59)]
        for row, prompt in enumerate(PROMPTS):
            single = KVCache(model.config, 1)
            expected = [model(torch.tensor([prompt]), cache=single)[0][:, -1]]
            expected += [model(torch.tensor([[t]]), cache=single)[0][:, -1] for t in (3, 14, 59)]
            for step, (b, e) in enumerate(zip(batched, expected, strict=True)):
                torch.testing.assert_close(b[row:row + 1], e, atol=1e-5, rtol=1e-5, msg=f"row {row} step {step}")


def test_greedy_rows_equal_each_prompt_alone_and_stop_at_a_stop_id(model):
    expected = [alone(model, p, 16, temperature=0.0) for p in PROMPTS]
    assert len({t for e in expected for t in e}) > 4  # the model does not emit one token everywhere (the count: 5 or 6,
    # by the machine's float32 kernels)
    out = generate(model, PROMPTS, 16, temperature=0.0)
    assert [r.tokens for r in out] == expected
    assert all(r.mask == [1] * 16 and r.logprobs == [0.0] * 16 for r in out)  # greedy: sure choices
    # a stop id ends a row with it; the others, which keep decoding without it, are unchanged
    first, stop = next((i, e[0]) for i, e in enumerate(expected) if any(e[0] not in f for f in expected))
    steps = list(generate_stream(model, PROMPTS, 16, temperature=0.0, stop_ids=[stop]))
    cut = [e[:e.index(stop) + 1] if stop in e else e for e in expected]
    assert len(cut[first]) == 1 and max(map(len, cut)) == 16
    assert [[s.tokens[s.rows.index(r)] for s in steps if r in s.rows] for r in range(len(PROMPTS))] == cut
    assert [len(s.rows) for s in steps] == [sum(len(c) > i for c in cut) for i in range(16)]


def test_each_row_ends_when_its_own_context_is_full(model):
    # block_size 64: room for 5 new tokens after the first prompt, 62 after the second (not the first's 5: its pad
    # columns are no part of its context), each as it gets alone
    prompts = [list(range(60)), [1, 2, 3]]
    out = generate(model, prompts, 70, temperature=0.0)
    assert [len(r.tokens) for r in out] == [5, 62]
    assert [r.tokens for r in out] == [alone(model, p, 65 - len(p), temperature=0.0) for p in prompts]


def test_rows_that_leave_one_after_another_keep_their_own_cache_rows(model):
    # the second row leaves after 3 tokens, the first after 5, while the third goes on: the second shrink keeps the
    # third row by its place in the shrunk batch (1), not by its prompt's index (2); and a prompt of a full block_size
    # is taken, its one token the block's next
    prompts = [list(range(60)), list(range(62)), list(range(7, 57)), list(range(64))]
    out = generate(model, prompts, 70, temperature=0.0)
    assert [len(r.tokens) for r in out] == [5, 3, 15, 1]
    assert [r.tokens for r in out] == [alone(model, p, 65 - len(p), temperature=0.0) for p in prompts]


def test_n_new_tokens_cost_n_forwards_a_prefill_and_one_per_token_after_the_first(model):
    calls = []
    hook = model.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    try:
        out = generate(model, PROMPTS, 5, temperature=0.0)
    finally:
        hook.remove()
    assert [len(r.tokens) for r in out] == [5] * 4
    assert calls == [(4, 21)] + [(4, 1)] * 4  # no forward for a token past max_new_tokens


def test_seeded_sampling_repeats_and_a_lone_row_samples_as_generate_does(model):
    kw = dict(temperature=0.8, top_k=20, top_p=0.9)
    out = generate(model, PROMPTS[1:2], 20, generator=torch.Generator().manual_seed(3), **kw)
    assert out[0].tokens == alone(model, PROMPTS[1], 20, generator=torch.Generator().manual_seed(3), **kw)
    runs = [[r.tokens for r in generate(model, PROMPTS, 20, generator=torch.Generator().manual_seed(s), **kw)]
            for s in (5, 5, 6)]
    assert runs[0] == runs[1] != runs[2]


def test_logprobs_are_the_models_log_likelihood_of_the_sampled_tokens(model):
    out = generate(model, PROMPTS, 12, temperature=1.0, generator=torch.Generator().manual_seed(0))
    for prompt, r in zip(PROMPTS, out, strict=True):
        seq = torch.tensor([prompt + r.tokens])
        with torch.no_grad():
            logp = model(seq[:, :-1])[0].log_softmax(-1)[0, len(prompt) - 1:]
        expected = logp.gather(1, torch.tensor(r.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(r.logprobs), expected, atol=1e-4, rtol=1e-4)
        assert r.mask == [1] * 12


@pytest.mark.parametrize("temperature", [1e-30, 1e-39, 5e-324])
def test_a_tiny_temperature_samples_the_argmax_and_an_infinite_one_is_refused(temperature):
    logits = torch.tensor([[3.0, 9.0, 9.5, -1.0, 20.0]])  # id 4 is past vocab=4
    token, _ = next_token(logits, temperature, None, None, torch.Generator().manual_seed(0), vocab=4)
    assert token.tolist() == [[2]]  # before: logits / temperature overflowed to inf, the softmax to NaN, the id to 5
    with pytest.raises(ValueError, match="^temperature must be finite, got inf$"):
        check_sampling(float("inf"), None, None)  # sample(), generate(), sample.py and chat.py check it first


def test_top_p_of_one_and_top_k_of_one_are_taken():
    check_sampling(1.0, 1, 1.0)  # HF's defaults' "no nucleus", and greedy by top-k: not refused as out of range


def test_bad_calls_fail_with_one_line(model):
    for prompts, new, message in (([[1], []], 4, "1 to block_size \\(64\\) token ids"),
                                  ([list(range(65))], 4, "crop long prompts"), ([[1]], 0, "max_new_tokens must be")):
        with pytest.raises(ValueError, match=message):
            generate(model, prompts, new)
    with pytest.raises(ValueError, match="top_p must be in"):
        generate(model, [[1]], 4, top_p=0.0)


# ----------------------------------------------------------------------------------------------------------------------
# special tokens and the calculator, on a GPT whose weights make it a bigram table


def bigram_model(successor: dict[int, int]) -> GPT:
    """A GPT that greedily follows each token in `successor` with its successor (others with id 0): every block's
    output is zero, so the last stream is its token's embedding, one axis per token, read by the untied lm_head."""
    model = GPT(GPTConfig(block_size=64, n_layer=1, n_head=1, n_embd=64))  # vocab 50304: the chat ids fit
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.lm_head.weight = nn.Parameter(torch.zeros_like(model.lm_head.weight))
        model.transformer.ln_f.weight.fill_(1.0)
        for axis, (token, nxt) in enumerate(successor.items()):
            model.transformer.wte.weight[token, axis] = 1.0
            model.lm_head.weight[nxt, axis] = 10.0
    return model


def test_special_ids_are_sampled_only_below_the_given_vocab():
    model = bigram_model({100: ASSISTANT_END})
    (chat,) = generate(model, [[100]], 8, temperature=0.0, vocab=CHAT_VOCAB, stop_ids=[ASSISTANT_END])
    assert chat.tokens == [ASSISTANT_END]
    (plain,) = generate(model, [[100]], 8, temperature=0.0, stop_ids=[ASSISTANT_END])
    assert len(plain.tokens) == 8 and max(plain.tokens) < GPT2_VOCAB


@pytest.mark.parametrize("expr, value", [("2+3", "5"), ("12*(3+4)", "84"), ("7**123456789", None)])
def test_the_calculator_forces_its_result_into_the_row(expr, value):
    enc = get_tokenizer()
    ids = enc.encode_ordinary(expr)
    chain = [TOOL_START, *ids, TOOL_END, ASSISTANT_END]
    assert len(set(ids)) == len(ids)  # a bigram table cannot repeat a token with another successor
    model = bigram_model({100: TOOL_START, **dict(zip(chain[:-1], chain[1:], strict=True)), OUTPUT_END: ASSISTANT_END,
                          200: ASSISTANT_END})
    calc = Calculator(TOOL_START, TOOL_END, OUTPUT_START, OUTPUT_END, enc)
    # row 1 ends at once, so row 0 finishes its tool call in a batch that shrank
    row, short = generate(model, [[7, 100], [200]], 30, temperature=0.0, vocab=CHAT_VOCAB,
                          stop_ids=[ASSISTANT_END], calculator=calc)
    forced = [] if value is None else [OUTPUT_START, *enc.encode_ordinary(value), OUTPUT_END]
    assert row.tokens == chain[:-1] + forced + [ASSISTANT_END]
    assert row.mask == [1] * (len(chain) - 1) + [0] * len(forced) + [1]
    assert row.logprobs == [0.0] * len(row.tokens)
    assert short.tokens == [ASSISTANT_END]
    # sampled with top_k=1: a mapped token's successor for sure (log-prob 0); after an unmapped one (the value's ids) a
    # uniform draw, log-prob -ln 50267, that the forced token replaces: its log-prob goes with it
    sampled = generate(model, [[7, 100], [200]], 30, temperature=1.0, top_k=1, vocab=CHAT_VOCAB,
                       stop_ids=[ASSISTANT_END], calculator=calc, generator=torch.Generator().manual_seed(0))
    assert sampled == [row, short]


@pytest.mark.parametrize("expr, value", [("2+3*4", "14"), ("(1+2)**3", "27"), ("7/2", "3.5"), ("7//2", "3"),
                                         ("-7%3", "2"), ("1,000*3", "3000"), ("2**-1", "0.5"), ("10/3", "3.333333333"),
                                         ("0.1+0.2", "0.3"), ("2**64", "18446744073709551616")])
def test_calculate_evaluates_arithmetic(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr", ["__import__('os')", "9**9**9", "2**10000", "10**70*10**70", "'a'*10**9",
                                  "(" * 50 + "1" + ")" * 50, "1" * 101, "1/0", "x", "[1, 2]", "(lambda: 1)()",
                                  "1e308*10", "True+1", "(-8)**0.5", "().__class__", "open('/etc/passwd').read()",
                                  "1 if 1 else 2", "print(1)", ""])
def test_calculate_refuses_anything_else(expr):
    assert calculate(expr) is None


def test_calculate_stops_at_its_time_limit():
    assert calculate("1+1", seconds=1.0) == "2"
    assert calculate("1+1", seconds=-1.0) is None



def test_decoding_runs_without_cudnn_attention_unless_it_is_the_only_kernel(model):
    # cuDNN plans each new key length: a fresh H200 process decoded 15-20 bf16 tokens/s with it, 150 without
    cuda, seen = torch.backends.cuda, []
    hook = model.register_forward_pre_hook(lambda *_: seen.append(cuda.cudnn_sdp_enabled()))
    switches = ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_math_sdp")
    try:
        assert cuda.cudnn_sdp_enabled()
        alone(model, [5, 9], 3, temperature=0.0)
        alone(model, [5, 9], 2, temperature=0.0, use_cache=False)
        generate(model, PROMPTS[:2], 3, temperature=0.0)
        assert seen == [False] * 8 and cuda.cudnn_sdp_enabled()  # 3 + 2 + 3 forwards; restored after
        # train.py --attention cudnn allows it alone: it stays, else SDPA has no kernel (none on CPU: the forward fails)
        for switch in switches:
            getattr(cuda, switch)(False)
        with pytest.raises(RuntimeError, match="No viable backend"):
            alone(model, [5, 9], 1, temperature=0.0)
        assert seen[-1] is True and cuda.cudnn_sdp_enabled()  # restored after a forward that raised, too
    finally:
        hook.remove()
        for switch in switches:
            getattr(cuda, switch)(True)


@pytest.mark.parametrize("allowed, cudnn", [(("flash",), True), (("mem_efficient",), True), (("math",), True),
                                            (("flash", "mem_efficient", "math"), False)])
def test_decoding_runs_without_cudnn_attention_where_another_kernel_is_allowed_and_leaves_it_as_it_was(model, allowed,
                                                                                                       cudnn):
    # any one other kernel allowed beside cuDNN's: decoding takes it; cuDNN's off (--attention flash, efficient or math
    # allows its kernel alone) stays off after a sample, not turned back on for the training that goes on
    cuda, seen = torch.backends.cuda, []
    hook = model.register_forward_pre_hook(lambda *_: seen.append(cuda.cudnn_sdp_enabled()))
    kernels = ("flash", "mem_efficient", "math")
    try:
        for name in kernels:
            getattr(cuda, f"enable_{name}_sdp")(name in allowed)
        cuda.enable_cudnn_sdp(cudnn)
        with contextlib.suppress(RuntimeError):  # CPU has no mem-efficient kernel: that forward fails
            alone(model, [5, 9], 1, temperature=0.0)
        assert seen == [False] and cuda.cudnn_sdp_enabled() == cudnn
    finally:
        hook.remove()
        for name in (*kernels, "cudnn"):
            getattr(cuda, f"enable_{name}_sdp")(True)


def test_a_special_id_inside_a_tool_call_is_left_out_of_the_expression():
    # <|system_start|> (50257, the tokenizer's n_vocab: the first id it cannot decode) between "2" and "+3"
    enc = get_tokenizer()
    two, plus, three = enc.encode_ordinary("2+3")
    chain = [TOOL_START, two, enc.n_vocab, plus, three, TOOL_END]
    model = bigram_model({100: TOOL_START, **dict(zip(chain[:-1], chain[1:], strict=True)),
                          OUTPUT_END: ASSISTANT_END})
    calc = Calculator(TOOL_START, TOOL_END, OUTPUT_START, OUTPUT_END, enc)
    (row,) = generate(model, [[100]], 20, temperature=0.0, vocab=CHAT_VOCAB, stop_ids=[ASSISTANT_END],
                      calculator=calc)
    assert row.tokens == chain + [OUTPUT_START, *enc.encode_ordinary("5"), OUTPUT_END, ASSISTANT_END]


def test_a_tool_end_without_its_start_calls_nothing():
    # after a call's result, a second <|tool_end|> with no <|tool_start|> before it is text, not a call on what came
    # since the first ("5" then "7": 57)
    enc = get_tokenizer()
    seven = enc.encode_ordinary("7")[0]
    chain = [TOOL_START, *enc.encode_ordinary("2+3"), TOOL_END]
    model = bigram_model({100: TOOL_START, **dict(zip(chain[:-1], chain[1:], strict=True)), OUTPUT_END: seven,
                          seven: TOOL_END, TOOL_END: ASSISTANT_END})
    calc = Calculator(TOOL_START, TOOL_END, OUTPUT_START, OUTPUT_END, enc)
    (row,) = generate(model, [[100]], 20, temperature=0.0, vocab=CHAT_VOCAB, stop_ids=[ASSISTANT_END],
                      calculator=calc)
    assert row.tokens == chain + [OUTPUT_START, *enc.encode_ordinary("5"), OUTPUT_END, seven, TOOL_END, ASSISTANT_END]
    assert row.mask == [1] * len(chain) + [0] * 3 + [1] * 3


def test_calculate_takes_up_to_its_limits_and_refuses_just_past_them():
    assert calculate("0+" * 49 + "10") == "10"  # 100 characters: MAX_EXPR_CHARS
    assert calculate("0+" * 49 + "100") is None  # 101
    assert calculate("2**64") == str(2**64) and calculate("2**65") is None  # MAX_EXPONENT
    assert calculate("(2**64)**4") is None  # 2**256: MAX_BITS
    assert calculate("(2**63)**4*15") == str(2**252 * 15)  # just under 2**256
    assert calculate("-(2**63)**4*15") == str(-(2**252) * 15)


def test_a_second_tool_start_begins_the_expression_anew():
    # <|tool_start|> 1 <|tool_start|> 2+3 <|tool_end|>: the call is the open one, 2+3, not 12+3
    enc = get_tokenizer()
    calc = Calculator(TOOL_START, TOOL_END, OUTPUT_START, OUTPUT_END, enc)
    row = _Row()
    ids = [TOOL_START, *enc.encode_ordinary("1"), TOOL_START, *enc.encode_ordinary("2+3"), TOOL_END]
    assert [row.next(t, calc) for t in ids] == [(t, 1) for t in ids]
    assert list(row.forced) == [OUTPUT_START, *enc.encode_ordinary("5"), OUTPUT_END]
