"""One symmetric-memory workspace per EP group: token pools, combine slots and the signal words.

Legend: W EP ranks, E experts, G = E / W local experts, K top-k, H hidden, T_max tokens per rank the
workspace holds, P pool rows = min(W * T_max * min(K, G), ceil(F * T_max * K)): every row that can be
routed to one rank, capped at F (``SymmSettings.capacity_factor``, default 2) times a balanced rank's share.

Layout of the buffer (identical offsets on every rank, so a peer's address is its base + offset)::

    arrive          i32 [W]         barrier: rank s stores its op epoch into slot s of every peer
    pool_ready      i32 [W, G]      source s stores the epoch once its rows of local expert g landed
    combine_ready   i32 [W]         expert rank d stores the epoch once all its rows reached us
    counts          i32 [2, W, E]   routed-row counts, rank s writes row s (two banks: epoch parity)
    pool            bf16 [P, H]     dispatched rows, expert-major (x forward, dy backward)
    pool_weight     f32 [P]         the routing weight of each dispatched row
    combine         bf16 [K*T_max, H]  expert outputs, at the source's send position of each slot
    combine_scalar  f32 [K*T_max]   per-slot scalars back to the source (routing-weight gradients)
    stage_x         bf16 [2, T_max, H]   pull mode: this rank's rows for its peers to read (epoch parity bank)
    stage_token     i32 [2, K*T_max]     pull mode: the token of each send position
    stage_weight    f32 [2, K*T_max]     pull mode: the routing weight of each send position

Signals carry the op epoch, a counter every rank bumps once per op on the device. Every rank runs
the same sequence of ops, so epochs agree; waits compare ``>= epoch`` and nothing is ever reset from
the host (CUDA-graph replay just keeps counting). Every op starts with a barrier, so a peer never
writes into a pool or combine slot this rank may still read (the cross-layer reuse race of the
original).

Capacity: P sizes the pool and every per-layer row tensor (``h``, the activation, their gradients), so
the worst case (``capacity_factor=inf``, ``MEGAMOE_SYMM_CAPACITY=max``) costs W times a balanced rank's rows at EP = W. The
default caps it at twice a balanced share, which equals the worst case at EP = 2. Rows past the cap
are never computed silently: the layout records the largest row count a rank received, and
:func:`check_capacity` (called by ``train pretrain`` before every optimizer step, and after every op
in debug mode) raises :class:`SymmCapacityError` with the numbers before anything is updated.
"""

from __future__ import annotations

import math
import os
import uuid
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import Tensor

from megamoe.errors import InvalidConfigError, MegaMoEError
from megamoe.settings import SymmSettings

_ALIGN = 256
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
STATE_EPOCH, STATE_TILE, STATE_DONE, STATE_ERROR = 0, 1, 2, 3
"""Slots of the local state vector; 4.. hold the failed wait (rank, counter id, index, seen, expected)."""


class SymmCapacityError(MegaMoEError):
    """A rank got more tokens, or more routed rows, than the workspace was sized for."""


class SymmTimeoutError(MegaMoEError):
    """A wait in a fused kernel did not finish (debug mode)."""


@dataclass(frozen=True, slots=True)
class WorkspaceKey:
    group_name: str
    topk: int
    num_experts: int
    hidden: int
    dtype: torch.dtype


