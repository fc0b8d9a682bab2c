"""GPTQ calibration (Frantar et al., 2022): each linear weight is quantized column by column,
the rounding error of each column spread over the columns not yet quantized through the inverse
Hessian H = 2 X^T X of the layer's inputs X on the user's calibration text. The inputs are the
full-precision model's (one forward pass collects every layer's H), the model runs in this
process at tensor/pipeline-parallel 1 whatever layout the checkpoint was saved in (or split
over the tensor/pipeline-parallel processes of a torchrun launch: split.py), and the sample
choice is seeded (`--seed`): the result is the same bit for bit on a machine.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gigatron.data.indexed import IndexedDataset, dataset_exists
from gigatron.data.json_lines import json_lines
from gigatron.data.tokenizers import build_run_tokenizer
from gigatron.errors import GigatronError
from gigatron.families import get_family
from gigatron.models.activation_quant import E4M3_MAX
from gigatron.models.moe.experts import GroupedExperts
from gigatron.parallel.context import ParallelContext
from gigatron.quantize.awq import awq
from gigatron.quantize.folding import Calibrated, check_foldable
from gigatron.quantize.fp8 import fp8_calibrated
from gigatron.quantize.methods import Method
from gigatron.quantize.reduction import ordered_sum
from gigatron.quantize.rtn import quantize_weight, quantized_layer
from gigatron.quantize.smoothquant import smoothquant
from gigatron.quantize.split import SplitModel, is_split, largest_over_tp, stats_on_first

EMBEDDING = "embedding.word_embeddings.weight"
DAMPING = 0.01  # of the mean diagonal of H, added to it (GPTQ's default)


def _documents(path: str, tokenizer: Any) -> list[np.ndarray]:
    if dataset_exists(path):
        data = IndexedDataset(path)
        return [np.asarray(data[i]) for i in range(len(data))]
    if not Path(path).is_file():
        raise GigatronError(f"--calib-data {path}: no such JSON-lines file or .bin/.idx prefix")
    with open(path, encoding="utf-8") as handle:
        return [
            np.asarray(tokenizer.tokenize(record["text"]), dtype=np.int64)
            for _, record in json_lines(handle, path)
            if isinstance(record, dict) and isinstance(record.get("text"), str)
        ]


def calibration_samples(path: str, tokenizer: Any, seq: int, size: int, seed: int) -> torch.Tensor:
    """`size` windows of `seq` tokens of the documents (joined by end-of-document), chosen by
    `seed`; refused when the data holds fewer."""
    eod = getattr(tokenizer, "eod", None)
    parts = [
        p for doc in _documents(path, tokenizer) for p in (doc, [eod] if eod is not None else [])
    ]
    tokens = torch.from_numpy(np.concatenate(parts).astype(np.int64)) if parts else torch.zeros(0)
    windows = len(tokens) // seq
    if windows < size:
        raise GigatronError(
            f"--calib-data {path}: {len(tokens)} tokens make {windows} windows of {seq} tokens; "
            f"--calib-size {size} needs {size * seq}; give more text or a smaller --calib-size"
        )
    order = torch.randperm(windows, generator=torch.Generator().manual_seed(seed))[:size]
    return tokens[: windows * seq].view(windows, seq)[order.sort().values]


def build_full_model(model: Any, vocab_size: int) -> torch.nn.Module:
    """The model at tp = pp = 1 with the checkpoint's weights, from a reader's FullModel."""
    cfg = copy.deepcopy(model.cfg)  # a copy is unfrozen: run it in one process
    cfg.parallel.tensor_model_parallel_size = cfg.parallel.pipeline_model_parallel_size = 1
    cfg.parallel.num_virtual_stages_per_pipeline_rank = None
    family = get_family(model.family)
    (chunk,) = family.build_model(cfg, ParallelContext.single(), vocab_size=vocab_size)
    state = chunk.state_dict()
    for name, tensor in model.source.stream():
        if name in state:
            state[name] = tensor
    chunk.load_state_dict(state, strict=True)
    return chunk.eval()


Stats = dict[str, torch.Tensor]


def merge_stats(a: Stats, b: Stats) -> Stats:
    """Two samples' statistics together: keys ending in `max` by maximum, the others summed."""
    return {
        key: torch.maximum(a[key], b[key]) if key.endswith("max") else a[key] + b[key] for key in a
    }


