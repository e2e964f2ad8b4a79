/* kvcap.h — the one public header of libkvcap, the KV-cache compression runtime for
 * vision-language models. Engines include this file and link libkvcap; nothing else is public.
 *
 * Conventions (they hold for every function declared here):
 *  - Every fallible call returns an `enum kvcap_status`. KVCAP_OK is 0; the other values are
 *    pinned and never renumbered, so they may be stored or sent across a process boundary.
 *  - On failure, a sentence naming the file, field or argument at fault is available from
 *    kvcap_last_error() on the calling thread, and is also passed to the log callback at
 *    KVCAP_LOG_ERROR. The library never exits, aborts or prints: without a callback it is silent.
 *  - Objects are opaque handles with paired create/free functions; every free accepts NULL.
 *    Parameter structs come from kvcap_<thing>_default_params(); fields are only ever added at
 *    the end, so code built against an older header keeps working.
 *  - Pointers passed in are borrowed for the duration of the call unless the function's comment
 *    says the library keeps them. Pointers returned are owned by the library unless stated.
 *
 * Thread safety: functions in this header may be called from any thread. The log callback is
 * process-wide and may be set at any time (kvcap_log_set says what a message logged meanwhile
 * sees). kvcap_last_error() is per thread.
 */
#ifndef KVCAP_H
#define KVCAP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Visibility ----------------------------------------------------------------------- */
/* libkvcap is built with -fvisibility=hidden; only symbols marked KVCAP_API are exported. */
#if defined(_WIN32)
#  if defined(KVCAP_BUILDING_LIBRARY)
#    define KVCAP_API __declspec(dllexport)
#  else
#    define KVCAP_API __declspec(dllimport)
#  endif
#elif defined(__GNUC__) && __GNUC__ >= 4
#  define KVCAP_API __attribute__((visibility("default")))
#else
#  define KVCAP_API
#endif

/* ---- Version -------------------------------------------------------------------------- */
/* The header's version. kvcap_version_number() returns the library's; an engine may check at
 * load time that the major numbers agree (the shared library's SOVERSION is the major). */
#define KVCAP_VERSION_MAJOR 0
#define KVCAP_VERSION_MINOR 1
#define KVCAP_VERSION_PATCH 0
#define KVCAP_VERSION_NUMBER \
    (KVCAP_VERSION_MAJOR * 10000 + KVCAP_VERSION_MINOR * 100 + KVCAP_VERSION_PATCH)
#define KVCAP_STRINGIFY_(x) #x
#define KVCAP_STRINGIFY(x) KVCAP_STRINGIFY_(x)
#define KVCAP_VERSION_STRING                                                          \
    KVCAP_STRINGIFY(KVCAP_VERSION_MAJOR) "." KVCAP_STRINGIFY(KVCAP_VERSION_MINOR) "." \
    KVCAP_STRINGIFY(KVCAP_VERSION_PATCH)

/* "MAJOR.MINOR.PATCH" of the library actually loaded; a static string. */
KVCAP_API const char *kvcap_version(void);
/* MAJOR*10000 + MINOR*100 + PATCH of the library actually loaded. */
KVCAP_API unsigned kvcap_version_number(void);

/* ---- Status --------------------------------------------------------------------------- */
/* Values are pinned: new codes are only appended. */
enum kvcap_status {
    KVCAP_OK = 0,
    KVCAP_ERR_INVALID_ARGUMENT = 1, /* a NULL, out-of-range or inconsistent argument */
    KVCAP_ERR_OUT_OF_MEMORY = 2,    /* host or device allocation failed */
    KVCAP_ERR_IO = 3,               /* open/read/write/fsync/rename/mmap failed */
    KVCAP_ERR_FORMAT = 4,           /* a file is malformed: container or kvcap schema */
    KVCAP_ERR_VERSION = 5,          /* a file's format_version is newer than this library */
    KVCAP_ERR_CONFIG = 6,           /* a YAML config is malformed or has an invalid value */
    KVCAP_ERR_GEOMETRY = 7,         /* model/span geometry disagrees with an artifact/config */
    KVCAP_ERR_UNSUPPORTED = 8,      /* valid request this build cannot serve (dtype, no CUDA) */
    KVCAP_ERR_NUMERIC = 9,          /* NaN/Inf in data, or a factorisation failed */
    KVCAP_ERR_DEVICE = 10,          /* a CUDA runtime/library call failed */
    KVCAP_ERR_STATE = 11,           /* call not valid in the object's current state */
    KVCAP_ERR_NOT_FOUND = 12,       /* a named tensor, key, bucket or layer does not exist */
    KVCAP_ERR_INTERNAL = 13         /* a bug in kvcap: please report it */
};

