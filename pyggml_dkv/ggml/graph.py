"""Graph: a computation graph built in a Context, computed on a Backend with the GIL released."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..common.checks import is_int
from . import liveness
from ._lowlevel import ffi, lib
from .backend import Backend
from .context import Context
from .errors import GGMLError
from .tensor import Tensor

if TYPE_CHECKING:  # pragma: no cover
    from .gallocr import Gallocr

# ggml_graph_renew_uid (our graph-uid patch, capabilities.GRAPH_UID_FIX): absent from a ggml built
# without it, where every compute over RPC sends the whole graph again
_HAS_UID = hasattr(lib, "ggml_graph_renew_uid")


class Graph:
    """A computation graph built in a Context (which must have room for it: graph_size=...)."""

    def __init__(self, ctx: Context, size: int = 2048) -> None:
        if not is_int(size) or size <= 0:
            raise ValueError(f"graph size must be a positive int, got {size!r}")
        need = lib.ggml_graph_overhead_custom(size, False)
        if ctx.used_mem + need > ctx.mem_size:
            raise GGMLError(
                f"context too small for a graph of size {size}: needs {need} more bytes; create it with graph_size={size}"
            )
        self.ctx = ctx
        self._ctxs = {ctx}  # every context holding a tensor of the graph: all must stay open
        self.size = size
        self.handle = lib.ggml_new_graph_custom(ctx.handle, size, False)
        if self.handle == ffi.NULL:
            raise GGMLError("ggml_new_graph_custom failed")
        self._seen: set[int] = set()
        self._deps: frozenset[tuple[int, int | None]] | None = None  # (buffer, token) pairs the allocated graph uses
        self._allocator: Gallocr | None = None  # the allocator that placed the intermediates (kept alive)
        # the graph's uid promises backends that it is unchanged since they last computed it (RPC
        # then resends only a recompute command): renewed at the next compute after any change
        self._uid_stale = True

    def _count_new(self, root: Tensor) -> tuple[int, set[int]]:
        """(how many, the addresses of) tensors (nodes + leafs) that expanding `root` would add, so
        we can refuse overflow."""
        new: set[int] = set()
        stack = [root.ptr]
        while stack:
            p = stack.pop()
            addr = int(ffi.cast("uintptr_t", p))
            if addr in self._seen or addr in new:
                continue
            new.add(addr)
            for i in range(10):
                s = p.src[i]
                if s != ffi.NULL:
                    stack.append(s)
        return len(new), new

    def expand(self, tensor: Tensor) -> Tensor:
        """ggml_build_forward_expand: add `tensor` and everything it depends on.

        The tensor is flagged as a graph output, so the allocator neither reuses its memory for a
        later node nor computes a later op in place over it: it can be read after compute().
        """
        self._check_ctxs()
        ctxs = {tensor.ctx, *tensor.ctx._src_ctxs}
        if any(c.closed for c in ctxs):
            raise GGMLError("tensor used after its Context (or one its ops read from) was closed")
        n_new, new = self._count_new(tensor)
        if len(self._seen) + n_new > self.size:
            raise GGMLError(
                f"graph of size {self.size} is full ({len(self._seen)} tensors + {n_new} new); build it with a larger size"
            )
        lib.ggml_set_output(tensor.ptr)
        lib.ggml_build_forward_expand(self.handle, tensor.ptr)
        self._seen |= new
        self._changed()
        self._ctxs |= ctxs
        return tensor

    def check_repacked_reads(self, backend: Backend) -> None:
        """Refuse a graph that would read repacked weights (AMX buffer) where ggml has no kernel for them.

        Only a matrix product whose matrix is the whole repacked tensor, on a CPU backend that
        accepts that product, may read one; anything else would compute on the kernel-specific
        layout and return garbage without an error.
        """
        if not liveness.repacked_buffers:
            return
        for node in self.nodes():
            p = node.ptr
            for i in range(10):
                src = p.src[i]
                if src == ffi.NULL or not liveness.reads_repacked(src):
                    continue
                name = ffi.string(src.name).decode()
                ok = (
                    node.op == "MUL_MAT"
                    and i == 0
                    and src.view_src == ffi.NULL
                    and backend.is_cpu
                    and backend.supports(node)
                )
                if not ok:
                    raise GGMLError(
                        f"{node.op} node {node.name!r} reads {name!r}, which is stored repacked (AMX, CPU_DKV_REPACK or CPU_REPACK buffer): "
                        "only a matrix product (mul_mat) of the whole tensor by contiguous f32 rows on the "
                        "CPU backend can use it; upload that tensor with repack=False"
                    )

    def _changed(self) -> None:
        """The nodes or where their tensors live changed (expand, allocation, freed buffers): the
        next compute gives the graph a new uid, so no backend replays what it kept of the old one."""
        self._uid_stale = True

    def _ctxs_open(self) -> bool:
        return not any(c.closed for c in self._ctxs)

    def _check_ctxs(self) -> None:
        self.ctx._check_open()
        if not self._ctxs_open():
            raise GGMLError("a Context holding tensors of this graph was closed")

    @property
    def n_nodes(self) -> int:
        self._check_ctxs()
        return int(lib.ggml_graph_n_nodes(self.handle))

    def node(self, i: int) -> Tensor:
        n = self.n_nodes
        if not -n <= i < n:
            raise IndexError(f"graph node {i} out of range ({n} nodes)")
        return Tensor(lib.ggml_graph_node(self.handle, i), self.ctx)

    def nodes(self) -> Iterator[Tensor]:
        for i in range(self.n_nodes):
            yield Tensor(lib.ggml_graph_node(self.handle, i), self.ctx)

    def _check_nonempty(self) -> None:
        self.ctx._check_open()
        if self.n_nodes == 0:
            raise GGMLError("graph is empty: expand() an output tensor first")

    def _tensor_ptrs(self) -> Iterator[Any]:
        """Every node, its sources and the tensors views look into (with repeats)."""
        for i in range(self.n_nodes):
            node = lib.ggml_graph_node(self.handle, i)
            for p in (node, node.view_src, *(node.src[j] for j in range(10))):
                if p != ffi.NULL:
                    yield p

    def _placements(self) -> Iterator[tuple[int, Any]]:
        for p in self._tensor_ptrs():
            if p.buffer != ffi.NULL:
                yield liveness.addr(p.buffer), p

    def _uses(self, addrs: set[int]) -> bool:
        return any(a in addrs for a, _ in self._placements())

    def _detach(self, addrs: set[int] | None) -> None:
        """Drop the data of this graph's tensors placed in the freed buffers `addrs` (None: any dead buffer)."""
        self._deps = None
        self._changed()
        if self._ctxs_open():
            liveness.detach(self._tensor_ptrs(), addrs)

    def _collect_buffers(self) -> frozenset[tuple[int, int | None]]:
        """(address, token) of every buffer the graph touches; raises if a tensor has no data (ggml would crash)."""
        self._check_nonempty()
        deps: set[tuple[int, int | None]] = set()
        for p in self._tensor_ptrs():
            if p.data == ffi.NULL or p.buffer == ffi.NULL:
                name = ffi.string(lib.ggml_get_name(p)).decode()
                raise GGMLError(
                    f"graph tensor {name!r} has no data: allocate the graph with a Gallocr "
                    "and its inputs/weights in a Buffer before computing (closing or reallocating "
                    "those drops the data)"
                )
            deps.add((liveness.addr(p.buffer), liveness.live_buffers.get(liveness.addr(p.buffer))))
        return frozenset(deps)

    def compute(self, backend: Backend) -> None:
        """ggml_backend_graph_compute, releasing the GIL. Every tensor must be allocated."""
        self._check_ctxs()
        if self._allocator is not None and self._allocator.closed:  # its intermediates were freed with it
            raise GGMLError("the Gallocr that placed this graph's tensors was closed: allocate the graph again")
        if self._deps is None:
            self._deps = self._collect_buffers()
        if any(token is None or liveness.live_buffers.get(a) != token for a, token in self._deps):
            raise GGMLError("the graph uses a backend buffer that has been closed (or reallocated by its Gallocr)")
        if self._uid_stale and _HAS_UID:
            # unchanged since: ggml's RPC client sends GRAPH_RECOMPUTE instead of the whole graph
            # (host-memory tensors moved by Tensor.place_in do not renew it: only the CPU backend
            # reads those, and it keeps no graph)
            lib.ggml_graph_renew_uid(self.handle)
            self._uid_stale = False
        with backend.lock:  # the handle is read under the lock: Backend.close() takes it too
            status = lib.ggml_backend_graph_compute(backend.handle, self.handle)
        backend.check_connection()  # RPC: a failed send is a failed connection, not just a failed compute
        if status != lib.GGML_STATUS_SUCCESS:
            raise GGMLError(f"graph compute failed: {ffi.string(lib.ggml_status_to_string(status)).decode()}")
