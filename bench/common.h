/* common.h — what kvcap-bench and kvcap-bench-cuda share: a random KVCapsule artifact
 * (timing only) and a runtime config written to a temporary file. */
#ifndef KVCAP_BENCH_COMMON_H
#define KVCAP_BENCH_COMMON_H

#include <stddef.h>

#include "kvcap.h"

/* A random artifact for geometry g and one bucket, opened into *out (the file it went through
 * is removed): one set of maps, of rank round(ratio · tile points), shared by every layer and
 * KV head. For timing only: fidelity is what kvcap-calibrate reports. */
enum kvcap_status kvcap_bench_random_artifact(const struct kvcap_model_geometry *g,
                                              const struct kvcap_bucket *b, double ratio,
                                              struct kvcap_artifact **out);

#endif
