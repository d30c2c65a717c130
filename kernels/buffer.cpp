// The CPU_DKV extra buffer type: where our kernels meet ggml-cpu. ggml_compute_forward asks every
// extra buffer type's get_tensor_traits(op) before its own kernels, and ggml_graph_plan asks their
// work_size; this buffer type answers for the ops whose weights live in its buffers.
//
// The memory is ggml's CPU buffer, as laid out by ggml (nothing is repacked), so every op may read
// it: supports_op gives ggml's own answer, ops no kernel of ours takes run ggml's kernels on it, and
// the buffers are host memory (is_host: what reads plain rows, like pyggml_dkv's screened argmax
// over an lm_head, reads them in place).
// Kernels so far: MUL_MAT of f16 / bf16 weights by a few f32 columns (mm-narrow.h), and
// FLASH_ATTN_EXT over K/V caches here (flash-attn.h).
//
// Each kernel file names what it brings on one line, for build_ggml.sh and the extension's
// capability query (pyggml_dkv_kernels):
// Pyggml-Dkv-Capability: dkv-buffer

#include "dkv.h"
#include "flash-attn.h"
#include "mm-narrow.h"

#include "ggml-backend-impl.h"
#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "traits.h"

#include <cstdlib>
#include <cstring>

namespace ggml::cpu::dkv {

// Which arithmetic bf16 weights get (old patch 0041): vdpbf16ps multiplies twice the values of an
// FMA per instruction, but runs at half the FMA's multiply-adds on Intel's cores (Sapphire /
// Emerald Rapids, the model-167 Xeon) and at twice them on AMD's (Zen 4, Zen 5): AMD keeps
// vdpbf16ps, every other CPU takes the FMAs, which are also the only choice where AVX512-BF16 is
// missing. By the CPU's vendor, not by a timing probe, so that results never depend on how busy
// the machine was when a process started. PYGGML_DKV_BF16_PRODUCTS=fma / dpbf16 forces one
// (dpbf16 only where the CPU has it); any other value is the default (Python refuses it).
bool bf16_products_on_fma() {
    static const bool on_fma = [] {
#if defined(__AVX512BF16__) && defined(__x86_64__)
        const char * e = getenv("PYGGML_DKV_BF16_PRODUCTS");
        if (e != nullptr && strcmp(e, "fma") == 0) {
            return true;
        }
        if (e != nullptr && strcmp(e, "dpbf16") == 0) {
            return false;
        }
        unsigned int leaf, ebx, ecx, edx;
        __asm__ __volatile__("cpuid" : "=a"(leaf), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(0), "c"(0));
        const bool amd = ebx == 0x68747541u && edx == 0x69746e65u && ecx == 0x444d4163u;  // "AuthenticAMD"
        return !amd;
#else
        return true;
#endif
    }();
    return on_fma;
}

static bool in_our_buffer(const struct ggml_tensor * t) {
    return t != nullptr && t->buffer != nullptr && t->buffer->buft == ggml_backend_cpu_dkv_buffer_type();
}

static const op_kernel * narrow_kernel_for(const struct ggml_tensor * op) {
    const op_kernel * order[4] = {};
    if (op->src[0]->type == GGML_TYPE_F16) {
        order[0] = mm_f16_narrow_kernel();
    } else if (op->src[0]->type == GGML_TYPE_BF16) {
        // AMX-BF16 tiles where usable (its takes() asks), then by the CPU's vendor
        const bool fma = bf16_products_on_fma();
        order[0] = mm_bf16_amx_kernel();
        order[1] = fma ? mm_bf16_fma_kernel() : mm_bf16_dpbf16_kernel();
        order[2] = fma ? mm_bf16_dpbf16_kernel() : mm_bf16_fma_kernel();
    } else {
        return nullptr;
    }
    order[3] = mm_half_avx2_kernel();
    for (const op_kernel * k : order) {
        if (k != nullptr && k->takes(op)) {
            return k;
        }
    }
    return nullptr;
}

const op_kernel * kernel_for(const struct ggml_tensor * op) {
    // asked for every op of every graph: the cheap tests first
    if (op->op == GGML_OP_MUL_MAT && in_our_buffer(op->src[0])) {
        return narrow_kernel_for(op);
    }
    if (op->op == GGML_OP_FLASH_ATTN_EXT && in_our_buffer(op->src[1])) {
        const op_kernel * k = fa_tiled_kernel();
        return k != nullptr && k->takes(op) ? k : nullptr;
    }
    return nullptr;
}

// the ops a kernel of ours takes
class kernel_traits : public ggml::cpu::tensor_traits {
    bool work_size(int n_threads, const struct ggml_tensor * op, size_t & size) override {
        const op_kernel * k = kernel_for(op);
        if (k == nullptr) {
            return false;
        }
        size = k->work_size(n_threads, op);
        return true;
    }

