"""Checkpoint readers (GGUF, HF safetensors) and the model loader."""
