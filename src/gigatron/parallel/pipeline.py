"""Pipeline parallelism: which layers each stage (and virtual stage) holds, and the
point-to-point exchange of activations and gradients between stages."""

from __future__ import annotations

from gigatron.errors import GigatronError


def chunk_layer_ranges(
    num_layers: int,
    pp_size: int,
    num_virtual_stages: int | None = None,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
) -> list[list[range]]:
    """Global layer indices of every model chunk: result[pp_rank][virtual_index] -> range.

    Layers go to virtual stages round-robin over pipeline ranks, as in Megatron: with pp = 2 and
    2 virtual stages of 2 layers, rank 0 holds layers [0, 1] and [4, 5], rank 1 [2, 3] and [6, 7].
    """
    vp = num_virtual_stages or 1
    if first_stage_layers is not None or last_stage_layers is not None:
        if vp > 1:
            raise GigatronError(
                "--decoder-first/last-pipeline-num-layers cannot be combined with virtual "
                "pipeline stages; drop one of them"
            )
        first = first_stage_layers
        last = last_stage_layers
        middle_stages = pp_size - (first is not None) - (last is not None)
        remaining = num_layers - (first or 0) - (last or 0)
        if (
            remaining < 0
            or (middle_stages > 0 and remaining % middle_stages)
            or (middle_stages == 0 and remaining != 0)
        ):
            raise GigatronError(
                f"--num-layers {num_layers} minus the first ({first}) and last ({last}) stage layers "
                f"leaves {remaining} layers, which do not split evenly over the other "
                f"{middle_stages} pipeline stages; change the layer counts"
            )
        per_middle = remaining // middle_stages if middle_stages else 0
        counts = [per_middle] * pp_size
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        starts = [sum(counts[:r]) for r in range(pp_size)]
        return [[range(starts[r], starts[r] + counts[r])] for r in range(pp_size)]

    stages = pp_size * vp
    if num_layers % stages:
        hint = (
            f"pipeline size {pp_size} x virtual stages {vp} = {stages}"
            if vp > 1
            else f"pipeline size {pp_size}"
        )
        raise GigatronError(
            f"--num-layers {num_layers} is not divisible by the {hint}; change --num-layers, "
            "the pipeline sizes, or give --decoder-first-pipeline-num-layers / "
            "--decoder-last-pipeline-num-layers for an uneven split"
        )
    per_stage = num_layers // stages
    return [
        [range((v * pp_size + r) * per_stage, (v * pp_size + r + 1) * per_stage) for v in range(vp)]
        for r in range(pp_size)
    ]
