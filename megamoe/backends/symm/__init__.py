"""Expert parallelism inside one node over PyTorch symmetric memory: the token exchange fused into the
grouped GEMMs, with every routing table built on the device (no host sync, so CUDA graphs work).

* :mod:`.workspace` one symmetric buffer per EP group (pools, combine slots, counters), reused by
  every layer; :mod:`.layout` the destination layout and tile table from the exchanged counts;
  :mod:`.kernels` the Triton kernels (barrier prologue, the fused comm + GEMM kernel, waits);
  :mod:`.launch` their host launchers; :mod:`.backend` the four expert steps that string them
  together (eager); :mod:`.ops` those steps as ``torch.library`` custom ops, which the Triton backend
  calls at EP > 1 (so ``torch.compile(fullgraph=True)`` takes the layer as one graph).
"""
