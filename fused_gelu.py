"""Fused bias + GELU(tanh) for the GPT-2 MLP: Triton kernels, their launchers, an autograd.Function, a reference.

    y = gelu_tanh(x + b)        x: (..., N) (the c_fc matmul output, no bias), b: (N,)

Forward reads x and b once and writes y: x + b never exists in memory. Backward recomputes x + b and writes dx and db
in one pass over dy and x; db goes through per-program partial rows, not atomics, so it is bitwise reproducible. Math
in fp32; y and dx in x's dtype, db in b's. The MLP calls `bias_gelu(x, b, fused)`; on CPU the kernels run under the
Triton interpreter when TRITON_INTERPRET=1 is set before triton is first imported. The self-check against the
reference: scripts/check_kernels.py gelu.
"""

import os

import torch
import torch.nn.functional as F
from torch import Tensor

# Triton 3.10 stops fusing a * b + c into FMAs by default: keep fusing, as every kernel figure here was measured
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
try:
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # CPU-only or macOS installs: bias_gelu falls back to the reference
    _HAS_TRITON = False

# Launch defaults for H100/H200, N = 3072, bf16 (why, measured: docs/notes.md, "fused_gelu.py"); bench.py sweeps them.
# forward: 4 x 1024 tiles at 4 warps; 1024 divides 3072, so no masked column blocks
FWD_BLOCK_M, FWD_BLOCK_N, FWD_NUM_WARPS = 4, 1024, 4
# backward: 8 x 256 per loop step at 4 warps (16 fp32 db registers per thread), 256 rows per program
BWD_BLOCK_M, BWD_BLOCK_N, BWD_NUM_WARPS, BWD_ROWS_PER_PROGRAM = 8, 256, 4, 256


def triton_available() -> bool:
    """True when triton imported, i.e. the fused kernels exist."""
    return _HAS_TRITON


def bias_gelu_reference(x: Tensor, b: Tensor) -> Tensor:
    """The pure-PyTorch definition the kernels must match: GPT-2's tanh GELU of x + b."""
    return F.gelu(x + b, approximate="tanh")


if _HAS_TRITON:
    # Constants are literals in the kernels: a plain Python global is not readable from a Triton kernel.
    # 2 * sqrt(2 / pi) = 1.5957691216057308, 0.044715 is GPT-2's cubic coefficient, 3 * 0.044715 = 0.134145.

    @triton.jit
    def _gelu_gate(u):
        # Returns s = 0.5 * (1 + tanh(z)) = sigmoid(2z), z = sqrt(2/pi) * (u + 0.044715 u^3), and s * (1 - s),
        # through exp(-|2z|): no tanh, no overflow, no cancellation in 1 - s (docs/notes.md, "fused_gelu.py")
        two_z = 1.5957691216057308 * (u + 0.044715 * u * u * u)
        e = tl.exp(-tl.abs(two_z))
        r = 1.0 / (1.0 + e)
        return tl.where(two_z >= 0, r, e * r), e * r * r

    @triton.jit
    def _bias_gelu_fwd_kernel(x_ptr, b_ptr, y_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # row blocks on grid axis 0, whose limit is 2^31 - 1; axes 1 and 2 stop at 65535
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = (rows < M)[:, None] & col_mask[None, :]
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]  # int64: M * N can pass 2^31 at long context
        b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + b[None, :]  # (BLOCK_M, BLOCK_N)
        s, _ = _gelu_gate(u)
        y = u * s
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias_gelu_bwd_kernel(dy_ptr, x_ptr, b_ptr, dx_ptr, db_partial_ptr, M, N, ROWS_PER_PROGRAM: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # program (g, j) sums the db of its ROWS_PER_PROGRAM rows of column block j into row g of db_partial: a fixed
        # order, so db is deterministic. The loop bound is a constexpr for the interpreter (docs/notes.md).
        group = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        b = tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # reduced over rows once, after the loop
        for start in range(0, ROWS_PER_PROGRAM, BLOCK_M):
            rows = group * ROWS_PER_PROGRAM + start + tl.arange(0, BLOCK_M)
            mask = (rows < M)[:, None] & col_mask[None, :]
            offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
            u = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32) + b[None, :]  # recomputed x + b
            dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            s, s1s = _gelu_gate(u)  # s1s = s * (1 - s)
            # d/du [u * s(u)] = s + u * s * (1 - s) * 2 sqrt(2/pi) * (1 + 3 * 0.044715 u^2)
            dx = dy * (s + u * s1s * 1.5957691216057308 * (1.0 + 0.134145 * u * u))
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            acc += dx  # masked lanes loaded dy = 0, so they add 0
        tl.store(db_partial_ptr + group * N + cols, tl.sum(acc, axis=0), mask=col_mask)


