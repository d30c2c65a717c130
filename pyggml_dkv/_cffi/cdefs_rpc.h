/* ggml-rpc.h — declared only when the RPC backend was built. */
ggml_backend_t ggml_backend_rpc_init(const char * endpoint, uint32_t device);
bool ggml_backend_is_rpc(ggml_backend_t backend);
ggml_backend_buffer_type_t ggml_backend_rpc_buffer_type(const char * endpoint, uint32_t device);
void ggml_backend_rpc_get_device_memory(const char * endpoint, uint32_t device, size_t * free, size_t * total);
void ggml_backend_rpc_start_server(const char * endpoint, const char * cache_dir, size_t n_threads, size_t n_devices, ggml_backend_dev_t * devices);
/* vendor/patches/0010-rpc-errors-not-aborts.patch */
void ggml_backend_rpc_set_timeout_ms(uint32_t timeout_ms);
bool ggml_backend_rpc_failed(ggml_backend_t backend);
bool ggml_backend_rpc_buffer_failed(ggml_backend_buffer_t buffer);
#define RPC_PROTO_MAJOR_VERSION ...
#define RPC_PROTO_MINOR_VERSION ...
#define RPC_PROTO_PATCH_VERSION ...
