"""Data: the .bin/.idx indexed dataset, tokenizers, preprocessing, and the training datasets.

Submodules are imported on demand (`from gigatron.data.indexed import IndexedDataset`) so that
`gigatron preprocess` never pays for torch or the model code.
"""
