/* main.c — kvcap-calibrate: fits per-layer KV compressors from a recorded dataset and writes a
 * mergeable calibration state (.kvcs), with a summary table and optional metrics JSON. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calibrate/calibrate.h"
#include "cli/cli.h"
#include "common/internal.h"

extern const char kvcap_default_calib_yaml[];

static void usage(FILE *out)
{
    fprintf(out,
            "usage: kvcap-calibrate --data DIR|FILE [--data ...] --out STATE.kvcs [options]\n"
            "\n"
            "Fits, per layer, KV head and bucket, a value basis (sequence-axis PCA) and a key\n"
            "mask + reconstructor from K/V activations recorded from a model, and writes a\n"
            "calibration state: raw Gram sums (so states from separate runs merge exactly with\n"
            "kvcap-convert), the fitted maps and validation metrics on a held-out split.\n"
            "\n"
            "options:\n"
            "  -c, --config FILE        calibration config (YAML: model, buckets, schedule, keys,\n"
            "                           validation, storage); default: the embedded SmolLM2-135M\n"
            "                           config (configs/smollm2-135m.calib.yaml)\n"
            "  -d, --data PATH          dataset shard or folder of shards (repeatable; also\n"
            "                           accepted as plain arguments). Shards are memory-mapped:\n"
            "                           replace one by renaming a new file over it, never by\n"
            "                           truncating or rewriting it in place while this runs\n"
            "                           (SIGBUS; formats/SPEC.md section 1)\n"
            "  -o, --out FILE           calibration state to write\n"
            "  -m, --metrics-json FILE  also write the per layer/head/bucket metrics as JSON\n"
            "      --skip-unmatched     skip spans whose grid matches no bucket (default: error)\n"
            "      --device DEV         where the Grams are accumulated, the value PCA runs and\n"
            "                           the key maps are trained (keys.method: trained): cuda,\n"
            "                           cpu or auto (default: cuda when a CUDA device is visible,\n"
            "                           else cpu). Grams and PCA agree to rounding (double\n"
            "                           precision), trained maps to float rounding amplified by\n"
            "                           Adam. Reading and preprocessing the spans, closed-form\n"
            "                           keys and validation run on the CPU either way. All Grams\n"
            "                           (and each unit's training columns) must fit in device\n"
            "                           memory: cuda fails naming the sizes, auto falls back to\n"
            "                           cpu; cuda without a device is an error\n"
            "  -q, --quiet              no progress or summary\n"
            "  -v, --verbose            also print per-unit training reports\n"
            "  -V, --version            print the kvcap version\n"
            "  -h, --help               show this help\n");
}

struct phase_progress {
    struct cli_progress bar;
    const char *phase;
    int quiet;
};

static void on_progress(const char *phase, int64_t done, int64_t total, void *user)
{
    struct phase_progress *p = user;
    if (p->phase != phase) {
        p->phase = phase;
        cli_progress_begin(&p->bar, phase, p->quiet);
    }
    cli_progress_update(&p->bar, done, total);
}

/* Mean over KV heads of one metric for (layer, bucket); NaN if none is defined. */
static double head_mean(const struct kvcap_calib_state *s, int l, int b, int metric)
{
    double sum = 0.0;
    int n = 0;
    for (int h = 0; h < s->model.n_kv_heads; h++) {
        double v = kvcap_state_unit(s, l, h, b)->metrics[metric];
        if (!isnan(v))
            sum += v, n++;
    }
    return n ? sum / n : NAN;
}

static void cell(double v, const char *fmt)
{
    if (isnan(v))
        printf(" %8s", "-");
    else
        printf(fmt, v);
}

/* "a", "a and b", "a, b and c" */
static void print_list(const char *const *items, int n)
{
    for (int i = 0; i < n; i++)
        printf("%s%s", i == 0 ? "" : i == n - 1 ? " and " : ", ", items[i]);
}

