"""Mixture-of-Experts throughput on the CPU, as ratios measured side by side in one run:

1. an 8-expert top-2 GPT against the dense GPT with the same active parameters (its MLP as wide
   as two experts), with the experts computed by the grouped GEMM and by the loop;
2. the alltoall against the allgather token dispatcher at expert-parallel size 2 (2 processes,
   Gloo), with the ep = 1 run on the same 2 processes (every rank holds every expert) as the
   reference.

    python benchmarks/bench_moe.py [--layers 4 --hidden 256 --seq 256 --batch 4 --rounds 5]

Forward + backward of a training step (no optimizer), fp32, dropout off, one torch thread per
process by default (a shared machine punishes spinning threads). Timed rounds alternate
between the variants so background load affects them alike; the best round of each is kept.
Prints markdown tables.
"""

from __future__ import annotations

import argparse
import time

import torch


def _config(args, moe: bool, dispatcher: str = "alltoall", grouped: bool = True, ep: int = 1):
    from gigatron.config.root import GigatronConfig
    from gigatron.config.validate import finalize_config

    cfg = GigatronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads = args.layers, args.hidden, args.heads
    m.seq_length, m.padded_vocab_size = args.seq, args.vocab
    m.swiglu, m.add_bias_linear, m.normalization = True, False, "RMSNorm"
    m.position_embedding_type = "rope"
    m.attention_dropout = m.hidden_dropout = 0.0
    # Dense: one MLP as wide as the two experts a token uses.
    m.ffn_hidden_size = args.expert_ffn * (args.topk if not moe else 1)
    if moe:
        e = cfg.moe
        e.num_experts, e.moe_router_topk = args.experts, args.topk
        e.moe_aux_loss_coeff = 1e-2
        e.moe_token_dispatcher_type, e.moe_grouped_gemm = dispatcher, grouped
        cfg.parallel.expert_model_parallel_size = ep
    finalize_config(cfg)
    return cfg


def _step(model, tokens, positions):
    logits = model(tokens, positions)
    logits.float().square().mean().backward()


def _time(variants: dict, args) -> dict[str, float]:
    """Best seconds per step of each variant (rounds alternate between variants)."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    positions = torch.arange(args.seq).expand(args.batch, args.seq)
    for model in variants.values():
        _step(model, tokens, positions)  # warm-up
    best = {name: float("inf") for name in variants}
    for _ in range(args.rounds):
        for name, model in variants.items():
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            _step(model, tokens, positions)
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def single_process(args) -> None:
    from gigatron.models import build_model
    from gigatron.models.params import count_parameters
    from gigatron.parallel.context import ParallelContext

    pctx = ParallelContext.single()
    configs = {
        "dense, same active parameters": _config(args, moe=False),
        "MoE, grouped GEMM": _config(args, moe=True, grouped=True),
        "MoE, loop over experts": _config(args, moe=True, grouped=False),
    }
    models = {name: build_model(cfg, pctx)[0] for name, cfg in configs.items()}
    used = models["MoE, grouped GEMM"].decoder.layers["0"].mlp.experts.grouped_gemm_used
    best = _time(models, args)
    tokens = args.batch * args.seq
    reference = best["dense, same active parameters"]
    print(f"\nGrouped GEMM available here: {used}\n")
    print("| model | parameters | active | tokens/s | ratio to dense |")
    print("|---|---|---|---|---|")
    for name, seconds in best.items():
        counts = count_parameters(configs[name], args.vocab)
        print(
            f"| {name} | {counts.total:,} | {counts.active:,} | {tokens / seconds:,.0f} | "
            f"{reference / seconds:.2f} |"
        )


def _distributed(rank: int, world_size: int, args) -> None:
    from gigatron.models import build_model
    from gigatron.parallel.context import ParallelContext

    torch.set_num_threads(args.threads)
    variants = {}
    for name, dispatcher, ep in (
        ("ep = 1 (every rank holds all experts)", "alltoall", 1),
        ("ep = 2, alltoall", "alltoall", 2),
        ("ep = 2, allgather", "allgather", 2),
    ):
        pctx = ParallelContext.from_sizes(ep=ep)
        variants[name] = build_model(_config(args, True, dispatcher, True, ep), pctx)[0]
    best = _time(variants, args)
    # The slower rank sets the pace.
    times = torch.tensor(list(best.values()))
    torch.distributed.all_reduce(times, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        tokens = args.batch * args.seq * world_size
        reference = float(times[0])
        print("\n| dispatcher (2 processes, Gloo) | tokens/s | ratio to ep = 1 |")
        print("|---|---|---|")
        for name, seconds in zip(best, times.tolist()):
            print(f"| {name} | {tokens / seconds:,.0f} | {reference / seconds:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--expert-ffn", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--skip-distributed", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {vars(args)}")
    single_process(args)
    if not args.skip_distributed:
        from gigatron.parallel.context import run_distributed

        run_distributed(_distributed, 2, args)


if __name__ == "__main__":
    main()
