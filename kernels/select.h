/* select.h — top-k selection by score, shared by the eviction and retrieval policies
 * (FlashCache deviations, VL-Cache column sums, FreeKV page scores). */
#ifndef KVCAP_SELECT_H
#define KVCAP_SELECT_H

/* Writes to idx[0..keep) the indices of the `keep` largest scores among score[0..n), in
 * ascending index order (so kept tokens stay in sequence order). Ties go to the lower index;
 * NaN scores rank below every number. keep is clamped to [0, n]; returns the number written.
 * `work` holds n ints (caller-owned scratch). O(n) expected plus O(keep log keep). */
int kvcap_topk_indices(const float *score, int n, int keep, int *idx, int *work);

/* The same by repeated selection (O(n·keep)): the readable oracle of the tests. Returns -1
 * when out of memory. */
int kvcap_topk_indices_ref(const float *score, int n, int keep, int *idx);

#endif
