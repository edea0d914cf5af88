"""Tensors: the KV cache and the model runner."""
