"""Adapters that let other tools run on gigatron checkpoints (lm_eval.py: lm-evaluation-harness)."""