def sample_statistics(
    chunk: Any, samples: torch.Tensor, hooks: dict[str, Any], when: str,
    pctx: ParallelContext | None = None,
) -> Stats:  # fmt: skip
    """The statistics `hooks` (module name -> fn(record, args, output) filling `record` with
    one sample's) over `samples`, in reduction.ordered_sum's fixed order, the samples split over
    the data-parallel processes of `pctx`: bit-equal whatever their number. `chunk`: a model
    chunk, or this process's SplitModel (the hooks on its stage's modules). `when`: "post" hooks see the
    module's inputs and output, "pre" hooks its inputs."""
    record: Stats = {}

    def bind(fn: Any) -> Any:
        if when == "pre":
            return lambda _module, args: fn(record, args, None)
        return lambda _module, args, output: fn(record, args, output)

    modules = dict(chunk.named_modules())
    register = "register_forward_pre_hook" if when == "pre" else "register_forward_hook"
    handles = [getattr(modules[name], register)(bind(fn)) for name, fn in hooks.items()]

    def leaf(index: int) -> Stats:
        record.clear()
        chunk(samples[index][None, :], None)
        return dict(record)

    try:
        with torch.no_grad():
            return ordered_sum(len(samples), leaf, merge_stats, pctx or ParallelContext.single())
    finally:
        for handle in handles:
            handle.remove()


def _add(record: Stats, key: str, value: torch.Tensor) -> None:
    """Into one sample's record (a module called twice in a forward adds up, or takes the max)."""
    record[key] = merge_stats({key: record[key]}, {key: value})[key] if key in record else value


def _input_statistics(layer: str, whole: Any = None) -> Any:
    """A hook recording a layer's input statistics; `whole(x)`: its whole input (split model)."""

    def record(stats: Stats, inputs: tuple, _output: Any) -> None:
        x = inputs[0].detach() if whole is None else whole(inputs[0].detach())
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        _add(stats, f"{layer}/xtx", x.T @ x)
        _add(stats, f"{layer}/abs", x.abs().sum(dim=0))
        _add(stats, f"{layer}/absmax", x.abs().amax(dim=0))
        _add(stats, f"{layer}/count", torch.tensor(float(x.shape[0]), dtype=torch.float64))

    return record


def _expert_statistics(name: str, experts: GroupedExperts, whole: Any = None) -> Any:
    """A hook on grouped experts (`forward(x, tokens_per_expert)`, rows sorted by expert): the
    statistics of each expert's fc1 input (the tokens routed to it) and fc2 input (its
    activation of them), stacked [experts, ...]; an expert without tokens adds zeros.
    `whole(h)`: the activation's features gathered over expert tensor parallelism (split)."""
    w1, b1 = experts.linear_fc1.weight, experts.linear_fc1.bias

    def record(stats: Stats, inputs: tuple, _output: Any) -> None:
        counts = inputs[1].tolist()
        blocks = inputs[0].detach().split(counts)
        hidden = [
            experts.activation(F.linear(x, w1[e], None if b1 is None else b1[e]))
            for e, x in enumerate(blocks)
        ]
        if whole is not None:  # one gather for every expert's rows
            hidden = list(whole(torch.cat(hidden)).split(counts))
        for layer, xs in (("linear_fc1", blocks), ("linear_fc2", hidden)):
            xs = [x.to(torch.float64) for x in xs]
            key = f"{name}.{layer}"
            _add(stats, f"{key}/xtx", torch.stack([x.T @ x for x in xs]))
            _add(stats, f"{key}/abs", torch.stack([x.abs().sum(dim=0) for x in xs]))
            _add(stats, f"{key}/absmax", torch.stack([_column_max(x) for x in xs]))
            rows = torch.tensor([float(len(x)) for x in xs], dtype=torch.float64)
            _add(stats, f"{key}/count", rows)

    return record


def _column_max(x: torch.Tensor) -> torch.Tensor:
    return x.abs().amax(dim=0) if len(x) else x.new_zeros(x.shape[1])


def _per_input(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A summed statistic over its number of inputs (per expert for grouped experts; an expert
    without inputs keeps zeros)."""
    count = count.clamp(min=1).reshape(*count.shape, *[1] * (total.dim() - count.dim()))
    return total / count


def collect_statistics(
    chunk: Any, samples: torch.Tensor, pctx: ParallelContext | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(H = 2 X^T X / n in float64, mean |x|, max |x| per input feature) of every quantized
    linear layer's inputs X over `samples` (split over the processes of `pctx`; a SplitModel's
    on process 0 only)."""
    split = isinstance(chunk, SplitModel)
    hooks = {
        name: _input_statistics(
            name, (lambda x, m=module: chunk.full_input(m, x)) if split else None
        )
        for name, module in chunk.named_modules()
        if quantized_layer(f"{name}.weight") == name
    }
    for name, module in chunk.named_modules():
        if isinstance(module, GroupedExperts):
            gather = chunk.gather_expert_features if split else None
            hooks[name] = _expert_statistics(name, module, gather)
    stats = sample_statistics(chunk, samples, hooks, "post", pctx)
    if split:
        stats = stats_on_first(stats, chunk.pctx)
    layers = [key[: -len("/xtx")] for key in stats if key.endswith("/xtx")]
    count = {layer: stats[f"{layer}/count"] for layer in layers}
    hessians = {layer: 2 * _per_input(stats[f"{layer}/xtx"], count[layer]) for layer in layers}
    mean_abs = {layer: _per_input(stats[f"{layer}/abs"], count[layer]) for layer in layers}
    return hessians, mean_abs, {layer: stats[f"{layer}/absmax"] for layer in layers}


def _kv_statistics(name: str) -> Any:
    def record(stats: Stats, inputs: tuple, _output: Any) -> None:
        for key, tensor in zip(("kmax", "vmax"), inputs[1:3]):
            _add(stats, f"{name}/{key}", tensor.detach().abs().max().to(torch.float64))

    return record


def collect_kv_scales(
    chunk: Any, samples: torch.Tensor, pctx: ParallelContext | None = None
) -> dict[str, list[float]]:
    """Each core attention's [max |key| / 448, max |value| / 448] over `samples` (its fp8
    KV-cache scales; a SplitModel's on process 0 only, the maxima over all heads)."""
    hooks = {
        name: _kv_statistics(name)
        for name, _ in chunk.named_modules()
        if name.endswith("core_attention")
    }
    stats = sample_statistics(chunk, samples, hooks, "pre", pctx)
    if isinstance(chunk, SplitModel):
        largest_over_tp(stats, chunk.pctx)
        stats = stats_on_first(stats, chunk.pctx)
    names = sorted({key.rsplit("/", 1)[0] for key in stats})
    return {
        name: [max(float(stats[f"{name}/{key}"]), 1e-12) / E4M3_MAX for key in ("kmax", "vmax")]
        for name in names
    }


def collect_hessians(chunk: torch.nn.Module, samples: torch.Tensor) -> dict[str, torch.Tensor]:
    """H = 2 X^T X / n (float64) of every quantized linear layer's inputs over `samples`."""
    return collect_statistics(chunk, samples)[0]


def gptq(
    weight: torch.Tensor, hessian: torch.Tensor, method: Method, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a 2-D weight, as `rtn.quantize_weight` gives them; each group's scale
    from its updated weights when the group starts."""
    w = weight.detach().to(torch.float64).clone()
    rows, cols = w.shape
    h = hessian.clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += DAMPING * h.diagonal().mean() * torch.eye(cols, dtype=h.dtype)
    upper = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    low, high = method.code_range
    codes = torch.zeros(rows, cols, dtype=torch.int8)
    scales = torch.zeros(rows, cols // group_size, dtype=torch.float32)
    for col in range(cols):
        if col % group_size == 0:
            group = w[:, col : col + group_size].abs().amax(dim=1) / high
            scales[:, col // group_size] = group.to(torch.float32)
        scale = scales[:, col // group_size].to(torch.float64)
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(w[:, col] / safe).clamp(low, high)
        codes[:, col] = q.to(torch.int8)
        error = (w[:, col] - q * scale) / upper[col, col]
        w[:, col + 1 :] -= error[:, None] * upper[col, col + 1 :][None, :]
    return codes, scales


def calibrate(
    model: Any, method: Method, group_size: int | None, data: str, size: int, seed: int,
    kv_cache_dtype: str | None = None, pctx: ParallelContext | None = None,
) -> Calibrated:  # fmt: skip
    """GPTQ's, or the method's calibration's (AWQ, SmoothQuant, fp8), codes and scales of every
    quantized linear layer of a reader's FullModel; with `kv_cache_dtype` fp8, each attention's
    KV-cache scales too. Under torchrun (`pctx`) the samples are split over the data-parallel
    processes and their statistics summed in a fixed order (reduction.py): every process gets
    the codes one process computes, bit for bit. With tensor/pipeline-parallel sizes in `pctx`
    the model is split over those processes (split.py) and process 0 alone gets the codes."""
    if size < 1:
        raise GigatronError(f"--calib-size {size}: must be at least 1; e.g. 128")
    if method.calibration in ("awq", "smoothquant"):
        check_foldable(model.cfg.model)
    # A .bin/.idx prefix is tokenized already: a checkpoint without a tokenizer (converted from
    # Hugging Face weights alone) calibrates on it, its vocabulary the embedding's (padded) rows.
    tokenless = dataset_exists(data) and model.cfg.tokenizer.tokenizer_type is None
    tokenizer = None if tokenless else build_run_tokenizer(model.cfg)
    rows = model.source.meta(EMBEDDING).shape[0]
    vocab = tokenizer.vocab_size if tokenizer else rows
    pctx = pctx or ParallelContext.single()
    chunk = SplitModel(model, vocab, pctx) if is_split(pctx) else build_full_model(model, vocab)
    samples = calibration_samples(data, tokenizer, model.cfg.model.seq_length, size, seed)
    hessians, mean_abs, input_max = collect_statistics(chunk, samples, pctx)
    kv_cache = collect_kv_scales(chunk, samples, pctx) if kv_cache_dtype == "fp8" else None
    if is_split(pctx) and pctx.rank != 0:
        return Calibrated(layers={})  # process 0 quantizes and writes
    weights = dict(model.source.stream()) if is_split(pctx) else chunk.state_dict()
    unseen = sorted({quantized_layer(n) for n in weights} - {None} - hessians.keys())
    if unseen:  # its module is not called with its input (its weight used another way)
        raise GigatronError(
            f"{unseen[0]}: the calibration saw no input of this layer; quantize without "
            "--calib-data (round-to-nearest)"
        )
    result = _method_codes(model.cfg.model, weights, (hessians, mean_abs, input_max), method,
                           group_size)  # fmt: skip
    result.kv_cache = kv_cache or {}
    return result


def _method_codes(
    m: Any, weights: dict[str, torch.Tensor], stats: tuple, method: Method, group_size: Any
) -> Calibrated:
    hessians, mean_abs, input_max = stats
    gated = m.swiglu or m.geglu or m.quick_geglu
    exact = gated and not m.glu_linear_offset and m.activation_func_clamp_value is None
    if method.calibration == "awq":
        return awq(weights, hessians, mean_abs, method, group_size, gated_exact=exact)
    if method.calibration == "fp8":
        return fp8_calibrated(weights, input_max, list(hessians), method)
    if method.calibration == "smoothquant":
        return smoothquant(weights, input_max, list(hessians), method, gated_exact=exact)
    return Calibrated(
        layers={
            layer: gptq_layer(weights[f"{layer}.weight"], hessian, method, group_size)
            for layer, hessian in hessians.items()
        }
    )


def gptq_layer(
    weight: torch.Tensor, hessian: torch.Tensor, method: Method, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's (codes, scales) of a 2-D weight, or of grouped experts [experts, out, in] each
    with its own Hessian (an expert no calibration token reached: round-to-nearest)."""
    if weight.dim() == 2:
        return gptq(weight, hessian, method, group_size)
    parts = [
        gptq(w, h, method, group_size) if h.any() else quantize_weight(w, method, group_size)
        for w, h in zip(weight, hessian)
    ]
    return torch.stack([c for c, _ in parts]), torch.stack([s for _, s in parts])
