"""The Mamba-2 mixer and the Mamba layer of hybrid stacks (Megatron-Core's MambaMixer/MambaLayer).

Mixer, on [seq, batch, hidden]:
    in_proj -> [z | x | B | C | dt];  x, B, C -> causal depthwise conv (width 4) -> SiLU;
    dt -> softplus(dt + dt_bias);  y = selective scan(x, dt, A = -exp(A_log), B, C) + D * x;
    y -> RMSNorm(y * SiLU(z)) per group;  out_proj.
The scan is `models.ssd` (pure PyTorch; the `mamba_ssm` / `causal_conv1d` kernels on a GPU when
installed). Layer: x + dropout(mixer(norm(x))).

Tensor parallelism splits the heads and the B/C groups over tp ranks (both must divide): every
per-head or per-channel parameter is split along dim 0, so each rank runs the scan of its own
heads with its own groups and nothing crosses ranks between in_proj (column-parallel, gathering
the sequence under sequence parallelism) and out_proj (row-parallel). The fused weights hold
several blocks, each split on its own (`partition_stride` = the blocks' full sizes):
- `mixer.in_proj.weight` [2 d_inner + 2 G N + H, hidden]: blocks [z; x; B; C; dt],
- `mixer.conv1d.weight` [d_inner + 2 G N, 1, 4] and `mixer.conv1d.bias`: blocks [x; B; C],
- `mixer.dt_bias`, `mixer.A_log`, `mixer.D` [H]; `mixer.norm.weight` [d_inner].
Names and layouts are Megatron's and Hugging Face `Mamba2`'s (which agree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gigatron.errors import GigatronError
from gigatron.models.ssd import (
    causal_depthwise_conv,
    kernels_for,
    ssd_chunked_scan,
    ssd_sequential_scan,
)
from gigatron.models.transformer import Mask, Norm, ResidualLayer, Rotary
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.random import ModelParallelRNG
from gigatron.parallel.tensor_parallel import (
    ColumnParallelLinear,
    InitFunction,
    RowParallelLinear,
    divide,
    set_tensor_parallel_attributes,
)

CONV_WIDTH = 4  # Megatron's d_conv
EXPAND = 2  # d_inner = 2 * hidden unless --mamba-num-heads is given
# Chunk of the PyTorch scan. Per head, a chunk costs Q^2 (the within-chunk products) plus P * N
# (its state); Q = 64 balances them for the usual P = 64, N = 128 and measured fastest on CPU.
# The result does not depend on it. The kernels use Megatron's 128.
CHUNK_SIZE = 64
KERNEL_CHUNK_SIZE = 128
NORM_EPSILON = 1e-5  # the gated norm's epsilon (fixed in Megatron)
DT_MIN, DT_MAX, DT_FLOOR = 0.001, 0.1, 1e-4  # initial softplus(dt_bias) range
A_INIT_RANGE = (1.0, 16.0)  # initial -A range


@dataclass(frozen=True)
class MambaSpec:
    """The mixer's shape: heads H of head_dim P, groups G of state_dim N, d_inner = H * P."""

    state_dim: int
    head_dim: int
    num_groups: int
    num_heads: int
    chunk_size: int = CHUNK_SIZE

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @classmethod
    def from_config(cls, cfg) -> MambaSpec:
        """From the `--mamba-*` flags and --hidden-size, with Megatron's rules."""
        m = cfg.model
        for value, flag in (
            (m.mamba_state_dim, "--mamba-state-dim"),
            (m.mamba_head_dim, "--mamba-head-dim"),
            (m.mamba_num_groups, "--mamba-num-groups"),
        ):
            if value is None or value <= 0:
                raise GigatronError(f"{flag} {value}: must be a positive integer")
        heads = m.mamba_num_heads
        if heads is None:
            if m.hidden_size is None:
                raise GigatronError("--hidden-size not set; give the model shape")
            d_inner = EXPAND * m.hidden_size
            if d_inner % m.mamba_head_dim:
                raise GigatronError(
                    f"--mamba-head-dim {m.mamba_head_dim}: does not divide 2 * --hidden-size "
                    f"({d_inner}); pick a divisor or give --mamba-num-heads"
                )
            heads = d_inner // m.mamba_head_dim
        elif heads <= 0:
            raise GigatronError(f"--mamba-num-heads {heads}: must be a positive integer")
        if heads % m.mamba_num_groups:
            raise GigatronError(
                f"--mamba-num-groups {m.mamba_num_groups}: does not divide the {heads} Mamba "
                "heads; pick a divisor of the head count"
            )
        return cls(m.mamba_state_dim, m.mamba_head_dim, m.mamba_num_groups, heads)


def _uniform(bound: float) -> InitFunction:
    def draw(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)

    return draw


