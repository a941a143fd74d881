/*
 * optim.c: the host optimizer from C. AdamW (with amsgrad, and as Adam), then SGD with Nesterov
 * momentum, over an odd-sized buffer, checked bit for bit against PyTorch's update rule written
 * out below (one rounding per operation; `fmaf` where ATen fuses a multiply and an add), and
 * bad arguments refused with a message.
 *
 *   cargo build --release -p teraio-capi
 *   cc -std=c99 -O2 -ffp-contract=off -Wall -Wextra -Ibindings/c/include \
 *      bindings/c/examples/optim.c -Ltarget/release -lteraio -lm -o optim
 *   LD_LIBRARY_PATH=target/release ./optim
 *
 * Exit status 0 and "optim: ok" when every element matched. (-ffp-contract=off: the reference
 * must not let the compiler fuse what PyTorch does not.)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "teraio.h"

#define CHECK(call)                                                                        \
    do {                                                                                   \
        teraio_status s_ = (call);                                                         \
        if (s_ != TERAIO_OK) {                                                             \
            fprintf(stderr, "optim: %s failed: %s (%d): %s\n", #call,                      \
                    teraio_status_name(s_), s_, teraio_last_error_message());              \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

/* A refused call: its status and a message containing `what`. */
#define REFUSED(call, what)                                                                \
    do {                                                                                   \
        teraio_status s_ = (call);                                                         \
        if (s_ != TERAIO_ERR_INVALID_ARGUMENT ||                                           \
            !strstr(teraio_last_error_message(), (what))) {                                \
            fprintf(stderr, "optim: %s gave %d (%s), expected an error naming %s\n", #call, \
                    s_, teraio_last_error_message(), (what));                              \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static volatile double half = 0.5; /* pow(x, 0.5), as Python's x ** 0.5, never a sqrt */

/* torch.optim.AdamW / Adam, single-tensor CPU step, one element. */
static void adam_ref(const teraio_adamw_params *h, unsigned long long step, float *p, float g,
                     float *m, float *v, float *vmax) {
    if (h->maximize) g = -g;
    if (h->weight_decay != 0) {
        if (h->decoupled_weight_decay)
            *p = *p * (float)(1 - h->lr * h->weight_decay);
        else
            g = fmaf(*p, (float)h->weight_decay, g); /* grad.add(param, alpha=wd) */
    }
    float w = (float)(1 - h->beta1); /* exp_avg.lerp_(grad, 1 - beta1) */
    *m = fabsf(w) < 0.5f ? fmaf(w, g - *m, *m) : fmaf(w - 1.0f, g - *m, g);
    /* exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2) */
    *v = fmaf((float)(1 - h->beta2) * g, g, *v * (float)h->beta2);
    float sq = *v;
    if (h->amsgrad) {
        if (!(*vmax > sq || isnan(*vmax))) *vmax = sq;
        sq = *vmax;
    }
    double bc1 = 1 - pow(h->beta1, (double)step), bc2 = 1 - pow(h->beta2, (double)step);
    float denom = sqrtf(sq) / (float)pow(bc2, half) + (float)h->eps;
    *p = *p + ((float)(-(h->lr / bc1)) * *m) / denom; /* addcdiv_ */
}

/* torch.optim.SGD, single-tensor CPU step, one element. */
static void sgd_ref(const teraio_sgd_params *h, int fresh, float *p, float g, float *buf) {
    if (h->maximize) g = -g;
    if (h->weight_decay != 0) g = fmaf(*p, (float)h->weight_decay, g);
    if (h->momentum != 0) {
        *buf = fresh ? g : fmaf(g, (float)(1 - h->dampening), *buf * (float)h->momentum);
        g = h->nesterov ? fmaf(*buf, (float)h->momentum, g) : *buf;
    }
    *p = fmaf(g, (float)(-h->lr), *p);
}

static float value(size_t i, unsigned seed) {
    return (float)((i * 2654435761u ^ seed) % 20001u) / 10000.0f - 1.0f;
}

static int same(const float *a, const float *b, size_t n, const char *what) {
    if (memcmp(a, b, n * sizeof(float)) == 0) return 1;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) {
            fprintf(stderr, "optim: %s differs at %zu: %.9g vs %.9g\n", what, i, a[i], b[i]);
            break;
        }
    return 0;
}

int main(void) {
    const size_t n = 100003; /* odd: not a multiple of any vector width */
    float *buf = calloc(10 * n, sizeof(float));
    if (!buf) return 1;
    float *p = buf, *m = buf + n, *v = buf + 2 * n, *x = buf + 3 * n, *g = buf + 4 * n;
    float *rp = buf + 5 * n, *rm = buf + 6 * n, *rv = buf + 7 * n, *rx = buf + 8 * n;

    for (int variant = 0; variant < 2; variant++) {
        teraio_adamw_params h = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                                 .weight_decay = 0.05, .amsgrad = variant == 0,
                                 .maximize = 0, .decoupled_weight_decay = variant == 0,
                                 .threads = 0};
        for (size_t i = 0; i < n; i++) {
            p[i] = rp[i] = value(i, 1);
            m[i] = v[i] = x[i] = rm[i] = rv[i] = rx[i] = 0.0f;
        }
        for (unsigned long long step = 1; step <= 3; step++) {
            for (size_t i = 0; i < n; i++) g[i] = value(i, (unsigned)step + 7u) * 0.1f;
            CHECK(teraio_adamw_step(&h, step, p, g, m, v, h.amsgrad ? x : NULL, n));
            for (size_t i = 0; i < n; i++) adam_ref(&h, step, &rp[i], g[i], &rm[i], &rv[i], &rx[i]);
        }
        if (!same(p, rp, n, "param") || !same(m, rm, n, "exp_avg") ||
            !same(v, rv, n, "exp_avg_sq") || !same(x, rx, n, "max_exp_avg_sq"))
            return 1;
        printf("optim: %s%s, 3 steps over %zu elements: bitwise as the rule\n",
               variant == 0 ? "AdamW" : "Adam", h.amsgrad ? " (amsgrad)" : "", n);
    }

    teraio_sgd_params s = {.lr = 0.1, .momentum = 0.9, .dampening = 0.0, .weight_decay = 1e-4,
                           .nesterov = 1, .maximize = 0, .threads = 2};
    for (size_t i = 0; i < n; i++) p[i] = rp[i] = value(i, 3);
    for (int step = 0; step < 3; step++) {
        for (size_t i = 0; i < n; i++) g[i] = value(i, (unsigned)step + 20u);
        CHECK(teraio_sgd_step(&s, p, g, m, step == 0, n));
        for (size_t i = 0; i < n; i++) sgd_ref(&s, step == 0, &rp[i], g[i], &rm[i]);
    }
    if (!same(p, rp, n, "param") || !same(m, rm, n, "momentum_buffer")) return 1;
    printf("optim: SGD (nesterov), 3 steps: bitwise as the rule\n");

    /* Refused, nothing written. */
    teraio_adamw_params bad = {.lr = -1.0, .beta1 = 0.9, .beta2 = 0.999, .decoupled_weight_decay = 1};
    REFUSED(teraio_adamw_step(&bad, 1, p, g, m, v, NULL, n), "lr = -1");
    bad.lr = 1e-3;
    REFUSED(teraio_adamw_step(NULL, 1, p, g, m, v, NULL, n), "`params` is NULL");
    REFUSED(teraio_adamw_step(&bad, 0, p, g, m, v, NULL, n), "step = 0");
    REFUSED(teraio_adamw_step(&bad, 1, p, NULL, m, v, NULL, n), "`grad` is NULL");
    REFUSED(teraio_adamw_step(&bad, 1, p, g, m, m, NULL, n), "overlap");
    bad.amsgrad = 1;
    REFUSED(teraio_adamw_step(&bad, 1, p, g, m, v, NULL, n), "`max_exp_avg_sq` is NULL");
    s.momentum = 0.0;
    REFUSED(teraio_sgd_step(&s, p, g, NULL, 0, n), "nesterov");
    if (!same(p, rp, n, "param after refused calls")) return 1;

    free(buf);
    printf("optim: ok\n");
    return 0;
}
