/* cffi declarations of the ggml API pyggml_dkv uses: ggml.h, ggml-alloc.h, ggml-backend.h,
 * ggml-cpu.h. Out-of-line API mode: the C compiler checks every declaration here against the
 * real headers, and `...` lets it fill in struct layouts and enum values. */

/* ---- ggml.h ---- */
#define GGML_MAX_DIMS 4
#define GGML_MAX_NAME ...
#define GGML_ROPE_TYPE_NEOX ...

typedef uint16_t ggml_fp16_t;
typedef struct { uint16_t bits; } ggml_bf16_t;

enum ggml_status { GGML_STATUS_ALLOC_FAILED, GGML_STATUS_FAILED, GGML_STATUS_SUCCESS, GGML_STATUS_ABORTED, ... };

enum ggml_type {
    GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_Q4_0, GGML_TYPE_Q4_1, GGML_TYPE_Q5_0, GGML_TYPE_Q5_1,
    GGML_TYPE_Q8_0, GGML_TYPE_Q8_1, GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K,
    GGML_TYPE_I8, GGML_TYPE_I16, GGML_TYPE_I32, GGML_TYPE_I64, GGML_TYPE_F64, GGML_TYPE_BF16,
    GGML_TYPE_COUNT, ...
};

enum ggml_prec { GGML_PREC_UNDEFINED, GGML_PREC_DEFAULT, GGML_PREC_F32, GGML_PREC_BF16, ... };
enum ggml_op { GGML_OP_NONE, ... };
enum ggml_log_level { GGML_LOG_LEVEL_NONE, GGML_LOG_LEVEL_DEBUG, GGML_LOG_LEVEL_INFO,
                      GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR, GGML_LOG_LEVEL_CONT, ... };

struct ggml_context;
struct ggml_cgraph;
struct ggml_backend_buffer;

struct ggml_init_params {
    size_t mem_size;
    void * mem_buffer;
    bool   no_alloc;
};

struct ggml_tensor {
    enum ggml_type type;
    struct ggml_backend_buffer * buffer;
    int64_t ne[4];
    size_t  nb[4];
    enum ggml_op op;
    int32_t flags;
    struct ggml_tensor * view_src;
    struct ggml_tensor * src[10];
    size_t view_offs;
    void * data;
    char name[...];
    void * extra;  /* set by a repacking buffer (CPU_REPACK, AMX): the tensor's kernel, NULL if none */
    ...;
};

typedef void (*ggml_log_callback)(enum ggml_log_level level, const char * text, void * user_data);
void ggml_log_set(ggml_log_callback log_callback, void * user_data);

const char * ggml_version(void);
const char * ggml_commit(void);
const char * ggml_status_to_string(enum ggml_status status);

float       ggml_fp16_to_fp32(ggml_fp16_t);
ggml_fp16_t ggml_fp32_to_fp16(float);
void ggml_fp16_to_fp32_row(const ggml_fp16_t *, float *, int64_t);
void ggml_fp32_to_fp16_row(const float *, ggml_fp16_t *, int64_t);
void ggml_bf16_to_fp32_row(const ggml_bf16_t *, float *, int64_t);
void ggml_fp32_to_bf16_row(const float *, ggml_bf16_t *, int64_t);

int64_t ggml_nelements(const struct ggml_tensor * tensor);
int64_t ggml_nrows(const struct ggml_tensor * tensor);
size_t  ggml_nbytes(const struct ggml_tensor * tensor);
int64_t ggml_blck_size(enum ggml_type type);
size_t  ggml_type_size(enum ggml_type type);
size_t  ggml_row_size(enum ggml_type type, int64_t ne);
const char * ggml_type_name(enum ggml_type type);
const char * ggml_op_desc(const struct ggml_tensor * t);
size_t  ggml_element_size(const struct ggml_tensor * tensor);
bool    ggml_is_quantized(enum ggml_type type);
bool    ggml_is_contiguous(const struct ggml_tensor * tensor);
int     ggml_n_dims(const struct ggml_tensor * tensor);
size_t  ggml_tensor_overhead(void);

