"""--torch-compile (models/compile.py): every kind of layer compiles into one graph, and a compiled
model (inductor) trains like the eager one and compiles only in its first iteration."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch._dynamo
from torch._inductor.compile_fx import compile_fx

from gigatron.config import parse_config
from gigatron.config.validate import finalize_config
from gigatron.families.gpt import token_losses
from gigatron.models import build_model
from gigatron.models.compile import compile_layers, compile_settings, transformer_layers
from gigatron.models.hybrid import build_model as build_hybrid
from gigatron.models.moe import MoELayer, MoESpec
from gigatron.models.moe.router import TopKRouter
from gigatron.models.transformer_config import TransformerConfig
from gigatron.parallel.context import ParallelContext, run_distributed
from gigatron.parallel.tensor_parallel import initialize_parameters

SEQ, BATCH, VOCAB = 16, 2, 128
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 --vocab-size 128"
).split()
LLAMA = (
    "--swiglu --normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
    "--group-query-attention --num-query-groups 2 --untie-embeddings-and-output-weights"
).split()
MAMBA = (
    "--hybrid-layer-pattern M* --mamba-num-heads 8 --mamba-head-dim 16 --mamba-state-dim 16 "
    "--mamba-num-groups 2 --position-embedding-type none --normalization RMSNorm"
).split()
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
MOE = (
    "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-aux-loss-coeff 0.01 "
    "--moe-z-loss-coeff 0.001"
).split()
KINDS = {
    "gpt": (build_model, []),
    "gpt-selective-recompute": (
        build_model,
        "--recompute-granularity selective --recompute-modules core_attn mlp layernorm".split(),
    ),
    "llama": (build_model, LLAMA),
    "mamba-hybrid": (build_hybrid, MAMBA),
    "moe": (build_model, MOE),
    "moe-sinkhorn": (
        build_model,
        "--num-experts 4 --moe-router-topk 1 --moe-ffn-hidden-size 32 "
        "--moe-router-load-balancing-type sinkhorn".split(),
    ),
    "moe-capacity-grouped-gemm-recompute": (
        build_model,
        [
            *MOE,
            *LLAMA,
            "--moe-expert-capacity-factor",
            "1.0",
            "--moe-grouped-gemm",
            "--moe-router-enable-expert-bias",
            "--moe-router-score-function",
            "sigmoid",
            "--recompute-granularity",
            "selective",
            "--recompute-modules",
            "moe_act",
            "mlp",
        ],
    ),
}


def _model(builder, flags: list[str]):
    torch.manual_seed(0)
    (model,) = builder(parse_config(TINY + flags), ParallelContext.single(), vocab_size=VOCAB)
    return model


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_layer_compiles_into_one_graph(kind):
    """Training mode with dropout: the dropout streams and recomputation trace too."""
    builder, flags = KINDS[kind]
    model = _model(builder, flags).train()
    rotary = None if model.rotary is None else model.rotary(torch.arange(SEQ).expand(BATCH, SEQ))
    x = torch.randn(SEQ, BATCH, 64, requires_grad=True)
    layers = transformer_layers([model])
    assert len(layers) == 2
    for layer in layers:
        with compile_settings():
            explained = torch._dynamo.explain(layer.forward)(x, None, rotary)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), (
            kind,
            type(layer).__name__,
            [b.reason for b in explained.break_reasons],
        )


def _train(model, steps: int, after_step=None) -> list[float]:
    """`steps` SGD steps on fixed random batches; the losses."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    losses = []
    for _ in range(steps):
        tokens, labels = torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=generator)
        loss = token_losses(model(tokens, positions), labels, ParallelContext.single()).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if after_step is not None:
            after_step()
    return losses


