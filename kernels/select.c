/* select.c — top-k indices by score: quickselect on an index permutation (fast) and a full
 * repeated selection (reference). Both use the same total order, so they agree exactly, ties included. */
#include <math.h>
#include <stdlib.h>

#include "kernels/select.h"

/* a ranks before b: larger score first, NaN last, lower index on ties. */
static int ranks_before(const float *s, int a, int b)
{
    float x = s[a], y = s[b];
    int xn = isnan(x), yn = isnan(y);
    if (xn != yn)
        return yn;
    if (!xn && x != y)
        return x > y;
    return a < b;
}

static int cmp_int(const void *a, const void *b)
{
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

int kvcap_topk_indices(const float *score, int n, int keep, int *idx, int *work)
{
    if (keep <= 0 || n <= 0)
        return 0;
    if (keep > n)
        keep = n;
    for (int i = 0; i < n; i++)
        work[i] = i;
    /* Quickselect: after it, work[0..keep) are the top `keep` in some order. Median-of-three
     * pivots keep sorted and reversed inputs linear. */
    int lo = 0, hi = n - 1;
    while (keep < n && lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (ranks_before(score, work[mid], work[lo])) {
            int t = work[mid]; work[mid] = work[lo]; work[lo] = t;
        }
        if (ranks_before(score, work[hi], work[lo])) {
            int t = work[hi]; work[hi] = work[lo]; work[lo] = t;
        }
        if (ranks_before(score, work[hi], work[mid])) {
            int t = work[hi]; work[hi] = work[mid]; work[mid] = t;
        }
        int pivot = work[mid], i = lo, j = hi;
        while (i <= j) {
            while (ranks_before(score, work[i], pivot))
                i++;
            while (ranks_before(score, pivot, work[j]))
                j--;
            if (i <= j) {
                int t = work[i]; work[i] = work[j]; work[j] = t;
                i++, j--;
            }
        }
        /* [lo, j] rank before or equal the pivot, [i, hi] after or equal */
        if (keep - 1 <= j)
            hi = j;
        else if (keep - 1 >= i)
            lo = i;
        else
            break;
    }
    for (int i = 0; i < keep; i++)
        idx[i] = work[i];
    qsort(idx, (size_t)keep, sizeof *idx, cmp_int);
    return keep;
}

/* Picks the best remaining index `keep` times: O(n·keep), obviously correct. */
int kvcap_topk_indices_ref(const float *score, int n, int keep, int *idx)
{
    if (keep <= 0 || n <= 0)
        return 0;
    if (keep > n)
        keep = n;
    unsigned char *taken = calloc((size_t)n, 1);
    if (!taken)
        return -1;
    for (int r = 0; r < keep; r++) {
        int best = -1;
        for (int i = 0; i < n; i++)
            if (!taken[i] && (best < 0 || ranks_before(score, i, best)))
                best = i;
        taken[best] = 1;
        idx[r] = best;
    }
    free(taken);
    qsort(idx, (size_t)keep, sizeof *idx, cmp_int);
    return keep;
}