/* A short static English description ("invalid argument", ...); never NULL, also for values
 * this version does not know. */
KVCAP_API const char *kvcap_status_str(enum kvcap_status status);

/* The detailed message of the most recent failing call on this thread, e.g.
 * "a.kvcap: tensor 'l0.h1.b0.U': shape [8, 1024] x F16 needs 16384 bytes, data range has 16000".
 * Empty string when none. Valid until the next failing call on this thread. */
KVCAP_API const char *kvcap_last_error(void);

/* ---- Logging -------------------------------------------------------------------------- */
enum kvcap_log_level {
    KVCAP_LOG_DEBUG = 0,
    KVCAP_LOG_INFO = 1,
    KVCAP_LOG_WARN = 2,
    KVCAP_LOG_ERROR = 3
};

/* `message` is a NUL-terminated line without a trailing newline, valid only during the call. */
typedef void (*kvcap_log_fn)(enum kvcap_log_level level, const char *message, void *user);

/* Install a process-wide log callback (NULL: silence, the default). Messages below
 * `min_level` are not formatted at all. A level outside DEBUG..ERROR is clamped to that range
 * (errors are always delivered to an installed callback).
 * Threads: may be called from any thread at any time, also while others log and from inside the
 * callback. fn, user and min_level are one setting: each message reads the setting once, when it
 * is logged, and is filtered by that min_level and passed to that fn with that user, never
 * mixing two calls' values. A message logged on another thread before this call returns may
 * still reach the previous fn, with the previous user, after it has returned: keep the previous
 * user valid until such library calls are over. The callback runs on the thread that logs,
 * possibly on several threads at once. */
KVCAP_API void kvcap_log_set(kvcap_log_fn fn, void *user, enum kvcap_log_level min_level);

/* ---- Element types -------------------------------------------------------------------- */
/* Pinned values; the same set the file formats use (formats/SPEC.md). */
enum kvcap_dtype {
    KVCAP_DTYPE_F32 = 0,
    KVCAP_DTYPE_F16 = 1,
    KVCAP_DTYPE_BF16 = 2,
    KVCAP_DTYPE_F64 = 3,
    KVCAP_DTYPE_I32 = 4,
    KVCAP_DTYPE_U8 = 5
};

/* Size of one element in bytes, 0 for an unknown value. */
KVCAP_API size_t kvcap_dtype_size(enum kvcap_dtype dtype);
/* The safetensors name ("F32", "BF16", ...), or "?" for an unknown value. */
KVCAP_API const char *kvcap_dtype_name(enum kvcap_dtype dtype);

/* ---- Model geometry ------------------------------------------------------------------- */
/* Rotary position embedding as the engine applies it to keys and queries. */
enum kvcap_rope_type {
    KVCAP_ROPE_NONE = 0,  /* no rotary embedding (keys carry no position) */
    KVCAP_ROPE_ROPE = 1,  /* one scalar position per token */
    KVCAP_ROPE_MROPE = 2  /* multimodal RoPE (Qwen2-VL): frequency pairs split in sections */
};

/* Which channels form a rotation pair. Must match the engine: HF transformers/NeoX rotate
 * channel i with i + rope_dim/2 ("half"); llama.cpp's normal mode rotates 2i with 2i+1. */
