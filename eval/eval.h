/* eval.h — what the files of kvcap-eval share: its options, the corpus, the model and its
 * prefilled prompts, the run matrix and its decode phases, the retrieval task and metrics.json.
 * Internal to eval/ (generate.c, the `generate` subcommand, stands apart: generate.h). */
#ifndef KVCAP_EVAL_H
#define KVCAP_EVAL_H

#include <stddef.h>
#include <stdint.h>

#include "engine/llama.h"
#include "engine/vision.h"
#include "kvcap.h"

struct kvtok;

#define DEFAULT_MODEL_FILE "SmolLM2-135M-Instruct.Q4_1.gguf"
#define DEFAULT_CORPUS "/usr/share/common-licenses"
/* The documents of the calibration and development splits inside DEFAULT_CORPUS: record's and
 * run's default --docs (eval_main.c holds their definitions, which tests/splits.sh reads). */
extern const char eval_calib_docs[], eval_heldout_docs[];
#define MAX_DOCS 64
#define MAX_ARTIFACTS 24
#define MAX_RETENTIONS 8
#define MAX_IMAGES 8 /* --images: spans per prompt */
/* Random eviction, the floor every row is judged against, is run with this many seeds; its row
 * is their mean, prompt by prompt (fold_seeds). */
#define RANDOM_SEEDS 8
#define RANDOM_SEEDS_MAX 16
/* The retrieval task: depths of the asked line in the span, greedy tokens of an answer per
 * value asked, the most keys (--task-keys) and values per key (--task-values), the characters
 * of an answer as scored. */
enum { TASK_DEPTHS = 8, TASK_ANSWER_TOKENS = 6, TASK_KEYS_MAX = 16, TASK_VALUES_MAX = 4,
       TASK_ANSWER_CHARS = 64 };

/* ---- Options (options.c) ------------------------------------------------------------------ */
/* What a run does with an artifact: KVCapsule (--kvcapsule), KVCapsule with kvcap's exact
 * tiles (--kvcapsule-exact, kvcapsule.exact_tiles), or KVzip keeping its values in the
 * artifact's value basis (--kvzip-basis, kvzip.values: basis). */
enum artifact_use { USE_KVCAPSULE, USE_EXACT, USE_KVZIP_BASIS };

struct artifact_arg {
    char variant[32];
    double retention;
    const char *path;
    enum artifact_use use;
};

enum track { TRACK_TEXT, TRACK_IMAGE };

struct options {
    int record;
    enum track track;
    const char *features;
    enum kvvision_split photos; /* --photos: the split the run's prompts show */
    int photos_set;
    const char *model, *corpus, *docs, *calib_docs, *out, *command;
    int head, span, tail, decode, max_chunks, prompts, generate, continuation, fidelity_steps;
    int images, gap; /* --images spans of --span tokens (image track), --gap text tokens apart */
    int task_queries, threads, quiet;
    int task_keys, task_values; /* --task-keys, --task-values: RULER's multi-key and
                                 * multi-value variants of the retrieval task (1, 1: plain) */
    int random_seeds;   /* --random-seeds: random eviction's seeds, its row their mean */
    const char *shipped; /* --shipped: the label of the row chosen in advance, or NULL */
    int headline;        /* --rows headline: full, the papers' methods, random, the shipped row */
    const char *split;   /* --split (text track): calibration, development or test */
    int split_set;
    enum kvcap_dtype storage;
    double retentions[MAX_RETENTIONS];
    int n_retentions;
    struct artifact_arg artifacts[MAX_ARTIFACTS];
    int n_artifacts, exact_tiles;
    int artifact_keys[MAX_ARTIFACTS]; /* 1: the artifact's key maps are trained (artifact_keys) */
    const char *compare[7]; /* metrics.json of other tracks, shown beside this one */
    int n_compare;
    char model_default[4096];
    char features_default[4096];
};


/* Parses argv (argv[1] is record or run) into *o with every default filled in; prints --help or
 * --version and exits; returns 0, or the exit status of a usage error (2), said on stderr. */
int parse_options(int argc, char **argv, struct options *o);
/* Refuses, before any work, an --out whose files would replace an input: 0, else 2. */
int check_outputs(const struct options *o);

/* The files `run` writes into --out: the one list check_outputs checks and cmd_run writes. */
struct run_outputs {
    char metrics[4200], html[4200], csv[4200], embd[4200];
};

void run_output_paths(const struct options *o, struct run_outputs *p);

/* ---- Corpus, photos, model and prompts (prompts.c) ------------------------------------------ */
struct model_ctx {
    struct kvllama_model *model;
    struct kvtok *tok;
    struct kvcap_model_geometry g;
    const struct kvllama_hparams *hp;
};