static void print_device(const struct kvcap_calib_state *s, const struct kvcap_calibrate_report *r)
{
    if (r->device != KVCAP_CALIB_DEVICE_CUDA) {
        printf("device: cpu\n");
        return;
    }
    const char *on_device[3], *on_cpu[5];
    int nd = 0, nc = 0;
    int pca = r->fit.values_device == KVCAP_CALIB_DEVICE_CUDA;
    int trained = s->key_method == KVCAP_KEY_METHOD_TRAINED;
    int train = trained && r->train_device == KVCAP_CALIB_DEVICE_CUDA;
    on_device[nd++] = "Gram accumulation";
    on_cpu[nc++] = "span preprocessing";
    on_cpu[nc++] = "closed-form keys";
    if (pca)
        on_device[nd++] = "value PCA";
    else
        on_cpu[nc++] = "value PCA";
    if (train)
        on_device[nd++] = "key training";
    else if (trained)
        on_cpu[nc++] = "key training";
    on_cpu[nc++] = "validation";
    printf("device: cuda (%s): ", r->device_name);
    print_list(on_device, nd);
    printf("; ");
    print_list(on_cpu, nc);
    printf(" on the CPU\n");
}

static void print_summary(const struct kvcap_calib_state *s, const struct kvcap_calibrate_report *r)
{
    printf("\n");
    print_device(s, r);
    printf("spans: %lld seen, %lld skipped;", (long long)r->spans_seen, (long long)r->spans_skipped);
    for (int b = 0; b < s->n_buckets; b++)
        printf(" bucket %d: %lld train / %lld validation;", b, (long long)s->train_spans[b],
               (long long)s->val_spans[b]);
    printf("\ntime: accumulate %.2fs (%.1f GFLOP/s Gram), fit %.2fs, train %.2fs, validate %.2fs\n",
           r->seconds_accumulate,
           r->seconds_accumulate > 0 ? r->gram_flops / r->seconds_accumulate * 1e-9 : 0.0,
           r->seconds_fit, r->seconds_train, r->seconds_validate);
    printf("validation metrics, mean over KV heads (attention = decode queries vs full "
           "attention):\n");
    printf("%6s %6s %6s %5s %5s %5s %5s %8s %8s %8s %8s %8s\n", "bucket", "layer", "r_k", "R_k",
           "h", "r_v", "R_v", "v_expl", "v_rel", "k_rel", "attn_cos", "attn_rel");
    static const int shown[] = {KVCAP_METRIC_V_EXPLAINED, KVCAP_METRIC_V_REL, KVCAP_METRIC_K_REL,
                                KVCAP_METRIC_ATTN_COS, KVCAP_METRIC_ATTN_REL};
    for (int b = 0; b < s->n_buckets; b++) {
        double sum[5] = {0}, rk = 0, rv = 0;
        int count[5] = {0}, L = s->model.n_layers;
        for (int l = 0; l < L; l++) {
            const struct kvcap_calib_unit *u = kvcap_state_unit(s, l, 0, b);
            printf("%6d %6d %6.3f %5d %5d %5.3f %5d", b, l, s->r_keys[l], u->keys.rk, u->keys.h,
                   s->r_values[l], kvcap_retained(s->r_values[l], u->m));
            rk += s->r_keys[l];
            rv += s->r_values[l];
            for (int i = 0; i < 5; i++) {
                double v = head_mean(s, l, b, shown[i]);
                cell(v, " %8.5f");
                if (!isnan(v))
                    sum[i] += v, count[i]++;
            }
            printf("\n");
        }
        printf("%6d %6s %6.3f %5s %5s %5.3f %5s", b, "mean", rk / L, "", "", rv / L, "");
        for (int i = 0; i < 5; i++)
            cell(count[i] ? sum[i] / count[i] : NAN, " %8.5f");
        printf("\n");
    }
    fflush(stdout);
}

