"""Fused cross-entropy for the GPT-2 loss: one Triton kernel that reads a row of logits and writes its loss and the
loss's gradient with respect to that row, with no fp32 copy of the logits and no softmax kept.

    loss[r] = logsumexp(z[r]) - z[r, t[r]]        grad[r] = softmax(z[r]) - onehot(t[r])        z: (N, V), t: (N,)

A row whose target is -1 is ignored (loss 0, gradient 0). Label smoothing s spreads over the R real token ids
(R = 50257 of GPT-2's padded 50304, as _chunk_loss below does):

    loss[r] = (1 - s) (lse - z_t) + s (lse - mean_{j < R} z_j)        grad[r] = softmax - (1 - s) onehot - s/R [j < R]

Each program owns one row: an online max and sum of exponentials, then the gradient, walking the row backwards so
its first blocks are still in L2. Math in fp32, the gradient in the logits' dtype. Why a kernel (the compiled loss's
cost on an H200): docs/notes.md, "fused_ce.py". It is the inner step of lm_loss below (GPTConfig.fused_ce). The
self-check against the reference: scripts/check_kernels.py ce.
"""

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from common import GPT2_VOCAB
from fused_gelu import triton_available

_HAS_TRITON = triton_available()  # without triton (CPU-only or macOS installs) the loss uses the PyTorch reference

# Launch defaults for GPT-2's V = 50304 in bf16: 4096 columns per loop step at 8 warps, 16 elements per thread; one
# program per row (the reasoning: docs/notes.md, "fused_ce.py")
BLOCK_V, NUM_WARPS = 4096, 8


def cross_entropy_reference(logits: Tensor, targets: Tensor, label_smoothing: float = 0.0,
                            real_vocab: int | None = None) -> tuple[Tensor, Tensor]:
    """The definition the kernel must match, through autograd in fp64 (fp32's rounding over V ids exceeds the kernel's):
    (loss per row (N,), gradient (N, V) of the summed loss) in fp32; 0 for ignored rows (target -1)."""
    z = logits.detach().double().requires_grad_()
    rows = _log_softmax_rows(z, targets, label_smoothing, real_vocab or z.size(1))
    (grad,) = torch.autograd.grad(rows.sum(), z)
    return rows.detach().float(), grad.float()


def _log_softmax_rows(logits: Tensor, targets: Tensor, label_smoothing: float, real: int) -> Tensor:
    """Each row's loss through log_softmax (label smoothing over the ids below real), 0 where the target is -1."""
    valid = targets != -1
    logp = logits.log_softmax(dim=-1)
    rows = -logp.gather(1, targets.masked_fill(~valid, 0)[:, None]).squeeze(1)
    if label_smoothing:
        rows = (1 - label_smoothing) * rows - label_smoothing * logp[:, :real].mean(dim=-1)
    return rows * valid


