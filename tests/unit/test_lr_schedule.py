"""Learning-rate schedule: hand-computed values at chosen points for every shape."""

import math

import pytest

from gigatron.config import GigatronConfig
from gigatron.errors import GigatronError
from gigatron.optim.lr_schedule import LRScheduler, build_lr_scheduler


class FakeOptimizer:
    def __init__(self, groups=None):
        self.param_groups = groups or [{"wd_mult": 1.0}, {"wd_mult": 0.0}]


def make(style="linear", **kwargs):
    args = dict(
        init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=10, lr_decay_steps=110,
        lr_decay_style=style, start_wd=0.01, end_wd=0.01, wd_incr_steps=110,
        wd_incr_style="constant",
    )  # fmt: skip
    args.update(kwargs)
    return LRScheduler(FakeOptimizer(), **args)


def lr_at(sched, samples):
    sched.num_steps = 0
    sched.step(samples)
    return sched.optimizer.param_groups[0]["lr"]


def test_linear_warmup_then_decay():
    s = make("linear")
    assert lr_at(s, 0) == 0.0
    assert lr_at(s, 5) == pytest.approx(0.5)
    assert lr_at(s, 10) == pytest.approx(1.0)
    assert lr_at(s, 60) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way through the decay
    assert lr_at(s, 110) == pytest.approx(0.1)
    assert lr_at(s, 500) == pytest.approx(0.1)


def test_cosine():
    s = make("cosine")
    assert lr_at(s, 60) == pytest.approx(0.55)
    assert lr_at(s, 35) == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi / 4) + 1))
    assert lr_at(s, 35) == pytest.approx(0.868198, abs=1e-6)
    assert lr_at(s, 110) == pytest.approx(0.1)


def test_constant_with_warmup_init():
    s = make("constant", init_lr=0.2)
    assert lr_at(s, 0) == pytest.approx(0.2)
    assert lr_at(s, 5) == pytest.approx(0.6)
    assert lr_at(s, 1000) == pytest.approx(1.0)


def test_inverse_square_root():
    s = make("inverse-square-root", lr_warmup_steps=4, lr_decay_steps=10_000, min_lr=0.01)
    assert lr_at(s, 2) == pytest.approx(0.5)  # warm-up
    assert lr_at(s, 16) == pytest.approx(0.5)  # 1 * sqrt(4) / sqrt(16)
    assert lr_at(s, 400) == pytest.approx(0.1)
    assert lr_at(s, 9999) == pytest.approx(0.02, rel=1e-3)
    assert lr_at(s, 20_000) == pytest.approx(0.01)  # past the decay: min_lr


@pytest.mark.parametrize(
    "wsd_style, expected_at_90",
    [
        ("linear", 0.1 + 0.9 * 0.5),
        ("cosine", 0.1 + 0.9 * 0.5),
        ("exponential", 0.1 + 0.9 * (2 * 0.5**0.5 - 1)),  # 0.472792
        ("minus_sqrt", 0.1 + 0.9 * (1 - 0.5**0.5)),  # 0.363604
    ],
)
def test_wsd_stable_then_anneal(wsd_style, expected_at_90):
    s = make("WSD", wsd_decay_steps=40, lr_wsd_decay_style=wsd_style)
    assert lr_at(s, 50) == pytest.approx(1.0)  # stable phase
    assert lr_at(s, 70) == pytest.approx(1.0)  # anneal starts after 110 - 40
    assert lr_at(s, 90) == pytest.approx(expected_at_90)
    assert lr_at(s, 110) == pytest.approx(0.1)


def test_wsd_exponential_numbers():
    s = make("WSD", wsd_decay_steps=40, lr_wsd_decay_style="exponential")
    assert lr_at(s, 90) == pytest.approx(0.472792, abs=1e-6)
    s = make("WSD", wsd_decay_steps=40, lr_wsd_decay_style="minus_sqrt")
    assert lr_at(s, 90) == pytest.approx(0.363604, abs=1e-6)