static int write_metrics_json(const char *path, const struct kvcap_calib_state *s,
                              const struct kvcap_calibrate_report *r)
{
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "model", s->model.name);
    cJSON_AddStringToObject(root, "device", kvcap_calib_device_name(r->device));
    cJSON_AddStringToObject(root, "value_pca_device",
                            kvcap_calib_device_name(r->fit.values_device));
    if (s->key_method == KVCAP_KEY_METHOD_TRAINED)
        cJSON_AddStringToObject(root, "train_device", kvcap_calib_device_name(r->train_device));
    cJSON *units = cJSON_AddArrayToObject(root, "units");
    for (int l = 0; l < s->model.n_layers; l++)
        for (int h = 0; h < s->model.n_kv_heads; h++)
            for (int b = 0; b < s->n_buckets; b++) {
                const struct kvcap_calib_unit *u = kvcap_state_unit(s, l, h, b);
                cJSON *o = cJSON_CreateObject();
                cJSON_AddNumberToObject(o, "layer", l);
                cJSON_AddNumberToObject(o, "kv_head", h);
                cJSON_AddNumberToObject(o, "bucket", b);
                cJSON_AddNumberToObject(o, "R_k", u->keys.rk);
                cJSON_AddNumberToObject(o, "h", u->keys.h);
                cJSON_AddNumberToObject(o, "R_v", kvcap_retained(s->r_values[l], u->m));
                cJSON *m = cJSON_AddObjectToObject(o, "metrics");
                for (int i = 0; i < KVCAP_METRIC_COUNT; i++) {
                    if (isnan(u->metrics[i]))
                        cJSON_AddNullToObject(m, kvcap_metric_name(i));
                    else
                        cJSON_AddNumberToObject(m, kvcap_metric_name(i), u->metrics[i]);
                }
                cJSON_AddItemToArray(units, o);
            }
    cJSON *t = cJSON_AddObjectToObject(root, "seconds");
    cJSON_AddNumberToObject(t, "accumulate", r->seconds_accumulate);
    cJSON_AddNumberToObject(t, "fit", r->seconds_fit);
    cJSON_AddNumberToObject(t, "train", r->seconds_train);
    cJSON_AddNumberToObject(t, "validate", r->seconds_validate);
    char *text = cJSON_Print(root);
    cJSON_Delete(root);
    if (!text) {
        fprintf(stderr, "kvcap-calibrate: error: %s: out of memory for the metrics\n", path);
        return 1;
    }
    /* atomic, and never onto a device or FIFO (a failed plain write used to remove(path)) */
    enum kvcap_status st = kvcap_write_file_atomic(path, text, strlen(text));
    cJSON_free(text);
    return st == KVCAP_OK ? 0 : cli_fail(st);
}

