"""The drafter on ggml: layer builders, masks, slot bookkeeping, the context-KV ring cache,
the one-shot recompute graph, the host-facing Drafter and the C-style API.
"""
