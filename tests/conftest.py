"""Test-session set-up shared by every test module."""

import os

import torch

# Triton kernels run through Triton's interpreter where no GPU is (CI): it must be chosen before
# anything imports Triton (torch's compiler may, for FlexAttention), so it is chosen here.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