enum kvcap_rope_pairing {
    KVCAP_ROPE_PAIRING_HALF = 0,
    KVCAP_ROPE_PAIRING_ADJACENT = 1
};

#define KVCAP_MAX_ROPE_SECTIONS 4
#define KVCAP_MAX_NAME 64

struct kvcap_model_geometry {
    char name[KVCAP_MAX_NAME]; /* informational, e.g. "Qwen2.5-VL-7B-Instruct" */
    int n_layers;
    int n_q_heads;             /* must be a multiple of n_kv_heads (GQA group G = q / kv) */
    int n_kv_heads;
    int head_dim;              /* 64, 80, 96, 128 or 256 */
    enum kvcap_rope_type rope_type;
    enum kvcap_rope_pairing rope_pairing;
    int rope_dim;              /* rotated channels, even, <= head_dim; 0 means head_dim */
    double rope_theta;         /* base frequency, finite and > 0 when rope_type != NONE */
    int n_rope_sections;       /* MROPE only: sections in frequency pairs, summing to rope_dim/2 */
    int rope_sections[KVCAP_MAX_ROPE_SECTIONS];
};

/* Checks the invariants stated above. KVCAP_ERR_GEOMETRY with a message naming the field. */
KVCAP_API enum kvcap_status kvcap_geometry_validate(const struct kvcap_model_geometry *g);

/* ---- Policies and buckets ------------------------------------------------------------- */
/* Compression policies (DESIGN §1), selectable per span kind. Pinned values. */
enum kvcap_policy {
    KVCAP_POLICY_FULL = 0,       /* no compression: the reference */
    KVCAP_POLICY_KVCAPSULE = 1,  /* learned reconstructive compression (needs an artifact) */
    KVCAP_POLICY_FLASHCACHE = 2, /* DCT low-pass deviation eviction */
    KVCAP_POLICY_VLCACHE = 3,    /* post-vision-attention eviction */
    KVCAP_POLICY_FREEKV = 4,     /* paged retrieval from a host-side store */
    KVCAP_POLICY_STREAMING = 5,  /* attention sinks + recent window */
    KVCAP_POLICY_KVZIP = 6,      /* reconstruction-attention eviction, one budget for all
                                  * layers and KV heads (needs the reconstruction queries) */
    KVCAP_POLICY_RANDOM = 7,     /* uniform random eviction: the baseline of evaluations */
    KVCAP_POLICY_EXPECTED_ATTENTION = 8 /* expected attention of the prompt's query statistics
                                         * (needs the prompt's queries) */
};
#define KVCAP_POLICY_COUNT 9

/* Span kinds a policy is chosen for. */
enum kvcap_span_kind {
    KVCAP_SPAN_VISION = 0,
    KVCAP_SPAN_TEXT = 1,
    KVCAP_SPAN_GENERATED = 2
};

/* Map structure of a bucket (DESIGN §4 "structured maps"). */
enum kvcap_structure {
    KVCAP_STRUCTURE_DENSE = 0, /* one map over the whole grid */
    KVCAP_STRUCTURE_TILED = 1  /* one small map shared by every tile_rows x tile_cols tile */
};

/* A grid shape compressors are fitted for. n = rows * cols tokens. */
struct kvcap_bucket {
    int rows, cols;
    enum kvcap_structure structure;
    int tile_rows, tile_cols; /* TILED only: must divide rows and cols; 0 for DENSE */
};

/* ---- Artifacts ------------------------------------------------------------------------ */
/* A compressor artifact (.kvcap, written by kvcap-convert): read-only once opened, so one
 * artifact may be shared by any number of caches and threads. */
struct kvcap_artifact;

/* Opens and validates `path` (formats/SPEC.md §4.3) and loads its maps. */
KVCAP_API enum kvcap_status kvcap_artifact_open(const char *path, struct kvcap_artifact **out);
/* NULL is a no-op. Caches created with the artifact keep it alive: it may be freed before them,
 * and its memory goes when the last of them is freed (from any thread). It must not be used
 * by the caller after this call. */
