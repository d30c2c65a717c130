/* ggml-cuda.h — declared only when the CUDA backend was built. */
ggml_backend_t ggml_backend_cuda_init(int device);
bool ggml_backend_is_cuda(ggml_backend_t backend);
ggml_backend_buffer_type_t ggml_backend_cuda_buffer_type(int device);
int  ggml_backend_cuda_get_device_count(void);
void ggml_backend_cuda_get_device_description(int device, char * description, size_t description_size);
void ggml_backend_cuda_get_device_memory(int device, size_t * free, size_t * total);
ggml_backend_reg_t ggml_backend_cuda_reg(void);
