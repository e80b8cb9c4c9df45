"""fused_ce.py: the Triton cross-entropy kernel against the PyTorch reference, and the fused lm_head + loss beside it.

On CPU the kernel runs under the Triton interpreter (TestInterpreted, in a child process with TRITON_INTERPRET=1), is
compiled ahead of time for sm_90 (no GPU needed), and the model's fused_ce path runs its PyTorch reference; on a
CUDA machine TestCUDA runs the kernel compiled, eagerly and under torch.compile.
"""

import math
import re

import pytest
import torch
import torch.nn.functional as F

import fused_ce
import model
from common import GPT2_VOCAB
from conftest import check_kernels, compile_for_hopper, run_interpreted
from fused_ce import cross_entropy_reference, cross_entropy_rows, triton_available
from model import GPT, MODEL_PRESETS


def _kernel_interpreted() -> bool:
    if not triton_available():
        return False
    import triton

    return not isinstance(fused_ce._cross_entropy_kernel, triton.runtime.JITFunction)


INTERPRETED = _kernel_interpreted()

# the loss is a sum of a logsumexp and a gather, in fp32 either way; the gradient is softmax - onehot, in [-1, 1],
# stored in the logits' dtype: one rounding to 8 (bf16) or 11 (fp16) mantissa bits, at most ~2e-3 / 2.5e-4 near 1
GRAD_ATOL = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 5e-4}


def make_inputs(rows: int, vocab: int, dtype: torch.dtype = torch.float32, device: str = "cpu", real: int = 0,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ~ N(0, 3^2) (a trained model's scale), targets among the real ids, every third row ignored (-1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=gen, device=device)).to(dtype)
    targets = torch.randint(0, real or vocab, (rows,), generator=gen, device=device)
    targets[::3] = -1
    return logits, targets


def assert_matches(logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0, real: int = 0,
                   **launch) -> None:
    loss, grad = cross_entropy_rows(logits, targets, label_smoothing, real or None, **launch)
    ref_loss, ref_grad = cross_entropy_reference(logits, targets, label_smoothing, real or None)
    assert loss.dtype == torch.float32 and loss.shape == targets.shape
    assert grad.dtype == logits.dtype and grad.shape == logits.shape
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(grad.float(), ref_grad, atol=GRAD_ATOL[logits.dtype], rtol=0)
    ignored = targets == -1
    assert loss[ignored].abs().sum() == 0 and grad[ignored].abs().sum() == 0


# ----------------------------------------------------------------------------------------------------------------------
# the reference, the model's fused_ce path on CPU, dispatch and errors: no kernel runs


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_reference_is_f_cross_entropy(label_smoothing: float) -> None:
    # without padding (R = V), the summed rows over the valid count are F.cross_entropy, and the gradient its
    logits, t = make_inputs(11, 37)
    rows, grad = cross_entropy_reference(logits, t, label_smoothing)
    z = logits.clone().requires_grad_()
    ref = F.cross_entropy(z, t, ignore_index=-1, label_smoothing=label_smoothing)
    ref.backward()
    count = (t != -1).sum()
    torch.testing.assert_close(rows.sum() / count, ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(grad / count, z.grad, atol=1e-7, rtol=1e-6)


def test_chunked_loss_smooths_over_the_real_ids_of_a_padded_vocabulary() -> None:
    # V = 50304 (GPT-2's padded head), s = 0.1: the chunked loss's gradients put s/R on the 50257 real ids only, as
    # the plain loss (log_softmax over the real ids) does; the padded ids' weight rows get softmax alone
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=gen, requires_grad=True)
    w = (0.5 * torch.randn(50304, 8, generator=gen)).requires_grad_()
    t = torch.tensor([3, -1, 50256, 7, 100])
    loss = fused_ce.chunked_cross_entropy(x, w, t, chunk=2, label_smoothing=0.1)
    gx, gw = torch.autograd.grad(loss, (x, w))
    ref = fused_ce.cross_entropy(F.linear(x, w), t, label_smoothing=0.1)
    rx, rw = torch.autograd.grad(ref, (x, w))
    assert loss.item() == pytest.approx(ref.item(), abs=1e-5)
    torch.testing.assert_close(gx, rx, atol=5e-5, rtol=1e-3)  # a sum over 50304 fp32 ids
    torch.testing.assert_close(gw, rw, atol=1e-7, rtol=1e-4)


def test_chunked_loss_without_grad_is_the_mean_over_the_counted_targets() -> None:
    # the no-grad path (evaluation on a GPU, where the -1 rows are not dropped first) divides by the targets that
    # count, not by all rows
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 8, generator=gen), torch.randn(37, 8, generator=gen)
    t = torch.tensor([1, -1, 5, -1, -1, 36, 0])
    with torch.no_grad():
        loss = fused_ce.chunked_cross_entropy(x, w, t, chunk=3)
    ref = F.cross_entropy(F.linear(x, w), t, ignore_index=-1)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)