KVCAP_API void kvcap_artifact_free(struct kvcap_artifact *artifact);
/* The model geometry the artifact was calibrated for; owned by the artifact. */
KVCAP_API const struct kvcap_model_geometry *kvcap_artifact_geometry(
    const struct kvcap_artifact *artifact);

/* ---- The cache ------------------------------------------------------------------------- */
/* The KV cache of a batch of sequences for one model. Thread safety: calls on one cache must
 * not overlap (the engine serialises them, as it does its own forward pass); different caches
 * are independent. The cache may use several threads inside a call (params.n_threads): its own
 * pool's, or the engine's (params.parallel_for). */
struct kvcap_cache;

/* Where a cache keeps its state, and so where the pointers an engine passes to it live.
 * Pinned values. */
enum kvcap_memory {
    KVCAP_MEMORY_HOST = 0, /* host memory (the default) */
    KVCAP_MEMORY_CUDA = 1  /* memory of CUDA device params.cuda_device: see "Device caches" */
};

/* The engine's own threads for a host cache's parallel loops (params.parallel_for), so that
 * attend runs on threads that are already awake instead of waking the cache's pool (waking an
 * idle core costs tens to hundreds of µs in a VM, a sizeable share of a decode call).
 * parallel_for(user, n_tasks, fn, ctx) must call fn(ctx, task, thread) exactly once for every
 * task in 0..n_tasks-1 and return when all calls have returned. `thread` must be in
 * 0..params.n_threads-1 (which must then be set, 1..64), and no two calls running at the same
 * time may pass the same one: the index of the engine thread that runs the task does. Any
 * order and any number of threads, the calling one alone included, are fine. It is called only
 * from inside the cache's calls, on the thread that made the call. */
typedef void (*kvcap_task_fn)(void *ctx, int task, int thread);
typedef void (*kvcap_parallel_for_fn)(void *user, int n_tasks, kvcap_task_fn fn, void *ctx);

struct kvcap_cache_params {
    struct kvcap_model_geometry model;     /* required */
    int n_seqs;                            /* sequences in the batch, >= 1 */
    enum kvcap_dtype storage;              /* dtype of everything the cache stores: F32, F16
                                            * (default) or BF16; math is always fp32 */
    const struct kvcap_artifact *artifact; /* may be NULL; the cache holds it until
                                            * kvcap_cache_free (kvcap_artifact_free) */
    const char *config_path;               /* runtime YAML (configs/runtime.yaml); NULL: defaults.
                                            * Its artifact key is ignored here: pass `artifact` */
    const char *record_dir;                /* non-NULL: record mode, vision spans and their decode
                                            * queries are appended to dataset shards there
                                            * (see kvcap_cache_record_flush) */
    int n_threads;                         /* 0: all cores */
    kvcap_parallel_for_fn parallel_for;    /* NULL (default): the cache's own pool of
                                            * n_threads (its idle workers block); else the
                                            * engine's threads, see kvcap_parallel_for_fn */
    void *parallel_user;                   /* passed to parallel_for */
    enum kvcap_memory memory;              /* HOST (default) or CUDA (see "Device caches") */
    int cuda_device;                       /* CUDA: the device ordinal, 0 (default) ..
                                            * kvcap_cuda_device_count() - 1 */
    int reserve_tokens;                    /* room for this many generated tokens per sequence
                                            * and layer, allocated by the first append of each;
                                            * 0 (default): 64. When it is used up the room
                                            * doubles (streaming needs at most sinks + window
                                            * rows). On a device cache growing is a step that
                                            * cannot be captured: reserve what a capture needs */
    const char *config_yaml;               /* the runtime YAML itself (NUL-terminated, read at
                                            * create), for engines that hold their config in
                                            * memory; its errors name params.config_yaml:line:col.
                                            * At most one of config_path and config_yaml */
};

