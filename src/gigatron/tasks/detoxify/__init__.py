"""Detoxification through self-generation (SGEAT, Wang et al. 2022): `gigatron detoxify`
generate -> score -> filter, then preprocess and `pretrain gpt --finetune`, and evaluate on
RealToxicityPrompts-style prompts (docs/detoxify.md)."""
