"""models/logits_buffer.py: the output layer's CPU product into a buffer reused across steps:
the same losses and gradients as F.linear and torch's cross entropy, the buffer lent again only
once its backward has run (or when no graph holds it), never to two graphs at once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from test_transformer import tiny_config

from gigatron.models import build_model
from gigatron.parallel.context import ParallelContext

SEQ, BATCH = 16, 2


def _model():
    torch.manual_seed(0)
    (model,) = build_model(tiny_config(), ParallelContext.single())
    return model


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(SEQ, BATCH, 64, generator=g).requires_grad_()
    return hidden, torch.randint(0, 128, (BATCH, SEQ), generator=g)


def _reference(model, hidden, labels):
    weight = model.output_weight().detach().clone().requires_grad_()
    leaf = hidden.detach().clone().requires_grad_()
    logits = F.linear(leaf, weight).transpose(0, 1)
    losses = F.cross_entropy(logits.reshape(-1, 128), labels.reshape(-1), reduction="none")
    (losses * torch.arange(losses.numel())).sum().backward()
    return losses.reshape(BATCH, SEQ).detach(), leaf.grad, weight.grad


def test_losses_and_gradients_equal_the_reference_and_the_buffer_is_reused():
    model = _model()
    assert model._logits_into_buffer(torch.zeros(1))
    lent = []
    for seed in (1, 2):
        hidden, labels = _inputs(seed)
        model.zero_grad()
        losses = model.token_losses(hidden, labels)
        lent.append(model.logits_buffer._free)  # None while the graph holds it
        (losses * torch.arange(losses.numel()).view(BATCH, SEQ)).sum().backward()
        expected = _reference(model, hidden, labels)
        actual = (losses.detach(), hidden.grad, model.output_weight().grad)
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
        lent.append(model.logits_buffer._free.data_ptr())
    assert lent[0] is None and lent[2] is None
    assert lent[1] == lent[3]  # the second step wrote into the first step's buffer


def test_graphs_in_flight_get_their_own_buffers_and_no_grad_gives_it_back():
    model = _model()
    (h1, y1), (h2, y2) = _inputs(1), _inputs(2)
    first, second = model.token_losses(h1, y1), model.token_losses(h2, y2)
    second.sum().backward()  # the later graph first, as a pipeline might
    first.sum().backward()
    for hidden, labels, losses in ((h1, y1, first), (h2, y2, second)):
        leaf = hidden.detach().clone().requires_grad_()
        logits = F.linear(leaf, model.output_weight().detach()).transpose(0, 1)
        ref = F.cross_entropy(logits.reshape(-1, 128), labels.reshape(-1), reduction="none")
        ref.sum().backward()
        torch.testing.assert_close(losses.detach().reshape(-1), ref.detach())
        torch.testing.assert_close(hidden.grad, leaf.grad)
    free = model.logits_buffer._free.data_ptr()
    with torch.no_grad():
        model.token_losses(*_inputs(3))
    assert model.logits_buffer._free.data_ptr() == free  # lent and handed back


def test_the_output_layers_hooks_still_run_and_a_replaced_output_is_not_taken():
    """LoRA, offloading and the data-parallel parameter gather hook the output layer: the
    buffer path goes through the layer's call; an output a hook replaces is not lent again."""
    model = _model()
    model.output_layer.register_forward_hook(lambda _m, _args, out: out * 2)
    hidden, labels = _inputs(1)
    losses = model.token_losses(hidden, labels)
    leaf = hidden.detach().clone().requires_grad_()
    logits = 2 * F.linear(leaf, model.output_weight().detach()).transpose(0, 1)
    ref = F.cross_entropy(logits.reshape(-1, 128), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(losses.detach().reshape(-1), ref.detach())
    losses.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(hidden.grad, leaf.grad)
    assert model.logits_buffer._free is None  # the hook's tensor held the gradient
