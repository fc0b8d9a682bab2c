"""Retro's retrieval side: chunk database, embeddings, Faiss index, neighbours (docs/retro.md)."""
