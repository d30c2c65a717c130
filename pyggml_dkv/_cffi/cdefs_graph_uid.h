/* ggml.h of a ggml carrying our graph-uid patch (ggml_graph_renew_uid): declared only when the
   installed ggml.h has it (_cffi/build.py). */
uint64_t ggml_graph_renew_uid(struct ggml_cgraph * cgraph);
