"""Downstream tasks: zero-shot evaluation (WikiText, LAMBADA), fine-tuning (GLUE, RACE),
supervised fine-tuning data, and the scoring they share (docs/evaluation.md)."""
