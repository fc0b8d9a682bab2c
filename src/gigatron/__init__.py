"""gigatron: train transformer language models at any scale with Megatron-LM's flags and files."""

__version__ = "0.1.0"
