"""Parallelism: the rank layout, collectives, and one module per parallel dimension."""

from gigatron.parallel.context import Grid, ParallelContext

__all__ = ["Grid", "ParallelContext"]