/* Loads the GGUF model and its tokenizer (a line on stderr unless quiet); model_close frees
 * both. */
enum kvcap_status model_open(const char *path, struct model_ctx *mc, int quiet);
void model_close(struct model_ctx *mc);

struct chunk {
    const int32_t *ids; /* into the document's tokens */
    int n;
    int doc;            /* index into the document list */
    int offset;         /* token offset inside the document */
};

struct corpus {
    int n_docs;
    char *names[MAX_DOCS];
    int32_t *tokens[MAX_DOCS];
    size_t n_tokens[MAX_DOCS];
    int64_t total_tokens;
    struct chunk *chunks;
    int n_chunks;
};

/* Tokenises every document of the comma-separated list and cuts it into chunks of chunk_len
 * tokens; corpus_free frees what it holds (also after a failed load). */
enum kvcap_status corpus_load(const struct kvtok *tok, const char *dir, const char *list,
                              int chunk_len, struct corpus *c);
void corpus_free(struct corpus *c);

/* Photo features, the projector fitted on the calibration photos, and one split's crops. */
struct image_set {
    struct kvvision_features f;
    struct kvvision_projector proj;
    int *crops, n;
};

/* Opens --features, fits the projector and lists the crops of `split`; image_set_free frees
 * it (a zeroed set too). */
enum kvcap_status image_set_open(const struct options *o, const struct model_ctx *mc,
                                 enum kvvision_split split, struct image_set *im);
void image_set_free(struct image_set *im);

/* A prompt's layout: HEAD text tokens, IMAGES compressible spans of SPAN tokens each (on a
 * ROWS x SPAN/ROWS grid; text: one 1 x SPAN span) with GAP text tokens between two, then TAIL
 * text tokens. */
struct layout {
    int head, span, tail;
    int images, gap;
    int rows;
};

/* Tokens of a prompt in a layout: head, its spans and the gaps between them, tail. */
static inline int layout_tokens(const struct layout *l)
{
    return l->head + l->images * l->span + (l->images - 1) * l->gap + l->tail;
}

/* The layout of --head, --images spans of --span tokens --gap apart, and --tail (rows: 1). */
static inline struct layout options_layout(const struct options *o)
{
    return (struct layout){.head = o->head, .span = o->span, .tail = o->tail,
                           .images = o->images, .gap = o->gap, .rows = 1};
}

/* Tokens of a prompt in the options' layout. */
static inline int prompt_len(const struct options *o)
{
    const struct layout l = options_layout(o);
    return layout_tokens(&l);
}

/* A prefilled prompt in its layout, and optionally the first `n_fid` tokens that follow it,
 * whose K/V and queries the attention-fidelity pass replays as decode steps. */
struct prompt {
    const int32_t *ids;    /* the prompt (+ what follows: continuation or answer) */
    struct layout lay;     /* rows: each span's grid, rows x (span / rows); 1 for text */
    const float *embd;     /* image track: the spans' embeddings [images][span][n_embd], else
                            * NULL */
    int n_fid;             /* tokens after the prompt prefilled too (their K/V and queries) */
    float *k, *v;          /* [layers][prompt + n_fid][kv_heads * head_dim] */
    float *q_post;         /* [layers][q_heads][tail][head_dim]: the tail's queries */
    float *q_dec;          /* [layers][q_heads][n_fid][head_dim] */
    float *logits;         /* [n_vocab] of the last prompt token */
    float *q_replay;       /* [layers][q_heads][n_replay][head_dim]: the context-reconstruction
                            * pass's queries (kvzip), NULL until prompt_replay */
    float *lse_replay;     /* [layers][q_heads][n_replay]: each one's log-sum-exp over the
                            * pass's own keys (causal), which the cache does not hold */
    int n_replay;
    float *q_prompt;       /* [layers][q_heads][head + span + tail][head_dim]: every prompt
                            * token's query (expected_attention), kept by the prefill when
                            * asked (all_queries), else NULL */
    double prefill_s; /* the model's prefill of the prompt */
    double replay_s;  /* the reconstruction pass, continuing from the prompt's K/V (NaN: not
                       * timed) */
};

/* Tokens of a prompt: head, its spans and the gaps between them, tail. */
static inline int prompt_tokens(const struct prompt *p) { return layout_tokens(&p->lay); }

/* Where span i of a prompt starts. */
static inline int prompt_span_at(const struct prompt *p, int i)
{
    return p->lay.head + i * (p->lay.span + p->lay.gap);
}

/* Which queries a run's cache takes after the prompt (kvcap_cache_add_post_queries). */
enum post_queries {
    POST_TAIL,   /* the tail's: VL-Cache's post-vision queries */
    POST_REPLAY, /* KVzip's reconstruction pass's, with their log-sum-exps */
    POST_PROMPT  /* every prompt token's: Expected Attention's statistics */
};

