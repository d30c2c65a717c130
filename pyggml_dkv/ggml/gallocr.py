"""Gallocr: ggml's graph allocator, placing a graph's intermediate tensors in one reusable buffer."""

from __future__ import annotations

import functools
import weakref
from typing import Any

from . import liveness
from ._lowlevel import ffi, lib
from .backend import Backend
from .errors import GGMLError
from .graph import Graph
from .owned import Owned


class Gallocr(Owned):
    """ggml's graph allocator: places a graph's intermediate tensors in one reusable buffer."""

    def __init__(self, backend: Backend) -> None:
        handle = lib.ggml_gallocr_new(backend.buffer_type)
        if handle == ffi.NULL:
            raise GGMLError("ggml_gallocr_new failed")
        self._buffers: set[int] = set()  # ggml buffers this allocator owns (shared with the finalizer)
        self._graphs: weakref.WeakSet[Graph] = weakref.WeakSet()  # graphs placed in them
        self._own(
            handle, functools.partial(Gallocr._free_handle, buffers=self._buffers, graphs=self._graphs), "gallocr"
        )
        self.backend = backend
        self.n_allocs = 0

    @staticmethod
    def _release(buffers: set[int], graphs: Any, keep: Graph | None = None) -> None:
        """ggml freed `buffers`: detach the tensors every graph (but `keep`) had placed in them."""
        for g in list(graphs):
            if g is not keep:
                g._detach(buffers)
        for a in buffers:
            liveness.live_buffers.pop(a, None)
        buffers.clear()

    @staticmethod
    def _free_handle(handle: Any, buffers: set[int], graphs: Any) -> None:
        Gallocr._release(buffers, graphs)
        lib.ggml_gallocr_free(handle)

    @property
    def handle(self) -> Any:
        self._check_open()
        return self._handle

    def reserve(self, graph: Graph) -> None:
        """Size the buffer for `graph` (and graphs no larger) without assigning addresses."""
        graph._check_nonempty()
        before = self.buffer_size
        ok = lib.ggml_gallocr_reserve(self.handle, graph.handle)
        if self.buffer_size != before:  # ggml freed the old buffer (and maybe made a bigger one)
            Gallocr._release(self._buffers, self._graphs)
        if not ok:
            raise GGMLError("ggml_gallocr_reserve failed (out of memory?)")

    def alloc_graph(self, graph: Graph) -> None:
        """Assign every intermediate tensor of `graph` an address in this allocator's buffer."""
        graph._check_nonempty()
        graph.check_repacked_reads(self.backend)
        handle = self.handle
        for _ in range(2):
            before = self.buffer_size
            placed_before = graph._uses(self._buffers)
            ok = lib.ggml_gallocr_alloc_graph(handle, graph.handle)
            if self.buffer_size == before:
                break
            # ggml freed the old buffer: every tensor it held is gone, in other graphs and in this one
            Gallocr._release(self._buffers, self._graphs, keep=graph)
            if not (ok and placed_before):
                break
            graph._detach(None)  # part of this graph sat in the freed buffer: place all of it again
        if not ok:
            raise GGMLError("ggml_gallocr_alloc_graph failed (out of memory?)")
        self.n_allocs += 1
        # record where this graph's tensors now live (a new allocation gets a new token)
        own = {a for a, _ in graph._placements()} - (liveness.live_buffers.keys() - self._buffers)
        for a in own - self._buffers:
            liveness.live_buffers[a] = liveness.new_token()
        self._buffers.update(own)
        self._graphs.add(graph)
        graph._deps = None
        graph._changed()  # its intermediates may sit elsewhere now
        graph._allocator = self  # the graph's intermediates live in our buffer: keep it alive
        try:  # remember the allocations the graph uses now, so a later free + address reuse is caught
            graph._deps = graph._collect_buffers()
        except GGMLError:
            pass  # a tensor still has no data: compute() will say so

    @property
    def buffer_size(self) -> int:
        return int(lib.ggml_gallocr_get_buffer_size(self.handle, 0))
