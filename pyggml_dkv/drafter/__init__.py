"""The drafter on ggml: its weights uploaded to a backend, layer builders, masks, slot
bookkeeping, the context-KV ring cache, the one-shot recompute graph, the host-facing Drafter and
the C-style API.
"""
