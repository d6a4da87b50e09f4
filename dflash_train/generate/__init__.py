"""The target's batched generation (synth, regen, the exact eval's continuations).

``engine``: the slot engine (continuous batching on a preallocated cache, CUDA-graphed decode) and
``build_generator``; ``slot_cache``: its per-slot cache; ``decode_attention``: attention of one
decode token over each slot's live cache, GQA-native, without copies; ``sampling``: per-row seeded
draws and the padded-batch engine it replaced; ``nucleus``: their top-p draw, without a sort. Above ``models``, below ``data`` and ``eval``.
"""
