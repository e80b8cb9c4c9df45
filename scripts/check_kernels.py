"""Check a Triton kernel against its PyTorch reference and print the max errors: fused_gelu.py's bias+GELU (y, dx, db)
or fused_ce.py's cross-entropy (loss and gradient, without and with label smoothing). Not a benchmark; speed lives in
bench.py.

Usage (from the repo root):
    python scripts/check_kernels.py gelu --rows 8192 --cols 3072 --dtype bfloat16          # on a CUDA machine
    TRITON_INTERPRET=1 python scripts/check_kernels.py gelu --rows 64 --cols 257 --device cpu
    python scripts/check_kernels.py ce --rows 4096 --vocab 50304 --dtype bfloat16
    TRITON_INTERPRET=1 python scripts/check_kernels.py ce --rows 16 --vocab 1000 --device cpu
"""

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fused_ce  # noqa: E402
import fused_gelu  # noqa: E402


def check_gelu(args: argparse.Namespace) -> None:
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=args.device).manual_seed(0)
    x = (3 * torch.randn(args.rows, args.cols, generator=gen, device=args.device)).to(dtype).requires_grad_()
    b = torch.randn(args.cols, generator=gen, device=args.device).to(dtype).requires_grad_()
    dy = torch.randn(args.rows, args.cols, generator=gen, device=args.device).to(dtype)
    y = fused_gelu.fused_bias_gelu(x, b)
    dx, db = torch.autograd.grad(y, (x, b), dy)
    # the reference in fp32 from the same (rounded) inputs: what the kernels approximate
    xr, br = x.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    yr = fused_gelu.bias_gelu_reference(xr, br)
    dxr, dbr = torch.autograd.grad(yr, (xr, br), dy.float())
    for name, got, ref in (("y", y, yr), ("dx", dx, dxr), ("db", db, dbr)):
        err = (got.float() - ref).abs().max().item()
        # relative to the largest |ref|: an element-wise relative error explodes where the reference crosses 0
        top = ref.abs().max().item()
        print(f"{name:>2}: max abs err {err:.3e} = {err / max(top, 1e-30):.1e} of |ref| max {top:.3e}")


def check_ce(args: argparse.Namespace) -> None:
    real = min(args.real_vocab, args.vocab)
    gen = torch.Generator(device=args.device).manual_seed(0)
    # logits at GPT-2's scale after training (std ~3), one target in ten ignored
    logits = (3 * torch.randn(args.rows, args.vocab, generator=gen, device=args.device)).to(getattr(torch, args.dtype))
    targets = torch.randint(0, real, (args.rows,), generator=gen, device=args.device)
    targets[::10] = -1
    for s in (0.0, args.label_smoothing):
        loss, grad = fused_ce.cross_entropy_rows(logits, targets, s, real)
        ref_loss, ref_grad = fused_ce.cross_entropy_reference(logits, targets, s, real)
        loss_err = (loss - ref_loss).abs().max().item() / max(ref_loss.abs().max().item(), 1e-30)
        grad_err = (grad.float() - ref_grad).abs().max().item()  # gradients are in [-1, 1]
        mean = ref_loss.sum().item() / (targets != -1).sum().item()
        print(f"label_smoothing {s}: loss max rel err {loss_err:.1e} | grad max abs err {grad_err:.1e} | "
              f"mean loss {mean:.4f} (ln V = {math.log(args.vocab):.4f})")


def check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error, not a traceback, for a missing triton, no GPU, or a CPU device without the interpreter; cuda:N
    becomes the current device (where Triton launches, whatever the tensors')."""
    if not fused_gelu.triton_available():
        parser.error("triton is not installed (pip install triton)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("this machine has no CUDA GPU; on CPU run the kernels in Triton's interpreter: "
                     f"TRITON_INTERPRET=1 python scripts/check_kernels.py {args.kernel} --device cpu")
    import triton

    # a JITFunction: the kernels compile for a GPU (under TRITON_INTERPRET=1 every kernel is an interpreted one)
    if not args.device.startswith("cuda") and isinstance(fused_gelu._bias_gelu_fwd_kernel, triton.runtime.JITFunction):
        parser.error(f"--device {args.device} needs Triton's interpreter: set TRITON_INTERPRET=1 (before the run)")
    if args.device.startswith("cuda:"):
        torch.cuda.set_device(args.device)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="check_kernels.py", description=__doc__.split("\n\n")[0])
    kernels = parser.add_subparsers(dest="kernel", required=True)
    gelu = kernels.add_parser("gelu", help="fused_gelu.py's bias+GELU, forward and backward")
    gelu.add_argument("--rows", type=int, default=8192, help="M, rows of x")
    gelu.add_argument("--cols", type=int, default=3072, help="N, the MLP width")
    ce = kernels.add_parser("ce", help="fused_ce.py's loss and the logits' gradient")
    ce.add_argument("--rows", type=int, default=4096, help="N, rows of logits")
    ce.add_argument("--vocab", type=int, default=50304, help="V, the (padded) vocabulary")
    ce.add_argument("--real-vocab", type=int, default=50257, help="R, the ids label smoothing spreads over")
    ce.add_argument("--label-smoothing", type=float, default=0.1)
    for sub in (gelu, ce):
        sub.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        sub.add_argument("--device", default="cuda", help="cuda, or cpu under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    for name in ("rows", "cols", "vocab", "real_vocab"):  # an empty shape has no max error to print
        if getattr(args, name, 1) < 1:
            kernels.choices[args.kernel].error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    check_device(kernels.choices[args.kernel], args)
    (check_gelu if args.kernel == "gelu" else check_ce)(args)


if __name__ == "__main__":
    main()
