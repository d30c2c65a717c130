/* DFlash-2's grouped dynamic causal convolution: a ggml custom op (ggml_custom_4d), compiled into
 * pyggml_dkv._ggml_cffi (docs/dflash2.md, section 1).
 *
 * For one side of one sublayer, over blocks of rows that never see each other:
 *
 *   out[c, i] = sum_{t < K, t <= i} (base[t, c] + delta[i, t, c / g]) * x[c, i - t]
 *
 * where i is a row's index within its block (taps before the block's first row read zeros), K the
 * kernel size, g the channels per group. In ggml's standard ops the per-group offsets must first be
 * repeated over their g channels (ggml_repeat copies one float at a time, on one thread) and every
 * tap is a multiply and an add of its own; here each output row is one pass over its K taps.
 *
 * Inputs (ggml order): src[0] x f32 [H, rows], packed rows; src[1] delta f32 [K * G, rows]: the
 * side's half of the kernel projection, tap-major (entry t * G + group), packed rows; src[2] base
 * f32 [H, K]: the side's base kernel, packed rows. Output: f32 [H, block, lanes] (rows = block *
 * lanes, the blocks one after another). The Python side (pyggml_dkv/ggml/ops_conv.py) checks every
 * shape and type before building the op. Rows are shared out over the threads; each row's sum runs
 * over the taps in ascending order, as the standard-op version adds them.
 */

#include <stdint.h>
#include <string.h>

#include "custom_ops.h"

void pyggml_dkv_dynamic_conv(struct ggml_tensor * dst, int ith, int nth, void * userdata) {
    (void) userdata;
    const struct ggml_tensor * x = dst->src[0];
    const struct ggml_tensor * delta = dst->src[1];
    const struct ggml_tensor * base = dst->src[2];
    const int64_t hidden = dst->ne[0];
    const int64_t block = dst->ne[1];
    const int64_t rows = block * dst->ne[2];
    const int64_t kernel = base->ne[1];
    const int64_t groups = delta->ne[0] / kernel;
    const int64_t group_size = hidden / groups;

    for (int64_t r = ith; r < rows; r += nth) {
        const int64_t in_block = r % block;
        float * out = (float *) ((char *) dst->data + r * dst->nb[1]);
        const float * offsets = (const float *) ((const char *) delta->data + r * delta->nb[1]);
        memset(out, 0, (size_t) hidden * sizeof(float));
        for (int64_t t = 0; t < kernel && t <= in_block; t++) {
            const float * xr = (const float *) ((const char *) x->data + (r - t) * x->nb[1]);
            const float * bt = (const float *) ((const char *) base->data + t * base->nb[1]);
            const float * dt = offsets + t * groups;
            for (int64_t group = 0; group < groups; group++) {
                const float d = dt[group];
                const int64_t c0 = group * group_size;
                for (int64_t c = c0; c < c0 + group_size; c++) {
                    out[c] += (bt[c] + d) * xr[c];
                }
            }
        }
    }
}
