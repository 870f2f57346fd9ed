"""The DDP rescue: what apply(reducer=True) does for each DistributedDataParallel built under it.

``built`` (what runs when a DDP is built), ``reducer`` (the reducer patches and their install), ``edges`` (every
trainable parameter's hook fires once per synced backward) with ``graph``, ``counts``, ``join`` and ``outputs``,
``trainable_set`` (the trainable-set guard) and ``teardown`` (a destroyed group releases its reducer).
The reasoning: DDP_GRADIENT_CHECKPOINTING_FIX.md §4, §5, §7 and §10.
"""
