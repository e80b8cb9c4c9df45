"""fused_gelu.py: the Triton bias+GELU kernels against the PyTorch reference, forward and backward.

On CPU the kernels run under the Triton interpreter (TestInterpreted, in a child process with TRITON_INTERPRET=1);
on a CUDA machine TestCUDA runs them compiled, eagerly and under torch.compile.
"""

import re

import pytest
import torch

import fused_gelu
from conftest import check_kernels, compile_for_hopper, run_interpreted
from fused_gelu import bias_gelu, bias_gelu_reference, fused_bias_gelu, triton_available


def _kernels_interpreted() -> bool:
    """Whether fused_gelu's kernels were built by the Triton interpreter (TRITON_INTERPRET=1 before triton loaded)."""
    if not triton_available():
        return False
    import triton

    return not isinstance(fused_gelu._bias_gelu_fwd_kernel, triton.runtime.JITFunction)


INTERPRETED = _kernels_interpreted()

# y and dx are elementwise, so fp32 differs from torch by a few ulps (the kernel's s * (1 - s) is, if anything, closer
# to float64 than torch's 1 - tanh^2); db sums rows in another order, so it gets a little more room.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
FP32_DB_TOL = dict(atol=1e-4, rtol=1e-5)
# half precision: one rounding of an fp32 result to 8 (bf16) or 11 (fp16) mantissa bits, ~4e-3 / 5e-4 relative
HALF_TOL = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def make_inputs(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, device: str = "cpu",
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x ~ N(0, 3^2) (pre-activations at a realistic scale, reaching the saturated tails), b ~ N(0, 1), dy ~ N(0, 1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = 3 * torch.randn(shape, generator=gen, device=device)
    b = torch.randn(shape[-1], generator=gen, device=device)
    dy = torch.randn(shape, generator=gen, device=device)
    return x.to(dtype), b.to(dtype), dy.to(dtype)


def run(fn, x: torch.Tensor, b: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, dx, db) of fn(x, b) with upstream gradient dy, on fresh leaves."""
    x, b = x.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    y = fn(x, b)
    dx, db = torch.autograd.grad(y, (x, b), dy)
    return y.detach(), dx, db


def reference_fp32(x: torch.Tensor, b: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The reference on the same (possibly rounded) inputs, computed in fp32: what the kernels approximate."""
    return run(bias_gelu_reference, x.float(), b.float(), dy.float())


def assert_matches(got: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...], x: torch.Tensor,
                   b: torch.Tensor) -> None:
    """Shapes and dtypes as documented (y, dx in x's dtype; db in b's), values within the per-dtype tolerance."""
    y, dx, db = got
    assert (y.shape, dx.shape, db.shape) == (x.shape, x.shape, b.shape)
    assert (y.dtype, dx.dtype, db.dtype) == (x.dtype, x.dtype, b.dtype)
    tol = FP32_TOL if x.dtype == torch.float32 else HALF_TOL[x.dtype]
    db_tol = FP32_DB_TOL if b.dtype == torch.float32 else HALF_TOL[b.dtype]
    torch.testing.assert_close(y.float(), ref[0], **tol)
    torch.testing.assert_close(dx.float(), ref[1], **tol)
    torch.testing.assert_close(db.float(), ref[2], **db_tol)


# ----------------------------------------------------------------------------------------------------------------------
# dispatch and errors: no triton needed


def test_reference_is_gpt2_gelu() -> None:
    x, b, _ = make_inputs((4, 6))
    u = (x + b).double()
    gpt2 = 0.5 * u * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (u + 0.044715 * u**3)))  # GPT-2's gelu_new
    torch.testing.assert_close(bias_gelu_reference(x, b).double(), gpt2, atol=1e-6, rtol=1e-6)


def test_bias_gelu_on_cpu_is_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fused(*args):
        raise AssertionError("bias_gelu took the Triton path for a CPU tensor")

    monkeypatch.setattr(fused_gelu.FusedBiasGELU, "apply", no_fused)
    x, b, dy = make_inputs((3, 5, 17))
    got, ref = run(lambda x, b: bias_gelu(x, b, fused=True), x, b, dy), run(bias_gelu_reference, x, b, dy)
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)


