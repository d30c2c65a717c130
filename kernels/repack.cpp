// The CPU_DKV_REPACK extra buffer type: weight matrices repacked for our int8 kernels as they are
// uploaded (repack.h lists the layouts), the way ggml's CPU_REPACK and AMX buffer types work. A
// repacked tensor cannot be read by any other op, so it cannot share CPU_DKV (buffer.cpp), whose
// tensors keep ggml's layout and are read by ggml's kernels too; hence a second buffer type.
//
//   init_tensor   picks the tensor's layout (the first of layouts() that fits it) into
//                 tensor->extra; a tensor no layout takes fails the allocation (status FAILED:
//                 ggml_backend_alloc_ctx_tensors_from_buft returns NULL, never a crash on upload)
//   set_tensor    repacks the whole tensor (offset 0, ggml_nbytes bytes: the only write allowed)
//   get_alloc_size  the layout's size
//   is_host       false; no get_tensor, memset_tensor or cpy_tensor
//   supports_op   MUL_MAT of such a tensor (2-D) by f32 rows that its layout's kernel takes
//   tensor traits MUL_MAT whose src0 lives here: the layout's kernel (an op it does not take
//                 aborts: ggml's kernels would read the repacked bytes as ggml's blocks)
//
// Pyggml-Dkv-Capability: dkv-repack-buffer

#include "dkv.h"
#include "repack.h"

#include "ggml-backend-impl.h"
#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "traits.h"

namespace ggml::cpu::dkv {

// the layout a tensor takes: the first that fits it, in this order (nullptr: none)
static const repack_layout * layout_for(const struct ggml_tensor * t) {
    static const repack_layout * const layouts[] = {
        vnni_q8_0_layout(), vnni_q4_0_layout(), vnni_q6_k_layout(), vnni_q4_k_layout(), vnni_q5_k_layout(),
    };
    for (const repack_layout * l : layouts) {
        if (l != nullptr && l->fits(t)) {
            return l;
        }
    }
    return nullptr;
}

static bool in_repack_buffer(const struct ggml_tensor * t) {
    return t != nullptr && t->buffer != nullptr && t->buffer->buft == ggml_backend_cpu_dkv_repack_buffer_type();
}

// the layout of an op's src0 in our buffer (nullptr: src0 is elsewhere, or MUL_MAT is not the op)
static const repack_layout * layout_of_weights(const struct ggml_tensor * op) {
    if (op->op != GGML_OP_MUL_MAT || !in_repack_buffer(op->src[0])) {
        return nullptr;
    }
    return (const repack_layout *) op->src[0]->extra;
}

class repack_traits : public ggml::cpu::tensor_traits {
    bool work_size(int n_threads, const struct ggml_tensor * op, size_t & size) override {
        const repack_layout * l = layout_of_weights(op);
        if (l == nullptr || !l->kernel.takes(op)) {
            return false;
        }
        size = l->kernel.work_size(n_threads, op);
        return true;
    }

    bool compute_forward(struct ggml_compute_params * params, struct ggml_tensor * op) override {
        const repack_layout * l = layout_of_weights(op);
        if (l == nullptr) {
            return false;
        }
        if (!l->kernel.takes(op)) {
            GGML_ABORT("pyggml_dkv: %s: no kernel takes this product of a tensor repacked for %s", op->name, l->name);
        }
        l->kernel.compute(params, op);
        return true;
    }
};

class repack_buffer_type : ggml::cpu::extra_buffer_type {
    bool supports_op(ggml_backend_dev_t dev, const struct ggml_tensor * op) override {
        GGML_UNUSED(dev);
        const repack_layout * l = layout_of_weights(op);
        if (l == nullptr || ggml_n_dims(op->src[0]) != 2) {
            return false;
        }
        if (op->src[1]->buffer != nullptr && !ggml_backend_buft_is_host(op->src[1]->buffer->buft)) {
            return false;
        }
        return l->kernel.takes(op);
    }