def _dt_bias(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """softplus^-1 of dt drawn log-uniformly in [DT_MIN, DT_MAX] (floored at DT_FLOOR)."""
    u = torch.rand(shape, generator=generator)
    dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN))
    dt = dt.clamp(min=DT_FLOOR)
    return dt + torch.log(-torch.expm1(-dt))


def _a_log(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    low, high = A_INIT_RANGE
    return torch.log(torch.empty(shape).uniform_(low, high, generator=generator))


def _parameter(
    shape: tuple[int, ...],
    config: TransformerConfig,
    pctx: ParallelContext,
    init,
    stride: int | tuple[int, ...] = 1,
) -> nn.Parameter:
    """A parameter split over tp along dim 0 (shape is this rank's)."""
    param = nn.Parameter(torch.empty(shape, dtype=config.params_dtype, device=pctx.device))
    set_tensor_parallel_attributes(param, True, 0, stride, init=init)
    return param


class DepthwiseConv(nn.Module):
    """The short causal convolution's parameters (`conv1d.weight` [c, 1, w], `conv1d.bias`)."""

    def __init__(
        self, channels: int, full_blocks: tuple[int, ...], config, pctx: ParallelContext
    ) -> None:
        super().__init__()
        # nn.Conv1d's default initialisation (kaiming-uniform with a = sqrt(5)): U(+-1/sqrt(w)).
        bound = 1.0 / math.sqrt(CONV_WIDTH)
        shape = (channels, 1, CONV_WIDTH)
        self.weight = _parameter(shape, config, pctx, _uniform(bound), full_blocks)
        self.bias = _parameter((channels,), config, pctx, _uniform(bound), full_blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, l, c] -> SiLU(conv(x)) [b, l, c]."""
        kernels = kernels_for(x)
        if kernels is None:
            return causal_depthwise_conv(x, self.weight, self.bias)
        out = kernels["conv"](
            x.transpose(1, 2), self.weight.squeeze(1), self.bias, activation="silu"
        )
        return out.transpose(1, 2)


class GatedRMSNorm(nn.Module):
    """weight * RMSNorm(y * SiLU(z)), the statistics taken per group of d_inner / G channels (a
    group's channels are all on one tp rank, so no statistic crosses ranks)."""

    def __init__(self, channels: int, group_size: int, config, pctx: ParallelContext) -> None:
        super().__init__()
        self.group_size = group_size
        self.weight = _parameter((channels,), config, pctx, "ones")

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = y.float() * F.silu(z.float())
        grouped = gated.unflatten(-1, (-1, self.group_size))
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + NORM_EPSILON)
        return self.weight * normed.flatten(-2).to(y.dtype)


class MambaMixer(nn.Module):
    """The Mamba-2 mixer: [s, b, h] -> [s, b, h] (see the module docstring)."""

    def __init__(self, config: TransformerConfig, mamba: MambaSpec, pctx: ParallelContext) -> None:
        super().__init__()
        tp = pctx.tp_size
        self.heads = divide(mamba.num_heads, tp, "the number of Mamba heads")
        self.groups = divide(mamba.num_groups, tp, "--mamba-num-groups")
        self.head_dim, self.state_dim = mamba.head_dim, mamba.state_dim
        self.chunk_size = mamba.chunk_size
        self.d_inner = self.heads * self.head_dim  # this rank's
        bc = mamba.num_groups * mamba.state_dim
        in_blocks = (mamba.d_inner, mamba.d_inner, bc, bc, mamba.num_heads)
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            sum(in_blocks),
            pctx,
            bias=False,
            sequence_parallel=config.sequence_parallel,
            init_std=config.init_method_std,
            stride=in_blocks,
            dtype=config.params_dtype,
        )
        conv_blocks = (mamba.d_inner, bc, bc)
        self.conv_channels = sum(conv_blocks) // tp
        self.conv1d = DepthwiseConv(self.conv_channels, conv_blocks, config, pctx)
        self.dt_bias = _parameter((self.heads,), config, pctx, _dt_bias)
        self.A_log = _parameter((self.heads,), config, pctx, _a_log)
        self.D = _parameter((self.heads,), config, pctx, "ones")
        self.norm = GatedRMSNorm(self.d_inner, mamba.d_inner // mamba.num_groups, config, pctx)
        self.out_proj = RowParallelLinear(
            mamba.d_inner,
            config.hidden_size,
            pctx,
            bias=False,
            sequence_parallel=config.sequence_parallel,
            init_std=config.output_init_std,
            dtype=config.params_dtype,
        )

    def forward(
        self, hidden: torch.Tensor, inference_cache=None, layer_number: int = 0
    ) -> torch.Tensor:
        """`inference_cache` (generation): continue each row from its cached state (layer
        `layer_number`'s, see `inference.mamba_state`) instead of starting from zero."""
        if inference_cache is not None:
            return self._generation_step(hidden, inference_cache.mamba, layer_number)
        zxbcdt = self.in_proj(hidden).transpose(0, 1)  # [b, s, local features]
        z, xbc, dt = torch.split(zxbcdt, [self.d_inner, self.conv_channels, self.heads], dim=-1)
        xbc = self.conv1d(xbc)
        bc = self.groups * self.state_dim
        x, B, C = torch.split(xbc, [self.d_inner, bc, bc], dim=-1)
        y = self.scan(
            x.unflatten(-1, (self.heads, self.head_dim)),
            dt,
            B.unflatten(-1, (self.groups, self.state_dim)),
            C.unflatten(-1, (self.groups, self.state_dim)),
        )
        y = self.norm(y.flatten(-2), z)
        return self.out_proj(y.transpose(0, 1))

    def _generation_step(self, hidden: torch.Tensor, states, layer_number: int) -> torch.Tensor:
        """One generation step over rows right-padded to hidden's length (always the PyTorch
        path: the state hand-over is the same for prompts and single tokens)."""
        zxbcdt = self.in_proj(hidden).transpose(0, 1)  # [b, n, local features]
        z, xbc, dt = torch.split(zxbcdt, [self.d_inner, self.conv_channels, self.heads], dim=-1)
        window, state = states.read(layer_number)
        lengths, width = states.lengths, window.shape[1]
        inputs = torch.cat([window.to(xbc.dtype), xbc], dim=1)  # [b, w - 1 + n, c]
        xbc = causal_depthwise_conv(inputs, self.conv1d.weight, self.conv1d.bias)[:, width:]
        # The next window: the last w - 1 inputs up to each row's last real token.
        taps = lengths.view(-1, 1) + torch.arange(width, device=lengths.device)
        window = inputs.gather(1, taps.unsqueeze(-1).expand(-1, -1, inputs.shape[-1]))
        bc = self.groups * self.state_dim
        x, B, C = torch.split(xbc, [self.d_inner, bc, bc], dim=-1)
        x = x.unflatten(-1, (self.heads, self.head_dim))
        B = B.unflatten(-1, (self.groups, self.state_dim))
        C = C.unflatten(-1, (self.groups, self.state_dim))
        steps = hidden.shape[0]
        real = torch.arange(steps, device=lengths.device)[None, :] < lengths[:, None]
        dt = F.softplus(dt.float() + self.dt_bias.float()) * real.unsqueeze(-1)  # 0: no update
        A = -torch.exp(self.A_log.float())
        if steps == 1:  # one recurrence step; the chunked form would pad it to a whole chunk
            y, state = ssd_sequential_scan(
                x.float(), dt, A, B.float(), C.float(), self.D.float(), state, True
            )
        else:
            y, state = ssd_chunked_scan(
                x, dt, A, B, C, self.chunk_size, self.D, state, return_final_state=True
            )
        states.write(layer_number, window, state)
        y = self.norm(y.to(x.dtype).flatten(-2), z)
        return self.out_proj(y.transpose(0, 1))

    def scan(self, x, dt, B, C) -> torch.Tensor:
        """x [b, l, H, P], raw dt [b, l, H], B and C [b, l, G, N] -> y [b, l, H, P]."""
        A = -torch.exp(self.A_log.float())
        kernels = kernels_for(x)
        if kernels is not None:
            # Contiguous inputs, as Megatron passes them (split views of in_proj's output).
            x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
            return kernels["scan"](
                x,
                dt,
                A,
                B,
                C,
                KERNEL_CHUNK_SIZE,
                D=self.D.float(),
                z=None,
                dt_bias=self.dt_bias.float(),
                dt_softplus=True,
            )
        dt = F.softplus(dt.float() + self.dt_bias.float())
        return ssd_chunked_scan(x, dt, A, B, C, self.chunk_size, D=self.D)


class MambaLayer(ResidualLayer):
    """Pre-norm residual Mamba layer: x + dropout(mixer(norm(x))); parameters `norm.*` and
    `mixer.*`. forward(x, attention_mask, rotary, inference_cache) like a transformer layer (mask
    and rotary unused)."""

    def __init__(
        self,
        config: TransformerConfig,
        mamba: MambaSpec,
        pctx: ParallelContext,
        layer_number: int,
        rng: ModelParallelRNG,
    ) -> None:
        super().__init__(config, layer_number, rng)
        self.norm = Norm(config, pctx)
        self.mixer = MambaMixer(config, mamba, pctx)

    def forward(
        self, x: Tensor, attention_mask: Mask = None, rotary: Rotary = None, inference_cache=None
    ) -> Tensor:
        return self.residual_add(x, self.mixer(self.norm(x), inference_cache, self.layer_number))
