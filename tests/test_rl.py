"""rl.py's stage on the engine: a GRPO step moves the policy toward the rewarded reply, a run resumes bitwise (GRPO
and PPO), 2 gloo ranks equal one process, and what cannot work is refused in one line."""

import contextlib
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

import engine
import rl
import stage
import tasks
from chat_format import ASSISTANT_END, ASSISTANT_START, USER_START, render_prompt
from common import _field_help, get_tokenizer, iter_log, load_checkpoint
from conftest import one_line_error, run_nodes, run_torchrun
from generate import Rollout
from model import GPT, GPTConfig
from parallel import Objective, build_trainable, logprobs_of, sequence_logprobs
from prefs import PrefsConfig
from sft import SFTConfig


def save_model(path: Path, seed: int, **shape) -> Path:
    """A random tiny GPT as a checkpoint; a value head gets random weights (a reward model that tells replies apart)."""
    torch.manual_seed(seed)
    config = GPTConfig(**{"block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 64, **shape})
    model = GPT(config)
    if config.value_head:
        torch.nn.init.normal_(model.value_head.weight)
    trained = {"objective": "reward"} if config.value_head else {}  # as train.py --objective reward records it
    torch.save({"model": model.state_dict(), "model_config": dataclasses.asdict(config), "train_config": trained}, path)
    return path


@pytest.fixture(autouse=True)
def one_thread():
    """Decoding is many small ops: on a loaded shared CPU, threads that wait for each other make it 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    """(a random tiny chat policy, a random reward model): its continuous rewards give every group an advantage."""
    out = tmp_path_factory.mktemp("rl_models")
    return save_model(out / "policy.pt", 0), save_model(out / "rm.pt", 1, block_size=64, value_head=True)


def flags(models: tuple[Path, Path], out: Path, *extra: str) -> list[str]:
    return ["--init-from", str(models[0]), "--reward-model", str(models[1]), "--out-dir", str(out), "--device=cpu",
            "--prompts=2", "--samples=4", "--rollout-batch=1", "--max-new-tokens=6", "--eval-limit=4", "--pass-k=2",
            "--eval-every=2", "--ckpt-every=2", "--max-lr=1e-3", "--warmup-steps=0", *extra]


def train_records(out: Path, *also: str) -> list[dict]:
    """log.jsonl's train records (and those of the types `also`) but for their timings."""
    return [{k: v for k, v in r.items() if k not in ("ms", "tok_s", "rollout_tok_s", "update_tok_s")}
            for r in iter_log(out / "log.jsonl") if r["type"] in ("train", *also)]


def test_a_grpo_step_moves_the_policy_toward_the_rewarded_reply():
    torch.manual_seed(0)
    raw = GPT(GPTConfig(block_size=32, n_layer=2, n_head=4, n_embd=64))
    cfg = rl.RLConfig(samples=4, rollout_batch=1, minibatches=1, max_lr=1e-3, temperature=1.0, device="cpu")
    problem = tasks.Addition().examples("test")[0]  # its answer is right, that + 1 is wrong
    enc, prompt = get_tokenizer(), render_prompt(problem["messages"][:-1])
    right, wrong = (enc.encode_ordinary(" ".join(str(v))) + [ASSISTANT_END] for v in (int(problem["answer"]),
                                                                                      int(problem["answer"]) + 1))
    share = [(problem, prompt, Rollout(reply, [1] * len(reply), [0.0] * len(reply))) for reply in
             (right, wrong, right, wrong)]
    batch = rl.score(share, tasks.task_reward(tasks.Addition(), "addition"), None, torch.device("cpu"))
    assert batch["scores"].tolist() == [1.0, 0.0, 1.0, 0.0]  # the task's checker
    assert batch["mask"].sum(1).tolist() == [len(right)] * 4 and batch["mask"][:, :len(prompt) - 1].sum() == 0
    batch = rl.prepare(batch, raw, None, cfg, 1)
    # the old log-probs are the policy's over the whole vocabulary, in eval mode: every position's log-prob on the
    # sampled tokens (the head ran on those positions only), 0 on the prompt
    every = logprobs_of(raw(batch["ids"][:, :-1])[0], batch["ids"][:, 1:])
    torch.testing.assert_close(batch["old_logp"], every * batch["mask"])
    assert (batch["old_logp"][batch["mask"] == 0] == 0).all() and (batch["old_logp"][batch["mask"] == 1] < 0).all()
    # mean 0.5, unbiased std sqrt(1/3): +-0.5 / (0.5774 + 1e-4)
    torch.testing.assert_close(batch["adv"], torch.tensor([1, -1, 1, -1]) * 0.5 / (3 ** -0.5 + 1e-4))
    built = build_trainable(raw, cfg, torch.device("cpu"), use_compile=False, verbose=False)
    before = batch["old_logp"].sum(1)  # 0 off the sampled tokens, as asserted above
    objective = Objective(lambda model, mb: rl.rl_loss(model, mb, cfg, 1))
    totals = rl.update(built, objective, batch, cfg, 1)
    after = rl.token_stats(raw, batch["ids"], batch["mask"])["old_logp"].sum(1)
    # at ratio 1 the per-token loss is -mean(A): 0 for two rewarded and two unrewarded replies of one length
    assert abs(totals["loss"].item()) < 1e-6 and totals["clip_frac"].item() == 0 and totals["grad_norm"] > 0
    assert after[0] > before[0] + 0.01 and after[1] < before[1] - 0.01
    assert after[0] == after[2] and after[1] == after[3]


def test_a_reward_model_trained_with_reward_logprob_scores_with_it(models, tmp_path):
    ckpt = load_checkpoint(models[1])
    torch.save({**ckpt, "train_config": {"objective": "reward", "reward_logprob": True}}, tmp_path / "rm_logprob.pt")
    problem = tasks.Addition().examples("test")[0]
    prompt = render_prompt(problem["messages"][:-1])
    reply = get_tokenizer().encode_ordinary("6 9") + [ASSISTANT_END]
    share = [(problem, prompt, Rollout(reply, [1] * len(reply), [0.0] * len(reply)))]
    scores = []
    for path in (models[1], tmp_path / "rm_logprob.pt"):
        rm = rl.load_reward_model(rl.RLConfig(reward_model=str(path), max_new_tokens=6), [problem])
        scores.append(rl.score(share, None, rm, torch.device("cpu"))["scores"])
    ids, mask = rl.pack([(prompt + reply, [0] * len(prompt) + [1] * len(reply))], torch.device("cpu"))
    mean = sequence_logprobs(rm, ids, mask) / len(reply)  # the same weights, read without the head
    torch.testing.assert_close(scores[1] - scores[0], mean, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_an_rl_run_resumes_bitwise(models, tmp_path, algo, capsys):
    # a constant lr after warmup: the decay's schedule ends at --max-steps, which the split run changes
    extra = [f"--algo={algo}", "--beta=0.05", "--ppo-epochs=2", "--minibatches=2", "--lr-schedule=constant"]
    full = rl.main(flags(models, tmp_path / "full", *extra, "--max-steps=4"))
    # --eval-only scores the last checkpoint as the run scored it there, and said "2 prompts x 4 replies per step ...
    # from --init-from policy.pt" as if it trained those weights
    capsys.readouterr()
    assert rl.main(flags(models, tmp_path / "full", *extra, "--eval-only", "--resume=auto"))["task"] == full["task"]
    out = capsys.readouterr().out
    assert "done: evaluated the weights at step 4" in out and "replies per step" not in out
    assert "optimizer" not in out  # its groups, printed by every stage's --eval-only: none is used
    rl.main(flags(models, tmp_path / "split", *extra, "--max-steps=2"))
    rest = rl.main(flags(models, tmp_path / "split", *extra, "--max-steps=4", "--resume=auto"))
    records = train_records(tmp_path / "full")
    assert train_records(tmp_path / "split") == records and len(records) == 4  # rewards, losses, KL...: bitwise
    assert rest["step"] == 4 and rest["task"] == full["task"] and set(full["task"]) == {"acc", "n", "pass@2"}
    assert rest["losses"] == full["losses"][2:]  # it resumed at step 2: a restart from 0 matched the full run too
    assert records[0]["kl"] == 0 and records[-1]["kl"] > 0  # the reference is the start
    assert len({r["reward"] for r in records}) == 4 and all(r["length"] == 6 for r in records)
    assert max(r["clip_frac"] for r in records) > 0 and ("value_loss" in records[-1]) == (algo == "ppo")
    weights = load_checkpoint(tmp_path / "full" / "ckpt_000004.pt")["model"]
    start = load_checkpoint(models[0])["model"]
    assert not torch.equal(weights["lm_head.weight"], start["lm_head.weight"])
    assert ("value_head.weight" in weights) == (algo == "ppo")


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_rl_on_two_ranks_equals_one_process(models, tmp_path, algo):
    extra = [f"--algo={algo}", "--beta=0.05", "--minibatches=2", "--max-steps=3", "--eval-every=0"]
    single = rl.main(flags(models, tmp_path / "single", *extra))  # one thread, as each gloo rank (run_torchrun)
    run_torchrun(["rl.py", *flags(models, tmp_path / "ddp", *extra)], nproc=2)
    one, two = train_records(tmp_path / "single"), train_records(tmp_path / "ddp")
    for name in ("reward", "reward_std", "loss", "grad_norm", "clip_frac", "kl", "entropy", "length",
                 *(["value_loss"] if algo == "ppo" else [])):
        assert [r[name] for r in two] == pytest.approx([r[name] for r in one], rel=1e-4, abs=1e-6), name
    ddp = [r for r in iter_log(tmp_path / "ddp" / "log.jsonl") if r["type"] == "task"][-1]
    assert {k: ddp[k] for k in single["task"]} == single["task"]


def test_what_cannot_work_is_refused_in_one_line(models, tmp_path, capsys, hf_dir):
    def error(*extra: str) -> str:
        return one_line_error(capsys, rl.main, flags(models, tmp_path / "out", *extra))

    assert "--samples must be >= 2 (or --algo ppo)" in error("--samples=1")
    assert rl.RLConfig(algo="ppo", samples=1).beta == 0.05 and rl.RLConfig().beta == 0.0
    assert error("--temperature=0").endswith("(FSDP cannot generate); got --temperature 0.0 --parallel ddp")
    # it said "--temperature must be > 0 (got 0.7) and --parallel ddp or zero1": the temperature was not the fault
    assert error("--parallel=fsdp").endswith("got --temperature 0.7 --parallel fsdp")
    assert "--minibatches (3) must divide a call's --rollout-batch x --samples = 4 replies" in error("--minibatches=3")
    assert "--prompts (2) must be a multiple of --rollout-batch (3)" in error("--rollout-batch=3")
    policy, rm = models
    assert error("--reward-model", str(policy)) == (f"error: --reward-model {policy} is a language model, not a "
                                                     "reward model: train one with prefs.py --objective reward")
    small = save_model(tmp_path / "small_vocab.pt", 2, vocab_size=1000, value_head=True)
    assert error("--reward-model", str(small)).startswith(f"error: --reward-model {small} has 1000 embedding rows, "
                                                          "fewer than the GPT-2 tokenizer's 50257 ids")
    short = save_model(tmp_path / "short.pt", 2, block_size=16, value_head=True)
    assert error("--reward-model", str(short)).startswith(f"error: --reward-model {short} reads 16 tokens, and a "
                                                          "prompt with a reply of --max-new-tokens 6 takes 19")
    assert error("--init-from", str(tmp_path / "none.pt")) == (  # it said "pass the .pt file that train.py wrote"
        f"error: --init-from {tmp_path / 'none.pt'} does not exist; pass a checkpoint that sft.py wrote")
    # a directory was an IsADirectoryError traceback, whose hint named the --init-from just given
    assert error("--init-from", str(hf_dir)) == (f"error: checkpoint {hf_dir} is a directory, not a file; it has a "
                                                 "config.json, so it looks like an HF GPT-2 directory: load it with "
                                                 f"--init-from {hf_dir} where the script has one; export.py and rl.py "
                                                 "take a checkpoint of this project (sft.py "
                                                 "--init-from it first)")
    assert error("--reward-model", str(policy.parent)).startswith(f"error: checkpoint {policy.parent} is a directory")
    # a reward model as the policy: PPO took its score head for a critic and trained it as a policy without a word
    assert error("--init-from", str(rm), "--algo=ppo") == (
        f"error: {rm} is a reward model (prefs.py --objective reward): it scores replies, and its logits were never "
        "trained to write them; load a policy, or score with it in rl.py --reward-model")


def test_grpo_continues_a_ppo_policy_and_a_gpt2_vocabulary_gets_the_chat_rows(models, tmp_path, capsys):
    # a PPO policy's critic was refused as "unexpected weights"; HF GPT-2's 50,257 rows were an IndexError traceback;
    # a base model (never SFT'd) started RL silently: allowed (R1-Zero), but warned of, unlike a chat model
    ppo = save_model(tmp_path / "ppo.pt", 3, value_head=True)
    torch.save({**torch.load(ppo), "train_config": {"algo": "ppo"}}, ppo)  # a policy with its critic, as rl.py saves
    gpt2 = save_model(tmp_path / "gpt2.pt", 4, vocab_size=50257)
    for start in (ppo, gpt2):
        rl.main(flags(models, tmp_path / start.stem, "--init-from", str(start), "--max-steps=1", "--eval-every=0",
                      "--pass-k=0", "--eval-limit=1"))
        saved = load_checkpoint(tmp_path / start.stem / "ckpt_000001.pt")
        assert saved["model_config"]["vocab_size"] == 50304 and "value_head.weight" not in saved["model"]
        warning = (f"warning: --init-from {start} is not a chat model (sft.py makes one): its replies will not "
                   "follow the chat format at first")
        assert (warning in capsys.readouterr().err.splitlines()) == (start == gpt2)


def test_only_rank_0_reads_the_start_again_to_warn_of_a_base_model(models, tmp_path, monkeypatch):
    read = []  # each rank read --init-from's dict a second time, for a warning rank 0 alone prints
    monkeypatch.setattr(rl, "load_checkpoint", lambda path, **kw: read.append(path) or load_checkpoint(path, **kw))
    # the warning's read is is_chat's (chat_format's own load_checkpoint): watched there, not only as rl's name
    monkeypatch.setattr(rl, "is_chat", lambda ckpt, is_chat=rl.is_chat: read.append(ckpt) or is_chat(ckpt))
    cfg = rl.RLConfig(init_from=str(models[0]), out_dir=str(tmp_path / "out"), device="cpu", prompts=2, samples=2,
                      rollout_batch=1, max_new_tokens=4, eval_limit=2, pass_k=0)
    rl.setup(cfg, engine.Context(rank=1))
    assert read == []
    rl.setup(dataclasses.replace(cfg, out_dir=str(tmp_path / "out0")), engine.Context()).log.close()
    assert read == [str(models[0])]  # rank 0 does read it: the watch sees the read it forbids rank 1


def test_the_lr_warms_up_then_decays_linearly_to_zero_at_max_steps():
    cfg = rl.RLConfig(max_steps=10, warmup_steps=2, max_lr=1.0)  # engine.get_lr, every stage's schedule
    assert [engine.get_lr(s, cfg) for s in range(11)] == pytest.approx([1 / 2, 1, 1, 7 / 8, 6 / 8, 5 / 8, 4 / 8, 3 / 8,
                                                                        2 / 8, 1 / 8, 0])
    constant = rl.RLConfig(max_steps=10, warmup_steps=2, max_lr=1.0, lr_schedule="constant")
    assert [engine.get_lr(s, constant) for s in (0, 2, 9)] == pytest.approx([1 / 2, 1, 1])


def test_a_resume_notes_another_schedule_and_refuses_a_checkpoint_past_max_steps(capsys, tmp_path):
    cfg = rl.RLConfig(max_steps=20, warmup_steps=2, max_lr=1e-3)
    stage.note_new_schedule(dataclasses.asdict(cfg), cfg, 10)
    assert capsys.readouterr().out == ""  # the same schedule
    stage.note_new_schedule({**dataclasses.asdict(cfg), "max_steps": 10}, cfg, 5)
    assert capsys.readouterr().out == ("note: the checkpoint's run had --max-steps 10, this run has 20: from step 5 "
                                       "the lr is 0.000833, not that run's 0.000625\n")
    with pytest.raises(ValueError, match=f"--resume {tmp_path} is at step 21, past --max-steps 20; raise --max-steps"):
        stage.check_resume((tmp_path, {"step": 21, "train_config": dataclasses.asdict(cfg)}), cfg)


def test_a_resume_names_the_flags_changed_since_the_checkpoint(capsys):
    # another --clip, --samples or --reward went on silently, as the same run; the lr's and paths' changes are not
    # listed (note_new_schedule speaks when the lr changes), nor a flag the checkpoint's config lacks
    saved = dataclasses.asdict(rl.RLConfig(max_steps=10, out_dir="a", clip=0.2, samples=8))
    del saved["temperature"]
    cfg = rl.RLConfig(max_steps=20, out_dir="b", clip=0.3, samples=4, temperature=1.0, reward="r.py:f")
    stage.note_changed_flags(saved, cfg)
    assert capsys.readouterr().out == ("note: flags changed since the checkpoint: --reward '' -> 'r.py:f', --samples "
                                       "8 -> 4, --clip 0.2 -> 0.3\n")
    for same in (rl.RLConfig(**{**saved, "temperature": 1.0}), dataclasses.replace(cfg, eval_only=True)):
        stage.note_changed_flags(saved, same)  # an evaluation trains nothing
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("saved, config", [
    ({}, rl.RLConfig()),  # an SFT or DPO policy went on silently at its step, a PPO one crashed on its critic
    ({"objective": "reward"}, rl.RLConfig()),  # a traceback on its value head
    ({"algo": "grpo"}, SFTConfig()),  # KeyError: 'loader'
    ({"objective": "reward"}, PrefsConfig(objective="dpo", init_from="x.pt")),  # a reward model went on as a policy
    ({"objective": "reward"}, SFTConfig()),
    ({"algo": "ppo"}, PrefsConfig(objective="reward")),  # a PPO critic scored as a reward model
])
def test_a_resume_from_another_stages_checkpoint_is_refused(tmp_path, saved, config):
    with pytest.raises(ValueError) as e:  # past --max-steps too: "raise --max-steps" was the advice, then this refusal
        stage.check_resume((tmp_path, {"step": 10**6, "train_config": saved}), config)
    # a reward model's fix is not --init-from it, which load_init (and rl.load) refuse: its policy is the start
    rm = "it is a reward model (prefs.py --objective reward), not a policy: "
    fix = (f"start a new run from its weights with --init-from {tmp_path}" if saved.get("objective") != "reward" else
           f"{rm}start a new run from the policy it was trained from")
    assert str(e.value) == (f"--resume {tmp_path} was written by another stage or --objective, which this run cannot "
                            f"continue: {fix}")
    stage.check_resume((tmp_path, {"step": 1, "train_config": {"objective": "lm"}}), SFTConfig())  # train.py's once
    # --eval-only scores another stage's policy (train.py's val loss of an SFT model), not a reward model as a policy
    # (prefs.py --objective dpo --eval-only printed DPO numbers for one) nor a policy as a reward model
    scored = dataclasses.replace(config, eval_only=True)
    if (saved.get("objective") == "reward") == (getattr(config, "objective", "") == "reward"):
        stage.check_resume((tmp_path, {"step": 1, "train_config": saved}), scored)
        return
    with pytest.raises(ValueError) as e:
        stage.check_resume((tmp_path, {"step": 1, "train_config": saved}), scored)
    fix = (f"{rm}score it with prefs.py --objective reward --eval-only" if saved.get("objective") == "reward" else
           f"start a new run from its weights with --init-from {tmp_path}")
    assert str(e.value) == (f"--resume {tmp_path} was written by another stage or --objective, which this run cannot "
                            f"score: {fix}")


def test_the_prompt_stream_is_a_seeded_order_per_epoch():
    problems = [{"answer": str(i)} for i in range(5)]
    sampler = rl.PromptSampler(problems, seed=3)
    first = sampler.peek(4)
    assert sampler.peek(4) == first and sampler.served == 0  # a step serves them once it scored them
    sampler.served = 4
    served = [p["answer"] for p in first + sampler.peek(6)]
    assert sorted(served[:5]) == sorted(served[5:]) == list("01234") and served[:5] != served[5:]  # two epochs
    assert sampler.state_dict() == {"served": 4, "problems": 5, "seed": 3, "task_digest": "0af107b669cbd7cb"}
    again = rl.PromptSampler(problems, seed=3)
    again.load_state_dict({"served": 4, "problems": 5})
    assert [p["answer"] for p in again.peek(6)] == served[4:]
    assert [p["answer"] for p in rl.PromptSampler(problems, seed=4).peek(5)] != served[:5]


def test_the_prompt_stream_refuses_a_checkpoint_of_other_problems_of_as_many_rows():
    # a --task of as many rows (another file, an edited one) resumed silently and trained on its prompts
    problems = [{"answer": str(i)} for i in range(5)]
    state = rl.PromptSampler(problems, seed=3).state_dict()
    with pytest.raises(ValueError) as e:
        rl.PromptSampler(problems[::-1], seed=3).load_state_dict(state)
    # a task drawing its problems unseeded gets this at every resume: "the same --task and --seed" alone misled
    assert str(e.value) == ("cannot resume the prompt stream: task_digest=0af107b669cbd7cb in the checkpoint but "
                            "cc3171ba8fed4bc8 here; resume with the same --task and --seed (and a task whose "
                            "examples('train') gives the same rows each run: seed its draws), or start a new run")
    rl.PromptSampler(problems[::-1], seed=3).load_state_dict({"served": 4, "problems": 5, "seed": 3})  # an older run's


def test_the_prompt_streams_digest_holds_across_processes_for_rows_holding_a_function():
    # a row's lambda was digested by its repr, an address: every resume refused ("cannot resume the prompt stream"), and
    # under torchrun the ranks' "--task data" fingerprints differed
    a, b = (rl.PromptSampler([{"answer": "1", "verify": lambda reply: reply == "1"}], seed=0) for _ in range(2))
    assert a.digest == b.digest


def test_rollouts_keep_each_problems_samples_together_and_ranks_take_whole_seeded_calls():
    torch.manual_seed(0)
    raw = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32))
    problems = tasks.Addition().examples("test")[:3]
    cfg = rl.RLConfig(samples=2, rollout_batch=2, max_new_tokens=3, temperature=1.0, device="cpu")
    out = rl.rollouts(raw, problems, 2, 5, cfg, 0, 1)  # calls of 2 problems and 1: pass@k's need not fill a call
    assert [p["answer"] for p, _, _ in out] == [p["answer"] for p in problems for _ in range(2)]
    assert all(ids == render_prompt(p["messages"][:-1]) for p, ids, _ in out)  # each reply to its own problem
    ranks = [rl.rollouts(raw, problems, 2, 5, cfg, rank, 2) for rank in (0, 1)]  # call c on rank c % 2, seed 5 + c
    assert [(p["answer"], r.tokens) for p, _, r in ranks[0] + ranks[1]] == [(p["answer"], r.tokens) for p, _, r in out]
    # a call's own seed: the same problem in two calls gets other replies
    twice = rl.rollouts(raw, problems[:1] * 2, 2, 5, dataclasses.replace(cfg, rollout_batch=1), 0, 1)
    assert [r.tokens for *_, r in twice[:2]] != [r.tokens for *_, r in twice[2:]]


def test_rollouts_end_at_any_reply_stop_as_chat_py_and_the_export_do():
    # they ran on past a <|user_start|> (or <|endoftext|>) to --max-new-tokens: the policy trained on tokens that
    # chat.py, HF's generate and the reward (reply_text) never see
    from conftest import bigram_model

    eight = get_tokenizer().encode_ordinary("8")[0]
    model = bigram_model({ASSISTANT_START: eight, eight: USER_START})
    cfg = rl.RLConfig(rollout_batch=1, max_new_tokens=5, device="cpu")
    ((_, _, reply),) = rl.rollouts(model, tasks.Addition().examples("test")[:1], 1, 0, cfg, 0, 1)
    assert reply.tokens == [eight, USER_START]


def test_load_turns_dropout_off_and_holds_out_the_problems_tasks_py_scores(tmp_path):
    # a policy saved with dropout trained with it on while its old log-probs were read in eval mode: ratios off 1
    policy = save_model(tmp_path / "policy.pt", 0, dropout=0.1)
    (tmp_path / "t.py").write_text("import tasks\n\n\nclass T(tasks.Addition):\n    hub = 'someone/addition'\n")
    cfg = rl.RLConfig(init_from=str(policy), task=f"{tmp_path / 't.py'}:T", eval_limit=5)
    task, _, raw, _, held, _ = rl.load(cfg)
    assert raw.config.dropout == 0.0
    # a hub task's held-out problems in nanochat's order, as sft.py and tasks.py --eval score them
    test = task.examples("test")
    assert held == tasks.held_out(task, test, 5) != test[:5]


def test_load_takes_a_local_copy_of_a_built_in_task_its_train_and_test_files(tmp_path):
    from test_tasks import GSM8K_ROWS, write_rows

    (copy := tmp_path / "gsm8k").mkdir()  # offline: the hub's splits as files
    write_rows(copy / "train.jsonl", GSM8K_ROWS[:2])
    write_rows(copy / "test.jsonl", GSM8K_ROWS[2:])
    cfg = rl.RLConfig(init_from=str(save_model(tmp_path / "policy.pt", 0)), task=f"gsm8k={copy}")
    _, _, _, train, held, _ = rl.load(cfg)
    assert [p["answer"] for p in train] == ["4", "5"] and [p["answer"] for p in held] == ["4"]
    file = write_rows(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    with pytest.raises(ValueError) as e:  # held-out accuracy on the problems it trains on
        rl.load(dataclasses.replace(cfg, task=f"gsm8k={file}"))
    assert str(e.value) == (f"--task gsm8k={file}: {file} is not a directory, and this reads train and test: pass a "
                            "directory with both (train.jsonl and test.jsonl, or the hub's parquet files)")
    # --eval-only scores the test split alone, as tasks.py --eval does: the file is that split
    held = rl.load(dataclasses.replace(cfg, task=f"gsm8k={file}", eval_only=True))[4]
    assert [p["answer"] for p in held] == ["4", "5", "4"]


def test_pass_at_k_counts_a_problem_any_of_whose_k_samples_is_right(monkeypatch):
    from types import SimpleNamespace as NS

    enc, calls, said = get_tokenizer(), [], []
    problems = [tasks.conversation(f"Say {a}", a, a) for a in ("1", "2", "3")]
    replies = {"1": ["0", "1"], "2": ["2", "2"], "3": ["0", "0"]}  # solved at the 2nd sample, at both, never

    def rollouts(model, given, samples, seed, cfg, rank, world):
        calls.append((given, samples, seed))
        return [(p, [], Rollout(enc.encode_ordinary(t) + [ASSISTANT_END])) for p in given for t in replies[p["answer"]]]

    monkeypatch.setattr(rl, "rollouts", rollouts)
    monkeypatch.setattr(tasks, "evaluate", lambda *args, **kwargs: {"acc": 0.25, "n": 3})
    task = NS(check=lambda reply, answer: reply == answer)
    cfg = rl.RLConfig(pass_k=2, seed=7, eval_every=5)
    val = rl.task_eval(cfg, None, task, problems, contextlib.nullcontext(), NS(say=said.append), engine.Context())
    assert val.every == 5 and val.fn(3) == {"acc": 0.25, "n": 3, "pass@2": 2 / 3}
    assert calls == [(problems, 2, 7 + 1_000_003 * 3)]  # k samples each, a seed of the step's
    assert said == ["step      3 | addition accuracy 0.2500, pass@2 0.6667 (3 held out)"]


class Near(tasks.Addition):
    def check(self, reply: str, answer: str) -> bool:  # right in float32 only: bf16 rounds 1.001 to 1
        return (torch.tensor([[1.001]]) @ torch.tensor([[1.0]])).item() > 1.0


def test_a_users_check_scores_rollouts_and_pass_at_k_outside_the_autocast_and_the_reward_model_inside(monkeypatch):
    # both ran under the bf16 autocast the replies are sampled in: a check that builds tensors scored a right reply 0
    from types import SimpleNamespace as NS

    torch.manual_seed(0)
    raw, problems = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)), Near().examples("test")[:2]
    cfg = rl.RLConfig(prompts=1, samples=2, rollout_batch=1, minibatches=1, max_new_tokens=3, pass_k=2, device="cpu")
    built = build_trainable(raw, cfg, torch.device("cpu"), use_compile=False, verbose=False)
    built.autocast, seen = torch.autocast("cpu", torch.bfloat16), []
    monkeypatch.setattr(rl, "rewards", lambda rm, ids, *_: seen.append(torch.is_autocast_enabled("cpu")) or
                        torch.zeros(len(ids)))  # a reward model's forward, stubbed: it scores 0
    judge = NS(config=raw.config, reward_logprob=False)
    for reward, rm, expected in ((tasks.task_reward(Near(), "near"), None, 1.0), (None, judge, 0.0)):
        step_fn = rl.rl_step(cfg, raw, built, None, reward, rm, rl.PromptSampler(problems, 0), NS(say=print),
                             engine.Context())
        assert step_fn(1)["reward"] == expected
    assert seen == [True]  # the reward model's forward runs under the autocast: bf16 on a GPU
    monkeypatch.setattr(tasks, "evaluate", lambda *args, **kwargs: {"acc": 1.0, "n": 2})
    val = rl.task_eval(cfg, raw, Near(), problems, built.autocast, NS(say=print), engine.Context())
    assert val.fn(0)["pass@2"] == 1.0


