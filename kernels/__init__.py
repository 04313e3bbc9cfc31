"""Paged-attention kernels: Triton on CUDA, torch references (reference.py) everywhere."""