def bias_gelu_fwd(x: Tensor, b: Tensor, block_m: int = FWD_BLOCK_M, block_n: int = FWD_BLOCK_N,
                  num_warps: int = FWD_NUM_WARPS) -> Tensor:
    """Launch the forward kernel on a contiguous (M, N) x and an (N,) b; returns y (M, N) in x's dtype."""
    M, N = x.shape
    y = torch.empty_like(x)
    if x.numel() == 0:  # a zero-size grid is not a valid launch
        return y
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _bias_gelu_fwd_kernel[grid](x, b, y, M, N, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return y


def bias_gelu_bwd(dy: Tensor, x: Tensor, b: Tensor, block_m: int = BWD_BLOCK_M, block_n: int = BWD_BLOCK_N,
                  rows_per_program: int = BWD_ROWS_PER_PROGRAM,
                  num_warps: int = BWD_NUM_WARPS) -> tuple[Tensor, Tensor]:
    """Launch the backward kernel on contiguous (M, N) dy and x and an (N,) b; returns dx (x's dtype), db (b's dtype).
    rows_per_program does not depend on M, so the kernel compiles once for every M (symbolic ones included)."""
    M, N = x.shape
    dx = torch.empty_like(x)
    if x.numel() == 0:
        return dx, torch.zeros_like(b)
    rows = block_m * triton.cdiv(rows_per_program, block_m)
    groups = triton.cdiv(M, rows)
    db_partial = torch.empty((groups, N), dtype=torch.float32, device=x.device)  # (row_groups, N), fp32
    grid = (groups, triton.cdiv(N, block_n))
    _bias_gelu_bwd_kernel[grid](dy, x, b, dx, db_partial, M, N, ROWS_PER_PROGRAM=rows, BLOCK_M=block_m,
                                BLOCK_N=block_n, num_warps=num_warps)
    return dx, db_partial.sum(0).to(b.dtype)


class FusedBiasGELU(torch.autograd.Function):
    """y = gelu_tanh(x + b) with Triton kernels; saves x and b only and recomputes x + b in backward."""

    @staticmethod
    def forward(ctx, x: Tensor, b: Tensor) -> Tensor:
        x, b = x.contiguous(), b.contiguous()  # the kernels index rows as row * N + col
        y = bias_gelu_fwd(x.view(-1, b.shape[0]), b)
        ctx.save_for_backward(x, b)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor]:
        x, b = ctx.saved_tensors
        N = b.shape[0]
        dx, db = bias_gelu_bwd(dy.contiguous().view(-1, N), x.view(-1, N), b)
        return dx.view(x.shape), db


def fused_bias_gelu(x: Tensor, b: Tensor) -> Tensor:
    """gelu_tanh(x + b) through the Triton kernels, always (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if not _HAS_TRITON:
        raise RuntimeError("fused_bias_gelu needs triton, which is not installed: `pip install triton` on a CUDA "
                           "machine, or call bias_gelu(x, b, fused=False) for the PyTorch reference")
    if b.dim() != 1 or x.dim() == 0 or x.shape[-1] != b.shape[0]:  # else x.view(-1, N) could fit, and mean nothing
        raise ValueError(f"bias_gelu needs x of shape (..., N) and b of shape (N,), got {tuple(x.shape)} "
                         f"and {tuple(b.shape)}")
    return FusedBiasGELU.apply(x, b)


def bias_gelu(x: Tensor, b: Tensor, fused: bool) -> Tensor:
    """The MLP's bias + GELU: the Triton kernels when fused, on CUDA, with triton; else the reference, with b cast to
    x's dtype as nn.Linear's bias is under autocast (docs/notes.md: the fp32 promotion this avoids)."""
    if fused and x.is_cuda and _HAS_TRITON:
        return fused_bias_gelu(x, b)
    return bias_gelu_reference(x, b.to(x.dtype))

