"""Kernel tests: compiled on CUDA, in Triton's numpy interpreter everywhere else.

TRITON_INTERPRET is read when a kernel is decorated, i.e. when its module is first
imported, so it is set here, before any test module of this folder imports a kernel.
Without Triton the kernel tests skip (see kernel_cases.require_triton).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
