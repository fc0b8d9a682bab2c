"""Causal attention with dropout on CPU, block by block, as one operator.

PyTorch's CPU flash kernel skips the masked half of causal attention but takes no dropout; with
dropout, scaled_dot_product_attention computes every [s, s] score. Here the queries go in blocks
of `BLOCK_ROWS`: block i (rows r0..r1) multiplies only the keys 0..r1, so about half of the
scores (5/8 at four blocks) are computed, masked, soft-maxed, dropped and multiplied back. The
dropout mask is models/dropout.py's (16-bit random lanes from torch's default generator, so
forked streams and recomputation that restores the generator repeat it).

It is a custom operator with its own backward (`gigatron::cpu_causal_attention` and
`..._backward`), so a compiled layer (--torch-compile) calls these kernels as they are instead of
tracing the softmax and the dropout's random numbers into inductor's generated loops. The forward
keeps the probabilities and the keep mask of the computed blocks (flat buffers); the backward
rebuilds the dropped probabilities from them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from gigatron.models.dropout import dropout_keep_scale, keep_mask_into

BLOCK_ROWS = 128  # query rows a block: 4 blocks at seq 512 (5/8 of the scores), each GEMM large


def row_blocks(seq: int) -> list[tuple[int, int, int]]:
    """(first row, end row, offset in the flat buffers per head) of each query block."""
    blocks, offset = [], 0
    for start in range(0, seq, BLOCK_ROWS):
        end = min(start + BLOCK_ROWS, seq)
        blocks.append((start, end, offset))
        offset += (end - start) * end
    return blocks


def _buffer_size(seq: int) -> int:
    start, end, offset = row_blocks(seq)[-1]
    return offset + (end - start) * end


def _block(flat: Tensor, heads: int, start: int, end: int, offset: int) -> Tensor:
    """The [heads, rows, keys] block of a flat buffer (blocks one after the other, each
    contiguous, so that kernels write them in place)."""
    size = heads * (end - start) * end
    return flat[heads * offset : heads * offset + size].view(heads, end - start, end)


@torch.library.custom_op(
    "gigatron::cpu_causal_attention",
    mutates_args=(),
    device_types="cpu",
    tags=(torch.Tag.nondeterministic_seeded,),
)
def cpu_causal_attention(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(output [b, n, s, hv], probabilities and keep mask of the computed blocks, flat) of causal
    softmax(q k^T * scale) with dropout, for q, k [b, n, s, hk] and v [b, n, s, hv]."""
    batch, heads, seq, _ = q.shape
    bh = batch * heads
    q3 = (q * scale).reshape(bh, seq, -1)
    k3, v3 = k.reshape(bh, seq, -1), v.reshape(bh, seq, -1)
    out = torch.empty(bh, seq, v.shape[-1], dtype=q.dtype)
    probs = torch.empty(bh * _buffer_size(seq), dtype=q.dtype)
    keep = torch.empty(bh * _buffer_size(seq), dtype=torch.bool)
    dropped = torch.empty(bh * min(BLOCK_ROWS, seq) * seq, dtype=q.dtype)
    for start, end, offset in row_blocks(seq):
        p = _block(probs, bh, start, end, offset)
        torch.bmm(q3[:, start:end], k3[:, :end].transpose(1, 2), out=p)
        diagonal = p[:, :, start:end]
        diagonal.masked_fill_(_upper(end - start), float("-inf"))
        torch._softmax(p, -1, False, out=p)
        m = _block(keep, bh, start, end, offset)
        keep_scale = keep_mask_into(m, dropout_p)
        d = torch.mul(p, m, out=dropped[: p.numel()].view(p.shape))
        torch.bmm(d, v3[:, :end], out=out[:, start:end])
    out.mul_(keep_scale)
    return out.view(batch, heads, seq, -1), probs, keep


@cpu_causal_attention.register_fake
def _(q, k, v, dropout_p, scale):
    batch, heads, seq, _ = q.shape
    size = _buffer_size(seq)
    return (
        q.new_empty(batch, heads, seq, v.shape[-1]),
        q.new_empty(batch * heads * size),
        q.new_empty(batch * heads * size, dtype=torch.bool),
    )


def _upper(rows: int) -> Tensor:
    """True above the diagonal of a [rows, rows] block: the keys after each query."""
    return torch.ones(rows, rows, dtype=torch.bool).triu_(1)


@torch.library.custom_op(
    "gigatron::cpu_causal_attention_backward", mutates_args=(), device_types="cpu"
)
def cpu_causal_attention_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    probs: Tensor,
    keep: Tensor,
    dropout_p: float,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `cpu_causal_attention` from its saved probabilities and keep mask."""
    batch, heads, seq, _ = q.shape
    bh = batch * heads
    keep_scale = dropout_keep_scale(dropout_p)
    g3 = (grad_out * keep_scale).reshape(bh, seq, -1)
    q3 = (q * scale).reshape(bh, seq, -1)
    k3, v3 = k.reshape(bh, seq, -1), v.reshape(bh, seq, -1)
    dq = torch.empty_like(q3)
    dk, dv = torch.zeros_like(k3), torch.zeros_like(v3)
    work = torch.empty(2, bh * min(BLOCK_ROWS, seq) * seq, dtype=q.dtype)
    for start, end, offset in row_blocks(seq):
        p, m = _block(probs, bh, start, end, offset), _block(keep, bh, start, end, offset)
        d = torch.mul(p, m, out=work[0, : p.numel()].view(p.shape))
        dv[:, :end] += torch.bmm(d.transpose(1, 2), g3[:, start:end])
        grad_d = torch.bmm(g3[:, start:end], v3[:, :end].transpose(1, 2), out=d)
        grad_p = torch.mul(grad_d, m, out=work[1, : p.numel()].view(p.shape))
        grad_s = torch._softmax_backward_data(grad_p, p, -1, p.dtype)
        torch.bmm(grad_s, k3[:, :end], out=dq[:, start:end])
        dk[:, :end] += torch.bmm(grad_s.transpose(1, 2), q3[:, start:end])
    dq.mul_(scale)
    return tuple(t.view(batch, heads, seq, -1) for t in (dq, dk, dv))


@cpu_causal_attention_backward.register_fake
def _(grad_out, q, k, v, probs, keep, dropout_p, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, dropout_p, scale = inputs
    _, probs, keep = output
    ctx.save_for_backward(q, k, v, probs, keep)
    ctx.dropout_p, ctx.scale = dropout_p, scale
    ctx.set_materialize_grads(False)  # no zero tensors for the saved buffers' gradients


def _backward(ctx, grad_out, _grad_probs, _grad_keep):
    if grad_out is None:  # only the saved buffers were used (never by the model)
        return None, None, None, None, None
    q, k, v, probs, keep = ctx.saved_tensors
    grads = cpu_causal_attention_backward(
        grad_out.contiguous(), q, k, v, probs, keep, ctx.dropout_p, ctx.scale
    )
    return (*grads, None, None)


cpu_causal_attention.register_autograd(_backward, setup_context=_setup_context)


def causal_attention_with_dropout(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float, scale: float
) -> Tensor:
    """Causal attention with dropout on CPU, [b, n, s, hk] queries and keys -> [b, n, s, hv]."""
    return cpu_causal_attention(q, k, v, dropout_p, scale)[0]
