"""torch-format checkpoints: layout, exact resume, atomic saves, safe loading, layout checks."""

import copy
import os
import random
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from gigatron.checkpoint import torch_format
from gigatron.checkpoint.torch_format import load_checkpoint, save_checkpoint
from gigatron.config import GigatronConfig
from gigatron.errors import GigatronError
from gigatron.optim import build_lr_scheduler, build_optimizer
from gigatron.parallel.context import ParallelContext

PCTX = ParallelContext.single()
GLOBAL_BATCH = 4


class DropoutNet(nn.Module):
    """Dropout makes the resumed run depend on the restored random state."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 32)
        self.drop = nn.Dropout(0.3)
        self.norm = nn.LayerNorm(32)
        self.fc2 = nn.Linear(32, 2)

    def forward(self, x):
        return self.fc2(self.norm(self.drop(torch.relu(self.fc1(x)))))


def make_cfg(bf16=False):
    cfg = GigatronConfig()
    cfg.optimizer.lr = 1e-2
    cfg.optimizer.lr_warmup_iters = 2
    cfg.optimizer.lr_decay_style = "cosine"
    cfg.optimizer.clip_grad = 0.5
    cfg.training.train_iters = 8
    cfg.training.global_batch_size = GLOBAL_BATCH
    cfg.training.micro_batch_size = GLOBAL_BATCH
    cfg.training.bf16 = bf16
    return cfg


def build(cfg, seed=0):
    torch.manual_seed(seed)
    model = DropoutNet()
    if cfg.training.bf16:
        model = model.to(torch.bfloat16)
    optimizer = build_optimizer(cfg, [model], PCTX)
    scheduler = build_lr_scheduler(cfg, optimizer)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps):
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        # data drawn from the global RNGs, so they must be restored too
        x = torch.from_numpy(np.random.standard_normal((GLOBAL_BATCH, 8))).to(dtype)
        y = torch.randn(GLOBAL_BATCH, 2) + random.random()
        optimizer.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        optimizer.scale_loss(loss).backward()
        success, _, _ = optimizer.step()
        assert success
        scheduler.step(GLOBAL_BATCH)


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@pytest.mark.parametrize("bf16", [False, True])
def test_resume_is_bitwise_exact(tmp_path, bf16):
    cfg = make_cfg(bf16)
    model, optimizer, scheduler = build(cfg)
    seed_all(7)
    train(model, optimizer, scheduler, 4)
    save_checkpoint(
        tmp_path, 4, [model], optimizer, scheduler, PCTX, cfg, {"consumed_train_samples": 16}
    )
    train(model, optimizer, scheduler, 4)
    expected = [p.detach().clone() for p in model.parameters()]

    seed_all(99)  # different random state, different init: all must come from the checkpoint
    model2, optimizer2, scheduler2 = build(cfg, seed=1)
    info = load_checkpoint(tmp_path, [model2], optimizer2, scheduler2, PCTX, cfg)
    assert info["loaded"] and info["iteration"] == 4 and info["consumed_train_samples"] == 16
    assert scheduler2.num_steps == 16
    train(model2, optimizer2, scheduler2, 4)
    for p, q in zip(expected, model2.parameters()):
        assert torch.equal(p, q)


def test_layout_and_contents(tmp_path):
    cfg = make_cfg()
    model, optimizer, scheduler = build(cfg)
    save_checkpoint(tmp_path, 3, [model], optimizer, scheduler, PCTX, cfg, {"x": 1})
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    path = tmp_path / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=True)
    assert state["checkpoint_version"] == 3.0 and state["iteration"] == 3 and state["x"] == 1
    assert state["args"]["optimizer"]["lr"] == 1e-2  # the config, as plain nested dicts
    assert set(state["model"]) == set(model.state_dict())
    assert {"optimizer", "opt_param_scheduler", "rng_state"} <= set(state)
    assert state["num_floating_point_operations_so_far"] == 0
    rng = state["rng_state"]
    assert {"random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"} <= set(rng)


def test_virtual_chunks_and_pipeline_dir_names(tmp_path):
    cfg = make_cfg()
    chunks = [nn.Linear(2, 2), nn.Linear(2, 3)]
    save_checkpoint(tmp_path, 1, chunks, None, None, PCTX, cfg)
    state = torch.load(tmp_path / "iter_0000001/mp_rank_00/model_optim_rng.pt", weights_only=True)
    assert "model0" in state and "model1" in state and "model" not in state
    assert torch_format.mp_rank_dir_name(1, 2, 4) == "mp_rank_01_002"
    fresh = [nn.Linear(2, 2), nn.Linear(2, 3)]
    load_checkpoint(tmp_path, fresh, None, None, PCTX, cfg)
    assert torch.equal(fresh[1].weight, chunks[1].weight)
    with pytest.raises(GigatronError, match="virtual pipeline"):
        load_checkpoint(tmp_path, [nn.Linear(2, 2)], None, None, PCTX, cfg)


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    cfg = make_cfg()
    model, optimizer, scheduler = build(cfg)
    save_checkpoint(tmp_path, 2, [model], optimizer, scheduler, PCTX, cfg)
    saved = [p.detach().clone() for p in model.parameters()]
    train(model, optimizer, scheduler, 1)

    real_write = torch_format._write_file

    def write_then_crash(state, path):
        real_write(state, path)
        raise KeyboardInterrupt("killed between the file write and the rename")

    monkeypatch.setattr(torch_format, "_write_file", write_then_crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, 3, [model], optimizer, scheduler, PCTX, cfg)
    monkeypatch.setattr(torch_format, "_write_file", real_write)
    assert not (tmp_path / "iter_0000003").exists()
    assert (tmp_path / "iter_0000003.tmp").exists()

    model2, optimizer2, scheduler2 = build(cfg, seed=5)
    info = load_checkpoint(tmp_path, [model2], optimizer2, scheduler2, PCTX, cfg)
    assert info["iteration"] == 2
    for p, q in zip(saved, model2.parameters()):
        assert torch.equal(p, q)

    # the next save of that iteration cleans the leftover and succeeds
    save_checkpoint(tmp_path, 3, [model], optimizer, scheduler, PCTX, cfg)
    assert not (tmp_path / "iter_0000003.tmp").exists()
    assert torch_format.read_tracker(tmp_path) == (3, False)


def test_crash_while_publishing_keeps_tracker(tmp_path, monkeypatch):
    cfg = make_cfg()
    model, optimizer, scheduler = build(cfg)
    save_checkpoint(tmp_path, 1, [model], optimizer, scheduler, PCTX, cfg)

    def crash(save_dir, iteration):
        raise OSError("disk full")

    monkeypatch.setattr(torch_format, "publish_iteration", crash)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, [model], optimizer, scheduler, PCTX, cfg)
    assert torch_format.read_tracker(tmp_path) == (1, False)
    assert load_checkpoint(tmp_path, [model], optimizer, scheduler, PCTX, cfg)["iteration"] == 1


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickled_code_is_refused_and_not_run(tmp_path):
    cfg = make_cfg()
    model, optimizer, scheduler = build(cfg)
    save_checkpoint(tmp_path, 1, [model], optimizer, scheduler, PCTX, cfg)
    marker = tmp_path / "pwned"
    exploit = Exploit()
    exploit.marker = marker
    path = tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=True)
    state["args"] = exploit
    torch.save(state, path)
    with pytest.raises(GigatronError, match=r"refused to load.*system"):
        load_checkpoint(tmp_path, [model], optimizer, scheduler, PCTX, cfg)
    assert not marker.exists()


def test_truncated_file_is_reported(tmp_path):
    cfg = make_cfg()
    model, optimizer, scheduler = build(cfg)
    save_checkpoint(tmp_path, 1, [model], optimizer, scheduler, PCTX, cfg)
    path = tmp_path / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(GigatronError, match="not a readable checkpoint"):
        load_checkpoint(tmp_path, [model], optimizer, scheduler, PCTX, cfg)


@pytest.mark.parametrize(
    "dirs, saved",
    [
        (["mp_rank_00", "mp_rank_01"], "tensor-parallel 2, pipeline-parallel 1"),
        (["mp_rank_00_000", "mp_rank_00_001"], "tensor-parallel 1, pipeline-parallel 2"),
    ],
)
def test_other_parallel_layout_is_refused_with_conversion_hint(tmp_path, dirs, saved):
    cfg = make_cfg()
    model, optimizer, scheduler = build(cfg)
    save_checkpoint(tmp_path, 5, [model], optimizer, scheduler, PCTX, cfg)
    iteration_dir = tmp_path / "iter_0000005"
    shutil.rmtree(iteration_dir / "mp_rank_00")
    for name in dirs:
        (iteration_dir / name).mkdir()
    with pytest.raises(GigatronError) as err:
        load_checkpoint(tmp_path, [model], optimizer, scheduler, PCTX, cfg)
    message = str(err.value)
    assert saved in message
    assert "gigatron convert-checkpoint --load" in message
    assert "--target-tensor-parallel-size 1 --target-pipeline-parallel-size 1" in message


def test_load_without_a_checkpoint_starts_from_scratch_only_when_meant(tmp_path):
    """An existing empty directory, or the --save directory (even not created yet), starts from
    scratch with one line; any other directory without a checkpoint is an error, so that a typo
    in --load never silently restarts training."""
    cfg = make_cfg()
    model, optimizer, scheduler = build(cfg)
    before = [p.detach().clone() for p in model.parameters()]
    (tmp_path / "empty").mkdir()
    cfg.checkpoint.save = str(tmp_path / "run")
    for load_dir in (tmp_path / "empty", tmp_path / "run"):
        with pytest.warns(UserWarning, match="no checkpoint there yet; starting from scratch"):
            info = load_checkpoint(load_dir, [model], optimizer, scheduler, PCTX, cfg)
        assert info["loaded"] is False and info["iteration"] == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(GigatronError, match="no such directory .and it is not the --save"):
        load_checkpoint(tmp_path / "rnu", [model], optimizer, scheduler, PCTX, cfg)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(GigatronError, match="holds no latest_checkpointed_iteration.txt"):
        load_checkpoint(tmp_path / "other", [model], optimizer, scheduler, PCTX, cfg)


def test_the_resume_line():
    loaded = {"loaded": True, "iteration": 40, "consumed_train_samples": 160, "path": "x"}
    assert torch_format.loaded_message("ckpt", loaded) == (
        "loaded checkpoint ckpt at iteration 40 (consumed samples 160)"
    )


def test_bad_tracker_is_named(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("banana")
    with pytest.raises(GigatronError, match="banana"):
        load_checkpoint(tmp_path, [nn.Linear(2, 2)], None, None, PCTX, make_cfg())


def test_release_and_finetune_load_weights_only(tmp_path):
    cfg = make_cfg()
    model, optimizer, scheduler = build(cfg)
    train(model, optimizer, scheduler, 2)
    save_checkpoint(
        tmp_path, 2, [model], optimizer, scheduler, PCTX, cfg, {"consumed_train_samples": 8}
    )
    finetune_cfg = make_cfg()
    finetune_cfg.checkpoint.finetune = True
    model2, optimizer2, scheduler2 = build(finetune_cfg, seed=3)
    info = load_checkpoint(tmp_path, [model2], optimizer2, scheduler2, PCTX, finetune_cfg)
    assert info["iteration"] == 0 and info["consumed_train_samples"] == 0
    assert torch.equal(model2.fc1.weight, model.fc1.weight)
    assert scheduler2.num_steps == 0 and not optimizer2.optimizer.state

    os.replace(tmp_path / "iter_0000002", tmp_path / "release")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    model3, optimizer3, scheduler3 = build(cfg, seed=4)
    info = load_checkpoint(tmp_path, [model3], optimizer3, scheduler3, PCTX, cfg)
    assert info["release"] and info["iteration"] == 0
    assert torch.equal(model3.fc2.weight, model.fc2.weight)
    assert scheduler3.num_steps == 0


def test_no_save_optim_needs_no_load_optim(tmp_path):
    cfg = make_cfg(bf16=True)
    cfg.checkpoint.no_save_optim = True
    cfg.checkpoint.no_save_rng = True
    model, optimizer, scheduler = build(cfg)
    save_checkpoint(tmp_path, 1, [model], optimizer, scheduler, PCTX, cfg)
    load_cfg = make_cfg(bf16=True)
    model2, optimizer2, scheduler2 = build(load_cfg, seed=2)
    with pytest.raises(GigatronError, match="weights only.*--no-load-optim --no-load-rng"):
        load_checkpoint(tmp_path, [model2], optimizer2, scheduler2, PCTX, load_cfg)
    load_cfg.checkpoint.no_load_optim = True
    with pytest.raises(GigatronError, match="--no-load-rng"):
        load_checkpoint(tmp_path, [model2], optimizer2, scheduler2, PCTX, load_cfg)
    load_cfg.checkpoint.no_load_rng = True
    info = load_checkpoint(tmp_path, [model2], optimizer2, scheduler2, PCTX, load_cfg)
    assert info["iteration"] == 1
    # the fp32 main params were refreshed from the loaded bf16 weights
    for model_param, main_param in optimizer2.param_pairs:
        assert torch.equal(main_param, model_param.float())
    assert torch.equal(model2.fc1.weight, model.fc1.weight)


def test_ckpt_step_selects_an_iteration(tmp_path):
    cfg = make_cfg()
    model, optimizer, scheduler = build(cfg)
    save_checkpoint(tmp_path, 1, [model], optimizer, scheduler, PCTX, cfg)
    at_one = copy.deepcopy(model.state_dict())
    train(model, optimizer, scheduler, 1)
    save_checkpoint(tmp_path, 2, [model], optimizer, scheduler, PCTX, cfg)
    cfg.checkpoint.ckpt_step = 1
    model2, optimizer2, scheduler2 = build(cfg, seed=8)
    assert load_checkpoint(tmp_path, [model2], optimizer2, scheduler2, PCTX, cfg)["iteration"] == 1
    assert torch.equal(model2.fc1.weight, at_one["fc1.weight"])