/* Device caches (params.memory = KVCAP_MEMORY_CUDA). Everything the cache stores lives on
 * device params.cuda_device, and every pointer an engine passes is memory of that device: the
 * base of a view and the pages its page table points to (the page table itself is a host
 * array, read during the call), q, out and lse. Each call makes that device current for its
 * duration and restores the caller's. Work is enqueued on the cache's stream
 * (kvcap_cache_set_stream; the legacy default stream until set); results are ready when the
 * stream gets past the call, and the engine's buffers must stay valid and unchanged until then.
 *  - Policies: full, streaming and kvcapsule (tiled and dense maps; a vision span without a
 *    bucket takes the fallback, which must be full, streaming or none: a runtime config that
 *    compresses vision spans with kvcapsule must set `fallback`, whose default is flashcache).
 *    With kvcapsule.exact_tiles, add_span computes each point's reconstruction error on the
 *    device and picks the tiles on the host, by the host cache's rule; its prefill takes 2-3x
 *    one without (kvcap-bench-cuda --sections prefill measures both).
 *    A runtime config that selects flashcache, vlcache or freekv fails kvcap_cache_create with
 *    KVCAP_ERR_UNSUPPORTED naming the key; so does record mode (record_dir). Without a runtime
 *    config a device cache keeps vision spans with kvcapsule when an artifact is given and in
 *    full otherwise, and the fallback is full (the host defaults use flashcache).
 *  - Limits of the device kernels: G = q_heads / kv_heads at most 16, head_dim a multiple of 8
 *    in 64..256 (KVCAP_ERR_UNSUPPORTED at create otherwise).
 *  - What synchronises: kvcap_cache_create (uploads the artifact's maps once), add_span (waits
 *    until the span is stored: the engine may reuse its K/V buffers on return), end_prefill,
 *    kvcap_cache_sync and kvcap_cache_free. A decode step — append and attend — only enqueues
 *    kernels, without host synchronisation, copies from host memory or allocation, so an
 *    engine may capture it into a CUDA graph, except in these steps, which allocate, upload
 *    the layer's descriptors through pinned memory and may wait for the stream: the first
 *    append or attend of a layer after add_span, and an append that finds the generated rows
 *    full (see reserve_tokens). Calling one of those while the stream is being captured fails
 *    with KVCAP_ERR_STATE and changes nothing; a graph captured before one of them refers to
 *    storage it replaced and must be captured again after it.
 *  - The calls made while capturing count as one step in the cache's own bookkeeping (their
 *    work runs at the first launch of the graph). Replaying the graph again appends and
 *    attends on the device without the library seeing it: call kvcap_cache_sync after
 *    replays, before the next direct call or kvcap_cache_stats.
 *  - kvcap_cache_stats reads nothing from the device: bytes_held counts the device allocations
 *    as a host cache counts its own (the device copy of the artifact's maps, like the host
 *    artifact, is not counted); bytes_read_last_attend is what the last direct attend call
 *    launched.
 * A build without CUDA, or a machine without a visible device, fails kvcap_cache_create with
 * KVCAP_ERR_UNSUPPORTED naming params.memory. */
KVCAP_API void kvcap_cache_default_params(struct kvcap_cache_params *params);
KVCAP_API enum kvcap_status kvcap_cache_create(const struct kvcap_cache_params *params,
                                               struct kvcap_cache **out);
/* NULL is a no-op. In record mode, spans not yet written are written out first, also those of
 * sequences whose prefill was not ended; a span that some layers never received cannot be
 * written and is dropped with a warning. Errors are logged: end the prefills and call
 * kvcap_cache_record_flush before to see them. A device cache waits for its stream first. */
KVCAP_API void kvcap_cache_free(struct kvcap_cache *cache);

/* Device caches: the cudaStream_t (passed as void *) the cache's work is enqueued on from now
 * on; NULL is the legacy default stream. The cache does not order work across streams: switch
 * between steps, once the work enqueued on the old stream is done or ordered before the new
 * one by the engine. KVCAP_ERR_STATE for a host cache. */