def test_compiled_llama_trains_like_eager_and_compiles_in_the_first_iteration_only():
    """Inductor, as --torch-compile runs it: losses and weights equal eager within 1e-5 over
    three steps; both layers share one compiled graph, and nothing compiles after step 1."""
    flags = LLAMA + NO_DROPOUT + ["--recompute-granularity", "selective"]
    eager, compiled = _model(build_model, flags), _model(build_model, flags)
    graphs: list[torch.fx.GraphModule] = []

    def counting_inductor(graph, example_inputs):
        graphs.append(graph)
        return compile_fx(graph, example_inputs)

    torch._dynamo.reset()
    assert compile_layers([compiled], backend=counting_inductor) == 2
    counts: list[int] = []
    compiled_losses = _train(compiled, 3, after_step=lambda: counts.append(len(graphs)))
    assert counts == [1, 1, 1]
    assert _train(eager, 3) == pytest.approx(compiled_losses, rel=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)


def test_compiled_moe_layers_train_like_eager_and_count_routing_once():
    """Inductor, full recompute of every layer: losses, weights and the routers' statistics
    equal eager's over two steps (a recomputed forward, compiled, counts nothing), one compiled
    graph serves both MoE layers, and nothing compiles after step 1."""
    flags = [
        *NO_DROPOUT,
        *MOE,
        *"--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split(),
    ]
    cfg = parse_config(TINY + flags)
    finalize_config(cfg)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        (model,) = build_model(cfg, ParallelContext.single(), vocab_size=VOCAB)
        models.append(model)
    eager, compiled = models
    graphs: list[torch.fx.GraphModule] = []

    def counting_inductor(graph, example_inputs):
        graphs.append(graph)
        return compile_fx(graph, example_inputs)

    torch._dynamo.reset()
    compile_layers([compiled], backend=counting_inductor)
    counts: list[int] = []
    compiled_losses = _train(compiled, 2, after_step=lambda: counts.append(len(graphs)))
    assert counts == [1, 1]
    assert _train(eager, 2) == pytest.approx(compiled_losses, rel=1e-5)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
    routers = [[m for m in model.modules() if isinstance(m, TopKRouter)] for model in models]
    assert len(routers[0]) == 2
    for a, b in zip(*routers):
        # Two micro-batches of 32 tokens, 2 experts each: 128 assignments counted once.
        assert a.stats.row[-4:].sum().item() == 128
        torch.testing.assert_close(b.stats.row, a.stats.row, rtol=1e-5, atol=1e-7)


def _expert_parallel_compiled_equals_eager(rank: int, world_size: int) -> None:
    cfg = parse_config(TINY + MOE + ["--expert-model-parallel-size", "2", "--disable-bias-linear"])
    spec, moe = TransformerConfig.from_config(cfg), MoESpec.from_config(cfg)
    pctx = ParallelContext.from_sizes(ep=2)
    generator = torch.Generator().manual_seed(rank)
    x, w = torch.randn(2, SEQ, BATCH, 64, generator=generator)
    for dispatcher in ("alltoall", "allgather"):
        results = []
        for compiled in (False, True):
            layer = MoELayer(spec, dataclasses.replace(moe, dispatcher=dispatcher), pctx, 1)
            initialize_parameters(layer, 5, 0, 1, pctx.ep_rank, 2, 0, 1)
            forward = layer.forward
            if compiled:
                with compile_settings():
                    explained = torch._dynamo.explain(layer.forward)(x)
                assert (explained.graph_count, explained.graph_break_count) == (1, 0), dispatcher
                layer.router.stats.pop()  # explain ran the forward once
                torch._dynamo.reset()
                forward = compile_settings()(torch.compile(forward, backend="aot_eager"))
            y = forward(x)
            (y * w).sum().backward()
            results.append([y, *(p.grad for p in layer.parameters()), layer.router.stats.pop()])
        for a, b in zip(*results):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=dispatcher)


def test_expert_parallel_moe_layer_compiles_into_one_graph_and_equals_eager():
    """ep 2 (Gloo), both dispatchers: the collectives with routing-dependent split sizes trace
    into the one graph; output, gradients and routing statistics equal eager's (aot_eager: the
    tracing is what is checked here; inductor's code generation is the tests' above)."""
    run_distributed(_expert_parallel_compiled_equals_eager, 2)
