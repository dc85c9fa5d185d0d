/* lowprec.jax's CPU kernel for the tensorwise amax, an XLA FFI handler (see _native.py).
 *
 * lowprec_absmax_bits(x: f32[...]) -> s32[rows]: for each of `rows` equal row-major chunks of x (rows is the
 * result's element count: 1 for one tensor, the batch under vmap), the largest |x| as its float32 bit pattern.
 * For non-negative floats the order of the bit patterns as unsigned integers is the order of the values, and
 * every NaN sorts above inf, so one integer max gives the amax, subnormals included, and NaN as soon as one
 * element is NaN: the amax of _scaled._amax, bit for bit.  XLA's own float max reduction is not usable for this
 * (on CPU it drops NaN) and its integer one runs at a third of a copy.
 *
 * Written against the plain C API of the XLA FFI (xla/ffi/api/c_api.h, shipped with jaxlib), so that the system
 * C compiler builds it in well under a second.
 */
#include <stddef.h>
#include <stdint.h>

#include "xla/ffi/api/c_api.h"

static uint32_t absmax_chunk(const uint32_t *x, int64_t n)
{
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = x[i] & 0x7fffffffu; /* the float's bits, read as integers (see -fno-strict-aliasing) */
        m = b > m ? b : m;
    }
    return m;
}

static int64_t numel(const XLA_FFI_Buffer *b)
{
    int64_t n = 1;
    for (int64_t i = 0; i < b->rank; i++) n *= b->dims[i];
    return n;
}

/* The metadata query XLA makes when the handler is registered: the FFI API version this file was built against. */
static XLA_FFI_Error *metadata(XLA_FFI_Metadata_Extension *ext)
{
    ext->metadata->api_version.struct_size = XLA_FFI_Api_Version_STRUCT_SIZE;
    ext->metadata->api_version.extension_start = NULL;
    ext->metadata->api_version.major_version = XLA_FFI_API_MAJOR;
    ext->metadata->api_version.minor_version = XLA_FFI_API_MINOR;
    ext->metadata->traits = 0;
    return NULL;
}

XLA_FFI_Error *lowprec_absmax_bits(XLA_FFI_CallFrame *frame)
{
    if (frame->extension_start != NULL && frame->extension_start->type == XLA_FFI_Extension_Metadata)
        return metadata((XLA_FFI_Metadata_Extension *)frame->extension_start);
    if (frame->stage != XLA_FFI_ExecutionStage_EXECUTE || frame->args.size != 1 || frame->rets.size != 1)
        return NULL; /* the Python side always calls with one float32 operand and one int32 result */
    const XLA_FFI_Buffer *x = (const XLA_FFI_Buffer *)frame->args.args[0];
    XLA_FFI_Buffer *out = (XLA_FFI_Buffer *)frame->rets.rets[0];
    const int64_t rows = numel(out), n = rows > 0 ? numel(x) / rows : 0;
    const uint32_t *data = (const uint32_t *)x->data;
    uint32_t *res = (uint32_t *)out->data;
    for (int64_t r = 0; r < rows; r++) res[r] = absmax_chunk(data + r * n, n);
    return NULL;
}
