/* bench_calibrate.c — kvcap-bench-calibrate: times calibration at a realistic scale against
 * this machine's own ceilings measured in the same run: Gram accumulation vs the best dsyrk
 * rate, value PCA vs a bare LAPACKE_dsyevd of the same size, and the total wall time. */
#include <cblas.h>
#include <getopt.h>
#include <lapacke.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "calibrate.h"
#include "cli.h"
#include "internal.h"
#include "rng.h"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: kvcap-bench-calibrate [options]\n"
            "\n"
            "Generates (or reads) a dataset for a 28-layer x 4-KV-head x d128 model with one\n"
            "32x32 bucket (n = 1024) and times kvcap_calibrate, printing each phase next to the\n"
            "ceiling it is measured against in the same run.\n"
            "\n"
            "options:\n"
            "  -n, --spans N      spans to generate (default 200)\n"
            "  -l, --layers L     layers (default 28)\n"
            "  -g, --grid RxC     span grid (default 32x32)\n"
            "  -d, --data DIR     use this dataset instead of generating one (its geometry must\n"
            "                     match the options)\n"
            "  -w, --work DIR     where to generate the dataset (default: $TMPDIR or /tmp)\n"
            "  -k, --keep         keep the generated dataset\n"
            "  -h, --help         show this help\n");
}

/* Best dsyrk rate (GFLOP/s, counting m(m+1)k flops) over a few k for an m x m Gram. */
static double dsyrk_roofline(int m, int *best_k, double *rate_at_512)
{
    double best = 0.0;
    for (int k = 256; k <= 4096; k *= 2) {
        double *a = malloc(sizeof(double) * (size_t)m * k), *c = calloc((size_t)m * m, sizeof(double));
        if (!a || !c) {
            free(a), free(c);
            break;
        }
        struct kvcap_rng r;
        kvcap_rng_seed(&r, (uint64_t)k);
        for (size_t i = 0; i < (size_t)m * k; i++)
            a[i] = kvcap_rng_uniform(&r) - 0.5;
        cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, m, k, 1.0, a, k, 1.0, c, m);
        int reps = 8192 / k + 2;
        double t0 = kvcap_seconds();
        for (int i = 0; i < reps; i++)
            cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, m, k, 1.0, a, k, 1.0, c, m);
        double rate = reps * (double)m * (m + 1) * k / (kvcap_seconds() - t0) * 1e-9;
        if (k == 512)
            *rate_at_512 = rate;
        if (rate > best)
            best = rate, *best_k = k;
        free(a), free(c);
    }
    return best;
}

/* Seconds of one bare LAPACKE_dsyevd on an m x m Gram of random data (best of 3). */
static double bare_dsyevd(int m)
{
    size_t mm = (size_t)m * m;
    double *x = malloc(sizeof(double) * mm), *g = malloc(sizeof(double) * mm);
    double *w = malloc(sizeof(double) * (size_t)m), best = 1e30;
    struct kvcap_rng r;
    kvcap_rng_seed(&r, 5);
    for (size_t i = 0; i < mm; i++)
        x[i] = kvcap_rng_normal(&r);
    cblas_dsyrk(CblasRowMajor, CblasUpper, CblasNoTrans, m, m, 1.0, x, m, 0.0, g, m);
    for (int rep = 0; rep < 3; rep++) {
        memcpy(x, g, sizeof(double) * mm);
        double t0 = kvcap_seconds();
        LAPACKE_dsyevd(LAPACK_ROW_MAJOR, 'V', 'U', m, x, m, w);
        double t = kvcap_seconds() - t0;
        best = t < best ? t : best;
    }
    free(x), free(g), free(w);
    return best;
}

static void rm_dataset(const char *dir, int shards)
{
    char path[4200];
    for (int i = 0; i < shards + 8; i++) {
        snprintf(path, sizeof path, "%s/shard-%05d.safetensors", dir, i);
        unlink(path);
    }
    rmdir(dir);
}

