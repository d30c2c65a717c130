/* ggml-rpc.h of a ggml carrying our RPC error patch (failures as errors, not aborts): declared only
   when the installed ggml-rpc.h declares them (_cffi/build.py). */
void ggml_backend_rpc_set_timeout_ms(uint32_t timeout_ms);
bool ggml_backend_rpc_failed(ggml_backend_t backend);
bool ggml_backend_rpc_buffer_failed(ggml_backend_buffer_t buffer);
