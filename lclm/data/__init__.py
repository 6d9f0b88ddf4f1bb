"""Data: sources, tokenizer, packing, and the loader that feeds global batches to the mesh."""