int main(int argc, char **argv)
{
    static const struct option options[] = {
        {"spans", required_argument, NULL, 'n'}, {"layers", required_argument, NULL, 'l'},
        {"grid", required_argument, NULL, 'g'},  {"data", required_argument, NULL, 'd'},
        {"work", required_argument, NULL, 'w'},  {"keep", no_argument, NULL, 'k'},
        {"help", no_argument, NULL, 'h'},        {NULL, 0, NULL, 0}};
    int spans = 200, layers = 28, rows = 32, cols = 32, keep = 0, c;
    const char *data = NULL, *work = getenv("TMPDIR");
    cli_init("kvcap-bench-calibrate", 0);
    while ((c = getopt_long(argc, argv, "n:l:g:d:w:kh", options, NULL)) != -1) {
        switch (c) {
        case 'n': spans = atoi(optarg); break;
        case 'l': layers = atoi(optarg); break;
        case 'g':
            if (sscanf(optarg, "%dx%d", &rows, &cols) != 2)
                return cli_usage_error("--grid: '%s' is not ROWSxCOLS", optarg);
            break;
        case 'd': data = optarg; break;
        case 'w': work = optarg; break;
        case 'k': keep = 1; break;
        case 'h': usage(stdout); return 0;
        default: return cli_usage_error("unknown option");
        }
    }
    if (spans < 2 || layers < 1 || layers > 1024 || rows < 1 || cols < 1)
        return cli_usage_error("--spans >= 2, --layers in 1..1024 and a positive grid are needed");

    char yaml[1024];
    snprintf(yaml, sizeof yaml,
             "model: {name: bench-28x4x128, layers: %d, q_heads: 28, kv_heads: 4, head_dim: 128,\n"
             "        rope: {type: mrope, pairing: half, theta: 1000000, sections: [16, 24, 24]}}\n"
             "buckets: [{rows: %d, cols: %d}]\n"
             "schedule: {keys: {kind: uniform, ratio: 0.4}, values: {kind: uniform, ratio: 0.4}}\n"
             "validation: {fraction: 0.1}\n",
             layers, rows, cols);
    struct kvcap_calib_config cfg;
    enum kvcap_status st = kvcap_calib_config_load_string(yaml, "bench", &cfg);
    if (st != KVCAP_OK)
        return cli_fail(st);
    int m = rows * cols;
    char dir[4096];
    double t_synth = 0.0;
    int generated = 0;
    if (!data) {
        snprintf(dir, sizeof dir, "%s/kvcap-bench-XXXXXX", work ? work : "/tmp");
        if (!mkdtemp(dir))
            return cli_usage_error("cannot create a folder under %s", work ? work : "/tmp");
        struct kvcap_synth_params p;
        kvcap_synth_default_params(&p);
        p.n_spans = spans;
        p.n_grids = 1;
        p.grid_rows[0] = rows;
        p.grid_cols[0] = cols;
        p.rank_k = 48;
        p.rank_v = 48;
        p.post_queries = 0;
        p.decode_queries = 1;
        struct cli_progress bar;
        cli_progress_begin(&bar, "generate", 0);
        double t0 = kvcap_seconds();
        st = kvcap_synth(&cfg.model, &p, dir, cli_progress_callback, &bar);
        t_synth = kvcap_seconds() - t0;
        if (st != KVCAP_OK) {
            rm_dataset(dir, spans);
            return cli_fail(st);
        }
        data = dir;
        generated = 1;
    }

    int best_k = 0;
    double at512 = 0.0;
    double roof = dsyrk_roofline(m, &best_k, &at512);
    double eig_bare = bare_dsyevd(m);

    struct kvcap_calibrate_options o;
    kvcap_calibrate_default_options(&o);
    const char *paths[1] = {data};
    o.data = paths;
    o.n_data = 1;
    struct kvcap_calib_state state;
    struct kvcap_calibrate_report r;
    double t0 = kvcap_seconds();
    st = kvcap_calibrate(&cfg, &o, &state, &r);
    double t_total = kvcap_seconds() - t0;
    /* The machine's speed drifts (shared host): measure the ceilings again after the run and
     * keep the best, so the ratio is never flattered by a slow ceiling measurement. */
    int best_k2 = 0;
    double at512_2 = 0.0, roof2 = dsyrk_roofline(m, &best_k2, &at512_2);
    if (roof2 > roof)
        roof = roof2, best_k = best_k2, at512 = at512_2;
    double eig_bare2 = bare_dsyevd(m);
    eig_bare = eig_bare2 < eig_bare ? eig_bare2 : eig_bare;
    if (generated && !keep)
        rm_dataset(dir, spans);
    if (st != KVCAP_OK)
        return cli_fail(st);

    double gram_rate = r.gram_flops / r.seconds_accumulate * 1e-9;
    double per_eig = r.fit.value_fits ? r.fit.values_seconds / r.fit.value_fits : 0.0;
    printf("\nkvcap calibration benchmark: %d layers x 4 KV heads x d128, bucket %dx%d (n = %d), "
           "%lld spans (%lld training)\n",
           layers, rows, cols, m, (long long)r.spans_seen, (long long)state.train_spans[0]);
    printf("%-34s %12s %14s %10s\n", "phase", "seconds", "rate", "vs ceiling");
    printf("%-34s %12.2f %10.1f GF/s %9.0f%%   (ceiling: best 2-core dsyrk m=%d, %.1f GF/s at "
           "k=%d; %.1f at k=512; best of before and after the run)\n",
           "Gram accumulation (K and V)", r.seconds_accumulate, gram_rate, 100 * gram_rate / roof,
           m, roof, best_k, at512);
    printf("%-34s %12.2f %10.3f s/op %9.2fx   (ceiling: bare LAPACKE_dsyevd n=%d, %.3f s)\n",
           "value PCA per unit (wall / units)", r.fit.values_seconds, per_eig,
           eig_bare > 0 ? per_eig / eig_bare : 0.0, m, eig_bare);
    printf("%-34s %12.2f %10.3f s/op\n", "closed-form keys per unit (wall)", r.fit.keys_seconds,
           r.fit.key_fits ? r.fit.keys_seconds / r.fit.key_fits : 0.0);
    printf("%-34s %12.2f\n", "validation metrics", r.seconds_validate);
    printf("%-34s %12.2f   (dataset generation, not included: %.2f s)\n", "total kvcap_calibrate",
           t_total, t_synth);
    kvcap_calib_state_free(&state);
    kvcap_calib_config_free(&cfg);
    return 0;
}