@dataclass(slots=True, weakref_slot=True)
class SymmWorkspace:
    """The symmetric buffer of one EP group plus this rank's local state (epoch, counters, errors).

    Owned by whoever allocated it (:func:`allocate_workspace`: the layers that use it, or the caller
    of the ops); the ops find it by its key while it lives, and its memory goes with its last owner.
    """

    group: dist.ProcessGroup
    key: WorkspaceKey
    rank: int
    world: int
    max_tokens: int
    pool_rows: int
    buffer: Tensor
    ptrs_dev: int
    """device address of the array of every rank's buffer base (int64 each)."""
    keepalive: tuple
    state: Tensor
    task_done: Tensor
    """per (peer, expert) task: comm programs done with it in this op (reset by the fused kernel)."""
    signal_G: Tensor
    """this op's epoch once per local expert, written by the op's barrier: broadcast mode's copy engines
    copy it into a peer's ``pool_ready[me, :]`` right after the rows (stream order), so no kernel signals."""
    received_max: Tensor
    """the most routed rows one op brought to this rank since the last :meth:`check_capacity` (device)."""
    settings: SymmSettings
    """what the workspace was allocated with, and what its launches run with."""
    programs: int | None = None
    """persistent grid of the fused kernel (default: one program per SM)."""
    trace: Tensor | None = None
    """with ``settings.trace``: the last fused launch's per-program timeline (see ``launch``)."""
    peers: list[Tensor] = field(default_factory=list)
    """every rank's whole buffer as a local uint8 tensor (broadcast mode copies into them)."""
    side_stream: object | None = None
    """broadcast mode: the stream its copies run on (CUDA)."""
    offsets: dict[str, int] = field(default_factory=dict)
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)

    @property
    def num_local_experts(self) -> int:
        return self.key.num_experts // self.world

    @property
    def dispatch(self) -> str:
        """``push``, ``pull`` or ``broadcast`` (:meth:`SymmSettings.dispatch_mode` for this group)."""
        return self.settings.dispatch_mode(self.world)

    @property
    def capacity_factor(self) -> float:
        return self.settings.capacity_factor

    def view(self, name: str, width: int | None = None) -> Tensor:
        """This rank's region ``name`` as a typed tensor; with ``width``, as rows of ``width`` elements
        packed from the region's start (:func:`narrow_rows`)."""
        shape, dtype = self.shapes[name]
        off = self.offsets[name]
        nbytes = _numel(shape) * dtype.itemsize
        return narrow_rows(self.buffer[off : off + nbytes].view(dtype).view(shape), width)

    def peer_view(self, rank: int, name: str, width: int | None = None) -> Tensor:
        """Rank ``rank``'s region ``name`` as a typed tensor this rank can copy into (``width`` as in
        :meth:`view`)."""
        shape, dtype = self.shapes[name]
        off = self.offsets[name]
        nbytes = _numel(shape) * dtype.itemsize
        return narrow_rows(self.peers[rank][off : off + nbytes].view(dtype).view(shape), width)

    def note_received(self, rows_1: Tensor) -> None:
        """Keep the largest routed-row count of an op on the device (no host sync; read by :meth:`check_capacity`)."""
        torch.maximum(self.received_max, rows_1.to(self.received_max.dtype), out=self.received_max)

    def check_capacity(self) -> None:
        """Raise if an op since the last check routed more rows to this rank than the pool holds.

        One host read (a sync): call it where the host waits anyway, e.g. before the optimizer step.
        Rows past the pool were left out of that op's outputs, so its results must not be used.
        """
        received = int(self.received_max.item())
        self.received_max.zero_()
        if received <= self.pool_rows:
            return
        share = self.max_tokens * self.key.topk
        raise SymmCapacityError(
            f"routed rows on EP rank {self.rank}",
            received,
            f"the workspace holds {self.pool_rows} rows per rank (MEGAMOE_SYMM_CAPACITY="
            f"{self.capacity_factor:g} x {self.max_tokens} tokens x top-{self.key.topk}); the rows past it "
            "were not computed, so this step's outputs and gradients are invalid",
            f"Set MEGAMOE_SYMM_CAPACITY>={received / share:.2f} (symm.capacity_factor; or 'max', the worst case: "
            f"{self.world} x the balanced share) on every rank, or balance the router",
        )

    def check(self) -> None:
        """Raise if a wait timed out or the pool overflowed (debug mode); host reads, so only in debug mode."""
        self.check_capacity()
        state = self.state.tolist()
        if state[STATE_ERROR]:
            rank, counter, index, seen, expected = state[4:9]
            raise SymmTimeoutError(
                f"{_COUNTER_NAMES.get(counter, counter)}[{index}] on EP rank {rank}",
                seen,
                f"a wait gave up (expected >= {expected}): a peer rank is stuck, crashed, or runs a "
                "different sequence of MegaMoE ops",
                "All EP ranks must call the same layers in the same order; rerun with symm.debug "
                "(MEGAMOE_SYMM_DEBUG=1) on every rank to see which wait",
            )


