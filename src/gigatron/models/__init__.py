"""Models: the transformer building blocks and the GPT built from them."""

from gigatron.models.gpt import GPTModel, build_model

__all__ = ["GPTModel", "build_model"]
