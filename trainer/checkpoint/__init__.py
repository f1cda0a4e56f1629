"""Checkpoints: the safetensors file format, saving and loading, resume checks, atomic writes,
pretrained weights."""
