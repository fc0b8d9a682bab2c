"""Round-to-nearest group-wise quantization: hand-computed codes, the error bound of each format,
int4 packing, and the refusals of shapes a method cannot take."""

from __future__ import annotations

import pytest
import torch

from gigatron.errors import GigatronError
from gigatron.quantize.methods import METHODS
from gigatron.quantize.reduction import block, block_nodes, maximal_intervals, root
from gigatron.quantize.rtn import (
    check_shape,
    dequantize,
    pack_int4,
    quantize_weight,
    quantized_layer,
    unpack_int4,
)


def test_codes_and_scales_by_hand():
    weight = torch.tensor([[7.0, -2.5, 1.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    codes, scales = quantize_weight(weight, METHODS["int4-weight"], group_size=4)
    # scale = max |w| / 7 = 1: -2.5 rounds (half to even) to -2, 1.5 to 2.
    assert scales[0, 0].item() == 1.0
    assert codes[0].tolist() == [7, -2, 2, 0]
    assert codes[1].tolist() == [0, 0, 0, 0] and scales[1, 0].item() == 0.0
    codes8, scales8 = quantize_weight(weight, METHODS["int8-weight"], group_size=2)
    assert scales8[0].tolist() == pytest.approx([7 / 127, 1.5 / 127])
    assert codes8[0].tolist() == [127, -45, 127, 0]  # -2.5 x 127 / 7 = -45.36
    back = dequantize(codes, scales, torch.float32)
    assert back[0].tolist() == [7.0, -2.0, 2.0, 0.0]


@pytest.mark.parametrize("method,group", [("int8-weight", 16), ("int8-weight", 64),
                                          ("int4-weight", 8), ("int4-weight", 32)])  # fmt: skip
def test_dequantization_error_within_the_format_bound(method, group):
    torch.manual_seed(0)
    weight = torch.randn(24, 64) * torch.rand(24, 1) * 3
    codes, scales = quantize_weight(weight, METHODS[method], group)
    low, high = METHODS[method].code_range
    assert codes.min() >= low and codes.max() <= high
    assert scales.shape == (24, 64 // group)
    error = (weight - dequantize(codes, scales, torch.float32)).abs()
    bound = scales.repeat_interleave(group, dim=1) / 2  # half a step of the group's scale
    assert (error <= bound + weight.abs() * 1e-6).all()  # float32 rounding at max |w|
    # Rounding to nearest: the error is not a coarser grid's (it uses most of the bound).
    assert (error / bound).max() > 0.9
    if method == "int4-weight":
        assert torch.equal(unpack_int4(pack_int4(codes), 64), codes)
    # Quantizing the dequantized weight again gives the same codes and (to rounding) scales.
    again, rescales = quantize_weight(
        dequantize(codes, scales, torch.float32), METHODS[method], group
    )
    assert torch.equal(again, codes)
    assert torch.allclose(rescales, scales, rtol=1e-6, atol=0)


def test_int4_packing_is_two_codes_per_byte():
    codes = torch.tensor([[-8, 7, -1, 0, 3]], dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 3)
    assert packed[0].tolist() == [0x78, 0x0F, 0x03]
    assert torch.equal(unpack_int4(packed, 5), codes)


def test_only_linear_layers_of_transformer_layers_are_quantized():
    assert (
        quantized_layer("decoder.layers.3.mlp.linear_fc1.weight")
        == "decoder.layers.3.mlp.linear_fc1"
    )
    assert quantized_layer("decoder.layers.0.self_attention.linear_qkv.bias") is None
    assert quantized_layer("embedding.word_embeddings.weight") is None
    assert quantized_layer("output_layer.weight") is None
    assert quantized_layer("decoder.layers.0.input_layernorm.weight") is None


def test_shapes_the_method_cannot_take_are_refused_naming_the_layer():
    method = METHODS["int4-weight"]
    with pytest.raises(GigatronError, match=r"^decoder.layers.1.mlp.linear_fc2: 96 input features"):
        check_shape("decoder.layers.1.mlp.linear_fc2", (64, 96), 64, method, False)
    check_shape("decoder.layers.1.mlp.linear_fc2", (64, 96), 32, method, False)
    # Grouped expert weights: weight-only methods (RTN or GPTQ per expert) and fp8, not AWQ or
    # SmoothQuant (scales folded into a norm every expert shares).
    experts = "decoder.layers.0.mlp.experts.linear_fc1"
    check_shape(experts, (4, 64, 64), 32, method, False)
    check_shape(experts, (4, 64, 64), 32, method, True)
    check_shape(experts, (4, 64, 64), 64, METHODS["fp8-channel"], True)
    for name in ("int4-awq", "int8-smoothquant"):
        with pytest.raises(GigatronError, match=rf"^{experts}: .*--method {name} quantizes 2-D"):
            check_shape(experts, (4, 64, 64), 32, METHODS[name], True)
    # A Mamba mixer: weight-only methods (GPTQ too), not AWQ / SmoothQuant / fp8.
    mixer = "decoder.layers.2.mixer.in_proj"
    assert quantized_layer(f"{mixer}.weight") == mixer
    check_shape(mixer, (328, 64), 32, method, True)
    with pytest.raises(
        GigatronError, match=rf"^{mixer}: a Mamba mixer projection; --method int4-awq"
    ):
        check_shape(mixer, (328, 64), 32, METHODS["int4-awq"], True)


def test_grouped_expert_weights_quantize_each_expert_like_a_2d_weight():
    torch.manual_seed(1)
    experts = torch.randn(3, 8, 32)
    codes, scales = quantize_weight(experts, METHODS["int4-weight"], 16)
    assert codes.shape == (3, 8, 32) and scales.shape == (3, 8, 2)
    for expert in range(3):
        alone = quantize_weight(experts[expert], METHODS["int4-weight"], 16)
        assert torch.equal(codes[expert], alone[0]) and torch.equal(scales[expert], alone[1])
    back = dequantize(codes, scales, torch.float32)
    assert torch.equal(back[2], dequantize(codes[2], scales[2], torch.float32))
    assert torch.equal(unpack_int4(pack_int4(codes), 32), codes)


def test_tree_sums_split_over_blocks_are_bit_equal_to_one_block():
    """reduction.py: the nodes of any split of [0, n) into contiguous blocks build the sum one
    block gives, bit for bit, where the plain left-to-right sum of the block sums differs."""
    values = [1e16, 1.0, -1e16, 1.0, 3.0, 1e-3, 7.0, -2.5, 1e16, 0.1, -1e16, 0.7, 5.0]
    add = float.__add__
    leaf = values.__getitem__
    plain_differs = False
    for n in range(1, len(values) + 1):
        single = root(block_nodes(leaf, 0, n, add), n, add)
        for world in (2, 3, 4):
            blocks = [block(n, rank, world) for rank in range(world)]
            assert [b[0] for b in blocks[1:]] == [b[1] for b in blocks[:-1]]
            nodes = {
                k: v
                for start, stop in blocks
                for k, v in block_nodes(leaf, start, stop, add).items()
            }
            assert root(nodes, n, add) == single, (n, world)
            plain = sum(sum(values[start:stop]) for start, stop in blocks)
            plain_differs |= plain != single
    assert plain_differs
    assert maximal_intervals(3, 13) == [(3, 1), (4, 4), (8, 4), (12, 1)]