def tiny(**kw) -> model.GPTConfig:
    import dataclasses

    return dataclasses.replace(MODEL_PRESETS["tiny"](), vocab_size=96, **kw)


@pytest.mark.parametrize("loss_chunk", [0, 40])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_fused_ce_model_on_cpu_matches_the_plain_loss(monkeypatch: pytest.MonkeyPatch, loss_chunk: int,
                                                        label_smoothing: float) -> None:
    # on CPU fused_ce runs the PyTorch reference inside the fused lm_head + loss (the kernel is CUDA only): the same
    # loss and gradients as the plain model, in fp32 and under bf16 autocast; loss_chunk 0 is one chunk of all rows
    def no_kernel(*args, **kwargs):
        raise AssertionError("the Triton kernel ran for a CPU tensor")

    monkeypatch.setattr(fused_ce, "cross_entropy_rows", no_kernel)
    torch.manual_seed(0)
    plain = GPT(tiny())
    fused = GPT(tiny(fused_ce=True, loss_chunk=loss_chunk))
    fused.load_state_dict(plain.state_dict())
    idx, y = torch.randint(0, 96, (3, 32)), torch.randint(0, 96, (3, 32))
    y[0, :5] = -1
    for autocast, tol in ((False, dict(atol=1e-5, rtol=1e-5)), (True, dict(atol=2e-3, rtol=2e-2))):
        losses, grads = [], []
        for m in (plain, fused):
            m.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits, loss = m(idx, y, label_smoothing=label_smoothing, return_logits=False)
            assert logits is None
            loss.backward()
            losses.append(loss.item())
            grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        assert losses[1] == pytest.approx(losses[0], abs=tol["atol"] * 10), (autocast, losses)
        for name, g in grads[0].items():
            torch.testing.assert_close(grads[1][name], g, **tol, msg=lambda m, n=f"{name} autocast={autocast}": n + m)


@pytest.mark.parametrize("loss_chunk", [0, 40])
def test_a_mostly_masked_loss_runs_the_head_on_the_scored_rows_only(monkeypatch: pytest.MonkeyPatch,
                                                                      loss_chunk: int) -> None:
    # SFT's targets are -1 but on the assistant's tokens: the lm_head then sees those rows alone, and the loss and
    # gradients are F.cross_entropy's over the whole logits
    torch.manual_seed(0)
    m = GPT(tiny(loss_chunk=loss_chunk))
    idx, y = torch.randint(0, 96, (3, 32)), torch.randint(0, 96, (3, 32))
    y[:, :28] = -1
    seen, scored_rows = [], fused_ce.scored_rows
    monkeypatch.setattr(fused_ce, "scored_rows", lambda x, t: seen.append(scored_rows(x, t)[0].shape) or
                        scored_rows(x, t))
    _, loss = m(idx, y, return_logits=False)
    grads = torch.autograd.grad(loss, list(m.parameters()))
    assert seen == [(12, 64)]  # 4 of each row's 32 targets
    ref = F.cross_entropy(m(idx)[0].view(-1, 96), y.view(-1), ignore_index=-1)
    assert loss.item() == pytest.approx(ref.item(), abs=1e-6)
    for g, r in zip(grads, torch.autograd.grad(ref, list(m.parameters())), strict=True):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