/* Prefilling (the prompt's K/V and queries, prompts.c says which), KVzip's reconstruction pass,
 * freeing what a prefill holds (the layout stays), and handing a prompt to a cache. */
enum kvcap_status prompt_prefill_image(const struct model_ctx *mc, const int32_t *ids,
                                       const struct layout *lay, int n_fid, const float *embd,
                                       int all_queries, struct prompt *p);
enum kvcap_status prompt_prefill(const struct model_ctx *mc, const int32_t *ids, int head,
                                 int span, int tail, int n_fid, int all_queries,
                                 struct prompt *p);
/* KVzip's reconstruction pass of p (its queries into p->q_replay), continuing from p's K/V.
 * timed: the pass runs REPLAY_TIMINGS times, replay_s the least (what the pass costs an
 * engine); untimed: the pass once, replay_s NaN. */
enum kvcap_status prompt_replay(const struct model_ctx *mc, struct prompt *p, int timed);
void prompt_free(struct prompt *p);
enum kvcap_status prompt_to_cache(const struct model_ctx *mc, const struct prompt *p,
                                  struct kvcap_cache *cache, int seq, enum post_queries post);

/* The runtime YAML that keeps everything: record's cache and the run's `full` row. */
extern const char *const k_full_yaml;

/* A cache for the model under the runtime YAML (and artifact, or NULL) for n_seqs sequences;
 * record_dir: record mode's output folder, or NULL. */
enum kvcap_status create_cache(const struct model_ctx *mc, const char *yaml,
                               const struct kvcap_artifact *art, int n_seqs,
                               enum kvcap_dtype storage, int threads, const char *record_dir,
                               struct kvcap_cache **out);

/* The text of the first n tokens (control tokens as written) into out[cap], what is not valid
 * UTF-8 replaced by '?'. */
void generated_text(const struct model_ctx *mc, const int32_t *ids, int n, char *out,
                    size_t cap);

/* ---- record (record.c) ------------------------------------------------------------------- */
/* `kvcap-eval record`: returns the process exit status. */
int cmd_record(const struct options *opt);

/* ---- The run matrix (run.c) ------------------------------------------------------------- */
/* FreeKV's counters over a run's decode (kvcap_cache_stats). */
struct freekv_counts {
    int64_t head_steps, corrections, reselections, hidden, pages_recalled, steps;
};

struct run {
    char id[96], label[80], yaml[1024];
    const char *policy;
    double retention;                 /* the target: fraction of the span's tokens (bytes) kept */
    double nominal;                   /* the policy's own parameter that reaches it */
    int extension;                    /* kvcap's own variant, not a paper's method */
    int match_vlcache;                /* find vlcache.budget so that the realised retention
                                       * is the target's (Algorithm 1 under-fills) */
    const char *vlcache_extra;        /* kvcap's variant's vlcache keys (+protect, +uniform) */
    const struct kvcap_artifact *art;
    int freekv_tokens;                /* span tokens FreeKV attends per KV head and step */
    int match_freekv;                 /* find the pages FreeKV attends so that the span bytes it
                                       * reads per step are the target's (match_freekv) */
    double held;                      /* span bytes held over full's; FreeKV: in its store and
                                       * pool together (realised is what it reads) */
    enum post_queries post;           /* the queries its cache takes after the prompt */
    double compress_ms;               /* per prompt: the cache's scoring and eviction, plus
                                       * (replay) the reconstruction pass beyond the prefill */
    double prefill_ms;                /* per prompt: the model's prefill, the denominator */
    struct kvcap_cache *cache;        /* the cache of the current phase */
    struct kvllama_group group;
    /* results */
    int32_t *generated;               /* [prompts][generate] */
    int32_t *forced_top1;             /* [prompts][continuation]: argmax under teacher forcing */
    double nll_sum, kl_sum;
    int64_t nll_count;
    double *prompt_nll, *prompt_kl;   /* [prompts]: the same sums per prompt (the report's
                                       * paired intervals) */
    double realised, bytes_held, bytes_held_span, bytes_read_step, step_ms;
    double *cos_sum, *err_sum;        /* [layers] */
    int64_t attn_count;
    struct freekv_counts fkv;
    int32_t *answers;                 /* [task queries][answer tokens] */
    double task_correct, task_same;   /* answers equal to the truth, to full's */
    double task_span_bytes;           /* span bytes held over the task's prompts */
    double *task_correct_depth;       /* [depth bins] */
    /* random eviction: its seed; the seed-0 run of a retention also counts the seeds that
     * follow it in runs[] (n_seeds) and, once fold_seeds has run, holds their mean and each
     * seed's own KL and dNLL; the others are then not written */
    int shipped; /* the row --shipped names: kvcap's configuration chosen in advance */
    int seed, n_seeds;
    double seed_kl[RANDOM_SEEDS_MAX], seed_dnll[RANDOM_SEEDS_MAX];
};

