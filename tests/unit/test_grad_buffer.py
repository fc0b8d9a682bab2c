"""DistributedDataParallel at dp = 1: buffers, buckets, hooks, accumulation, event ordering."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from gigatron.config.parallel import ParallelConfig
from gigatron.parallel.context import ParallelContext
from gigatron.parallel.data_parallel import DistributedDataParallel


class TinyMLP(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.pre_process = True
        self.post_process = True
        self.input_tensor = None

    def set_input_tensor(self, tensor: torch.Tensor) -> None:
        self.input_tensor = tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.norm(x)


def make(bucket_size=None, overlap=False, dtype=torch.float32, grad_dtype=torch.float32):
    torch.manual_seed(0)
    reference = TinyMLP().to(dtype)
    wrapped = DistributedDataParallel(
        copy.deepcopy(reference),
        ParallelContext.single(),
        ParallelConfig(overlap_grad_reduce=overlap, ddp_bucket_size=bucket_size),
        grad_dtype=grad_dtype,
    )
    return reference, wrapped


def batch(seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_main_grad_is_a_view_into_one_buffer_in_reverse_order():
    _, ddp = make()
    (buffer,) = ddp.grad_buffers
    params = [p for p in ddp.module.parameters()]
    assert buffer.numel == sum(p.numel() for p in params)
    assert len(ddp.buckets) == 1  # no overlap, no bucket size: one reduction
    offsets = []
    for param in params:
        assert param.main_grad.untyped_storage().data_ptr() == (
            buffer.grad_data.untyped_storage().data_ptr()
        )
        offsets.append(param.main_grad.storage_offset())
    # the last registered parameter comes first in the buffer
    assert offsets == sorted(offsets, reverse=True)
    assert offsets[-1] == 0


def test_gradients_match_plain_autograd_and_grad_is_freed():
    reference, ddp = make()
    reference(batch(1)).square().sum().backward()
    ddp(batch(1)).square().sum().backward()
    ddp.finish_grad_sync()
    for (name, ref), (name2, param) in zip(
        reference.named_parameters(), ddp.module.named_parameters()
    ):
        assert name == name2
        assert param.grad is None
        torch.testing.assert_close(param.main_grad, ref.grad, rtol=0, atol=0)


def test_no_sync_accumulates_and_reduces_once():
    reference, ddp = make(bucket_size=100, overlap=True)
    assert len(ddp.buckets) > 1
    for micro in range(3):
        reference(batch(micro)).sum().backward()
        if micro < 2:
            with ddp.no_sync():
                ddp(batch(micro)).sum().backward()
            assert all(b.num_reductions == 0 for b in ddp.buckets)
        else:
            ddp(batch(micro)).sum().backward()
    ddp.finish_grad_sync()
    assert [b.num_reductions for b in ddp.buckets] == [1] * len(ddp.buckets)
    for ref, param in zip(reference.parameters(), ddp.module.parameters()):
        torch.testing.assert_close(param.main_grad, ref.grad, rtol=1e-6, atol=1e-6)
    ddp.zero_grad_buffer()
    assert all(float(p.main_grad.abs().sum()) == 0 for p in ddp.module.parameters())


def test_overlapped_buckets_launch_once_after_all_their_grads_and_before_backward_ends():
    _, ddp = make(bucket_size=100, overlap=True)
    buckets = ddp.buckets
    for _ in range(2):  # two iterations: state resets correctly
        ddp(batch(3)).sum().backward()
        ddp.finish_grad_sync()
        ready_seq, launch_seq = {}, {}
        for event in ddp.events:
            if event.kind == "grad_ready":
                ready_seq.setdefault(event.bucket, []).append(event.seq)
            if event.kind == "reduce_launch":
                assert event.bucket not in launch_seq, "bucket reduced twice"
                launch_seq[event.bucket] = event.seq
                assert event.detail == len(buckets[event.bucket].params)
        assert set(launch_seq) == {b.index for b in buckets}
        for index, seqs in ready_seq.items():
            assert len(seqs) == len(buckets[index].params)
            assert max(seqs) < launch_seq[index]
        last_grad = max(s for seqs in ready_seq.values() for s in seqs)
        # overlap is real: the first bucket was launched while backward was still running
        assert min(launch_seq.values()) < last_grad
        ddp.zero_grad_buffer()
    assert [b.num_reductions for b in buckets] == [2] * len(buckets)
    assert all(
        counts == [len(b.params)] * 2 for b in buckets for counts in [b.ready_counts_at_launch]
    )


def test_second_backward_without_no_sync_is_an_error():
    _, ddp = make()
    ddp(batch(1)).sum().backward()
    with pytest.raises(RuntimeError, match="ready twice"):
        ddp(batch(2)).sum().backward()


def test_bf16_params_accumulate_in_fp32_buffer():
    reference, ddp = make(dtype=torch.bfloat16, grad_dtype=torch.float32)
    assert ddp.grad_buffers[0].grad_data.dtype == torch.float32
    for micro in range(2):
        reference(batch(micro, torch.bfloat16)).float().sum().backward()
        with ddp.no_sync() if micro == 0 else _null():
            ddp(batch(micro, torch.bfloat16)).float().sum().backward()
    ddp.finish_grad_sync()
    for ref, param in zip(reference.parameters(), ddp.module.parameters()):
        assert param.main_grad.dtype == torch.float32
        torch.testing.assert_close(param.main_grad, ref.grad.float(), rtol=2e-2, atol=2e-2)


def _null():
    import contextlib

    return contextlib.nullcontext()


def test_wrapper_is_transparent():
    reference, ddp = make()
    assert list(ddp.state_dict()) == list(reference.state_dict())
    assert ddp.pre_process is True and ddp.post_process is True
    marker = torch.ones(1)
    ddp.set_input_tensor(marker)
    assert ddp.module.input_tensor is marker
    state = {k: v + 1 for k, v in reference.state_dict().items()}
    ddp.load_state_dict(state)
    for key, value in ddp.module.state_dict().items():
        torch.testing.assert_close(value, state[key])
    # loading kept the parameters inside nothing new: main_grad views are untouched
    assert all(hasattr(p, "main_grad") for p in ddp.module.parameters())


def test_per_token_loss_disables_averaging_and_default_bucket_size():
    cfg = dataclasses.replace(
        ParallelConfig(), calculate_per_token_loss=True, overlap_grad_reduce=True
    )
    ddp = DistributedDataParallel(TinyMLP(), ParallelContext.single(), cfg)
    assert ddp.grad_scaling_factor == 1.0
    assert ddp.bucket_size == 40_000_000


# ---- the distributed optimizer at dp = 1: same steps and the same bytes as the plain one -------
MEGATRON_PLAIN_BYTES = {"fp16": 20, "bf16": 18, "fp32": 16}


def _train_mlp(precision: str, distributed: bool, steps: int = 3):
    from gigatron.config.root import GigatronConfig
    from gigatron.optim import build_optimizer
    from gigatron.optim.memory import memory_bytes_per_rank

    cfg = GigatronConfig()
    cfg.parallel.use_distributed_optimizer = distributed
    cfg.training.fp16 = precision == "fp16"
    cfg.training.bf16 = precision == "bf16"
    cfg.training.initial_loss_scale = 1024.0
    cfg.optimizer.lr = 1e-2
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    # Megatron's rows: fp16 params with fp16 grads; bf16 and fp32 params with fp32 grads.
    grad_dtype = torch.float16 if precision == "fp16" else torch.float32
    torch.manual_seed(0)
    # 2 x (32 x 32 + 32) + 2 x 32 = 2176 parameters: a multiple of the shard alignment (64)
    model = TinyMLP(width=32, depth=2).to(dtype)
    ddp = DistributedDataParallel(model, ParallelContext.single(), cfg.parallel, grad_dtype)
    optimizer = build_optimizer(cfg, [ddp], ParallelContext.single())
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(step)).to(dtype)
        loss = ddp(x).float().square().mean()
        optimizer.scale_loss(loss).backward()
        ddp.finish_grad_sync()
        success, grad_norm, _ = optimizer.step()
        assert success
        losses.append((loss.item(), grad_norm))
    numel = sum(p.numel() for p in model.parameters())
    return losses, memory_bytes_per_rank([ddp], optimizer), numel


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_distributed_optimizer_at_dp1_matches_plain_steps_and_memory(precision):
    plain, plain_memory, numel = _train_mlp(precision, distributed=False)
    sharded, sharded_memory, _ = _train_mlp(precision, distributed=True)
    torch.testing.assert_close(torch.tensor(sharded), torch.tensor(plain), rtol=1e-6, atol=1e-7)
    # (Adam's per-tensor `step` counters add a few bytes beyond the table)
    expected = pytest.approx(MEGATRON_PLAIN_BYTES[precision], abs=0.05)
    assert plain_memory["total"] / numel == expected
    # d = 1: a + b / 1 equals the plain figure
    assert sharded_memory["total"] / numel == expected
    param_bytes = {"fp16": 2, "bf16": 2, "fp32": 4}[precision]
    assert sharded_memory["params"] == param_bytes * numel
