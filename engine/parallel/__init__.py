"""Tensor parallelism on torch.distributed: NCCL on CUDA, gloo on the CPU, one code path for both.

Rank 0 is the engine's own process: it schedules, samples and hands each step's model inputs to the other
ranks (spawned processes, launcher.py), which run the same forward pass on their shard of the weights and
of the KV cache in lockstep (rank.py). The layers (layers.py): column-parallel qkv and gate_up, row-parallel
o and down with one all-reduce each, a vocabulary-parallel embedding and LM head. The loader reads only each
rank's slice of the checkpoint (loader.py); sharding.py says which slice that is.
"""