int main(int argc, char **argv)
{
    enum { SKIP = 1000, DEVICE };
    static const struct option options[] = {
        {"config", required_argument, NULL, 'c'},       {"data", required_argument, NULL, 'd'},
        {"out", required_argument, NULL, 'o'},          {"metrics-json", required_argument, NULL, 'm'},
        {"skip-unmatched", no_argument, NULL, SKIP},    {"device", required_argument, NULL, DEVICE},
        {"quiet", no_argument, NULL, 'q'},              {"verbose", no_argument, NULL, 'v'},
        {"version", no_argument, NULL, 'V'},            {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0}};
    cli_init("kvcap-calibrate", 0);
    const char *config_path = NULL, *out = NULL, *metrics = NULL;
    const char **data = calloc((size_t)argc + 1, sizeof *data);
    int n_data = 0, quiet = 0, verbose = 0, skip = 0, c;
    enum kvcap_calib_device device = KVCAP_CALIB_DEVICE_AUTO;
    if (!data)
        return 1;
    while ((c = getopt_long(argc, argv, "c:d:o:m:qvVh", options, NULL)) != -1) {
        switch (c) {
        case 'c': config_path = optarg; break;
        case 'd': data[n_data++] = optarg; break;
        case 'o': out = optarg; break;
        case 'm': metrics = optarg; break;
        case SKIP: skip = 1; break;
        case DEVICE:
            if (!kvcap_calib_device_parse(optarg, &device)) {
                free(data);
                return cli_usage_error("--device: '%s' is not cuda, cpu or auto", optarg);
            }
            break;
        case 'q': quiet = 1; break;
        case 'v': verbose = 1; break;
        case 'V': printf("kvcap-calibrate %s\n", kvcap_version()); free(data); return 0;
        case 'h': usage(stdout); free(data); return 0;
        default: free(data); return cli_usage_error("unknown option");
        }
    }
    while (optind < argc)
        data[n_data++] = argv[optind++];
    if (!out || n_data == 0) {
        free(data);
        return cli_usage_error(!out ? "--out STATE.kvcs is required" : "--data PATH is required");
    }
    {
        struct cli_path outs[2] = {{"--out", out}, {"--metrics-json", metrics}};
        struct cli_path *ins = calloc((size_t)n_data + 1, sizeof *ins);
        int bad = !ins;
        for (int i = 0; ins && i < n_data; i++)
            ins[i] = (struct cli_path){"--data", data[i]};
        if (ins)
            ins[n_data] = (struct cli_path){"--config", config_path};
        bad = bad ? cli_usage_error("out of memory") : cli_check_outputs(outs, 2, ins, n_data + 1);
        if (!bad) /* shards read twice would count their spans twice */
            bad = cli_check_inputs(ins, n_data);
        free(ins);
        if (bad) {
            free(data);
            return bad;
        }
    }
    cli_init("kvcap-calibrate", verbose);
    const char *no_cuda = kvcap_calib_cuda_unavailable();
    if (device == KVCAP_CALIB_DEVICE_CUDA && no_cuda) {
        fprintf(stderr, "kvcap-calibrate: error: --device cuda: %s; use --device cpu or auto\n",
                no_cuda);
        free(data);
        return 1;
    }

    struct kvcap_calib_config cfg;
    enum kvcap_status st =
        config_path ? kvcap_calib_config_load_file(config_path, &cfg)
                    : kvcap_calib_config_load_string(kvcap_default_calib_yaml,
                                                     "embedded:smollm2-135m.calib.yaml", &cfg);
    if (st != KVCAP_OK) {
        free(data);
        return cli_fail(st);
    }
    struct kvcap_calibrate_options o;
    kvcap_calibrate_default_options(&o);
    o.data = data;
    o.n_data = n_data;
    o.skip_unmatched = skip;
    o.device = device;
    struct phase_progress progress = {.quiet = quiet};
    o.progress = on_progress;
    o.user = &progress;
    struct kvcap_calib_state state;
    struct kvcap_calibrate_report report;
    st = kvcap_calibrate(&cfg, &o, &state, &report);
    const int have_state = st == KVCAP_OK;
    if (st == KVCAP_OK) {
        char note[512];
        size_t used = 0;
        for (int i = 0; i < n_data && used < sizeof note; i++)
            used += (size_t)snprintf(note + used, sizeof note - used, "%s%s", i ? " " : "", data[i]);
        state.data_note = strdup(note);
        st = kvcap_calib_state_write(&state, out);
    }
    int rc = st == KVCAP_OK ? 0 : cli_fail(st);
    if (rc == 0 && metrics)
        rc = write_metrics_json(metrics, &state, &report);
    if (rc == 0 && !quiet) {
        print_summary(&state, &report);
        fprintf(stderr, "kvcap-calibrate: wrote %s\n", out);
    }
    if (have_state) /* also when writing it failed */
        kvcap_calib_state_free(&state);
    kvcap_calib_config_free(&cfg);
    free(data);
    return rc;
}
