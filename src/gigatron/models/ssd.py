"""The Mamba-2 sequence transforms in plain PyTorch: the selective state-space scan (chunked,
"state-space duality" form, and the step-by-step recurrence it must equal) and the short causal
depthwise convolution; with the `mamba_ssm` / `causal_conv1d` GPU kernels when installed.

The recurrence, per head h (state S [head_dim, state_dim], one B/C group shared by h/g heads):

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T        y_t = S_t C_t + D_h * x_t

The chunked form splits the sequence into chunks of Q steps. Within a chunk, y is a masked
"attention" (C_i . B_j) * exp(sum_{k=j+1..i} a_k) * dt_j x_j over j <= i (quadratic in Q, matrix
products); across chunks only the states at chunk ends are carried (linear in the number of
chunks). Cost: O(L Q) instead of the recurrence's L sequential steps.

Shapes (batch first, as the kernels take them): x [b, l, h, p], dt [b, l, h] (already positive:
softplus(dt + dt_bias)), A [h] (negative), B and C [b, l, g, n], D [h]; y like x.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F


def segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: entry [i, j] = a[j+1] + ... + a[i] for i >= j, -inf above the
    diagonal. Summed along the masked rows rather than as cumsum[i] - cumsum[j]: no cancellation
    of two large partial sums, so the decays stay accurate in float32 for long chunks."""
    t = a.shape[-1]
    rows = a.unsqueeze(-1).expand(*a.shape, t)  # [..., k, j] = a[k]
    strictly_lower = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)
    sums = rows.masked_fill(~strictly_lower, 0.0).cumsum(dim=-2)
    lower = torch.ones(t, t, dtype=torch.bool, device=a.device).tril()
    return sums.masked_fill(~lower, float("-inf"))


def ssd_chunked_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The scan in chunked form, computed in float32 (float64 inputs stay float64); returns y in
    x's dtype, and with `return_final_state` also the state after the last step [b, h, p, n]
    (float32). `initial_state` [b, h, p, n] is the state before the first step."""
    b, length, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    q = chunk_size
    pad = (-length) % q
    chunks = (length + pad) // q

    def blocks(t: torch.Tensor) -> torch.Tensor:
        # Zero padding at the end: a = 0 (no decay) and x = B = C = 0 leave the state unchanged.
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t
        return t.reshape(b, chunks, q, *t.shape[2:])

    dt = dt.to(work)
    xs = blocks((x.to(work) * dt.unsqueeze(-1)).reshape(b, length, g, r, p))  # dt_j x_j
    a = blocks((dt * A.to(work)).reshape(b, length, g, r))  # [b, c, q, g, r]
    Bc = blocks(B.to(work))  # [b, c, q, g, n]
    Cc = blocks(C.to(work))

    a = a.permute(0, 1, 3, 4, 2)  # [b, c, g, r, q]
    a_cum = a.cumsum(dim=-1)

    # 1. Within each chunk: masked attention-like products.
    scores = torch.einsum("bcign,bcjgn->bcgij", Cc, Bc)  # shared by the heads of a group
    weights = scores.unsqueeze(3) * torch.exp(segment_sum(a))  # [b, c, g, r, i, j]
    y = torch.einsum("bcgrij,bcjgrp->bcigrp", weights, xs)

    # 2. Each chunk's own contribution to the state at its end.
    to_end = torch.exp(a_cum[..., -1:] - a_cum).permute(0, 1, 4, 2, 3)  # [b, c, j, g, r]
    chunk_states = torch.einsum("bcjgn,bcjgrp->bcgrpn", Bc, xs * to_end.unsqueeze(-1))

    # 3. States entering each chunk: decayed sums over the chunks before it.
    if initial_state is None:
        start = torch.zeros_like(chunk_states[:, :1])
    else:
        start = initial_state.to(work).reshape(b, 1, g, r, p, n)
    states = torch.cat([start, chunk_states], dim=1)  # [b, c + 1, g, r, p, n]
    totals = F.pad(a_cum[..., -1].permute(0, 2, 3, 1), (1, 0))  # [b, g, r, 1 + c]
    chunk_decay = torch.exp(segment_sum(totals))  # [b, g, r, z, c]: through chunks c .. z-1
    states = torch.einsum("bgrzc,bcgrpn->bzgrpn", chunk_decay, states)
    entering, final = states[:, :-1], states[:, -1]

    # 4. What the entering state contributes to each position of the chunk.
    from_start = torch.exp(a_cum).permute(0, 1, 4, 2, 3)  # [b, c, i, g, r]
    y = y + torch.einsum("bcign,bcgrpn->bcigrp", Cc, entering) * from_start.unsqueeze(-1)

    y = y.reshape(b, chunks * q, h, p)[:, :length]
    if D is not None:
        y = y + x.to(work) * D.to(work).view(h, 1)
    y = y.to(x.dtype)
    if return_final_state:
        return y, final.reshape(b, h, p, n)
    return y


def ssd_sequential_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The recurrence one step at a time, in the inputs' dtype (the reference of the tests, and
    the naive baseline of the benchmark)."""
    b, length, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    Bh = B.repeat_interleave(r, dim=2)  # [b, l, h, n]
    Ch = C.repeat_interleave(r, dim=2)
    state = x.new_zeros(b, h, p, n) if initial_state is None else initial_state.to(x.dtype)
    ys = []
    for t in range(length):
        step_decay = torch.exp(dt[:, t] * A).view(b, h, 1, 1)
        inject = (dt[:, t].unsqueeze(-1) * x[:, t]).unsqueeze(-1) * Bh[:, t].unsqueeze(-2)
        state = step_decay * state + inject
        ys.append(torch.einsum("bhpn,bhn->bhp", state, Ch[:, t]))
    y = torch.stack(ys, dim=1)
    if D is not None:
        y = y + x * D.view(h, 1)
    return (y, state) if return_final_state else y


def causal_depthwise_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [b, l, c], weight [c, 1, w] -> SiLU(causal convolution of each channel), [b, l, c]:
    output t sees inputs t-w+1 .. t (zeros before the start).

    Written as w shifted multiply-adds in the [b, l, c] layout: for the short widths Mamba uses
    this is about twice as fast on CPU as a grouped F.conv1d (forward + backward), and needs no
    transposes."""
    length, width = x.shape[1], weight.shape[-1]
    padded = F.pad(x, (0, 0, width - 1, 0))
    taps = weight[:, 0].t()  # [w, c]; tap w-1 multiplies the current step
    out = padded[:, :length] * taps[0]
    for k in range(1, width):
        out = out + padded[:, k : k + length] * taps[k]
    if bias is not None:
        out = out + bias
    return F.silu(out)


@functools.cache
def _kernel_functions() -> dict[str, Any] | None:
    """The GPU kernels if both packages import, else None (they are optional)."""
    try:
        # why: optional Mamba kernels (mamba_ssm, causal_conv1d)
        from causal_conv1d import causal_conv1d_fn
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError:
        return None
    return {"conv": causal_conv1d_fn, "scan": mamba_chunk_scan_combined}


def kernels_for(x: torch.Tensor) -> dict[str, Any] | None:
    """The kernels to use for x: only on a CUDA device and only when installed."""
    return _kernel_functions() if x.is_cuda else None
