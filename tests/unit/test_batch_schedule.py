"""Micro-batches per iteration, with and without --rampup-batch-size."""

import pytest

from gigatron.config import GigatronConfig
from gigatron.errors import GigatronError
from gigatron.optim.batch_schedule import (
    NumMicroBatchesCalculator,
    build_num_microbatches_calculator,
)


def test_constant():
    calc = NumMicroBatchesCalculator(16, 2, 2)
    assert calc.get() == 4
    calc.update(10_000)
    assert calc.get() == 4 and calc.get_current_global_batch_size() == 16


def test_constant_not_divisible():
    with pytest.raises(GigatronError, match=r"global batch size 10 .* = 4"):
        NumMicroBatchesCalculator(10, 2, 2)


def test_rampup_steps():
    # 3 increments of 4 over 100 samples: one every 33.33 samples.
    calc = NumMicroBatchesCalculator(16, 2, 2, [4, 4, 100])
    expected = {0: 4, 33: 4, 34: 8, 66: 8, 67: 12, 99: 12, 100: 16, 101: 16, 5000: 16}
    for consumed, gbs in expected.items():
        calc.update(consumed)
        assert calc.get_current_global_batch_size() == gbs, consumed
        assert calc.get() == gbs // 4


def test_rampup_train_iters_for_samples():
    calc = NumMicroBatchesCalculator(16, 2, 2, [4, 4, 100])
    # by hand: 9 iterations of 4 (to 36), 4 of 8 (to 68), 3 of 12 (to 104),
    # then (200 - 104) // 16 = 6 full batches
    assert calc.train_iters_for_samples(200) == 22
    assert NumMicroBatchesCalculator(16, 2, 2).train_iters_for_samples(200) == 12


@pytest.mark.parametrize(
    "rampup, message",
    [
        ([2, 2, 100], "global batch size 2 is not divisible"),
        ([32, 4, 100], "exceeds --global-batch-size"),
        ([4, 8, 100], "not a multiple of the increment"),
        ([0, 4, 100], "must be positive"),
    ],
)
def test_rampup_errors(rampup, message):
    with pytest.raises(GigatronError, match=message):
        NumMicroBatchesCalculator(16, 2, 2, rampup)


def test_rampup_without_increments_is_constant():
    calc = NumMicroBatchesCalculator(16, 2, 2, [16, 4, 100])
    calc.update(0)
    assert calc.get_current_global_batch_size() == 16


def test_build_from_config():
    cfg = GigatronConfig()
    cfg.training.micro_batch_size = 2
    cfg.training.global_batch_size = 12
    cfg.training.rampup_batch_size = [6, 6, 60]
    calc = build_num_microbatches_calculator(cfg, data_parallel_size=3)
    assert calc.get() == 1
    calc.update(61)
    assert calc.get() == 2
    cfg.training.global_batch_size = None
    cfg.training.rampup_batch_size = None
    assert build_num_microbatches_calculator(cfg, 3).get_current_global_batch_size() == 6
