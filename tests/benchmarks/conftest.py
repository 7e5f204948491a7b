"""The benchmark scripts' kernels run in Triton's interpreter on machines without CUDA, with the same
compatibility shims as the kernel tests (tests/megamoe/conftest.py says why)."""

from tests._interpret import interpret_without_cuda

interpret_without_cuda()