def test_weight_decay_increment_and_group_multipliers():
    groups = [{"wd_mult": 1.0, "lr_mult": 1.0}, {"wd_mult": 0.0, "lr_mult": 0.5}]
    s = LRScheduler(
        FakeOptimizer(groups), init_lr=0.0, max_lr=1.0, min_lr=0.0, lr_warmup_steps=0,
        lr_decay_steps=100, lr_decay_style="linear", start_wd=0.0, end_wd=0.1, wd_incr_steps=100,
        wd_incr_style="linear",
    )  # fmt: skip
    s.step(50)
    assert groups[0]["weight_decay"] == pytest.approx(0.05)
    assert groups[1]["weight_decay"] == 0.0
    assert groups[0]["lr"] == pytest.approx(0.5)
    assert groups[1]["lr"] == pytest.approx(0.25)
    s.step(25)
    assert groups[0]["weight_decay"] == pytest.approx(0.075)


def test_cosine_weight_decay_increment():
    s = make(start_wd=0.0, end_wd=0.2, wd_incr_steps=100, wd_incr_style="cosine")
    s.step(25)
    assert s.get_wd() == pytest.approx(0.2 * 0.5 * (math.cos(math.pi * 0.75) + 1))


def config(**optimizer):
    cfg = GigatronConfig()
    cfg.training.train_iters = 100
    cfg.training.global_batch_size = 8
    cfg.optimizer.lr = 1.0
    cfg.optimizer.min_lr = 0.0
    for k, v in optimizer.items():
        setattr(cfg.optimizer, k, v)
    return cfg


def test_build_from_iterations_counts_samples():
    s = build_lr_scheduler(config(lr_warmup_iters=10), FakeOptimizer())
    assert s.lr_warmup_steps == 80 and s.lr_decay_steps == 800
    for _ in range(10):
        s.step(8)  # one iteration = one global batch of samples
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(1.0)
    for _ in range(36):
        s.step(8)
    # 46 iterations: 36 of the 90 decay iterations done
    assert s.optimizer.param_groups[0]["lr"] == pytest.approx(1 - 36 / 90)
    assert s.optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.01)


def test_build_warmup_fraction_and_samples():
    s = build_lr_scheduler(config(lr_warmup_fraction=0.1, lr_decay_iters=50), FakeOptimizer())
    assert s.lr_decay_steps == 400 and s.lr_warmup_steps == pytest.approx(40)
    cfg = config(lr_warmup_samples=30, lr_decay_samples=300)
    cfg.training.train_iters = None
    cfg.training.train_samples = 600
    s = build_lr_scheduler(cfg, FakeOptimizer())
    assert (s.lr_warmup_steps, s.lr_decay_steps, s.wd_incr_steps) == (30, 300, 600)


def test_state_dict_round_trip_and_mismatch():
    s = make("cosine")
    s.step(42)
    saved = s.state_dict()
    fresh = make("cosine")
    fresh.load_state_dict(saved)
    assert fresh.num_steps == 42
    assert fresh.optimizer.param_groups[0]["lr"] == s.optimizer.param_groups[0]["lr"]

    other = make("cosine", max_lr=2.0)
    with pytest.raises(GigatronError, match="override-opt_param-scheduler"):
        other.load_state_dict(saved)
    keep_flags = make("cosine", max_lr=2.0, override_opt_param_scheduler=True)
    keep_flags.load_state_dict(saved)
    assert keep_flags.max_lr == 2.0 and keep_flags.num_steps == 42
    keep_ckpt = make("cosine", max_lr=2.0, use_checkpoint_opt_param_scheduler=True)
    keep_ckpt.load_state_dict(saved)
    assert keep_ckpt.max_lr == 1.0


def test_bad_inputs_are_named():
    with pytest.raises(GigatronError, match="WSD"):
        make("WSD")
    with pytest.raises(GigatronError, match="warm-up"):
        make("linear", lr_warmup_steps=200)
    with pytest.raises(GigatronError, match="weight-decay-incr-style"):
        make(start_wd=0.0, end_wd=0.1)
    cfg = config()
    cfg.training.train_iters = None
    with pytest.raises(GigatronError, match="train-iters"):
        build_lr_scheduler(cfg, FakeOptimizer())


def test_megatron_flag_spellings():
    from gigatron.config import parse_config

    cfg = parse_config(
        ["--override-opt-param-scheduler", "--start-weight-decay", "0.0"], validate=False
    )
    assert cfg.optimizer.override_opt_param_scheduler is True
    assert cfg.optimizer.start_weight_decay == 0.0
