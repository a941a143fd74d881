/*
 * bench.c: offload+prefetch throughput through the C ABI, with the tensor mix of
 * `teraio bench --tensors` (log-uniform 1 MiB - 1 GiB, the same seeded draw, the same total),
 * so the two can be compared on the same engine configuration file.
 *
 *   bench CONFIG TOTAL_BYTES [SEED] [buffer|copy]
 *
 * buffer (default): engine buffers (teraio_buffer_alloc), moved without a copy, as the Rust
 * benchmark moves its engine buffers. copy: malloc'd memory, copied into engine memory at
 * offload and out of it when each prefetch is waited.
 * Prints one JSON line: tensors, total and offload/prefetch bytes per second.
 */
#define _POSIX_C_SOURCE 199309L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "teraio.h"

#define CHECK(call)                                                                        \
    do {                                                                                   \
        teraio_status s_ = (call);                                                         \
        if (s_ != TERAIO_OK) {                                                             \
            fprintf(stderr, "bench: %s failed: %s: %s\n", #call, teraio_status_name(s_),  \
                    teraio_last_error_message());                                          \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

/* rand 0.8's SmallRng on 64-bit targets: xoshiro256++ whose seed rand_core 0.6's default
 * seed_from_u64 fills with PCG32 outputs, so the sizes are those of
 * `teraio bench --tensors --seed SEED` (the benchmark script checks count, min and max). */
static uint64_t rng[4];
static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
static uint32_t pcg32(uint64_t *state) {
    *state = *state * 6364136223846793005ull + 11634580027462260723ull;
    uint64_t s = *state;
    uint32_t xorshifted = (uint32_t)(((s >> 18) ^ s) >> 27), rot = (uint32_t)(s >> 59);
    return (xorshifted >> rot) | (xorshifted << ((32 - rot) & 31));
}
static void rng_seed(uint64_t state) {
    for (int i = 0; i < 4; i++) {
        uint64_t lo = pcg32(&state), hi = pcg32(&state);
        rng[i] = lo | hi << 32;
    }
}
static uint64_t rng_next(void) {
    uint64_t r = rotl(rng[0] + rng[3], 23) + rng[0], t = rng[1] << 17;
    rng[2] ^= rng[0];
    rng[3] ^= rng[1];
    rng[1] ^= rng[2];
    rng[0] ^= rng[3];
    rng[2] ^= t;
    rng[3] = rotl(rng[3], 45);
    return r;
}
static double rng_f64(void) { return (double)(rng_next() >> 11) * (1.0 / 9007199254740992.0); }

static size_t mix(uint64_t total, uint64_t seed, uint64_t *sizes, size_t max) {
    const double lo = log((double)(1u << 20)), hi = log((double)(1u << 30));
    uint64_t sum = 0;
    size_t n = 0;
    rng_seed(seed);
    while (sum < total && n < max) {
        uint64_t s = (uint64_t)exp(lo + rng_f64() * (hi - lo));
        if (s > total - sum) s = total - sum;
        if (s < (1u << 20)) s = 1u << 20;
        sizes[n++] = s;
        sum += s;
    }
    return n;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: bench CONFIG TOTAL_BYTES [SEED] [buffer|copy]\n");
        return 2;
    }
    const char *config = argv[1];
    uint64_t total = strtoull(argv[2], NULL, 10);
    uint64_t seed = argc > 3 ? strtoull(argv[3], NULL, 10) : 1;
    int copy = argc > 4 && strcmp(argv[4], "copy") == 0;
    static uint64_t sizes[100000];
    size_t n = mix(total, seed, sizes, 100000);
    uint64_t min = sizes[0], max = sizes[0];
    for (size_t i = 0; i < n; i++) {
        if (sizes[i] < min) min = sizes[i];
        if (sizes[i] > max) max = sizes[i];
    }

    /* Host buffers for every tensor (copy mode: engine memory for the copies; an offload's
     * memory is released just after its wait returns, so leave room for both phases). */
    char over[128];
    snprintf(over, sizeof over, "{\"host_buffers\": %llu}",
             (unsigned long long)(2 * total + ((uint64_t)n + 128) * (2u << 20)));
    teraio_engine *engine = NULL;
    CHECK(teraio_engine_open_file(config, over, &engine));

    /* Memory is allocated and touched before the clock starts. */
    teraio_buffer **bufs = calloc(n, sizeof *bufs);
    unsigned char **mem = calloc(n, sizeof *mem);
    teraio_op **ops = calloc(n, sizeof *ops);
    for (size_t i = 0; i < n; i++) {
        if (copy) {
            mem[i] = malloc(sizes[i]);
            if (!mem[i]) return 1;
        } else {
            void *p = NULL;
            CHECK(teraio_buffer_alloc(sizes[i], &bufs[i]));
            CHECK(teraio_buffer_data(bufs[i], &p, NULL));
            mem[i] = p;
        }
        memset(mem[i], (int)(i & 0xff), sizes[i]);
    }

    double t0 = now();
    for (size_t i = 0; i < n; i++) {
        if (copy)
            CHECK(teraio_offload(engine, i, mem[i], sizes[i], NULL, TERAIO_DEST_SSD,
                                 TERAIO_PRIORITY_NORMAL, &ops[i]));
        else
            CHECK(teraio_offload_buffer(engine, i, bufs[i], NULL, TERAIO_DEST_SSD,
                                        TERAIO_PRIORITY_NORMAL, &ops[i]));
    }
    for (size_t i = 0; i < n; i++) {
        CHECK(teraio_wait(ops[i], -1));
        CHECK(teraio_op_free(ops[i]));
    }
    double offload_s = now() - t0;
    if (copy)
        for (size_t i = 0; i < n; i++) mem[i][0] = 0xff; /* the prefetch must bring it back */

    t0 = now();
    for (size_t i = 0; i < n; i++) {
        if (copy)
            CHECK(teraio_prefetch(engine, i, mem[i], sizes[i], TERAIO_PRIORITY_NORMAL, &ops[i]));
        else
            CHECK(teraio_prefetch_buffer(engine, i, bufs[i], TERAIO_PRIORITY_NORMAL, &ops[i]));
    }
    for (size_t i = 0; i < n; i++) {
        CHECK(teraio_wait(ops[i], -1));
        CHECK(teraio_op_free(ops[i]));
        if (mem[i][0] != (unsigned char)(i & 0xff)) {
            fprintf(stderr, "bench: tensor %zu came back with wrong bytes\n", i);
            return 1;
        }
    }
    double prefetch_s = now() - t0;
    CHECK(teraio_engine_close(engine));

    printf("{\"workload\": \"tensors\", \"mode\": \"%s\", \"tensors\": %zu, \"total_bytes\": %llu, "
           "\"min_tensor_bytes\": %llu, \"max_tensor_bytes\": %llu, "
           "\"offload\": {\"bw_bytes\": %.1f, \"runtime_s\": %.4f}, "
           "\"prefetch\": {\"bw_bytes\": %.1f, \"runtime_s\": %.4f}}\n",
           copy ? "copy" : "buffer", n, (unsigned long long)total, (unsigned long long)min,
           (unsigned long long)max, (double)total / offload_s, offload_s,
           (double)total / prefetch_s, prefetch_s);
    for (size_t i = 0; i < n; i++) {
        if (copy)
            free(mem[i]);
        else
            CHECK(teraio_buffer_free(bufs[i]));
    }
    return 0;
}
