"""Triton kernels for the CUDA path: the paged KV-cache write, paged decode attention (split-K
with a reduce step) and paged prefill/extend attention, all over the project's cache layout
``[num_blocks, block_size, num_kv_heads, head_dim]`` and reading the block table directly; and
the row-wise RMSNorm (with the residual add), rotary and SiLU-and-mul; LoRA adapters' updates
per row (``lora.py``).

With ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (how the tests check what they
compute); ``aot_check`` compiles them for a GPU architecture without a GPU.
"""