def test_fused_without_triton_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_gelu, "_HAS_TRITON", False)
    x, b, _ = make_inputs((2, 8))
    assert not triton_available()
    with pytest.raises(RuntimeError, match="needs triton"):
        fused_bias_gelu(x, b)
    assert torch.equal(bias_gelu(x, b, fused=True), bias_gelu_reference(x, b))


def test_unfused_path_under_autocast_is_the_bf16_linear_bias_gelu() -> None:
    # the MLP's unfused path must equal nn.Linear(bias=True) + GELU under autocast, the standard GPT-2 MLP: a bf16
    # output (an fp32 one would be twice the activation memory) and an fp32 gradient for the fp32 bias
    torch.manual_seed(0)
    fc = torch.nn.Linear(16, 48)
    x = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = bias_gelu(torch.nn.functional.linear(x, fc.weight), fc.bias, fused=False)
        standard = torch.nn.functional.gelu(fc(x), approximate="tanh")
    assert ours.dtype == standard.dtype == torch.bfloat16
    torch.testing.assert_close(ours, standard, atol=0.02, rtol=0.02)  # bf16 rounding of the product, then the sum
    ours.float().sum().backward()
    assert fc.bias.grad.dtype == torch.float32


@pytest.mark.parametrize("which", ["fwd", "bwd"])
def test_kernels_compile_for_hopper(which: str) -> None:
    # what the MLP launches under bf16 autocast: bf16 activations, the fp32 bias, the default tiles
    if not triton_available():
        pytest.skip("needs triton")
    if which == "fwd":
        kernel, warps = fused_gelu._bias_gelu_fwd_kernel, fused_gelu.FWD_NUM_WARPS
        signature = {"x_ptr": "*bf16", "b_ptr": "*fp32", "y_ptr": "*bf16", "M": "i32", "N": "i32",
                     "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
        constexprs = {"BLOCK_M": fused_gelu.FWD_BLOCK_M, "BLOCK_N": fused_gelu.FWD_BLOCK_N}
    else:
        kernel, warps = fused_gelu._bias_gelu_bwd_kernel, fused_gelu.BWD_NUM_WARPS
        signature = {"dy_ptr": "*bf16", "x_ptr": "*bf16", "b_ptr": "*fp32", "dx_ptr": "*bf16",
                     "db_partial_ptr": "*fp32", "M": "i32", "N": "i32", "ROWS_PER_PROGRAM": "constexpr",
                     "BLOCK_M": "constexpr", "BLOCK_N": "constexpr"}
        constexprs = {"ROWS_PER_PROGRAM": fused_gelu.BWD_ROWS_PER_PROGRAM, "BLOCK_M": fused_gelu.BWD_BLOCK_M,
                      "BLOCK_N": fused_gelu.BWD_BLOCK_N}
    compiled = compile_for_hopper(kernel, signature, constexprs, warps)
    assert compiled.metadata.num_warps == warps
    assert len(compiled.asm["cubin"]) > 0 and ".target sm_90" in compiled.asm["ptx"]
    assert "fma.rn.f32" in compiled.asm["ptx"]  # a * b + c fused, as measured (Triton 3.10's default would not)


# ----------------------------------------------------------------------------------------------------------------------
# the kernels under the Triton interpreter, on CPU


@pytest.mark.skipif(not triton_available() or INTERPRETED, reason="needs triton; TestInterpreted runs in-process")
def test_interpreter_in_child_process() -> None:
    """TestInterpreted, in a child process with TRITON_INTERPRET=1 (conftest.run_interpreted says why)."""
    run_interpreted(__file__, timeout=300)


@pytest.mark.skipif(not INTERPRETED, reason="run by test_interpreter_in_child_process (TRITON_INTERPRET=1)")
class TestInterpreted:
    # odd rows and columns against both block shapes: (1, 1), a row past 128 columns, 3-D input, and a (33, 1030)
    # case that spans two forward column blocks (1024 + 6 masked) and five backward ones (256 wide)
    @pytest.mark.parametrize("shape", [(1, 1), (7, 129), (3, 5, 257), (33, 1030)])
    def test_fp32_matches_reference(self, shape: tuple[int, ...]) -> None:
        x, b, dy = make_inputs(shape)
        assert_matches(run(fused_bias_gelu, x, b, dy), reference_fp32(x, b, dy), x, b)

    # small blocks, so that with M = 21, N = 40 every block edge is masked and db comes from several row groups
    # (rows_per_program 4: six groups of one step; 6, rounded up to 8: three groups of two steps) or from one group
    # looping six steps and then ten fully masked ones (64 > M = 21)
    @pytest.mark.parametrize("rows_per_program", [4, 6, 64])
    def test_launchers_with_small_blocks(self, rows_per_program: int) -> None:
        x, b, dy = make_inputs((21, 40))
        y = fused_gelu.bias_gelu_fwd(x, b, block_m=4, block_n=16)
        dx, db = fused_gelu.bias_gelu_bwd(dy, x, b, block_m=4, block_n=16, rows_per_program=rows_per_program)
        assert_matches((y, dx, db), reference_fp32(x, b, dy), x, b)

    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
    def test_half_matches_fp32_reference(self, dtype: torch.dtype) -> None:
        x, b, dy = make_inputs((9, 200), dtype=dtype)
        assert_matches(run(fused_bias_gelu, x, b, dy), reference_fp32(x, b, dy), x, b)

    def test_bf16_activations_fp32_bias(self) -> None:
        # what the MLP passes under autocast: a bf16 matmul output and the fp32 bias parameter
        x, b, dy = make_inputs((6, 130), dtype=torch.bfloat16)
        b = b.float()
        assert_matches(run(fused_bias_gelu, x, b, dy), reference_fp32(x, b, dy), x, b)

    def test_non_contiguous_input(self) -> None:
        x, b, dy = make_inputs((5, 40))
        x = make_inputs((40, 5), seed=1)[0].t()  # (5, 40) with strides (1, 5)
        assert not x.is_contiguous()
        assert_matches(run(fused_bias_gelu, x, b, dy), reference_fp32(x, b, dy), x, b)

    def test_non_contiguous_upstream_gradient(self) -> None:
        # backward's dy comes from whatever op follows (a transpose, a slice): the kernel indexes it as row * N + col,
        # so it must be made contiguous first, or dx is read from the wrong elements
        x, b, _ = make_inputs((5, 40))
        dy = make_inputs((40, 5), seed=1)[2].t()  # (5, 40) with strides (1, 5)
        assert not dy.is_contiguous()
        assert_matches(run(fused_bias_gelu, x, b, dy), reference_fp32(x, b, dy), x, b)

    def test_zero_rows(self) -> None:
        x, b, dy = make_inputs((0, 12))
        y, dx, db = run(fused_bias_gelu, x, b, dy)
        assert (y.shape, dx.shape) == ((0, 12), (0, 12))
        assert torch.equal(db, torch.zeros(12))

    def test_deterministic(self) -> None:
        x, b, dy = make_inputs((21, 40))
        first = fused_gelu.bias_gelu_bwd(dy, x, b, block_m=4, block_n=16, rows_per_program=8)
        second = fused_gelu.bias_gelu_bwd(dy, x, b, block_m=4, block_n=16, rows_per_program=8)
        assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])

    def test_saves_only_x_and_b(self) -> None:
        # the memory claim: backward keeps the inputs alive, not x + b or y
        x, b, _ = make_inputs((4, 24))
        x.requires_grad_()
        b.requires_grad_()
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            fused_bias_gelu(x, b)
        assert sorted(t.data_ptr() for t in saved) == sorted([x.data_ptr(), b.data_ptr()])

    def test_bad_arguments(self) -> None:
        x, b, _ = make_inputs((4, 24))
        with pytest.raises(ValueError, match=r"b of shape \(N,\)"):
            fused_bias_gelu(x, b[:-1])

    def test_check_kernels_script(self, capsys: pytest.CaptureFixture) -> None:
        # fp32 kernels against the fp32 reference: errors at rounding level, relative to the largest |ref|
        check_kernels(["gelu", "--rows", "33", "--cols", "40", "--device", "cpu"])
        out = capsys.readouterr().out
        rel = {m[0]: float(m[1]) for m in re.findall(r"(y|dx|db): max abs err \S+ = (\S+) of", out)}
        assert set(rel) == {"y", "dx", "db"} and max(rel.values()) < 1e-5, out