KVCAP_API enum kvcap_status kvcap_cache_set_stream(struct kvcap_cache *cache, void *stream);

/* Device caches: waits for the cache's stream, then reads the token counts the device kept
 * (appends replayed from a captured graph included) back into the cache's own bookkeeping.
 * KVCAP_ERR_STATE when an append found no room for its token (a replay past the room reserved;
 * that token was not stored). A no-op for a host cache. */
KVCAP_API enum kvcap_status kvcap_cache_sync(struct kvcap_cache *cache);

/* K or V rows handed over by the engine, read in place (no copy into a special layout is
 * needed): element (head h, token j, channel c) is at
 *     base + h * head_stride + j * token_stride + c                  (pages == NULL)
 *     pages[j / page_size] + h * head_stride + (j % page_size) * token_stride + c   (paged)
 * in elements of `dtype`. Contiguous NHD: head_stride = d, token_stride = heads * d; HND:
 * head_stride = n * d, token_stride = d. Host memory, borrowed for the duration of the call; on a
 * device cache base and the pages are device memory (the page table is a host array). */
struct kvcap_tensor_view {
    const void *base;
    const void *const *pages; /* optional: page table */
    int page_size;            /* tokens per page, with pages */
    enum kvcap_dtype dtype;   /* F32, F16 or BF16 */
    int64_t head_stride, token_stride;
};

struct kvcap_span_desc {
    enum kvcap_span_kind kind; /* VISION or TEXT (GENERATED tokens come through append) */
    int n_tokens;              /* >= 1 */
    int rows, cols;            /* VISION: the grid, rows * cols == n_tokens; else 0 */
    int p0;                    /* position of the first token (the RoPE offset), >= 0 */
};

/* Prefill: adds a span of sequence `seq` at `layer`. Engines call it layer by layer; the i-th
 * call for (seq, layer) adds span i of that sequence, so spans must come in the same order on
 * every layer with the same description (KVCAP_ERR_INVALID_ARGUMENT otherwise), and every layer
 * must get every span before the prefill ends (kvcap_cache_end_prefill). Layer 0 leads: span i
 * is added at layer 0 before any other layer. The span is stored under the policy the runtime
 * config gives its kind (vision spans whose grid has no bucket in the artifact use the
 * fallback). Record mode also refuses, with KVCAP_ERR_INVALID_ARGUMENT naming span.rows,
 * span.cols or span.p0, a vision span the dataset format cannot hold (rows and cols in
 * 1..4096, formats/SPEC.md §4.1). Device cache: k and v are device memory; the KVCapsule
 * state is computed on the device; the call returns when the span is stored. */
KVCAP_API enum kvcap_status kvcap_cache_add_span(struct kvcap_cache *cache, int seq, int layer,
                                                 const struct kvcap_span_desc *span,
                                                 const struct kvcap_tensor_view *k,
                                                 const struct kvcap_tensor_view *v);

/* The queries of the post-vision prompt tokens of `seq` at `layer` (q: [q_heads][n][head_dim]
 * fp32, rotated at their own positions): the last n tokens of the prompt, i.e. of the spans
 * added so far. Required before the end of prefill when a span's policy is vlcache (which
 * scores tokens by the attention these queries pay them); otherwise optional (recorded in
 * record mode with the most recent vision span). A kvzip span takes, through this call, the
 * queries of the engine's context-reconstruction pass instead (the tokens of "repeat the
 * previous context" and of the prompt again, run after the prompt, each rotated at its own
 * position): they see the whole prompt. An expected_attention span takes the queries of every
 * prompt token (the last n tokens of the prompt, n its length). A sequence whose spans use
 * two of these policies gives them the same queries. Several calls extend the set. Device cache:
 * q is device memory; the arguments are checked and the queries not read (no policy a device
 * cache offers uses them). */