def test_missing_eos_penalty_comes_off_the_score_of_a_reply_that_met_no_stop_token_as_trls(monkeypatch):
    # a reply cut at --max-new-tokens was scored as one that ended: a reward model read it with <|assistant_end|>
    from types import SimpleNamespace as NS

    problem, enc = tasks.Addition().examples("test")[0], get_tokenizer()
    prompt, reply = render_prompt(problem["messages"][:-1]), enc.encode_ordinary(" ".join(problem["answer"]))
    share = [(problem, prompt, Rollout(tokens, [1] * len(tokens))) for tokens in (reply + [ASSISTANT_END], reply)]
    monkeypatch.setattr(rl, "rollouts", lambda *_: share)  # the second reply is cut: it met no stop token
    torch.manual_seed(0)
    raw = GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32))
    cfg = rl.RLConfig(prompts=1, samples=2, rollout_batch=1, minibatches=1, missing_eos_penalty=0.25, device="cpu")
    built = build_trainable(raw, cfg, torch.device("cpu"), use_compile=False, verbose=False)
    step_fn = rl.rl_step(cfg, raw, built, None, tasks.task_reward(tasks.Addition(), "addition"), None,
                         rl.PromptSampler([problem], 0), NS(say=print), engine.Context())
    assert step_fn(0)["reward"] == (1.0 + 0.75) / 2  # both are right