COUNTER_ARRIVE, COUNTER_POOL, COUNTER_COMBINE = 1, 2, 3
_COUNTER_NAMES = {COUNTER_ARRIVE: "arrive", COUNTER_POOL: "pool_ready", COUNTER_COMBINE: "combine_ready"}


def narrow_rows(region_RH: Tensor, width: int | None) -> Tensor:
    """``region_RH`` (contiguous ``[R, H]``) as ``[R, width]`` rows packed from its start, ``width <= H``:
    rows narrower than the region's (a quantised row and its scales, in the row's dtype) move through
    it at their own size, and every kernel that reads or writes them uses ``width`` as the row stride."""
    if width is None or width == region_RH.shape[1]:
        return region_RH
    rows, cols = region_RH.shape
    if not 0 < width <= cols:
        raise ValueError(f"rows of {width} elements do not fit the region's rows of {cols}")
    return region_RH.view(-1)[: rows * width].view(rows, width)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass(frozen=True, slots=True)
class BufferLayout:
    """Sizes and byte offsets of the regions (the same on every rank)."""

    world: int
    max_tokens: int
    pool_rows: int
    capacity_factor: float
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    offsets: dict[str, int]
    total_bytes: int

    @classmethod
    def build(
        cls, key: WorkspaceKey, world: int, max_tokens: int, capacity_factor: float, broadcast: bool = False
    ) -> BufferLayout:
        G = key.num_experts // world
        worst = world * max_tokens * min(key.topk, G)
        capped = worst if math.isinf(capacity_factor) else math.ceil(capacity_factor * max_tokens * key.topk)
        pool_rows = max(1, min(worst, capped))
        slots = max_tokens * key.topk
        shapes = {
            "arrive": ((world,), torch.int32),
            "pool_ready": ((world, G), torch.int32),
            "combine_ready": ((world,), torch.int32),
            "counts": ((2, world, key.num_experts), torch.int32),
            "pool": ((pool_rows, key.hidden), key.dtype),
            "pool_weight": ((pool_rows,), torch.float32),
            "combine": ((slots, key.hidden), key.dtype),
            "combine_scalar": ((slots,), torch.float32),
            "stage_x": ((2 * max_tokens, key.hidden), key.dtype),
            "stage_token": ((2 * slots,), torch.int32),
            "stage_weight": ((2 * slots,), torch.float32),
            # broadcast mode: every source's x, send-order tokens and weights, copied in by the source
            "bcast_x": ((world * max_tokens if broadcast else 0, key.hidden), key.dtype),
            "bcast_token": ((world * slots if broadcast else 0,), torch.int32),
            "bcast_weight": ((world * slots if broadcast else 0,), torch.float32),
        }
        offsets, total = {}, 0
        for name, (shape, dtype) in shapes.items():
            offsets[name] = total
            total += -(-_numel(shape) * dtype.itemsize // _ALIGN) * _ALIGN
        return cls(world, max_tokens, pool_rows, capacity_factor, shapes, offsets, total)

    def workspace(
        self,
        group,
        key: WorkspaceKey,
        rank: int,
        buffer: Tensor,
        ptrs_dev: int,
        keepalive: tuple,
        settings: SymmSettings,
        peers: list[Tensor] | None = None,
    ) -> SymmWorkspace:
        """This rank's workspace over ``buffer`` (``total_bytes``, zeroed) whose peers ``ptrs_dev`` lists."""
        return SymmWorkspace(
            group=group,
            key=key,
            rank=rank,
            world=self.world,
            max_tokens=self.max_tokens,
            pool_rows=self.pool_rows,
            buffer=buffer,
            ptrs_dev=ptrs_dev,
            keepalive=keepalive,
            state=torch.zeros(16, dtype=torch.int32, device=buffer.device),
            task_done=torch.zeros(key.num_experts, dtype=torch.int32, device=buffer.device),
            signal_G=torch.zeros(key.num_experts // self.world, dtype=torch.int32, device=buffer.device),
            received_max=torch.zeros(1, dtype=torch.int32, device=buffer.device),
            settings=settings,
            offsets=self.offsets,
            shapes=self.shapes,
            peers=peers or [],
        )


def check_capacity() -> None:
    """Raise :class:`SymmCapacityError` if any MegaMoE op since the last call routed more rows to this
    rank than its symmetric workspace holds (see the module docstring). A host sync; no-op without one."""
    for ws in list(_LIVE.values()):
        ws.check_capacity()


_LIVE: weakref.WeakValueDictionary[WorkspaceKey, SymmWorkspace] = weakref.WeakValueDictionary()
"""Every workspace alive in this process, by key: how the ops find their caller's workspace (they take
only the key, so torch.compile can trace them). Holds no reference: owners do."""
_ALLOCATED_BY_OPS: dict[WorkspaceKey, SymmWorkspace] = {}
"""Workspaces the ops allocated because no caller had one for their group and shape (kept for the
process's life, as scripts that call the ops directly expect)."""


def find_workspace(key: WorkspaceKey) -> SymmWorkspace | None:
    """The live workspace of ``key``, if any (no collective)."""
    return _LIVE.get(key)


def live_workspaces() -> list[SymmWorkspace]:
    """Every workspace alive in this process."""
    return list(_LIVE.values())


def pool_rows(key: WorkspaceKey, world: int, settings: SymmSettings) -> int:
    """The pool rows P of ``key``'s workspace: its own if it exists, else what ``settings.max_tokens``
    sizes it to, with no collective (torch.compile traces the EP path before its first step allocates
    the workspace)."""
    ws = find_workspace(key)
    if ws is not None:
        return ws.pool_rows
    if settings.max_tokens is None:
        raise InvalidConfigError(
            "symm.max_tokens (MEGAMOE_SYMM_MAX_TOKENS)",
            None,
            "torch.compile traces the EP path before its symmetric workspace exists, and the workspace's "
            "size (the largest token count over the group) is only agreed at its first eager use",
            "Set it (tokens per rank) on every rank, allocate the workspace first "
            "(megamoe.allocate_workspace, or train pretrain, which sizes it from the config), "
            "or run one step eagerly",
        )
    return BufferLayout.build(key, world, settings.max_tokens, settings.capacity_factor).pool_rows


def allocate_workspace(
    group: dist.ProcessGroup,
    *,
    max_tokens: int,
    topk: int,
    num_experts: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    settings: SymmSettings | None = None,
) -> SymmWorkspace:
    """The workspace for ``group`` and this shape, sized for ``max_tokens`` tokens per rank (a
    collective: every EP rank calls it with the same arguments).

    The caller owns the result; the ops on this group and shape use it while it lives. A live
    workspace that holds ``max_tokens`` is returned as is, so the layers of a model share one;
    ``settings`` (default :class:`SymmSettings`, with ``max_tokens`` replaced) configure a new one.
    """
    if max_tokens < 1:
        raise InvalidConfigError("max_tokens", max_tokens, "must be at least 1 token per rank")
    key = WorkspaceKey(group.group_name, topk, num_experts, hidden, dtype)
    ws = _LIVE.get(key)
    if ws is not None:
        if ws.max_tokens < max_tokens:
            raise SymmCapacityError(
                "max_tokens",
                max_tokens,
                f"a live workspace of this group and shape holds {ws.max_tokens} tokens per rank, and "
                "one group and shape has one workspace",
                "Allocate the larger one first, or drop every reference to the smaller one",
            )
        return ws
    settings = SymmSettings() if settings is None else settings
    ws = _allocate(group, key, max_tokens, device, replace(settings, max_tokens=max_tokens))
    _LIVE[key] = ws
    return ws


def get_workspace(
    group: dist.ProcessGroup,
    *,
    num_tokens: int,
    topk: int,
    num_experts: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    settings: SymmSettings,
) -> SymmWorkspace:
    """The ops' workspace: the live one of this group and shape, else one allocated now and kept (a
    collective: every EP rank must call it), sized by ``settings.max_tokens`` if set, else by the
    largest ``num_tokens`` over the group. A call with more tokens than it holds raises on that rank.
    """
    key = WorkspaceKey(group.group_name, topk, num_experts, hidden, dtype)
    ws = _LIVE.get(key)
    if ws is None:
        ws = _allocate(group, key, num_tokens, device, settings)
        _LIVE[key] = _ALLOCATED_BY_OPS[key] = ws
    if num_tokens > ws.max_tokens:
        raise SymmCapacityError(
            "tokens on this EP rank",
            num_tokens,
            f"the symmetric workspace holds {ws.max_tokens} tokens per rank; rows are never dropped, "
            "so the op refuses",
            f"Set MEGAMOE_SYMM_MAX_TOKENS>={num_tokens} (symm.max_tokens, turbo_mega_moe_symm_max_tokens) "
            "on every rank, or allocate the workspace for that many",
        )
    return ws


def _allocate(
    group: dist.ProcessGroup, key: WorkspaceKey, num_tokens: int, device: torch.device, settings: SymmSettings
) -> SymmWorkspace:
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if key.num_experts % world:
        raise MegaMoEError("num_experts", key.num_experts, f"does not split over {world} EP ranks")
    max_tokens = settings.max_tokens
    if max_tokens is None:
        bound = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(bound, op=dist.ReduceOp.MAX, group=group)
        max_tokens = int(bound.item())
    broadcast = settings.dispatch_mode(world) == "broadcast"
    layout = BufferLayout.build(key, world, max(max_tokens, 1), settings.capacity_factor, broadcast=broadcast)
    if device.type == "cuda":
        buffer, ptrs_dev, keepalive, peers = _symmetric_cuda(group, layout.total_bytes, device, broadcast)
    else:
        buffer, ptrs_dev, keepalive, peers = _shared_host(group, layout.total_bytes)
    return layout.workspace(group, key, rank, buffer, ptrs_dev, keepalive, settings, peers)


def _symmetric_cuda(
    group: dist.ProcessGroup, nbytes: int, device: torch.device, with_peers: bool
) -> tuple[Tensor, int, tuple, list[Tensor]]:
    """PyTorch symmetric memory (CUDA backend); peers are unicast loads and stores, multicast never used.
    ``with_peers``: also every rank's buffer as a local tensor (broadcast mode copies into them)."""
    import torch.distributed._symmetric_memory as symm_mem

    buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    buffer.zero_()
    handle = symm_mem.rendezvous(buffer, group.group_name)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)
    world = dist.get_world_size(group)
    peers = [handle.get_buffer(r, (nbytes,), torch.uint8) for r in range(world)] if with_peers else []
    return buffer, int(handle.buffer_ptrs_dev), (handle,), peers


def _shared_host(group: dist.ProcessGroup, nbytes: int) -> tuple[Tensor, int, tuple, list[Tensor]]:
    """The same layout in host shared memory for CPU ranks, so the kernels run under ``TRITON_INTERPRET=1``.

    Each rank creates one file under /dev/shm and maps every rank's file; the files are unlinked as
    soon as all are mapped (the mappings stay). Used by the CPU tests of the fused path.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    paths = [os.path.join(_SHM_DIR, f"megamoe-{token[0]}-{r}") for r in range(world)]
    mine = torch.from_file(paths[rank], shared=True, size=nbytes, dtype=torch.uint8)
    dist.barrier(group=group)
    maps = [
        mine if r == rank else torch.from_file(paths[r], shared=True, size=nbytes, dtype=torch.uint8)
        for r in range(world)
    ]
    dist.barrier(group=group)
    os.unlink(paths[rank])
    table = torch.tensor([m.data_ptr() for m in maps], dtype=torch.int64)
    return mine, table.data_ptr(), (maps, table), maps
