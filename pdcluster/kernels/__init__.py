"""Hot-path kernels.  Each Triton kernel sits beside a torch reference with
the same signature; the engine calls only :mod:`pdcluster.kernels.ops`, which picks
Triton on CUDA and the torch reference elsewhere.

KV pool layout (block-major, one region per block)::

    kv_pool[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
                          K=0 / V=1
    slot = block_id * block_size + offset_in_block

An 8-bit pool (int8 or float8_e4m3fn, ``kv_cache_dtype``) has rows of
``head_dim + 2`` bytes: the payload, then its bf16 scale (pdcluster/kernels/kv_quant.py).
"""