@pytest.mark.parametrize("algo", ["rloo", "reinforce"])
def test_rloo_and_reinforce_train_on_the_engine(models, tmp_path, algo):
    result = rl.main(flags(models, tmp_path / algo, f"--algo={algo}", "--max-steps=2", "--eval-every=0", "--pass-k=0",
                           "--ckpt-every=0"))
    records = train_records(tmp_path / algo)
    assert len(result["losses"]) == 2 and all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in records)
    assert all(r["clip_frac"] == 0 for r in records) if algo == "reinforce" else True  # no clip, on-policy


RECORDING_REWARD = '''import json, os


def length(prompt, reply, answer):
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps([prompt, reply, answer]) + "\\n")
    return float(len(reply))


def one(prompt, reply, answer):
    return 1.0
'''


def test_rl_on_a_users_task_with_its_own_reward_that_sees_the_prompt(models, tmp_path, monkeypatch, capsys):
    from test_tasks import USER_TASK

    (tmp_path / "doubling.py").write_text(USER_TASK)
    (tmp_path / "rewards.py").write_text(RECORDING_REWARD)
    monkeypatch.setenv("REWARD_LOG", str(tmp_path / "calls.jsonl"))
    task = f"{tmp_path / 'doubling.py'}:Doubling"
    common = ["--init-from", str(models[0]), "--task", task, "--device=cpu", "--prompts=2", "--samples=2",
              "--rollout-batch=1", "--max-new-tokens=4", "--eval-limit=2", "--pass-k=0", "--max-steps=1"]
    rewards = f"{tmp_path / 'rewards.py'}:length,{tmp_path / 'rewards.py'}:one"
    result = rl.main([*common, "--reward", rewards, "--reward-weights=0.5,2", "--out-dir", str(tmp_path / "run")])
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 4 and result["task"]["n"] == 2  # 2 prompts x 2 samples; the task's 2 held-out problems
    for prompt, _, answer in calls:  # the prompt's messages and the task's answer (the reply's text: below)
        k = int(prompt[-1]["content"].removeprefix("Double ").rstrip("?"))
        assert prompt == [{"role": "user", "content": f"Double {k}?"}] and answer == str(2 * k) and 10 <= k < 30
    # the weighted sum, and each function's own mean over the 4 replies (as TRL's rewards/<name>/mean), unweighted
    record, length = train_records(tmp_path / "run")[0], sum(len(r) for _, r, _ in calls) / 4
    assert (record["reward"], record["reward/length"], record["reward/one"]) == (0.5 * length + 2, length, 1.0)
    # the step served its 2 prompts (not 1, nor one per sample) and trained at warmup's first lr, which it records
    ckpt = load_checkpoint(tmp_path / "run" / "ckpt_000001.pt")
    lrs = {group["lr"] for group in ckpt["optimizer"]["param_groups"]}
    assert ckpt["sampler"]["served"] == 2 and lrs == {train_records(tmp_path / "run")[0]["lr"]} == {3e-4 / 10}
    assert one_line_error(capsys, rl.main, [*common, "--reward", f"{tmp_path / 'doubling.py'}:raises", "--out-dir",
                                            str(tmp_path / "bad")]) == \
        f"error: --reward {tmp_path / 'doubling.py'}:raises raised KeyError: 'no such field'"
    # TRL's reward functions as written: each reply scored alone, logged under its name as ours are
    from test_tasks import TRL_REWARDS

    (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    trl = f"{tmp_path / 'trl_rewards.py'}:later,{tmp_path / 'trl_rewards.py'}:accuracy"
    rl.main([*common, "--reward", trl, "--reward-weights=2,1", "--out-dir", str(tmp_path / "trl")])
    record = train_records(tmp_path / "trl")[0]
    assert record["reward/later"] == 0.25 and record["reward"] == 0.5 + record["reward/accuracy"]
    # and the problem's other keys as its columns: `solution` (a TypeError before), passed with each reply
    solved = [f"{tmp_path / 'doubling.py'}:Solved" if arg == task else arg for arg in common]
    rl.main([*solved, "--reward", f"{tmp_path / 'trl_rewards.py'}:solved", "--out-dir", str(tmp_path / "solved")])
    seen = tasks.load_object(f"{tmp_path / 'trl_rewards.py'}:seen", "--reward")
    assert seen == [["answer", "level", "prompts", "solution"]] * 4  # 2 prompts x 2 samples
    assert train_records(tmp_path / "solved")[0]["reward/solved"] in (0.0, 0.25, 0.5, 0.75, 1.0)
    quarter = f"{tmp_path / 'doubling.py'}:tensor"  # inf in the float32 scores: a NaN loss, blamed on --max-lr
    assert one_line_error(capsys, rl.main, [*common, "--reward", quarter, "--reward-weights=1e40", "--out-dir",
                                            str(tmp_path / "big")]) == \
        f"error: --reward {quarter} returned 0.25 (weight 1e+40): the reward, 2.5e+39, is not a finite float32 number"


BROKEN_TASK = '''

calls = itertools.count(1)


class Broken(Doubling):
    def reward(self, prompt, reply, answer):
        if next(calls) == 3:  # step 1's first reply: a step scores 2
            raise KeyError("boom")
        return float(len(reply))
'''


def test_a_task_whose_reward_raises_mid_run_saves_the_steps_done_and_the_fixed_run_goes_on_bitwise(models, tmp_path,
                                                                                                     capsys):
    # the run stopped with every step since the last checkpoint lost; the state saved is step 0's end (not the RNG and
    # prompt stream that step 1 had drawn), so the run resumed once the file is fixed equals an uninterrupted one
    from test_tasks import USER_TASK

    (tmp_path / "t.py").write_text("import itertools\n" + USER_TASK + BROKEN_TASK)
    split, task = tmp_path / "split", f"{tmp_path}/t.py:Broken"
    args = ["--init-from", str(models[0]), f"--task={task}", "--device=cpu", "--prompts=1", "--samples=2",
            "--rollout-batch=1", "--max-new-tokens=2", "--eval-limit=1", "--pass-k=0", "--eval-every=0",
            "--ckpt-every=50", "--max-lr=1e-3", "--warmup-steps=0", "--max-steps=2"]
    assert one_line_error(capsys, rl.main, [*args, "--out-dir", str(split)]) == (
        f"error: --task {task}'s reward raised KeyError: 'boom' at step 1; {split}/ckpt_000001.pt holds the steps "
        "before it: fix that, then --resume auto goes on from there")
    saved = load_checkpoint(split / "ckpt_000001.pt")  # step 0's end: step 1 neither served its prompt nor set its lr
    assert saved["sampler"]["served"] == 1 and {group["lr"] for group in saved["optimizer"]["param_groups"]} == {1e-3}
    (tmp_path / "t.py").write_text("import itertools\n" + USER_TASK + BROKEN_TASK.replace("== 3", "== 0"))
    resumed = rl.main([*args, "--out-dir", str(split), "--resume=auto"])
    full = rl.main([*args, "--out-dir", str(tmp_path / "full")])
    assert train_records(split) == train_records(tmp_path / "full") and resumed["losses"] == full["losses"][1:]
    assert 0 not in full["losses"] and resumed["step"] == 2  # the second minibatch's ratio is not 1


@pytest.mark.parametrize("pass_k, raises, step", [(0, 2, 2), (2, 5, 2), (0, 3, 3)])  # greedy, pass@2, final
def test_a_task_whose_check_raises_in_a_held_out_eval_saves_the_steps_done_and_the_fixed_run_goes_on_bitwise(
        models, tmp_path, capsys, pass_k, raises, step):
    # the eval at step 2 lost steps 0 and 1: the state saved is theirs, and the resumed run evaluates step 2 again;
    # the final step's: its checkpoint was written anyway, and the resumed run only evaluates
    from test_tasks import flaky_task

    (tmp_path / "t.py").write_text(flaky_task(raises))
    split, task = tmp_path / "split", f"{tmp_path}/t.py:Flaky"
    args = ["--init-from", str(models[0]), f"--task={task}", "--device=cpu", "--prompts=1", "--samples=2",
            "--rollout-batch=1", "--max-new-tokens=2", "--eval-limit=1", f"--pass-k={pass_k}", "--eval-every=2",
            "--ckpt-every=50", "--max-lr=1e-3", "--warmup-steps=0", "--max-steps=3"]
    assert one_line_error(capsys, rl.main, [*args, "--out-dir", str(split)]) == (
        f"error: --task {task}: check() raised KeyError: 'boom' at step {step}; {split}/ckpt_00000{step}.pt holds the "
        "steps before it: fix that, then --resume auto goes on from there")
    (tmp_path / "t.py").write_text(flaky_task(0))
    resumed = rl.main([*args, "--out-dir", str(split), "--resume=auto"])
    full = rl.main([*args, "--out-dir", str(tmp_path / "full")])
    assert train_records(split, "task") == train_records(tmp_path / "full", "task") and len(full["losses"]) == 3
    assert resumed["losses"] == full["losses"][step:] and resumed["task"] == full["task"]


@pytest.mark.parametrize("flags, unused", [(dict(algo="grpo", gamma=0.9), "gamma"), (dict(algo="rloo", lam=0.5), "lam"),
                                           (dict(algo="reinforce", clip=0.3), "clip"),
                                           (dict(algo="ppo", scale_rewards=False), "scale-rewards")])
def test_a_flag_the_algorithm_does_not_use_is_refused(flags, unused):
    with pytest.raises(ValueError, match=f"^--algo {flags['algo']} does not use --{unused}: drop it$"):
        rl.RLConfig(**flags)
    rl.RLConfig(algo="ppo", gamma=0.9, lam=0.5, vf_coef=1.0)  # its own


@pytest.mark.parametrize("flag, ours", [("--epsilon", "--clip"), ("--num-generations", "--samples"),
                                        ("--max-completion-length", "--max-new-tokens"), ("--loss-type", "--loss-agg"),
                                        ("--num-iterations", "--ppo-epochs"), ("--learning-rate", "--max-lr"),
                                        ("--examples-per-step", "--prompts")])  # nanochat's
def test_trls_and_nanochats_names_for_our_flags_point_to_ours(flag, ours):
    # TRL's --epsilon (its clip range) was offered AdamW's --eps; the others were "see --help"
    with pytest.raises(SystemExit) as e:
        rl.main([flag, "1"])
    assert e.value.code == f"error: unknown option {flag}; did you mean {ours}?"


@pytest.mark.parametrize("value", ["group", "none", "batch"])
def test_trls_scale_rewards_words_are_refused_naming_ours(value):
    # TRL 1.16's GRPOConfig takes scale_rewards="group", "batch" or "none": the refusal said only true/false
    with pytest.raises(SystemExit) as e:
        rl.main(["--scale-rewards", value])
    assert e.value.code == (f"error: --scale-rewards expects true/false, got '{value}'; TRL's scale_rewards group is "
                            "true here, none false (its batch, the std of the whole batch, is not offered)")


@pytest.mark.parametrize("flags, message", [
    (dict(reward="r.py:f", reward_model="rm.pt"), "--reward and --reward-model each score the replies: pass one"),
    (dict(reward_weights=(2.0,)), "--reward-weights weigh --reward's functions: add it"),  # the task's reward, alone
    (dict(reward="r.py:f", reward_weights=(1.0, math.inf)), r"--reward-weights must be finite: \(1.0, inf\)"),
    (dict(eval_limit=0), "--eval-limit must be >= 1; got 0"),  # 0 divided pass@k by 0; -1 dropped the last problem
    (dict(algo="ppo", vf_coef=-1.0), "--beta, --pass-k, --vf-coef and --missing-eos-penalty must be >= 0"),
    (dict(missing_eos_penalty=-1.0), "--beta, --pass-k, --vf-coef and --missing-eos-penalty must be >= 0"),
    # NaN: min() of the four kept a first non-NaN value, so a later NaN passed and made the scores or the loss NaN
    (dict(algo="ppo", vf_coef=math.nan), "--beta, --pass-k, --vf-coef and --missing-eos-penalty must be >= 0"),
    (dict(missing_eos_penalty=math.nan), "--beta, --pass-k, --vf-coef and --missing-eos-penalty must be >= 0"),
    # the scores are float32: past its range a cut reply scored -inf, and the NaN loss was blamed on --max-lr
    (dict(missing_eos_penalty=1e39), "--beta, --pass-k, --vf-coef and --missing-eos-penalty must be >= 0 and within "
                                     "float32's range"),
    (dict(beta=math.inf), "--beta, --pass-k, --vf-coef and --missing-eos-penalty must be >= 0 and within float32's"),
    (dict(algo="ppo", vf_coef=math.inf), "--beta, --pass-k, --vf-coef and --missing-eos-penalty must be >= 0 and"),
    # --clip 0 clips every ratio (no gradient); --gamma 0 or --lam past 1 make GAE's sum meaningless or diverge
    *((flags, r"--beta, .* within float32's range, --clip > 0, --gamma in \(0, 1\] and --lam in \[0, 1\]$")
      for flags in (dict(clip=0.0), dict(algo="ppo", gamma=0.0), dict(algo="ppo", lam=1.01))),
    # TRL's loss_type names: which of ours each is was said by --help alone
    (dict(loss_agg="grpo"), "--algo must be one of grpo, rloo, reinforce, ppo and --loss-agg one of token, sequence, "
                            r"dr_grpo; got 'grpo' and 'grpo' \(TRL's dapo is token, its grpo sequence\)$"),
])
def test_flags_that_would_be_ignored_or_break_the_run_are_refused(flags, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        rl.RLConfig(**flags)


def test_a_resume_from_other_starting_weights_is_refused_where_they_are_the_kl_anchor(models, tmp_path, capsys):
    extra = ["--beta=0.05", "--eval-every=0", "--pass-k=0", "--max-steps=2", "--ckpt-every=1"]
    rl.main(flags(models, tmp_path / "run", *extra, "--max-steps=1"))
    other = save_model(tmp_path / "other.pt", 3)
    resumed = flags(models, tmp_path / "run", *extra, "--resume=auto")
    resumed[resumed.index(str(models[0]))] = str(other)
    assert one_line_error(capsys, rl.main, resumed) == (
        f"error: the run resumed was anchored (--beta) to the weights of --init-from {models[0]}, not {other}'s: pass "
        "its --init-from, or start a new run")


def test_an_rl_resume_without_init_from_takes_its_runs_start_not_the_default(models, tmp_path, monkeypatch, capsys):
    # rl.py's default --init-from (out/sft-demo-1200/ckpt_001200.pt) built the policy and the KL anchor: "does not
    # exist", or another model's weights refused; the checkpoint records the run's start
    monkeypatch.chdir(tmp_path)  # the default's relative path: no such file here
    extra = ["--beta=0.05", "--eval-every=0", "--pass-k=0", "--max-steps=2", "--ckpt-every=1"]
    full = rl.main(flags(models, tmp_path / "full", *extra))
    rl.main(flags(models, tmp_path / "split", *extra, "--max-steps=1"))
    capsys.readouterr()
    rest = rl.main(flags(models, tmp_path / "split", *extra, "--resume=auto")[2:])  # without --init-from
    note = f"note: --init-from {models[0]}, the resumed run's start (its checkpoint records it; none given here)"
    assert note in capsys.readouterr().out.splitlines() and rest["losses"] == full["losses"][1:]  # bitwise


def test_one_process_digests_only_what_its_checkpoint_keeps_to_compare_on_resume(models, tmp_path, monkeypatch):
    # the policy's (and a reward model's) weights, about 0.7 s a GB, and the task's problems were digested at every
    # single-process start for a fingerprint with no other rank to compare it with
    from test_tasks import USER_TASK

    (tmp_path / "doubling.py").write_text(USER_TASK)  # 20 problems: addition's 7,700 take a second to render
    digested, hashed, weights_digest, digest = [], [], engine.weights_digest, stage.digest
    monkeypatch.setattr(engine, "weights_digest", lambda module: digested.append(module) or weights_digest(module))
    monkeypatch.setattr(stage, "digest", lambda obj: hashed.append(obj) or digest(obj))
    cfg = rl.RLConfig(init_from=str(models[0]), task=f"{tmp_path / 'doubling.py'}:Doubling", beta=0.05,
                      out_dir=str(tmp_path / "run"), device="cpu", prompts=2, rollout_batch=1)
    run = rl.setup(cfg, engine.Context())
    run.log.close()
    # the frozen KL anchor's weights and the prompt stream's problems: a resume compares them with the checkpoint's
    frozen = [(weights_digest(m), not any(p.requires_grad for p in m.parameters())) for m in digested]
    assert frozen == [(run.parts["reference"].digest, True)]
    assert hashed == [run.parts["sampler"].problems]


def test_a_resume_with_another_seed_or_task_is_refused_the_prompt_stream_depends_on_them(models, tmp_path, capsys):
    extra = ["--eval-every=0", "--pass-k=0", "--max-steps=2", "--ckpt-every=1"]
    rl.main(flags(models, tmp_path / "run", *extra, "--max-steps=1"))
    assert one_line_error(capsys, rl.main, flags(models, tmp_path / "run", *extra, "--resume=auto", "--seed=7")) == (
        "error: cannot resume the prompt stream: seed=1337 in the checkpoint but 7 here; resume with the same --task "
        "and --seed (and a task whose examples('train') gives the same rows each run: seed its draws), or start a new "
        "run")  # it went on with other prompts and samples, silently
    (tmp_path / "t.py").write_text("import tasks\nclass T(tasks.Addition):\n    def examples(self, split):\n"
                                   "        return super().examples(split)[::-1]\n")
    assert one_line_error(capsys, rl.main, flags(models, tmp_path / "run", *extra, "--resume=auto",
                                                 f"--task={tmp_path}/t.py:T")) == (
        "error: cannot resume the prompt stream: task_digest=86eb798aa90db8bf in the checkpoint but "
        "3b230a14984fab3c here; resume with the same --task and --seed (and a task whose examples('train') gives the "
        "same rows each run: seed its draws), or start a new run")  # as many problems
    assert rl.main(flags(models, tmp_path / "run", *extra, "--resume=auto"))["step"] == 2


def test_prompts_that_fill_the_policys_context_are_refused_at_setup(models, tmp_path, capsys):
    # addition's prompts take 12 tokens: a 12-token policy had room for 1-token replies, silently, a shorter one
    # stopped at step 0 in generate() with a line naming no task
    short = save_model(tmp_path / "short.pt", 0, block_size=12)
    argv = flags(models, tmp_path / "run", "--eval-every=0")
    argv[argv.index(str(models[0]))] = str(short)
    assert one_line_error(capsys, rl.main, argv) == ("error: --task addition: a prompt takes 12 tokens, the policy's "
                                                     "whole context 12: no room for a reply (a 1-token one at most)")


@pytest.mark.slow
def test_a_reward_raising_on_one_rank_stops_every_rank_with_its_line(models, tmp_path):
    # rank 0 went on to the step's all-reduces while rank 1 had stopped: a gloo traceback on rank 0 (across nodes under
    # NCCL, a wait of --dist-timeout)
    (tmp_path / "r.py").write_text("import os\ndef r(prompt, reply, answer):\n"
                                   "    if os.environ['RANK'] == '1':\n        raise KeyError('no')\n    return 1.0\n")
    args = flags(models, tmp_path / "out", "--reward-model=", f"--reward={tmp_path}/r.py:r", "--max-steps=2")
    done = run_nodes([["rl.py", *args]] * 2)  # a node each: one torchrun would end the other rank at once
    line = f"--reward {tmp_path}/r.py:r raised KeyError: 'no'"
    assert [[e for e in r.stderr.splitlines() if e.startswith("error:")] for r in done] == [[f"error: rank 1: {line}"],
                                                                                            [f"error: {line}"]]


@pytest.mark.slow
def test_a_file_one_node_cannot_read_or_holds_otherwise_stops_every_node_with_its_line(models, tmp_path):
    # rl.py read --init-from and --reward-model alone: the node that could went on to a collective and got a lost
    # peer's traceback (under NCCL, a wait of --dist-timeout). One load (rl.load) takes both: --reward-model stands in
    missing = tmp_path / "missing.pt"
    done = run_nodes([["rl.py", *flags(models, tmp_path / "rm", *extra)]
                      for extra in ([], [f"--reward-model={missing}"])])
    assert [r.returncode for r in done] == [1, 1]
    line = f"checkpoint {missing} does not exist; pass a .pt file that train.py, sft.py, prefs.py or rl.py wrote"
    errors = [next(e for e in r.stderr.splitlines() if e.startswith("error: ")) for r in done]
    assert errors[0].startswith(f"error: rank 1: {line}") and errors[1].startswith(f"error: {line}"), errors
    # a task whose file differs between the nodes: each rank drew its prompts from its own problems, silently
    (tmp_path / "t.py").write_text("import os\nimport tasks\nclass T:\n    def examples(self, split):\n"
                                   "        return tasks.Addition().examples(split)[:None if os.environ['RANK'] == '0' "
                                   "else -1]\n    def check(self, reply, answer):\n        return True\n")
    done = run_nodes([["rl.py", *flags(models, tmp_path / "task", f"--task={tmp_path}/t.py:T", "--max-steps=1")]] * 2)
    assert [next(e for e in r.stderr.splitlines() if e.startswith("error: ")) for r in done] == [
        "error: rank 1's --task data differs from rank 0's: every node must hold the same --task data"] * 2


@pytest.mark.parametrize("which, flag, line", [
    (0, "init-from", "rank 1 built its model from --init-from {} with half_residual True (rank 0: False): every node "
                     "must build the same model (its checkpoint's options, where no flag sets them)"),
    (1, "reward-model", "rank 1's --reward-model differs from rank 0's: every node must hold the same --reward-model")])
def test_nodes_whose_models_were_saved_with_other_options_stop_naming_them(models, tmp_path, which, flag, line):
    # each node's --init-from or --reward-model (LOCAL paths) holds the same weights, one copy saved with
    # --half-residual: the weights digests matched and the nodes ran (or scored) with other options, silently
    ckpt = torch.load(models[which], weights_only=False)
    ckpt["model_config"]["half_residual"] = True
    torch.save(ckpt, half := tmp_path / "half.pt")
    done = run_nodes([["rl.py", *flags(models, tmp_path / "out", "--max-steps=1", *other)]
                      for other in ([], [f"--{flag}={half}"])])
    assert [(r.returncode, r.stderr.splitlines()[-1:]) for r in done] == [(1, [f"error: {line.format(half)}"])] * 2


def test_eval_only_of_another_algos_checkpoint_names_the_algo_not_optimizer_state(models, tmp_path, capsys):
    # --eval-only loads no optimizer state, yet was refused for it; the policy's heads follow --algo (PPO's critic)
    grpo = save_model(tmp_path / "grpo.pt", 3)
    torch.save({**torch.load(grpo), "step": 1, "train_config": {"algo": "grpo"}}, grpo)
    assert one_line_error(capsys, rl.main, flags(models, tmp_path / "out", "--algo=ppo", "--eval-only",
                                                 f"--resume={grpo}")) == (
        f"error: --resume {grpo} was trained with --algo grpo, and --eval-only builds the policy (PPO's with a value "
        "head) by --algo: pass --algo grpo")


def test_the_seed_help_names_the_sampling_it_seeds():
    # --seed also draws every step's rollout seed and pass@k's (two seeds sample other replies): rl.py --help said
    # "seeds weights, dropout and the data shuffle", little of which an RL run from --init-from has
    assert _field_help(rl.RLConfig)["seed"] == (
        "seeds the init, dropout, the data order and sampling (rl.py's rollouts, train.py's samples)")