KVCAP_API enum kvcap_status kvcap_cache_add_post_queries(struct kvcap_cache *cache, int seq,
                                                         int layer, const float *q, int n);

/* kvcap_cache_add_post_queries with, per query, lse: [q_heads][n] fp32, the log-sum-exp of its
 * scores (scaled by 1/sqrt(head_dim)) over keys the cache does not hold but the query saw: for
 * KVzip's reconstruction pass, the pass's own tokens up to the query (causal). kvzip's softmax
 * over the prompt then has the pass's whole normaliser, as in KVzip; -inf means "none" (what
 * add_post_queries assumes), NaN or +inf is refused (KVCAP_ERR_NUMERIC). NULL lse is
 * add_post_queries. */
KVCAP_API enum kvcap_status kvcap_cache_add_post_queries_lse(struct kvcap_cache *cache, int seq,
                                                             int layer, const float *q,
                                                             const float *lse, int n);

/* Ends the prefill of `seq`: spans whose policy compresses across layers (flashcache, vlcache)
 * are compressed now, their evicted rows freed. Needs every layer's spans, whatever the
 * policies: when some layers got a span and others did not, it fails with KVCAP_ERR_STATE
 * naming the sequence and the first layer that lacks it (the engine may add the missing spans
 * and call again). vlcache also needs the post-vision queries. Called by kvcap_cache_append
 * (for its sequence) and kvcap_cache_attend (for every sequence of the batch) when the engine
 * has not, so those fail the same way; calling it explicitly puts the compression time where
 * the engine wants it and reports errors at the right place. Otherwise a no-op when nothing is
 * pending; in record mode it marks the sequence's spans ready to be written. On failure the
 * spans not yet compressed stay as they were (held in full) and the call may be repeated. (A
 * device cache has no cross-layer policy: nothing is ever pending.) */
KVCAP_API enum kvcap_status kvcap_cache_end_prefill(struct kvcap_cache *cache, int seq);

/* Decode: appends one generated token's K and V (views of one token) to `seq` at `layer`.
 * Device cache: views of device memory; one kernel enqueued, which writes the token's row and
 * advances the token count kept on the device (so a replayed graph appends at the next row).
 * The first append of a layer after add_span, and one that finds the generated rows full,
 * also allocate and upload descriptors (see "Device caches": not capturable). */
KVCAP_API enum kvcap_status kvcap_cache_append(struct kvcap_cache *cache, int seq, int layer,
                                               const struct kvcap_tensor_view *k,
                                               const struct kvcap_tensor_view *v);

/* Decode: attention output of every query head of every sequence at `layer` over everything
 * the cache holds for it. q and out: [n_seqs][q_heads][head_dim] fp32 (q rotated at its own
 * position, as the engine does); scores are scaled by 1/sqrt(head_dim). Ends the prefill of
 * every sequence first, so no sequence may be half-way through its prefill (a span on some
 * layers only: KVCAP_ERR_STATE, see kvcap_cache_end_prefill). Device cache: q and out
 * are device memory; the call only enqueues kernels (a fixed set while storage does not grow:
 * partial reset, query preparation, one launch for every plain segment of the batch, one per
 * KVCapsule bucket and KV head, one merge) and returns without waiting. */
KVCAP_API enum kvcap_status kvcap_cache_attend(struct kvcap_cache *cache, int layer,
                                               const float *q, float *out);

/* kvcap_cache_attend that also writes, per query head, lse = log Σ_j exp(s_j) over everything
 * attended (-inf when nothing was): lets an engine merge this output with attention it computes
 * itself (o = Σ_i exp(lse_i − lse) o_i). lse: [n_seqs][q_heads] fp32 (device memory on a
 * device cache). */
KVCAP_API enum kvcap_status kvcap_cache_attend_lse(struct kvcap_cache *cache, int layer,
                                                   const float *q, float *out, float *lse);

