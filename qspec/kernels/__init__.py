"""Kernels: each Triton kernel sits beside its torch reference; callers use the dispatch function."""