struct ggml_context * ggml_init(struct ggml_init_params params);
void   ggml_free(struct ggml_context * ctx);
size_t ggml_used_mem(const struct ggml_context * ctx);
size_t ggml_get_mem_size(const struct ggml_context * ctx);
bool   ggml_get_no_alloc(struct ggml_context * ctx);

struct ggml_tensor * ggml_new_tensor_1d(struct ggml_context * ctx, enum ggml_type type, int64_t ne0);
struct ggml_tensor * ggml_new_tensor_2d(struct ggml_context * ctx, enum ggml_type type, int64_t ne0, int64_t ne1);
struct ggml_tensor * ggml_new_tensor_3d(struct ggml_context * ctx, enum ggml_type type, int64_t ne0, int64_t ne1, int64_t ne2);
struct ggml_tensor * ggml_new_tensor_4d(struct ggml_context * ctx, enum ggml_type type, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
struct ggml_tensor * ggml_get_first_tensor(const struct ggml_context * ctx);
struct ggml_tensor * ggml_get_next_tensor(const struct ggml_context * ctx, struct ggml_tensor * tensor);
struct ggml_tensor * ggml_get_tensor(struct ggml_context * ctx, const char * name);
const char *         ggml_get_name(const struct ggml_tensor * tensor);
struct ggml_tensor * ggml_set_name(struct ggml_tensor * tensor, const char * name);
void ggml_set_input(struct ggml_tensor * tensor);
void ggml_set_output(struct ggml_tensor * tensor);

/* views and layout */
struct ggml_tensor * ggml_view_1d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, size_t offset);
struct ggml_tensor * ggml_view_2d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1, size_t nb1, size_t offset);
struct ggml_tensor * ggml_view_3d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, size_t nb1, size_t nb2, size_t offset);
struct ggml_tensor * ggml_view_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3, size_t nb1, size_t nb2, size_t nb3, size_t offset);
struct ggml_tensor * ggml_reshape_2d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1);
struct ggml_tensor * ggml_reshape_3d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2);
struct ggml_tensor * ggml_reshape_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
struct ggml_tensor * ggml_permute(struct ggml_context * ctx, struct ggml_tensor * a, int axis0, int axis1, int axis2, int axis3);
struct ggml_tensor * ggml_cont(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_concat(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b, int dim);
struct ggml_tensor * ggml_repeat_4d(struct ggml_context * ctx, struct ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3);
struct ggml_tensor * ggml_pad_ext(struct ggml_context * ctx, struct ggml_tensor * a, int lp0, int rp0, int lp1, int rp1, int lp2, int rp2, int lp3, int rp3);
struct ggml_tensor * ggml_cpy(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_cast(struct ggml_context * ctx, struct ggml_tensor * a, enum ggml_type type);

/* ops */
struct ggml_tensor * ggml_mul_mat(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
/* the accumulator precision of a product or an attention (ggml_mul_mat_set_prec and
   ggml_flash_attn_ext_set_prec are deprecated aliases in ggml 0.25.3); false: the op has none */
bool ggml_prec_set_acc(struct ggml_tensor * a, enum ggml_prec prec);
struct ggml_tensor * ggml_rms_norm(struct ggml_context * ctx, struct ggml_tensor * a, float eps);
struct ggml_tensor * ggml_mul(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_add(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_sub(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);
struct ggml_tensor * ggml_silu(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_softplus(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_tanh(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_scale(struct ggml_context * ctx, struct ggml_tensor * a, float s);
struct ggml_tensor * ggml_argmax(struct ggml_context * ctx, struct ggml_tensor * a);
struct ggml_tensor * ggml_top_k(struct ggml_context * ctx, struct ggml_tensor * a, int k);
#define GGML_N_TASKS_MAX ...
typedef void (*ggml_custom_op_t)(struct ggml_tensor * dst, int ith, int nth, void * userdata);
struct ggml_tensor * ggml_custom_4d(struct ggml_context * ctx, enum ggml_type type, int64_t ne0, int64_t ne1,
                                    int64_t ne2, int64_t ne3, struct ggml_tensor ** args, int n_args,
                                    ggml_custom_op_t fun, int n_tasks, void * userdata);
struct ggml_tensor * ggml_soft_max_ext(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * mask, float scale, float max_bias);
struct ggml_tensor * ggml_rope_ext(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b, struct ggml_tensor * c,
        int n_dims, int mode, int n_ctx_orig, float freq_base, float freq_scale, float ext_factor,
        float attn_factor, float beta_fast, float beta_slow);
struct ggml_tensor * ggml_flash_attn_ext(struct ggml_context * ctx, struct ggml_tensor * q, struct ggml_tensor * k,
        struct ggml_tensor * v, struct ggml_tensor * mask, float scale, float max_bias, float logit_softcap);
struct ggml_tensor * ggml_set_rows(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b, struct ggml_tensor * c);
struct ggml_tensor * ggml_get_rows(struct ggml_context * ctx, struct ggml_tensor * a, struct ggml_tensor * b);

/* graphs */
size_t ggml_graph_overhead_custom(size_t size, bool grads);
struct ggml_cgraph * ggml_new_graph_custom(struct ggml_context * ctx, size_t size, bool grads);
void ggml_graph_add_node(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
void ggml_build_forward_expand(struct ggml_cgraph * cgraph, struct ggml_tensor * tensor);
int  ggml_graph_n_nodes(struct ggml_cgraph * cgraph);
int  ggml_graph_size(struct ggml_cgraph * cgraph);
struct ggml_tensor * ggml_graph_node(struct ggml_cgraph * cgraph, int i);

/* type traits (dequantization for reading quantized tensors back) */
typedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k);
struct ggml_type_traits {
    const char * type_name;
    int64_t      blck_size;
    size_t       type_size;
    bool         is_quantized;
    ggml_to_float_t to_float;
    ...;
};
const struct ggml_type_traits * ggml_get_type_traits(enum ggml_type type);

/* quantization */
void   ggml_quantize_init(enum ggml_type type);
bool   ggml_quantize_requires_imatrix(enum ggml_type type);
size_t ggml_quantize_chunk(enum ggml_type type, const float * src, void * dst, int64_t start,
                           int64_t nrows, int64_t n_per_row, const float * imatrix);

/* ---- ggml-backend.h ---- */
typedef struct ggml_backend_buffer_type * ggml_backend_buffer_type_t;
typedef struct ggml_backend_buffer * ggml_backend_buffer_t;
typedef struct ggml_backend * ggml_backend_t;
typedef struct ggml_backend_reg * ggml_backend_reg_t;
typedef struct ggml_backend_device * ggml_backend_dev_t;

enum ggml_backend_buffer_usage { GGML_BACKEND_BUFFER_USAGE_ANY, GGML_BACKEND_BUFFER_USAGE_WEIGHTS, GGML_BACKEND_BUFFER_USAGE_COMPUTE, ... };
enum ggml_backend_dev_type { GGML_BACKEND_DEVICE_TYPE_CPU, GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU, GGML_BACKEND_DEVICE_TYPE_ACCEL, ... };

const char *          ggml_backend_buft_name(ggml_backend_buffer_type_t buft);
ggml_backend_buffer_t ggml_backend_buft_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size);
size_t                ggml_backend_buft_get_alignment(ggml_backend_buffer_type_t buft);
bool                  ggml_backend_buft_is_host(ggml_backend_buffer_type_t buft);

const char * ggml_backend_buffer_name(ggml_backend_buffer_t buffer);
void         ggml_backend_buffer_free(ggml_backend_buffer_t buffer);
void *       ggml_backend_buffer_get_base(ggml_backend_buffer_t buffer);
size_t       ggml_backend_buffer_get_size(ggml_backend_buffer_t buffer);
void         ggml_backend_buffer_clear(ggml_backend_buffer_t buffer, uint8_t value);
bool         ggml_backend_buffer_is_host(ggml_backend_buffer_t buffer);
void         ggml_backend_buffer_set_usage(ggml_backend_buffer_t buffer, enum ggml_backend_buffer_usage usage);
ggml_backend_buffer_type_t ggml_backend_buffer_get_type(ggml_backend_buffer_t buffer);

const char * ggml_backend_name(ggml_backend_t backend);
void         ggml_backend_free(ggml_backend_t backend);
ggml_backend_buffer_type_t ggml_backend_get_default_buffer_type(ggml_backend_t backend);
ggml_backend_buffer_t      ggml_backend_alloc_buffer(ggml_backend_t backend, size_t size);
size_t                     ggml_backend_get_alignment(ggml_backend_t backend);
ggml_backend_dev_t         ggml_backend_get_device(ggml_backend_t backend);

void ggml_backend_tensor_set(struct ggml_tensor * tensor, const void * data, size_t offset, size_t size);
void ggml_backend_tensor_get(const struct ggml_tensor * tensor, void * data, size_t offset, size_t size);
void ggml_backend_tensor_set_async(ggml_backend_t backend, struct ggml_tensor * tensor, const void * data, size_t offset, size_t size);
void ggml_backend_tensor_memset(struct ggml_tensor * tensor, uint8_t value, size_t offset, size_t size);
void ggml_backend_synchronize(ggml_backend_t backend);
enum ggml_status ggml_backend_graph_compute(ggml_backend_t backend, struct ggml_cgraph * cgraph);
bool ggml_backend_supports_op(ggml_backend_t backend, const struct ggml_tensor * op);

struct ggml_backend_dev_caps { bool async; bool host_buffer; bool buffer_from_host_ptr; bool events; bool mmap_support; };
struct ggml_backend_dev_props {
    const char * name;
    const char * description;
    size_t memory_free;
    size_t memory_total;
    enum ggml_backend_dev_type type;
    const char * device_id;
    struct ggml_backend_dev_caps caps;
};
const char *               ggml_backend_dev_name(ggml_backend_dev_t device);
const char *               ggml_backend_dev_description(ggml_backend_dev_t device);
void                       ggml_backend_dev_memory(ggml_backend_dev_t device, size_t * free, size_t * total);
enum ggml_backend_dev_type ggml_backend_dev_type(ggml_backend_dev_t device);
void                       ggml_backend_dev_get_props(ggml_backend_dev_t device, struct ggml_backend_dev_props * props);
ggml_backend_reg_t         ggml_backend_dev_backend_reg(ggml_backend_dev_t device);
ggml_backend_t             ggml_backend_dev_init(ggml_backend_dev_t device, const char * params);
ggml_backend_buffer_type_t ggml_backend_dev_buffer_type(ggml_backend_dev_t device);
bool                       ggml_backend_dev_supports_op(ggml_backend_dev_t device, const struct ggml_tensor * op);

const char *       ggml_backend_reg_name(ggml_backend_reg_t reg);
size_t             ggml_backend_reg_dev_count(ggml_backend_reg_t reg);
ggml_backend_dev_t ggml_backend_reg_dev_get(ggml_backend_reg_t reg, size_t index);
size_t             ggml_backend_reg_count(void);
ggml_backend_reg_t ggml_backend_reg_get(size_t index);
ggml_backend_reg_t ggml_backend_reg_by_name(const char * name);
size_t             ggml_backend_dev_count(void);
ggml_backend_dev_t ggml_backend_dev_get(size_t index);
ggml_backend_dev_t ggml_backend_dev_by_name(const char * name);
ggml_backend_dev_t ggml_backend_buft_get_device(ggml_backend_buffer_type_t buft);
bool               ggml_backend_dev_supports_buft(ggml_backend_dev_t device, ggml_backend_buffer_type_t buft);
void *             ggml_backend_reg_get_proc_address(ggml_backend_reg_t reg, const char * name);
/* obtained with ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts") */
typedef ggml_backend_buffer_type_t * (*ggml_backend_dev_get_extra_bufts_t)(ggml_backend_dev_t device);

ggml_backend_buffer_type_t ggml_backend_cpu_buffer_type(void);

/* ---- ggml-alloc.h ---- */
typedef struct ggml_gallocr * ggml_gallocr_t;
ggml_gallocr_t ggml_gallocr_new(ggml_backend_buffer_type_t buft);
void   ggml_gallocr_free(ggml_gallocr_t galloc);
bool   ggml_gallocr_reserve(ggml_gallocr_t galloc, struct ggml_cgraph * graph);
bool   ggml_gallocr_alloc_graph(ggml_gallocr_t galloc, struct ggml_cgraph * graph);
size_t ggml_gallocr_get_buffer_size(ggml_gallocr_t galloc, int buffer_id);
size_t ggml_backend_alloc_ctx_tensors_from_buft_size(struct ggml_context * ctx, ggml_backend_buffer_type_t buft);
ggml_backend_buffer_t ggml_backend_alloc_ctx_tensors_from_buft(struct ggml_context * ctx, ggml_backend_buffer_type_t buft);
ggml_backend_buffer_t ggml_backend_alloc_ctx_tensors(struct ggml_context * ctx, ggml_backend_t backend);

/* ---- ggml-cpu.h ---- */
ggml_backend_t ggml_backend_cpu_init(void);
bool ggml_backend_is_cpu(ggml_backend_t backend);
void ggml_backend_cpu_set_n_threads(ggml_backend_t backend_cpu, int n_threads);
ggml_backend_reg_t ggml_backend_cpu_reg(void);
/* what the CPU backend was compiled for (non-zero: yes) */
int ggml_cpu_has_avx512(void);
int ggml_cpu_has_f16c(void);
int ggml_cpu_has_avx2(void);
int ggml_cpu_has_fma(void);
int ggml_cpu_has_avx_vnni(void);
int ggml_cpu_has_avx512_vnni(void);
int ggml_cpu_has_avx512_bf16(void);
int ggml_cpu_has_amx_int8(void);

/* ---- kernels.c: what of ours this build carries, and its build stamp (checked by _cffi/stamp.py) ---- */
const char * pyggml_dkv_kernels(void);
const char * pyggml_dkv_build_capabilities(void);
const char * pyggml_dkv_built_ggml_version(void);
const char * pyggml_dkv_built_variant(void);
const char * pyggml_dkv_built_ggml_build_id(void);
ggml_backend_dev_t pyggml_dkv_cpu_dkv_device(void);

/* ---- custom ops compiled into the extension (_cffi/*.c) ---- */
/* screened_argmax.c: a ggml_custom_op_t for ggml_custom_4d (pyggml_dkv/ggml/ops_screen.py) */
void pyggml_dkv_screened_argmax(struct ggml_tensor * dst, int ith, int nth, void * userdata);
/* dynamic_conv.c: DFlash-2's dynamic convolution, for ggml_custom_4d (pyggml_dkv/ggml/ops_conv.py) */
void pyggml_dkv_dynamic_conv(struct ggml_tensor * dst, int ith, int nth, void * userdata);

/* amx_tiles.c: ggml's AMX matmul tile configuration on the calling thread (1 loaded, 0 no AMX) */
int pyggml_dkv_load_ggml_matmul_tiles(void);
/* amx_tiles.c: 1 when the calling thread has used AMX tile data (a tile instruction ran on it and
   the tiles were not released since), 0 otherwise or without AMX: for tests of which kernel ran */
int pyggml_dkv_amx_tile_data_in_use(void);

/* Python-side callbacks */
extern "Python" void _pyggml_log_callback(enum ggml_log_level level, const char * text, void * user_data);
