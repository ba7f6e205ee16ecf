"""Attention over a packed step: the step's layout, the per-step object a forward calls per layer, one file
per backend (flash-attn, PyTorch's varlen op, flex_attention, padded SDPA) and the choice among them."""
