"""Attention over a compressed store: the hand-off from transformers, the PyTorch reference, decode, and the compiled backends."""