def test_fused_ce_eval_returns_the_loss_only() -> None:
    torch.manual_seed(0)
    plain = GPT(tiny())
    fused = GPT(tiny(fused_ce=True))
    fused.load_state_dict(plain.state_dict())
    idx, y = torch.randint(0, 96, (2, 16)), torch.randint(0, 96, (2, 16))
    with torch.no_grad():
        logits, loss = fused(idx, y)
        ref = plain(idx, y)[1]
        assert logits is None and loss.item() == pytest.approx(ref.item(), abs=1e-5)
        assert fused(idx)[0].shape == (2, 16, 96)  # no targets: the logits, as always


def test_fused_ce_config_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match="fused_ce must be True or False"):
        tiny(fused_ce=1)


def test_cross_entropy_rows_without_triton_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_ce, "_HAS_TRITON", False)
    logits, t = make_inputs(2, 8)
    with pytest.raises(RuntimeError, match="needs triton"):
        cross_entropy_rows(logits, t)


@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("with_grad", [False, True])
def test_kernel_compiles_for_hopper(smooth: bool, with_grad: bool) -> None:
    # what the model launches under bf16 autocast: bf16 logits and gradient, int64 targets, GPT-2's padded vocabulary
    if not triton_available():
        pytest.skip("needs triton")
    signature = {"logits_ptr": "*bf16", "targets_ptr": "*i64", "loss_ptr": "*fp32", "grad_ptr": "*bf16",
                 "label_smoothing": "fp32", "real_vocab": "i32", "V": "constexpr", "BLOCK_V": "constexpr",
                 "SMOOTH": "constexpr", "WITH_GRAD": "constexpr"}
    compiled = compile_for_hopper(fused_ce._cross_entropy_kernel, signature,
                                  {"V": 50304, "BLOCK_V": fused_ce.BLOCK_V, "SMOOTH": smooth, "WITH_GRAD": with_grad},
                                  fused_ce.NUM_WARPS)
    assert compiled.metadata.num_warps == fused_ce.NUM_WARPS
    assert len(compiled.asm["cubin"]) > 0 and ".target sm_90" in compiled.asm["ptx"]


# ----------------------------------------------------------------------------------------------------------------------
# the kernel under the Triton interpreter, on CPU


@pytest.mark.skipif(not triton_available() or INTERPRETED, reason="needs triton; TestInterpreted runs in-process")
def test_interpreter_in_child_process() -> None:
    """TestInterpreted, in a child process with TRITON_INTERPRET=1 (conftest.run_interpreted says why)."""
    run_interpreted(__file__)


