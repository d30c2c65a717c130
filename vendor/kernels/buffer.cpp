// The CPU_DKV extra buffer type: where our kernels will meet ggml-cpu. ggml_compute_forward asks
// every extra buffer type's get_tensor_traits(op) before its own kernels, and ggml_graph_plan asks
// their work_size; a kernel file answers for the ops whose weights (or K/V) live in this buffer.
//
// Skeleton (plan step 4): host memory like ggml's CPU buffer, readable and writable; it claims no
// op yet (supports_op false, no tensor traits), so ggml-cpu computes nothing differently and the
// package places nothing here. The kernel files fill in set_tensor (repacking by type and shape),
// supports_op and get_tensor_traits.
//
// Each kernel file names what it brings on one line, for build_ggml.sh and the extension's
// capability query (pyggml_dkv_kernels):
// Pyggml-Dkv-Capability: dkv-buffer

#include "dkv.h"

#include "ggml-backend-impl.h"
#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "traits.h"

namespace ggml::cpu::dkv {

class extra_buffer_type : ggml::cpu::extra_buffer_type {
    bool supports_op(ggml_backend_dev_t, const struct ggml_tensor *) override {
        return false;
    }

    ggml::cpu::tensor_traits * get_tensor_traits(const struct ggml_tensor *) override {
        return nullptr;
    }
};

}  // namespace ggml::cpu::dkv

static const char * ggml_backend_cpu_dkv_buffer_type_get_name(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return "CPU_DKV";
}

static ggml_backend_buffer_t ggml_backend_cpu_dkv_buffer_type_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    // ggml's CPU buffer (aligned host memory, its get / set / memset / clear), typed as ours
    ggml_backend_buffer_t buffer = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);
    if (buffer == nullptr) {
        return nullptr;
    }
    buffer->buft = buft;
    return buffer;
}

static size_t ggml_backend_cpu_dkv_buffer_type_get_alignment(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return TENSOR_ALIGNMENT;
}

ggml_backend_buffer_type_t ggml_backend_cpu_dkv_buffer_type(void) {
    static struct ggml_backend_buffer_type ggml_backend_cpu_buffer_type_dkv = {
        /* .iface    = */ {
            /* .get_name         = */ ggml_backend_cpu_dkv_buffer_type_get_name,
            /* .alloc_buffer     = */ ggml_backend_cpu_dkv_buffer_type_alloc_buffer,
            /* .get_alignment    = */ ggml_backend_cpu_dkv_buffer_type_get_alignment,
            /* .get_max_size     = */ nullptr,  // SIZE_MAX
            /* .get_alloc_size   = */ nullptr,  // ggml_nbytes
            /* .is_host          = */ nullptr,
        },
        /* .device  = */ ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0),
        /* .context = */ new ggml::cpu::dkv::extra_buffer_type(),
    };
    return &ggml_backend_cpu_buffer_type_dkv;
}