if _HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _cross_entropy_kernel(logits_ptr, targets_ptr, loss_ptr, grad_ptr, label_smoothing, real_vocab,
                              V: tl.constexpr, BLOCK_V: tl.constexpr, SMOOTH: tl.constexpr,
                              WITH_GRAD: tl.constexpr):
        # V is a constexpr: the interpreter cannot loop to a runtime int; a model has one V, so this compiles once
        row = tl.program_id(0).to(tl.int64)  # int64: row * V passes 2^31 at B*T = 65536 rows, V = 50304
        base = logits_ptr + row * V
        target = tl.load(targets_ptr + row)
        valid = target != -1
        safe = tl.where(valid, target, 0)
        offs = tl.arange(0, BLOCK_V)
        # pass 1: running max m and sum d of exp(z - m), one block at a time (a masked lane is -inf: exp gives 0)
        m = -float("inf")
        d = 0.0
        z_sum = 0.0  # sum of z over the real ids, for label smoothing
        for start in range(0, V, BLOCK_V):
            cols = start + offs
            z = tl.load(base + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
            if SMOOTH:
                z_sum += tl.sum(tl.where(cols < real_vocab, z, 0.0), axis=0)
        lse = m + tl.log(d)
        z_t = tl.load(base + safe).to(tl.float32)
        loss = lse - z_t
        if SMOOTH:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - z_sum / real_vocab)
        tl.store(loss_ptr + row, tl.where(valid, loss, 0.0))
        if WITH_GRAD:
            # pass 2, last block first: those were read last in pass 1, so they are the likeliest still in L2
            keep = tl.where(valid, 1.0, 0.0)  # an ignored row's gradient is 0
            out = grad_ptr + row * V
            last = ((V - 1) // BLOCK_V) * BLOCK_V
            for step in range(0, V, BLOCK_V):
                cols = last - step + offs
                mask = cols < V
                z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
                g = tl.exp(z - lse) - tl.where(cols == safe, 1.0 - label_smoothing, 0.0)
                if SMOOTH:
                    g -= tl.where(cols < real_vocab, label_smoothing / real_vocab, 0.0)
                tl.store(out + cols, (g * keep).to(out.dtype.element_ty), mask=mask)


def cross_entropy_rows(logits: Tensor, targets: Tensor, label_smoothing: float = 0.0, real_vocab: int | None = None,
                       with_grad: bool = True, block_v: int = BLOCK_V,
                       num_warps: int = NUM_WARPS) -> tuple[Tensor, Tensor | None]:
    """Launch the kernel on logits (N, V) and targets (N,): (loss per row (N,) fp32, gradient of the summed loss (N, V)
    in logits' dtype, or None). Targets in [0, V) or -1, unchecked (a check would sync the GPU). Not autograd."""
    if not _HAS_TRITON:
        raise RuntimeError("cross_entropy_rows needs triton, which is not installed: `pip install triton` on a CUDA "
                           "machine, or use the PyTorch loss (GPTConfig.fused_ce=False)")
    real_vocab = real_vocab or logits.size(-1)
    logits, targets = logits.contiguous(), targets.contiguous()  # the kernel indexes element (r, j) as r * V + j
    N, V = logits.shape
    loss = torch.empty(N, dtype=torch.float32, device=logits.device)
    grad = torch.empty_like(logits) if with_grad else None
    if N == 0:  # a zero-size grid is not a valid launch
        return loss, grad
    # without the gradient grad_ptr is never stored to, but it needs the logits' dtype: a one-element buffer, not
    # `loss` again (two arguments aliasing one mutated buffer are best avoided under torch.compile)
    out = grad if with_grad else torch.empty(1, dtype=logits.dtype, device=logits.device)
    _cross_entropy_kernel[(N,)](logits, targets, loss, out, float(label_smoothing),
                                real_vocab, V=V, BLOCK_V=block_v, SMOOTH=bool(label_smoothing), WITH_GRAD=with_grad,
                                num_warps=num_warps)
    return loss, grad

# ----------------------------------------------------------------------------------------------------------------------
# The loss behind GPT.forward: plain, chunked (the logits a chunk of rows at a time) or fused (this kernel per chunk)


def _chunk_loss(logits: Tensor, targets: Tensor, label_smoothing: float,
                with_grad: bool) -> tuple[Tensor, Tensor | None]:
    """Cross-entropy of each row of fp32 logits (n, V), 0 where the target is -1, and optionally the gradient of their
    sum. Label smoothing spreads s over the R = min(V, 50257) real ids only: on the padded ids it would train up
    logits never used."""
    valid = targets != -1
    safe = targets.masked_fill(~valid, 0)  # (n,)
    real = min(logits.size(-1), GPT2_VOCAB)
    lse = logits.logsumexp(dim=-1)  # (n,)
    rows = lse - logits.gather(1, safe[:, None]).squeeze(1)  # -log p(target)
    if label_smoothing:  # the mean over the real ids of -log p(id)
        rows = (1 - label_smoothing) * rows + label_smoothing * (lse - logits[:, :real].mean(dim=-1))
    rows = rows * valid
    if not with_grad:
        return rows, None
    grad = (logits - lse[:, None]).exp_()  # softmax, in place of a second (n, V) buffer
    grad.scatter_add_(1, safe[:, None], torch.full_like(grad[:, :1], label_smoothing - 1.0))
    if label_smoothing:
        grad[:, :real] -= label_smoothing / real
    return rows, grad.mul_(valid[:, None])


def cross_entropy(logits: Tensor, targets: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Mean cross-entropy of (N, V) logits, in fp32, over the targets that are not -1; label smoothing over the real
    ids only (see _chunk_loss), where F.cross_entropy would spread it over the padded ones too."""
    logits = logits.float()
    if label_smoothing and logits.size(-1) > GPT2_VOCAB:
        # through log_softmax, whose backward keeps one (N, V) buffer; _chunk_loss's logsumexp and mean would keep
        # two more (docs/notes.md, "fused_ce.py")
        return _log_softmax_rows(logits, targets, label_smoothing, GPT2_VOCAB).sum() / (targets != -1).sum()
    return F.cross_entropy(logits, targets, ignore_index=-1, label_smoothing=label_smoothing)


def _rows_loss(logits: Tensor, targets: Tensor, label_smoothing: float, fused: bool,
               with_grad: bool) -> tuple[Tensor, Tensor | None]:
    """One chunk's loss per row (N,) and, with with_grad, the gradient of their sum (N, V): the kernel in the logits'
    own dtype, or _chunk_loss on an fp32 copy."""
    if fused:
        return cross_entropy_rows(logits, targets, label_smoothing, min(logits.size(1), GPT2_VOCAB), with_grad)
    return _chunk_loss(logits.float(), targets, label_smoothing, with_grad)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of x @ weight.T, a chunk of rows at a time. Each chunk's gradients for x and weight are made
    in forward from its logits, then freed; backward only scales them: peak memory is one chunk's logits, not B*T's."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, targets: Tensor, chunk: int,
                label_smoothing: float, fused: bool) -> Tensor:
        count = (targets != -1).sum()  # the mean over the targets that count (none: a NaN loss, as F.cross_entropy)
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        device = x.device.type
        # the gradient matmuls run in the forward matmul's precision (bf16 under autocast), but never fp16: these are
        # the summed loss's gradients, which can pass fp16's 65504 before backward scales them (docs/notes.md)
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else torch.float32
        mm = torch.float32 if dtype == torch.float16 else dtype
        w = weight.to(dtype)  # cast once, not once per chunk
        w_mm = w if mm == dtype else weight.to(mm)
        grad_x, grad_w = [], torch.zeros_like(weight, dtype=torch.float32) if x.size(0) == 0 else None
        for i in range(0, x.size(0), chunk):
            xc = x[i:i + chunk].to(dtype)
            part, grad = _rows_loss(F.linear(xc, w), targets[i:i + chunk], label_smoothing, fused, with_grad=True)
            loss += part.sum()
            grad = grad.to(mm)  # (n, V)
            with torch.autocast(device, enabled=False):  # else fp16 autocast would cast the fp32 operands back
                grad_x.append(grad @ w_mm)  # (n, C)
                part_w = (grad.t() @ xc.to(mm)).float()  # (V, C)
            grad_w = part_w if grad_w is None else grad_w + part_w
        # one chunk (fused_ce's default) needs no copy; several are concatenated once
        grad_x = (grad_x[0] if len(grad_x) == 1 else torch.cat(grad_x)) if grad_x else torch.zeros_like(x)
        ctx.save_for_backward(grad_x, grad_w, count)
        ctx.dtypes = (x.dtype, weight.dtype)
        return loss / count

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        grad_x, grad_w, count = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        # no target that counts (count 0): the loss is NaN, and the gradients 0 as F.cross_entropy's (they are 0 here)
        scale = grad_out.float() / count.clamp(min=1)
        return (grad_x.float() * scale).to(x_dtype), (grad_w * scale).to(w_dtype), None, None, None, None


def chunked_cross_entropy(x: Tensor, weight: Tensor, targets: Tensor, chunk: int,
                          label_smoothing: float = 0.0, fused: bool = False) -> Tensor:
    """F.cross_entropy(x @ weight.T, targets, ignore_index=-1, label_smoothing=...) of x (N, C), weight (V, C) without
    the full logits (chunk 0: all rows at once); fused uses the kernel on CUDA with triton, the reference elsewhere."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        fused = fused and x.is_cuda and triton_available()
        return _ChunkedCrossEntropy.apply(x, weight, targets, chunk or max(x.size(0), 1), label_smoothing, fused)
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for rows in _chunk_rows(x, weight, targets, chunk, label_smoothing, fused):
        total += rows.sum()
    return total / (targets != -1).sum()


def token_losses(x: Tensor, weight: Tensor, targets: Tensor, chunk: int = 0, fused: bool = False) -> Tensor:
    """The cross-entropy of each row of x (N, C) through weight (V, C): fp32 (N,), 0 where the target is -1, the
    logits a chunk of rows at a time (0: all at once), through the kernel where `fused` can run. No gradient."""
    return torch.cat(list(_chunk_rows(x, weight, targets, chunk, 0.0, fused)))


def _chunk_rows(x: Tensor, weight: Tensor, targets: Tensor, chunk: int, label_smoothing: float,
                fused: bool) -> Iterator[Tensor]:
    """Each chunk's loss per row, without gradients: the logits `chunk` rows at a time (0: all at once)."""
    chunk, fused = chunk or max(x.size(0), 1), fused and x.is_cuda and triton_available()
    for i in range(0, x.size(0), chunk):
        yield _rows_loss(F.linear(x[i:i + chunk], weight), targets[i:i + chunk], label_smoothing, fused, False)[0]


def scored_rows(x: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Only the rows of x (.., C) whose target is not -1 (SFT scores the assistant's tokens alone: a sixth of
    sft-demo's rows). Eager CPU only: the shape depends on data, and on a GPU each check would wait for it."""
    keep = targets != -1
    if bool(keep.all()) or not bool(keep.any()):
        return x, targets
    return x[keep], targets[keep]


def lm_loss(x: Tensor, weight: Tensor, targets: Tensor, label_smoothing: float = 0.0, chunk: int = 0,
            fused: bool = False, return_logits: bool = True) -> tuple[Tensor | None, Tensor]:
    """(logits (B, T, V) or None, mean loss over targets != -1) of hidden states x (B, T, C) through the lm_head weight
    (V, C). With chunk or fused the logits never exist whole and come back None, as without return_logits."""
    if x.device.type == "cpu" and (chunk or fused or not return_logits) and not torch.compiler.is_compiling():
        x, targets = scored_rows(x, targets)
    if chunk or fused:
        return None, chunked_cross_entropy(x.reshape(-1, x.size(-1)), weight, targets.reshape(-1), chunk,
                                           label_smoothing, fused)
    logits = F.linear(x, weight)
    loss = cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), label_smoothing)
    return (logits if return_logits else None), loss