struct kvcap_cache_stats {
    uint64_t bytes_held;                /* all sequences, layers and heads */
    uint64_t bytes_by_policy[KVCAP_POLICY_COUNT]; /* indexed by enum kvcap_policy */
    uint64_t bytes_by_kind[3];          /* indexed by enum kvcap_span_kind */
    uint64_t bytes_full_equivalent;     /* what `full` would hold for the same tokens */
    int64_t tokens_by_kind[3];          /* tokens seen (before compression) */
    uint64_t bytes_read_last_attend;    /* K/V, compressed state and maps read by the last
                                         * kvcap_cache_attend call */
    uint64_t map_bytes_read_last_attend; /* of which artifact maps */
    int64_t spans_fallback;             /* vision spans with no bucket (fallback policy) */
    double compress_seconds;            /* spent compressing spans: scoring and evicting,
                                         * KVCapsule's projection, FreeKV's paging (not the
                                         * storing of rows every policy does) */
    /* FreeKV, summed over sequences and layers since creation: (step, KV head) pairs served,
     * of which corrected on the critical path; pages and bytes copied store → pool. */
    int64_t freekv_head_steps, freekv_corrections, freekv_pages_recalled;
    uint64_t freekv_bytes_recalled;
    /* FreeKV, how each (step, KV head) pair was served, summed like the counts above: with
     * freekv_corrections they add up to freekv_head_steps (less the head-steps of a layer whose
     * FreeKV store was still empty). Speculative: selected with the previous step's queries,
     * and recalled, after that step's attend, by a background thread. A device cache leaves
     * all three 0 (it has no FreeKV; see params.memory). */
    int64_t freekv_reselections; /* selected synchronously on the critical path because no
                                  * usable speculative selection existed: the first step, a
                                  * step after one the head skipped, or a store that grew by
                                  * more than window_pages candidate pages since (corrections
                                  * not included). A store that grew by a few tokens, or not at
                                  * all (only a span in FreeKV), keeps its speculation. */
    int64_t freekv_hidden;       /* served by a speculative selection, and its recall, that had
                                  * completed off the critical path before the step needed it */
    int64_t freekv_waited;       /* served by a speculative selection that attend had to wait
                                  * for (still running in the background when the step came) */
};

KVCAP_API enum kvcap_status kvcap_cache_stats(const struct kvcap_cache *cache,
                                              struct kvcap_cache_stats *stats);

/* 1 when the cache's runtime config gives `policy` to some span kind, or to vision spans
 * kvcapsule has no bucket for (the fallback, when vision spans go to kvcapsule); 0 otherwise
 * and for a NULL cache. Engines ask it before prefill to learn what the config needs of them:
 * kvzip its reconstruction pass's queries, vlcache and expected_attention the prompt's queries
 * (kvcap_cache_add_post_queries). */
KVCAP_API int kvcap_cache_uses_policy(const struct kvcap_cache *cache, enum kvcap_policy policy);

/* Record mode: writes to the dataset the vision spans of every sequence whose prefill has
 * ended (kvcap_cache_end_prefill, explicitly or through append or attend), each with its
 * post-vision queries and the decode queries recorded so far. The spans of a sequence still in
 * prefill are kept, not written, and are written by a later flush once its prefill has ended:
 * a flush never cuts a span short or drops it. A flushed span collects no more queries; a
 * sequence's spans are also written when it starts a new prefill with a vision span, and when
 * the cache is freed. On failure (KVCAP_ERR_IO, ...) the spans not written are kept and the
 * call may be repeated. KVCAP_ERR_STATE when the cache is not in record mode. */
KVCAP_API enum kvcap_status kvcap_cache_record_flush(struct kvcap_cache *cache);

/* ---- Devices -------------------------------------------------------------------------- */
/* Number of CUDA devices usable by this build: 0 when built without CUDA, when no driver is
 * installed or when no device is present — none of which is an error. */
KVCAP_API int kvcap_cuda_device_count(void);

#ifdef __cplusplus
}
#endif

#endif /* KVCAP_H */
