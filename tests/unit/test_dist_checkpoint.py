"""torch_dist checkpoints in one process: the global view of local tensors (strided and expert
partitions, distributed-optimizer shards), the safe metadata reader, and an exact resume."""

from __future__ import annotations

import math
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gigatron.checkpoint import dist_format
from gigatron.checkpoint.formats import detect_format, load_checkpoint, save_checkpoint
from gigatron.checkpoint.global_view import (
    flat_range_boxes,
    pieces_of_box,
    pieces_of_flat_shard,
    tensor_layout,
)
from gigatron.errors import GigatronError
from gigatron.parallel.tensor_parallel import slice_for_rank
from helpers import EnumsByGetattr, GetattrOf


def _pctx(tp=1, tp_rank=0, ep=1, ep_rank=0, etp=None, etp_rank=None):
    return SimpleNamespace(
        tp_size=tp, tp_rank=tp_rank, ep_size=ep, ep_rank=ep_rank,
        etp_size=etp or tp, etp_rank=tp_rank if etp_rank is None else etp_rank,
    )  # fmt: skip


def _attrs(dim, stride=1, experts=False):
    t = torch.empty(0)
    t.tensor_model_parallel, t.partition_dim, t.partition_stride = dim >= 0, dim, stride
    t.expert_parallel = experts
    return t


def _assemble(full_shape, rank_tensors, attrs, pctx_of):
    """Place every rank's pieces into an empty global tensor; each element exactly once."""
    out = torch.full(full_shape, float("nan"))
    count = torch.zeros(full_shape)
    for rank, local in enumerate(rank_tensors):
        layout = tensor_layout(attrs, tuple(local.shape), pctx_of(rank))
        assert layout.global_shape == tuple(full_shape)
        for piece in pieces_of_box("w", local, (0,) * local.dim(), layout):
            where = tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.tensor.shape))
            out[where] = piece.tensor
            count[where] += 1
    assert torch.equal(count, torch.ones(full_shape))
    return out


@pytest.mark.parametrize("stride", [1, 2, (8, 4, 4)])
def test_strided_tensor_parallel_pieces_rebuild_the_full_tensor(stride):
    full = torch.randn(16, 6)
    tp = 2
    parts = [slice_for_rank(full, 0, stride, r, tp) for r in range(tp)]
    rebuilt = _assemble((16, 6), parts, _attrs(0, stride), lambda r: _pctx(tp=tp, tp_rank=r))
    assert torch.equal(rebuilt, full)


def test_expert_pieces_shift_by_the_expert_parallel_rank():
    full = torch.randn(4, 8, 6)  # 4 experts, split over ep 2, dim 1 over etp 2 (stride 2)
    ranks = [(e, t) for e in range(2) for t in range(2)]
    parts = [slice_for_rank(full.chunk(2, 0)[e], 1, 2, t, 2) for e, t in ranks]
    rebuilt = _assemble(
        (4, 8, 6), parts, _attrs(1, 2, experts=True),
        lambda r: _pctx(tp=1, ep=2, ep_rank=ranks[r][0], etp=2, etp_rank=ranks[r][1]),
    )  # fmt: skip
    assert torch.equal(rebuilt, full)


@pytest.mark.parametrize("shape", [(5, 7), (3, 4, 5), (11,)])
def test_flat_ranges_tile_into_contiguous_boxes(shape):
    numel = math.prod(shape)
    for start, end in [(0, numel), (3, numel - 2), (6, 9), (1, 2), (7, 7 + shape[-1])]:
        seen = torch.zeros(numel, dtype=torch.int64)
        for offsets, sizes, flat in flat_range_boxes(shape, start, end):
            index = torch.arange(numel).view(shape)[
                tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
            ]
            # contiguous in flat order, starting at `flat`
            assert torch.equal(index.reshape(-1), torch.arange(flat, flat + index.numel()))
            seen[index.reshape(-1)] += 1
        expected = torch.zeros(numel, dtype=torch.int64)
        expected[start:end] = 1
        assert torch.equal(seen, expected)


def test_distributed_optimizer_shard_pieces_land_at_their_global_place():
    full = torch.randn(8, 6)  # fused [gate; up] at tp 2; rank 1's local (4, 6), shard [5, 17)
    local = slice_for_rank(full, 0, 2, 1, 2)
    layout = tensor_layout(_attrs(0, 2), (4, 6), _pctx(tp=2, tp_rank=1))
    flat = local.reshape(-1)[5:17].clone()
    out = torch.full((8, 6), float("nan"))
    for piece in pieces_of_flat_shard("w", flat, (4, 6), 5, layout):
        out[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.tensor.shape))] = (
            piece.tensor
        )
    mask = torch.zeros(24, dtype=torch.bool)
    mask[5:17] = True
    placed = slice_for_rank(out, 0, 2, 1, 2).reshape(-1)
    assert torch.equal(placed[mask], local.reshape(-1)[mask])
    assert torch.isnan(placed[~mask]).all()


