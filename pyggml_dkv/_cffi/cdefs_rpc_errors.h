/* ggml-rpc.h of a ggml carrying our RPC error patch (failures as errors, not aborts; the server's
   device-type command): declared only when the installed ggml-rpc.h defines
   GGML_RPC_FAILURES_ARE_ERRORS (_cffi/build.py). */
#define GGML_RPC_EXT_CMD_DEVICE_TYPE ...
void ggml_backend_rpc_set_timeout_ms(uint32_t timeout_ms);
bool ggml_backend_rpc_failed(ggml_backend_t backend);
bool ggml_backend_rpc_buffer_failed(ggml_backend_buffer_t buffer);