# ----------------------------------------------------------------------------------------------------------------------
# the compiled kernels on a GPU


@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()) or INTERPRETED,
                    reason="needs CUDA, triton, and compiled (not interpreted) kernels")
class TestCUDA:
    # GPT-2 MLP width at a few rows (incl. a 3-D batch), and an odd width that masks every block
    SHAPES = [(4096, 3072), (3, 77, 3072), (1000, 257)]

    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_matches_reference(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        x, b, dy = make_inputs(shape, dtype=dtype, device="cuda")
        assert_matches(run(fused_bias_gelu, x, b, dy), reference_fp32(x, b, dy), x, b)

    def test_bias_gelu_dispatches_to_kernel(self, monkeypatch: pytest.MonkeyPatch) -> None:
        calls = []
        apply = fused_gelu.FusedBiasGELU.apply
        monkeypatch.setattr(fused_gelu.FusedBiasGELU, "apply", lambda *a: calls.append(1) or apply(*a))
        x, b, dy = make_inputs((64, 3072), dtype=torch.bfloat16, device="cuda")
        assert_matches(run(lambda x, b: bias_gelu(x, b, fused=True), x, b, dy), reference_fp32(x, b, dy), x, b)
        assert calls == [1]

    def test_deterministic(self) -> None:
        x, b, dy = make_inputs((8192, 3072), dtype=torch.bfloat16, device="cuda")
        first, second = run(fused_bias_gelu, x, b, dy), run(fused_bias_gelu, x, b, dy)
        for f, s in zip(first, second, strict=True):
            assert torch.equal(f, s)

    @pytest.mark.slow
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
    def test_torch_compile(self, dtype: torch.dtype) -> None:
        # between inductor-generated ops, forward and backward, with no graph break (fullgraph); the scalings by
        # 2 and 0.5 are exact in every dtype, so the fp32 reference of the same expression stays the yardstick
        torch._dynamo.reset()
        x, b, dy = make_inputs((2, 64, 3072), dtype=dtype, device="cuda")

        @torch.compile(fullgraph=True)
        def compiled(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return 0.5 * bias_gelu(2 * x, b, fused=True)

        ref = run(lambda x, b: 0.5 * bias_gelu_reference(2 * x, b), x.float(), b.float(), dy.float())
        assert_matches(run(compiled, x, b, dy), ref, x, b)


@pytest.mark.skipif(not triton_available() or torch.cuda.is_available() or INTERPRETED,
                    reason="the CPU usage errors: triton, no GPU, no interpreter")
@pytest.mark.parametrize("argv, triton, error", [
    ([], True, "this machine has no CUDA GPU; on CPU run the kernels in Triton's interpreter: "
               "TRITON_INTERPRET=1 python scripts/check_kernels.py gelu --device cpu"),
    (["--device", "cpu"], True, "--device cpu needs Triton's interpreter: set TRITON_INTERPRET=1 (before the run)"),
    ([], False, "triton is not installed (pip install triton)")])
def test_check_kernels_refuses_what_cannot_run(argv: list[str], triton: bool, error: str,
                                               monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    # scripts/check_kernels.py: a one-line usage error that says how to run it, not a CUDA traceback
    monkeypatch.setattr(fused_gelu, "_HAS_TRITON", triton)
    with pytest.raises(SystemExit) as e:
        check_kernels(["gelu", "--rows", "33", "--cols", "40", *argv])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == f"check_kernels.py gelu: error: {error}"