    ggml::cpu::tensor_traits * get_tensor_traits(const struct ggml_tensor * op) override {
        if (layout_of_weights(op) == nullptr) {
            return nullptr;
        }
        static repack_traits traits;
        return &traits;
    }
};

}  // namespace ggml::cpu::dkv

using ggml::cpu::dkv::layout_for;
using ggml::cpu::dkv::repack_layout;

static enum ggml_status ggml_backend_cpu_dkv_repack_buffer_init_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor) {
    GGML_UNUSED(buffer);
    if (tensor->view_src != nullptr) {
        return GGML_STATUS_FAILED;  // a view of repacked bytes reads nothing meaningful
    }
    const repack_layout * l = layout_for(tensor);
    if (l == nullptr) {
        return GGML_STATUS_FAILED;
    }
    tensor->extra = const_cast<repack_layout *>(l);  // ggml keeps traits there the same way (CPU_REPACK)
    return GGML_STATUS_SUCCESS;
}

static void ggml_backend_cpu_dkv_repack_buffer_set_tensor(ggml_backend_buffer_t buffer, struct ggml_tensor * tensor,
                                                          const void * data, size_t offset, size_t size) {
    GGML_UNUSED(buffer);
    GGML_ASSERT(offset == 0 && size == ggml_nbytes(tensor) && "a CPU_DKV_REPACK tensor is written whole");
    const repack_layout * l = (const repack_layout *) tensor->extra;
    GGML_ASSERT(l != nullptr);
    l->repack(tensor, data);
}

static const char * ggml_backend_cpu_dkv_repack_buffer_type_get_name(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return "CPU_DKV_REPACK";
}

static ggml_backend_buffer_t ggml_backend_cpu_dkv_repack_buffer_type_alloc_buffer(ggml_backend_buffer_type_t buft, size_t size) {
    // ggml's CPU buffer memory, typed as ours, with the repacking writes and no reads
    ggml_backend_buffer_t buffer = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);
    if (buffer == nullptr) {
        return nullptr;
    }
    buffer->buft                = buft;
    buffer->iface.init_tensor   = ggml_backend_cpu_dkv_repack_buffer_init_tensor;
    buffer->iface.set_tensor    = ggml_backend_cpu_dkv_repack_buffer_set_tensor;
    buffer->iface.memset_tensor = nullptr;
    buffer->iface.get_tensor    = nullptr;
    buffer->iface.cpy_tensor    = nullptr;
    return buffer;
}

static size_t ggml_backend_cpu_dkv_repack_buffer_type_get_alignment(ggml_backend_buffer_type_t buft) {
    GGML_UNUSED(buft);
    return TENSOR_ALIGNMENT;
}

static size_t ggml_backend_cpu_dkv_repack_buffer_type_get_alloc_size(ggml_backend_buffer_type_t buft, const struct ggml_tensor * tensor) {
    GGML_UNUSED(buft);
    const repack_layout * l = layout_for(tensor);
    return l != nullptr ? l->alloc_size(tensor) : ggml_nbytes(tensor);
}

ggml_backend_buffer_type_t ggml_backend_cpu_dkv_repack_buffer_type(void) {
    static struct ggml_backend_buffer_type ggml_backend_cpu_buffer_type_dkv_repack = {
        /* .iface    = */ {
            /* .get_name         = */ ggml_backend_cpu_dkv_repack_buffer_type_get_name,
            /* .alloc_buffer     = */ ggml_backend_cpu_dkv_repack_buffer_type_alloc_buffer,
            /* .get_alignment    = */ ggml_backend_cpu_dkv_repack_buffer_type_get_alignment,
            /* .get_max_size     = */ nullptr,  // SIZE_MAX
            /* .get_alloc_size   = */ ggml_backend_cpu_dkv_repack_buffer_type_get_alloc_size,
            /* .is_host          = */ nullptr,  // false: repacked, not ggml's layout
        },
        /* .device  = */ ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0),
        /* .context = */ new ggml::cpu::dkv::repack_buffer_type(),
    };
    return &ggml_backend_cpu_buffer_type_dkv_repack;
}