def test_metadata_with_foreign_objects_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(GigatronError, match="refused to load.*builtins.print"):
        dist_format.read_metadata(tmp_path)


def test_metadata_of_a_python_whose_enums_pickle_by_getattr_loads(tmp_path):
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    size = torch.Size([2, 3])
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=size)
    saved = TensorStorageMetadata(TensorProperties(dtype=torch.bfloat16), size, [chunk])
    reach = GetattrOf(torch.Size, "__init__")
    for name, value in (("ok", Metadata({"w": saved})), ("reach", reach)):
        with open(tmp_path / name, "wb") as stream:
            EnumsByGetattr(stream).dump(value)
    assert b"getattr" in (tmp_path / "ok").read_bytes()
    (tmp_path / ".metadata").write_bytes((tmp_path / "ok").read_bytes())
    loaded = dist_format.read_metadata(tmp_path).state_dict_metadata["w"]
    assert loaded.size == size and loaded.properties.dtype == torch.bfloat16
    assert loaded.properties.memory_format == torch.contiguous_format
    (tmp_path / ".metadata").write_bytes((tmp_path / "reach").read_bytes())
    with pytest.raises(GigatronError, match="getattr of '__init__' on .* is not allowed"):
        dist_format.read_metadata(tmp_path)


# ---- a tiny model, saved and resumed ------------------------------------------------------------
def _run(seed: int = 1234, precision: str = "bf16"):
    from gigatron.config.root import GigatronConfig
    from gigatron.models import build_model
    from gigatron.optim import build_optimizer
    from gigatron.optim.lr_schedule import build_lr_scheduler
    from gigatron.parallel.context import ParallelContext

    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = 2, 64, 4
    m.seq_length = m.max_position_embeddings = 16
    m.padded_vocab_size = 64
    m.hidden_dropout = m.attention_dropout = 0.0
    cfg.training.seed = seed
    cfg.training.bf16 = precision == "bf16"
    cfg.training.train_iters = 10
    cfg.training.micro_batch_size = cfg.training.global_batch_size = 2
    cfg.optimizer.lr = 1e-2
    cfg.checkpoint.ckpt_format = "torch_dist"
    pctx = ParallelContext.single()
    (model,) = build_model(cfg, pctx, vocab_size=64)
    optimizer = build_optimizer(cfg, [model], pctx)
    return cfg, pctx, model, optimizer, build_lr_scheduler(cfg, optimizer)


def _step(model, optimizer, scheduler, i: int) -> float:
    from gigatron.families.gpt import token_losses
    from gigatron.parallel.context import ParallelContext

    g = torch.Generator().manual_seed(i)
    tokens = torch.randint(0, 64, (2, 17), generator=g)
    positions = torch.arange(16).expand(2, 16)
    loss = token_losses(model(tokens[:, :-1], positions), tokens[:, 1:], ParallelContext.single())
    loss = loss.float().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step(increment=2)
    return loss.item()


def test_single_process_resume_is_bitwise(tmp_path: Path):
    cfg, pctx, model, optimizer, scheduler = _run()
    for i in range(3):
        _step(model, optimizer, scheduler, i)
    save_checkpoint(tmp_path, 3, [model], optimizer, scheduler, pctx, cfg)
    assert detect_format(tmp_path / "iter_0000003") == "torch_dist"
    reference = [_step(model, optimizer, scheduler, i) for i in range(3, 6)]

    cfg2, pctx2, model2, optimizer2, scheduler2 = _run(seed=99)
    info = load_checkpoint(tmp_path, [model2], optimizer2, scheduler2, pctx2, cfg2)
    assert info["iteration"] == 3 and info["format"] == "torch_dist"
    resumed = [_step(model2, optimizer2, scheduler2, i) for i in range(3, 6)]
    assert resumed == reference
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)

    stored = dist_format.read_full_tensors(tmp_path / "iter_0000003")
    # bf16 weights keep their fp32 main copies and both Adam moments, keyed by parameter name
    name = "decoder.layers.0.mlp.linear_fc1.weight"
    assert stored[f"model.{name}"].dtype == torch.bfloat16
    assert {f"optimizer.{k}.{name}" for k in ("fp32_param", "exp_avg", "exp_avg_sq")} <= set(stored)
    # common.pt's args: gigatron's nested configuration whose attributes are Megatron-LM's flat
    # arguments (its load_checkpoint reads args.num_layers, ...), read back with weights_only
    args = torch.load(tmp_path / "iter_0000003" / "common.pt", weights_only=True)["args"]
    assert args["model"]["num_layers"] == 2
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (2, 64, 4)
    assert (args.padded_vocab_size, args.iteration, args.params_dtype) == (64, 3, torch.bfloat16)


