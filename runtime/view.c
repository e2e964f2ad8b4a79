/* view.c — reading an engine's K/V tensor views (struct kvcap_tensor_view, kvcap.h): rows as
 * f32 through the optional page table, the checks of dtype and strides, and of their values. */
#include <math.h>
#include <stdlib.h>

#include "kernels/load.h"
#include "runtime/cache_internal.h"

static const void *view_row(const struct kvcap_tensor_view *v, int head, int token)
{
    size_t esize = kvcap_dtype_size(v->dtype);
    if (v->pages) {
        const char *page = v->pages[token / v->page_size];
        return page + ((int64_t)head * v->head_stride +
                       (int64_t)(token % v->page_size) * v->token_stride) * (int64_t)esize;
    }
    return (const char *)v->base +
           ((int64_t)head * v->head_stride + (int64_t)token * v->token_stride) * (int64_t)esize;
}

void kvcap_view_read(const struct kvcap_tensor_view *v, int head, int t0, int n, int d, float *dst)
{
    for (int j = 0; j < n; j++)
        kvcap_load_f32(v->dtype, view_row(v, head, t0 + j), (size_t)d, dst + (size_t)j * d);
}

enum kvcap_status kvcap_view_check(const struct kvcap_tensor_view *v, const char *what, int heads,
                                   int n, int d)
{
    KVCAP_RETURN_IF(!v, KVCAP_ERR_INVALID_ARGUMENT, "%s: NULL view", what);
    KVCAP_RETURN_IF(!kvcap_dtype_is_storage(v->dtype), KVCAP_ERR_INVALID_ARGUMENT,
                    "%s.dtype: %s is not F32, F16 or BF16", what, kvcap_dtype_name(v->dtype));
    KVCAP_RETURN_IF(!v->base && !v->pages, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: neither base nor pages given", what);
    KVCAP_RETURN_IF(v->pages && v->page_size < 1, KVCAP_ERR_INVALID_ARGUMENT,
                    "%s.page_size: %d, need >= 1 with pages", what, v->page_size);
    KVCAP_RETURN_IF(v->head_stride < 0 || v->token_stride < 0 ||
                        (heads > 1 && v->head_stride < d && v->token_stride < d) ||
                        (n > 1 && v->token_stride == 0) || (heads > 1 && v->head_stride == 0),
                    KVCAP_ERR_INVALID_ARGUMENT,
                    "%s: strides (head %lld, token %lld) overlap rows of %d channels", what,
                    (long long)v->head_stride, (long long)v->token_stride, d);
    return KVCAP_OK;
}

/* NaN or Inf in what an engine hands over would flow through every policy and come back as
 * finite-looking outputs with status OK (a softmax drops it, or zeros it): refuse it here,
 * naming the argument and where. Host views only (a device cache's views are device memory). */
enum kvcap_status kvcap_view_check_finite(const struct kvcap_tensor_view *v, const char *what,
                                          int heads, int n, int d)
{
    enum { ROWS = 64 };
    float *buf = malloc(sizeof(float) * ROWS * (size_t)d);
    KVCAP_RETURN_IF(!buf, KVCAP_ERR_OUT_OF_MEMORY, "cache: out of memory");
    for (int h = 0; h < heads; h++)
        for (int t0 = 0; t0 < n; t0 += ROWS) {
            const int rows = n - t0 < ROWS ? n - t0 : ROWS;
            kvcap_view_read(v, h, t0, rows, d, buf);
            for (size_t i = 0; i < (size_t)rows * d; i++)
                if (!isfinite(buf[i])) {
                    const int t = t0 + (int)(i / (size_t)d), ch = (int)(i % (size_t)d);
                    const double x = buf[i];
                    free(buf);
                    return kvcap_fail(KVCAP_ERR_NUMERIC,
                                      "%s: non-finite value %g at head %d, token %d, channel %d",
                                      what, x, h, t, ch);
                }
        }
    free(buf);
    return KVCAP_OK;
}
