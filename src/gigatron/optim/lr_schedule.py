"""Learning-rate and weight-decay schedule (the semantics of Megatron's OptimizerParamScheduler).

The schedule counts *samples*, not iterations: the training loop calls `step(increment)` after
every successful optimizer step with the global batch size of that iteration, so a growing batch
(`--rampup-batch-size`) moves the schedule by the samples really consumed. Iteration-based flags
(`--lr-warmup-iters`, `--lr-decay-iters`) are converted to samples with the global batch size.

Shape, with n = samples so far, W = warm-up samples, D = decay samples:
- n <= W (and W > 0): linear from `init_lr` to `max_lr`;
- `constant`: `max_lr` after the warm-up;
- n > D: `min_lr`;
- `inverse-square-root`: max(min_lr, max_lr * sqrt(max(W, 1)) / sqrt(max(n, 1)));
- otherwise r = (n - W) / (D - W) and lr = min_lr + c * (max_lr - min_lr) with
  c = 1 - r (linear), (cos(pi r) + 1) / 2 (cosine), or for WSD c = 1 until D - S (S = WSD decay
  samples), then with q = (n - (D - S)) / S: 1 - q (linear), (cos(pi q) + 1) / 2 (cosine),
  2 * 0.5**q - 1 (exponential), 1 - sqrt(q) (minus_sqrt).
"""

from __future__ import annotations

import math
from typing import Any

from gigatron.errors import GigatronError

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")
# The checkpoint entries checked against the flags on load, in order, and what they are called.
_CHECKED_STATE = (
    ("max_lr", "learning rate"),
    ("min_lr", "minimum learning rate"),
    ("lr_warmup_steps", "warm-up samples"),
    ("lr_decay_steps", "decay samples"),
    ("lr_decay_style", "decay style"),
    ("wsd_decay_steps", "WSD decay samples"),
    ("lr_wsd_decay_style", "WSD decay style"),
    ("start_wd", "start weight decay"),
    ("end_wd", "end weight decay"),
    ("wd_incr_steps", "weight-decay increment samples"),
    ("wd_incr_style", "weight-decay increment style"),
)
_WSD_STATE = ("wsd_decay_steps", "lr_wsd_decay_style")


def check_styles(lr_decay_style: str, lr_wsd_decay_style: str, wd_incr_style: str) -> None:
    """GigatronError for an unknown decay, WSD-decay or weight-decay increment style."""
    for style, known, flag in (
        (lr_decay_style, DECAY_STYLES, "--lr-decay-style"),
        (lr_wsd_decay_style, WSD_DECAY_STYLES, "--lr-wsd-decay-style"),
        (wd_incr_style, WD_INCR_STYLES, "--weight-decay-incr-style"),
    ):
        if style not in known:
            raise GigatronError(f"{flag} {style}: unknown; choose one of {known}")


def check_lr_lengths(
    min_lr: float,
    max_lr: float,
    lr_warmup_steps: float,
    lr_decay_steps: float,
    lr_decay_style: str,
    wsd_decay_steps: float | None,
) -> None:
    """GigatronError when the learning rates or the warm-up / decay lengths do not fit."""
    if not 0.0 <= min_lr <= max_lr:
        raise GigatronError(f"--min-lr {min_lr} must lie in [0, --lr {max_lr}]")
    if lr_decay_style != "constant" and lr_decay_steps <= 0:
        raise GigatronError(
            f"learning-rate decay length is {lr_decay_steps} samples; give a positive "
            "--lr-decay-iters/--lr-decay-samples (or --train-iters/--train-samples)"
        )
    if lr_decay_style not in ("constant", "inverse-square-root") and (
        lr_warmup_steps >= lr_decay_steps
    ):
        raise GigatronError(
            f"warm-up ({lr_warmup_steps} samples) must be shorter than the decay "
            f"({lr_decay_steps} samples); shorten --lr-warmup-* or lengthen --lr-decay-*"
        )
    if lr_decay_style != "WSD":
        return
    if wsd_decay_steps is None or wsd_decay_steps <= 0:
        raise GigatronError(
            "--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples"
        )
    if wsd_decay_steps > lr_decay_steps - lr_warmup_steps:
        raise GigatronError(
            f"WSD decay ({wsd_decay_steps} samples) is longer than the decay after "
            f"warm-up ({lr_decay_steps - lr_warmup_steps} samples); shorten "
            "--lr-wsd-decay-iters/--lr-wsd-decay-samples"
        )