@pytest.mark.skipif(not INTERPRETED, reason="run by test_interpreter_in_child_process (TRITON_INTERPRET=1)")
class TestInterpreted:
    # one column; a row inside one block; GPT-2's padding pattern (R < V) across two 4096-wide blocks, the second
    # masked; and a small block that masks the last of five
    @pytest.mark.parametrize("rows, vocab, real, block_v", [(1, 1, 0, 4096), (5, 1000, 0, 4096),
                                                            (7, 5000, 4990, 4096), (9, 300, 257, 64)])
    @pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
    def test_fp32_matches_reference(self, rows: int, vocab: int, real: int, block_v: int,
                                    label_smoothing: float) -> None:
        logits, t = make_inputs(rows, vocab, real=real)
        assert_matches(logits, t, label_smoothing, real, block_v=block_v)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_half_matches_fp32_reference(self, dtype: torch.dtype) -> None:
        logits, t = make_inputs(6, 777, dtype=dtype, real=700)
        assert_matches(logits, t, 0.1, 700, block_v=256)

    def test_large_logits_are_stable(self) -> None:
        # exp of a logit of 1e4 overflows fp32: the running max must be subtracted first. Row 0: the target holds the
        # maximum (loss ~0); row 1: it is far below (loss ~2e4); row 2: every logit equal (loss ln V, gradient 1/V)
        logits = torch.zeros(3, 600)
        logits[0, 5], logits[1, 7], logits[1, 8] = 1e4, 1e4, -1e4
        t = torch.tensor([5, 8, 3])
        loss, grad = cross_entropy_rows(logits, t, block_v=128)
        assert loss[0].item() == 0.0 and loss[1].item() == pytest.approx(2e4, rel=1e-6)
        assert loss[2].item() == pytest.approx(math.log(600), abs=1e-6)
        torch.testing.assert_close(grad[2, :3], torch.full((3,), 1 / 600))
        assert grad[2, 3].item() == pytest.approx(1 / 600 - 1, abs=1e-6)
        assert torch.isfinite(grad).all()
        assert_matches(logits, t, block_v=128)

    def test_without_grad_gives_the_same_loss(self) -> None:
        logits, t = make_inputs(5, 300, real=257)
        loss, grad = cross_entropy_rows(logits, t, 0.1, 257, with_grad=False, block_v=64)
        assert grad is None
        torch.testing.assert_close(loss, cross_entropy_rows(logits, t, 0.1, 257, block_v=64)[0], atol=0, rtol=0)

    def test_zero_rows_and_all_ignored(self) -> None:
        loss, grad = cross_entropy_rows(torch.zeros(0, 10), torch.zeros(0, dtype=torch.long))
        assert loss.shape == (0,) and grad.shape == (0, 10)
        logits, _ = make_inputs(4, 50)
        loss, grad = cross_entropy_rows(logits, torch.full((4,), -1))
        assert loss.abs().sum() == 0 and grad.abs().sum() == 0

    def test_non_contiguous_logits(self) -> None:
        logits, t = make_inputs(300, 6)
        logits = logits.t()  # (6, 300) with strides (1, 6)
        assert not logits.is_contiguous()
        assert_matches(logits, t[:6], block_v=64)

    @pytest.mark.parametrize("chunk", [37, 8])
    @pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
    def test_fused_lm_head_and_loss_matches_f_cross_entropy(self, chunk: int, label_smoothing: float) -> None:
        # fused_ce.py's autograd.Function with the kernel (what CUDA runs), called directly: on a CPU tensor the
        # dispatch picks the reference. One chunk of all 37 rows, and chunks of 8 with a short last one
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(37, 16, generator=gen, requires_grad=True)
        w = torch.randn(101, 16, generator=gen, requires_grad=True)
        t = torch.randint(0, 101, (37,), generator=gen)
        t[::5] = -1
        ref = F.cross_entropy(F.linear(x, w), t, ignore_index=-1, label_smoothing=label_smoothing)
        ref_dx, ref_dw = torch.autograd.grad(3 * ref, (x, w))
        got = fused_ce._ChunkedCrossEntropy.apply(x, w, t, chunk, label_smoothing, True)
        dx, dw = torch.autograd.grad(3 * got, (x, w))
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-6)
        torch.testing.assert_close(dx, ref_dx, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(dw, ref_dw, atol=1e-6, rtol=1e-5)

    def test_fused_lm_head_and_loss_under_autocast(self) -> None:
        # bf16 autocast, GPT-2's padded vocabulary and smoothing over the real ids: the kernel's path against the
        # reference's, the same bf16 matmuls either side of the loss
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(6, 8, generator=gen, requires_grad=True)
        w = (0.5 * torch.randn(50304, 8, generator=gen)).requires_grad_()
        t = torch.randint(0, GPT2_VOCAB, (6,), generator=gen)
        t[0] = -1
        out = []
        for fused in (True, False):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = fused_ce._ChunkedCrossEntropy.apply(x, w, t, 6, 0.1, fused)
            out.append((loss, *torch.autograd.grad(loss, (x, w))))
        assert out[0][0].dtype == torch.float32
        torch.testing.assert_close(out[0][0], out[1][0], atol=1e-5, rtol=1e-6)
        # the gradients go through the logits' gradient in bf16, rounded from softmax values that the kernel's online
        # sums and torch's logsumexp make a few fp32 ulps apart: the target's entry (about -0.9) can round one bf16
        # ulp (2^-8) either way, which moves a gradient element by up to 2^-8 * |w| (|w| < 2.5 here)
        for got, ref in zip(out[0][1:], out[1][1:], strict=True):
            assert got.dtype == ref.dtype == torch.float32
            torch.testing.assert_close(got, ref, atol=1e-2, rtol=2e-2)

    def test_check_kernels_script(self, capsys: pytest.CaptureFixture) -> None:
        check_kernels(["ce", "--rows", "6", "--vocab", "300", "--real-vocab", "257", "--device", "cpu"])
        out = capsys.readouterr().out
        errs = re.findall(r"loss max rel err (\S+) \| grad max abs err (\S+)", out)
        assert len(errs) == 2 and max(float(e) for pair in errs for e in pair) < 1e-5, out


# ----------------------------------------------------------------------------------------------------------------------
# the compiled kernel on a GPU


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()) or INTERPRETED,
                    reason="needs CUDA, triton, and a compiled (not interpreted) kernel")