def test_format_mismatch_needs_auto_detect(tmp_path: Path):
    cfg, pctx, model, optimizer, scheduler = _run(precision="fp32")
    save_checkpoint(tmp_path, 1, [model], optimizer, scheduler, pctx, cfg)
    cfg.checkpoint.ckpt_format = "torch"
    with pytest.raises(GigatronError, match="holds a torch_dist checkpoint but --ckpt-format"):
        load_checkpoint(tmp_path, [model], optimizer, scheduler, pctx, cfg)
    cfg.checkpoint.auto_detect_ckpt_format = True
    assert load_checkpoint(tmp_path, [model], optimizer, scheduler, pctx, cfg)["iteration"] == 1


def test_checkpoint_flag_rules():
    from gigatron.config.root import parse_config

    with pytest.raises(GigatronError, match="--async-save works with --ckpt-format torch_dist"):
        parse_config(["--async-save"])
    with pytest.raises(GigatronError, match="--ckpt-convert-format torch converts .* give both"):
        parse_config(["--ckpt-convert-format", "torch", "--ckpt-convert-save", "out"])
    with pytest.raises(GigatronError, match="--ckpt-convert-save needs --ckpt-convert-format"):
        parse_config(["--ckpt-convert-save", "out"])
    parse_config(["--async-save", "--ckpt-format", "torch_dist"])


def test_finetune_and_missing_optimizer_state(tmp_path: Path):
    cfg, pctx, model, optimizer, scheduler = _run()
    for i in range(2):
        _step(model, optimizer, scheduler, i)
    cfg.checkpoint.no_save_optim = True
    save_checkpoint(tmp_path, 2, [model], optimizer, scheduler, pctx, cfg)
    assert not any(k.startswith("optimizer.") for k in dist_format.read_full_tensors(
        tmp_path / "iter_0000002"))  # fmt: skip

    cfg2, pctx2, model2, optimizer2, scheduler2 = _run(seed=5)
    with pytest.raises(GigatronError, match="has no optimizer state .* --no-load-optim"):
        load_checkpoint(tmp_path, [model2], optimizer2, scheduler2, pctx2, cfg2)
    cfg2.checkpoint.finetune = True
    info = load_checkpoint(tmp_path, [model2], optimizer2, scheduler2, pctx2, cfg2)
    assert info["loaded"] and info["iteration"] == 0
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b)
    # the fp32 main copies start from the loaded bf16 weights
    for param, main in optimizer2.param_pairs:
        assert torch.equal(main, param.float())


def _model_of(layers: int, strictness: str):
    cfg, pctx, model, optimizer, scheduler = _run(precision="fp32")
    if layers != 2:
        from gigatron.models import build_model

        cfg.model.num_layers = layers
        (model,) = build_model(cfg, pctx, vocab_size=64)
    cfg.checkpoint.dist_ckpt_strictness = strictness
    cfg.checkpoint.no_load_optim = cfg.checkpoint.no_load_rng = True
    return cfg, pctx, model


def test_dist_ckpt_strictness(tmp_path: Path):
    cfg, pctx, model, optimizer, scheduler = _run(precision="fp32")
    save_checkpoint(tmp_path, 1, [model], optimizer, scheduler, pctx, cfg)
    layer0 = "decoder.layers.0.mlp.linear_fc1.weight"

    # A model with a third layer: its tensors are missing from the checkpoint.
    for strictness in ("assume_ok_unexpected", "raise_unexpected", "log_unexpected"):
        cfg3, pctx3, model3 = _model_of(3, strictness)
        with pytest.raises(GigatronError, match="holds no tensor model.decoder.layers.2"):
            load_checkpoint(tmp_path, [model3], None, None, pctx3, cfg3)
    cfg3, pctx3, model3 = _model_of(3, "raise_all")
    with pytest.raises(GigatronError, match="missing: model.decoder.layers.2.*refuses it"):
        load_checkpoint(tmp_path, [model3], None, None, pctx3, cfg3)
    cfg3, pctx3, model3 = _model_of(3, "log_all")
    initial = model3.state_dict()["decoder.layers.2.mlp.linear_fc1.weight"].clone()
    with pytest.warns(UserWarning, match="missing: model.decoder.layers.2"):
        load_checkpoint(tmp_path, [model3], None, None, pctx3, cfg3)
    state = model3.state_dict()
    assert torch.equal(state[layer0], model.state_dict()[layer0])
    assert torch.equal(state["decoder.layers.2.mlp.linear_fc1.weight"], initial)

    # A one-layer model: the checkpoint's second layer is unexpected.
    cfg1, pctx1, model1 = _model_of(1, "assume_ok_unexpected")
    load_checkpoint(tmp_path, [model1], None, None, pctx1, cfg1)
    assert torch.equal(model1.state_dict()[layer0], model.state_dict()[layer0])
    cfg1, pctx1, model1 = _model_of(1, "raise_unexpected")
    with pytest.raises(GigatronError, match="unexpected: model.decoder.layers.1"):
        load_checkpoint(tmp_path, [model1], None, None, pctx1, cfg1)
    cfg1, pctx1, model1 = _model_of(1, "log_unexpected")
    with pytest.warns(UserWarning, match="unexpected: model.decoder.layers.1"):
        load_checkpoint(tmp_path, [model1], None, None, pctx1, cfg1)