    bool compute_forward(struct ggml_compute_params * params, struct ggml_tensor * op) override {
        const op_kernel * k = kernel_for(op);
        if (k == nullptr) {
            return false;
        }
        k->compute(params, op);
        return true;
    }
};

class extra_buffer_type : ggml::cpu::extra_buffer_type {
    // ggml's own answer for the op, as if our tensors were in its CPU buffer (they are laid out as
    // there): the CPU device is asked about a copy of the op whose sources in our buffers have none
    bool supports_op(ggml_backend_dev_t dev, const struct ggml_tensor * op) override {
        struct ggml_tensor copy = *op;
        struct ggml_tensor srcs[GGML_MAX_SRC];
        for (int i = 0; i < GGML_MAX_SRC; i++) {
            if (in_our_buffer(op->src[i])) {
                srcs[i] = *op->src[i];
                srcs[i].buffer = nullptr;
                copy.src[i] = &srcs[i];
            }
        }
        return ggml_backend_dev_supports_op(dev, &copy);
    }

    ggml::cpu::tensor_traits * get_tensor_traits(const struct ggml_tensor * op) override {
        if (kernel_for(op) == nullptr) {
            return nullptr;
        }
        static kernel_traits traits;
        return &traits;
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

static bool ggml_backend_cpu_dkv_buffer_type_is_host(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return true;  // laid out as in ggml's CPU buffer
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
            /* .is_host          = */ ggml_backend_cpu_dkv_buffer_type_is_host,
        },
        /* .device  = */ ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0),
        /* .context = */ new ggml::cpu::dkv::extra_buffer_type(),
    };
    return &ggml_backend_cpu_buffer_type_dkv;
}

const ggml_backend_buffer_type_t * ggml_backend_cpu_dkv_buffer_types(void) {
    static const ggml_backend_buffer_type_t bufts[] = {
        ggml_backend_cpu_dkv_buffer_type(),
        ggml_backend_cpu_dkv_repack_buffer_type(),
        nullptr,
    };
    return bufts;
}

// The CPU device, but with our buffer type: ggml's RPC server allocates every buffer from its
// device's buffer type, so a server on this device holds the weights where our kernels take them.
static const char * ggml_backend_cpu_dkv_device_get_name(ggml_backend_dev_t dev) {
    GGML_UNUSED(dev);
    return "CPU_DKV";
}

static ggml_backend_buffer_type_t ggml_backend_cpu_dkv_device_get_buffer_type(ggml_backend_dev_t dev) {
    GGML_UNUSED(dev);
    return ggml_backend_cpu_dkv_buffer_type();
}

static ggml_backend_t ggml_backend_cpu_dkv_device_init_backend(ggml_backend_dev_t dev, const char * params) {
    ggml_backend_dev_t cpu = ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0);
    ggml_backend_t backend = cpu->iface.init_backend(cpu, params);
    if (backend != nullptr) {
        backend->device = dev;  // its default buffer type: ours
    }
    return backend;
}

ggml_backend_dev_t ggml_backend_cpu_dkv_device(void) {
    static struct ggml_backend_device device = [] {
        ggml_backend_dev_t cpu = ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0);
        struct ggml_backend_device d = *cpu;  // the CPU device's functions and context
        d.iface.get_name        = ggml_backend_cpu_dkv_device_get_name;
        d.iface.get_buffer_type = ggml_backend_cpu_dkv_device_get_buffer_type;
        d.iface.init_backend    = ggml_backend_cpu_dkv_device_init_backend;
        return d;
    }();
    return &device;
}