def check_weight_decay(
    start_wd: float, end_wd: float, wd_incr_steps: float, wd_incr_style: str
) -> None:
    """GigatronError when the weight-decay increment does not fit its style."""
    if wd_incr_style == "constant" and start_wd != end_wd:
        raise GigatronError(
            f"--start-weight-decay {start_wd} differs from --end-weight-decay {end_wd}; "
            "set --weight-decay-incr-style linear or cosine"
        )
    if wd_incr_style != "constant" and wd_incr_steps <= 0:
        raise GigatronError("weight-decay increment needs --train-iters or --train-samples")


class LRScheduler:
    """Sets `lr` and `weight_decay` of every param group of `optimizer` from the sample count.

    A param group may carry `lr_mult` and `wd_mult` (default 1.0); the group without weight decay
    has `wd_mult = 0.0`. `max_lr`/`min_lr` keys in a group override the global ones.
    """

    def __init__(
        self,
        optimizer: Any,
        init_lr: float,
        max_lr: float,
        min_lr: float,
        lr_warmup_steps: float,
        lr_decay_steps: float,
        lr_decay_style: str,
        start_wd: float,
        end_wd: float,
        wd_incr_steps: float,
        wd_incr_style: str,
        use_checkpoint_opt_param_scheduler: bool = False,
        override_opt_param_scheduler: bool = False,
        wsd_decay_steps: float | None = None,
        lr_wsd_decay_style: str = "exponential",
    ) -> None:
        check_styles(lr_decay_style, lr_wsd_decay_style, wd_incr_style)
        check_lr_lengths(
            min_lr, max_lr, lr_warmup_steps, lr_decay_steps, lr_decay_style, wsd_decay_steps
        )
        check_weight_decay(start_wd, end_wd, wd_incr_steps, wd_incr_style)
        if use_checkpoint_opt_param_scheduler and override_opt_param_scheduler:
            raise GigatronError(
                "--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler both "
                "given; keep one"
            )
        self.optimizer = optimizer
        self.init_lr = float(init_lr)
        self.max_lr = float(max_lr)
        self.min_lr = float(min_lr)
        self.lr_warmup_steps = float(lr_warmup_steps)
        self.lr_decay_steps = float(lr_decay_steps)
        self.lr_decay_style = lr_decay_style
        self.wsd_decay_steps = None if wsd_decay_steps is None else float(wsd_decay_steps)
        self.lr_wsd_decay_style = lr_wsd_decay_style
        self.start_wd = float(start_wd)
        self.end_wd = float(end_wd)
        self.wd_incr_steps = float(wd_incr_steps)
        self.wd_incr_style = wd_incr_style
        self.use_checkpoint_opt_param_scheduler = use_checkpoint_opt_param_scheduler
        self.override_opt_param_scheduler = override_opt_param_scheduler
        self.num_steps = 0
        self.step(0)

    # ---- the curves -----------------------------------------------------------------------
    def get_wd(self) -> float:
        """Weight decay at the current sample count."""
        if self.wd_incr_style == "constant" or self.num_steps > self.wd_incr_steps:
            return self.end_wd
        ratio = self.num_steps / self.wd_incr_steps
        if self.wd_incr_style == "linear":
            coeff = ratio
        else:  # cosine
            coeff = 0.5 * (math.cos(math.pi * (1.0 - ratio)) + 1.0)
        return self.start_wd + coeff * (self.end_wd - self.start_wd)

    def get_lr(self, param_group: dict | None = None) -> float:
        """Learning rate at the current sample count (before the group's `lr_mult`)."""
        group = param_group or {}
        max_lr = group.get("max_lr", self.max_lr)
        min_lr = group.get("min_lr", self.min_lr)
        n = self.num_steps
        if self.lr_warmup_steps > 0 and n <= self.lr_warmup_steps:
            return self.init_lr + (max_lr - self.init_lr) * n / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return max_lr
        if n > self.lr_decay_steps:
            return min_lr
        if self.lr_decay_style == "inverse-square-root":
            warmup = max(self.lr_warmup_steps, 1.0)
            lr = max_lr * math.sqrt(warmup) / math.sqrt(max(n, 1))
            return max(min_lr, lr)
        ratio = (n - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        if self.lr_decay_style == "linear":
            coeff = 1.0 - ratio
        elif self.lr_decay_style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        else:  # WSD: stable until the last wsd_decay_steps samples, then anneal
            assert self.wsd_decay_steps is not None
            anneal_start = self.lr_decay_steps - self.wsd_decay_steps
            if n <= anneal_start:
                coeff = 1.0
            else:
                q = (n - anneal_start) / self.wsd_decay_steps
                if self.lr_wsd_decay_style == "linear":
                    coeff = 1.0 - q
                elif self.lr_wsd_decay_style == "cosine":
                    coeff = 0.5 * (math.cos(math.pi * q) + 1.0)
                elif self.lr_wsd_decay_style == "exponential":
                    coeff = 2.0 * math.pow(0.5, q) - 1.0
                else:  # minus_sqrt
                    coeff = 1.0 - math.sqrt(q)
        return min_lr + coeff * (max_lr - min_lr)

    def step(self, increment: int) -> None:
        """Advance by `increment` samples and write lr / weight decay into the param groups."""
        self.num_steps += increment
        wd = self.get_wd()
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(group) * group.get("lr_mult", 1.0)
            group["weight_decay"] = wd * group.get("wd_mult", 1.0)

    # ---- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "max_lr": self.max_lr,
            "lr_warmup_steps": self.lr_warmup_steps,
            "num_steps": self.num_steps,
            "lr_decay_style": self.lr_decay_style,
            "lr_decay_steps": self.lr_decay_steps,
            "min_lr": self.min_lr,
            "start_wd": self.start_wd,
            "end_wd": self.end_wd,
            "wd_incr_style": self.wd_incr_style,
            "wd_incr_steps": self.wd_incr_steps,
            "wsd_decay_steps": self.wsd_decay_steps,
            "lr_wsd_decay_style": self.lr_wsd_decay_style,
        }

    def _check_and_set(self, current: Any, saved: Any, name: str) -> Any:
        """Flags win with --override-opt_param-scheduler; the checkpoint wins with
        --use-checkpoint-opt_param-scheduler; otherwise both must agree."""
        if self.override_opt_param_scheduler:
            return current
        if not self.use_checkpoint_opt_param_scheduler and current != saved:
            raise GigatronError(
                f"learning-rate schedule: {name} is {current} from the flags but {saved} in the "
                "checkpoint; pass --override-opt_param-scheduler to keep the flags or "
                "--use-checkpoint-opt_param-scheduler to keep the checkpoint's"
            )
        return saved

    def load_state_dict(self, state: dict[str, Any]) -> None:
        has_wsd = "wsd_decay_steps" in state  # older checkpoints have no WSD entries
        for name, what in _CHECKED_STATE:
            if has_wsd or name not in _WSD_STATE:
                setattr(self, name, self._check_and_set(getattr(self, name), state[name], what))
        # The sample count always comes from the checkpoint: it is where training stopped.
        self.num_steps = 0
        self.step(int(state["num_steps"]))