/* A target a policy's run could not be matched to (FreeKV reading more than it at its fewest
 * pages): no row, named in metrics.json with what it reads at best. */
struct unreached {
    const char *policy;
    double retention, floor;
};

/* The bytes a cache holds for the span, and whether any run takes the queries `post` names. */
enum kvcap_status span_bytes(const struct kvcap_cache *c, double *bytes);
int runs_take(const struct run *runs, int n_runs, enum post_queries post);
/* A cache of one run holding every prompt, prefill ended. */
enum kvcap_status run_cache(const struct options *o, const struct model_ctx *mc,
                            const struct run *run, const struct prompt *prompts, int n_prompts,
                            struct kvcap_cache **out);
/* Every run's cache for the prompts (measure: its bytes and realised retention too), and
 * freeing them again. */
enum kvcap_status phase_setup(const struct options *o, const struct model_ctx *mc,
                              struct run *runs, int n_runs, const struct prompt *prompts,
                              int n_prompts, int measure);
void phase_teardown(struct run *runs, int n_runs);
/* `kvcap-eval run`: returns the process exit status. */
int cmd_run(const struct options *opt, int argc, char **argv);

/* ---- Decode and fidelity phases (fidelity.c) --------------------------------------------- */
enum decode_mode {
    DECODE_GREEDY, /* each run continues with its own argmax: out[run][prompt][steps] */
    DECODE_FORCED  /* the true continuation is fed: NLL, KL and argmax vs full */
};

/* Held-out token t of every prompt into the cache at layer l, its queries into q. */
enum kvcap_status fidelity_step(const struct model_ctx *mc, struct kvcap_cache *cache,
                                const struct prompt *prompts, int n_prompts, int l, int t,
                                float *q);
/* Decodes `steps` tokens after every prompt, all runs batched (runs[0] is full). */
enum kvcap_status decode_phase(const struct options *o, const struct model_ctx *mc,
                               struct run *runs, int n_runs, const struct prompt *prompts,
                               int n_prompts, enum decode_mode mode, int steps, int32_t **out,
                               int time, const char *what);
/* Per layer, every run's attention outputs against full's on the prompts' next tokens. */
enum kvcap_status attention_fidelity(const struct options *o, const struct model_ctx *mc,
                                     struct run *runs, int n_runs,
                                     const struct prompt *prompts, int n_prompts);

/* ---- The retrieval task (task.c) --------------------------------------------------------- */
struct task {
    int n;              /* queries */
    int keys, values;   /* names in the span; lines (codes) of the asked one */
    int answer_tokens;  /* greedy tokens an answer is read from: TASK_ANSWER_TOKENS a value */
    int32_t *ids;       /* [n][max_len] token ids of each prompt */
    int max_len;
    struct prompt *prompts;
    char (*truth)[TASK_VALUES_MAX][8]; /* [n][values] the asked name's codes */
    double *depth;      /* [n] start of the asked name's first line in the span, 0..1 */
    int *bin;           /* [n] depth bin */
    char (*full_answer)[TASK_ANSWER_CHARS]; /* [n] full's, as task_parse_answer gives it */
};

/* Builds o->task_queries queries on the corpus's text; task_run has every run answer them;
 * task_free frees the task (a zeroed one too). */
enum kvcap_status task_build(const struct options *o, const struct model_ctx *mc,
                             const struct corpus *corpus, struct task *t);
enum kvcap_status task_run(const struct options *o, const struct model_ctx *mc,
                           struct run *runs, int n_runs, struct task *t);
void task_free(struct task *t);
/* An answer as it is scored, from the text of its greedy tokens into out[cap]: for one value
 * the first run of digits after leading spaces; for several, every run of digits, sorted and
 * separated by spaces (order free). task_answer_correct: 1 when it holds the truth, for one
 * value exactly, for several every true code among its runs of digits. */
void task_parse_answer(const char *text, int values, char *out, size_t cap);
int task_answer_correct(const char *answer, const char (*truth)[8], int values);

/* ---- metrics.json (metrics.c) ------------------------------------------------------------ */
/* Writes metrics.json to `path`: the setup, every row (random eviction's seeds folded into
 * their seed-0 row), the masks and the notes. im and embd: the image track's, else NULL. */
enum kvcap_status write_metrics(const struct options *o, const struct model_ctx *mc,
                                const struct corpus *corpus, struct run *runs, int n_runs,
                                int n_prompts, const struct task *task, double bandwidth_gbs,
                                const char *command, const struct image_set *im,
                                const float *embd, int crop0, const struct unreached *unreached,
                                int n_unreached, const char *path);

#endif