class TestCUDA:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    @pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
    def test_gpt2_vocabulary(self, dtype: torch.dtype, label_smoothing: float) -> None:
        logits, t = make_inputs(2048, 50304, dtype=dtype, device="cuda", real=GPT2_VOCAB)
        assert_matches(logits, t, label_smoothing, GPT2_VOCAB)

    def test_odd_vocabulary(self) -> None:
        logits, t = make_inputs(999, 4097, dtype=torch.bfloat16, device="cuda")
        assert_matches(logits, t)

    def test_deterministic(self) -> None:
        logits, t = make_inputs(4096, 50304, dtype=torch.bfloat16, device="cuda")
        first, second = cross_entropy_rows(logits, t), cross_entropy_rows(logits, t)
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])

    @pytest.mark.slow
    def test_compiled_model_matches_the_plain_loss(self) -> None:
        # GPT-2's head and loss under torch.compile and bf16 autocast: the fused path (kernel inside the compiled
        # graph) against the plain one, the same loss to bf16 noise and the same gradients
        torch._dynamo.reset()
        torch.manual_seed(0)
        import dataclasses

        cfg = dataclasses.replace(MODEL_PRESETS["gpt2"](), n_layer=2, block_size=256)
        plain = GPT(cfg).cuda()
        fused = GPT(dataclasses.replace(cfg, fused_ce=True)).cuda()
        fused.load_state_dict(plain.state_dict())
        idx = torch.randint(0, GPT2_VOCAB, (8, 256), device="cuda")
        y = torch.randint(0, GPT2_VOCAB, (8, 256), device="cuda")
        out = []
        for m in (plain, fused):
            step = torch.compile(m)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = step(idx, y, return_logits=False)[1]
            loss.backward()
            out.append((loss.item(), m.lm_head.weight.grad.clone(), m.transformer.h[0].mlp.c_fc.weight.grad.clone()))
        assert out[1][0] == pytest.approx(out[0][0], abs=2e-3)
        for got, ref in zip(out[1][1:], out[0][1:], strict=True):
            torch.testing.assert_close(got, ref, atol=1e-4, rtol=5e-2)


@pytest.mark.skipif(not triton_available() or torch.cuda.is_available(), reason="the CPU usage error: triton, no GPU")
def test_check_kernels_without_a_gpu_says_how_to_run_it(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        check_kernels(["ce", "--rows", "6", "--vocab", "300", "--real-vocab", "257"])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == (
        "check_kernels.py ce: error: this machine has no CUDA GPU; on CPU run the kernels in Triton's interpreter: "
        "TRITON_INTERPRET=1 python scripts/check_kernels.py ce --device cpu")


@pytest.mark.parametrize("argv, flag", [(["gelu", "--rows", "0"], "--rows must be >= 1, got 0"),
                                        (["gelu", "--cols", "-3"], "--cols must be >= 1, got -3"),
                                        (["ce", "--rows", "0"], "--rows must be >= 1, got 0"),
                                        (["ce", "--vocab", "0"], "--vocab must be >= 1, got 0"),
                                        (["ce", "--real-vocab", "0"], "--real-vocab must be >= 1, got 0")])
def test_check_kernels_refuses_an_empty_shape_in_one_line(argv, flag, capsys: pytest.CaptureFixture) -> None:
    # each was a traceback from the max of an empty tensor, a reshape or randint; before the device's checks
    with pytest.raises(SystemExit) as e:
        check_kernels([*argv, "--device", "cpu"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"check_kernels.py {argv[0]}: error: {flag}"