def schedule_lengths_in_samples(cfg: Any) -> dict[str, float | None]:
    """Warm-up, decay, WSD-decay and weight-decay-increment lengths in samples, from the flags."""
    o, t = cfg.optimizer, cfg.training
    if t.train_iters is not None:
        if t.global_batch_size is None:
            raise GigatronError(
                "the learning-rate schedule needs the global batch size; give "
                "--global-batch-size (or --micro-batch-size with a known data-parallel size)"
            )
        gbs = t.global_batch_size
        decay_iters = o.lr_decay_iters if o.lr_decay_iters is not None else t.train_iters
        decay = decay_iters * gbs
        wd_incr = t.train_iters * gbs
        wsd = o.lr_wsd_decay_iters * gbs if o.lr_wsd_decay_iters is not None else None
        if o.lr_warmup_fraction is not None:
            warmup = o.lr_warmup_fraction * decay
        else:
            warmup = o.lr_warmup_iters * gbs
    elif t.train_samples is not None:
        decay = o.lr_decay_samples if o.lr_decay_samples is not None else t.train_samples
        wd_incr = t.train_samples
        wsd = o.lr_wsd_decay_samples
        if o.lr_warmup_fraction is not None:
            warmup = o.lr_warmup_fraction * decay
        else:
            warmup = o.lr_warmup_samples
    else:
        raise GigatronError(
            "the learning-rate schedule needs the training length; give --train-iters or "
            "--train-samples"
        )
    return {"warmup": warmup, "decay": decay, "wsd_decay": wsd, "wd_incr": wd_incr}


def build_lr_scheduler(cfg: Any, optimizer: Any) -> LRScheduler:
    """The schedule the flags describe, driving `optimizer.param_groups`."""
    o = cfg.optimizer
    if o.lr is None:
        raise GigatronError("--lr is required to build the learning-rate schedule")
    lengths = schedule_lengths_in_samples(cfg)
    start_wd = o.start_weight_decay if o.start_weight_decay is not None else o.weight_decay
    end_wd = o.end_weight_decay if o.end_weight_decay is not None else o.weight_decay
    return LRScheduler(
        optimizer,
        init_lr=o.lr_warmup_init,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=lengths["warmup"],
        lr_decay_steps=lengths["decay"],
        lr_decay_style=o.lr_decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=lengths["wd_incr"],
        wd_incr_style=o.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=o.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=o.override_opt_param_scheduler,
        wsd_decay_steps=lengths["wsd_decay"],
        lr_wsd_decay_style=o.lr_wsd_decay_style,
    )
