"""Shared by the GPU tests that capture the expert path in a CUDA graph."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def capture(step: Callable[[], T], *, warmup: int) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run ``step`` ``warmup`` times on a side stream (compiles, lazy allocations and workspaces happen
    outside the graph), then capture one call; returns the graph and that call's outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs
