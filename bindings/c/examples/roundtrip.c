/*
 * roundtrip.c: open a file-backed teraio engine, offload a buffer, prefetch it back, check it.
 *
 *   cargo build --release -p teraio-capi
 *   cc -std=c99 -Wall -Wextra -Ibindings/c/include bindings/c/examples/roundtrip.c \
 *      -Ltarget/release -lteraio -o roundtrip
 *   LD_LIBRARY_PATH=target/release ./roundtrip /tmp/teraio-roundtrip
 *
 * Exit status 0 and "roundtrip: ok" when every byte came back.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "teraio.h"

/* Print the failing call, its status and teraio's message, and leave. */
#define CHECK(call)                                                                        \
    do {                                                                                   \
        teraio_status s_ = (call);                                                         \
        if (s_ != TERAIO_OK) {                                                             \
            fprintf(stderr, "roundtrip: %s failed: %s (%d): %s\n", #call,                  \
                    teraio_status_name(s_), s_, teraio_last_error_message());              \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static unsigned char pattern(size_t i) { return (unsigned char)(i * 31u + 7u); }

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "/tmp/teraio-roundtrip";
    char config[1024];
    snprintf(config, sizeof config,
             "dir = \"%s\"\nfiles = 2\nfile_size = \"64M\"\noverwrite = \"teraio\"\n", dir);

    printf("teraio %s (C ABI %u)\n", teraio_version(), teraio_abi_version());
    teraio_engine *engine = NULL;
    CHECK(teraio_engine_open_toml(config, &engine));

    /* 1. Caller memory: copied at offload, copied back when the prefetch is waited. */
    const size_t len = (3u << 20) + 17u; /* an odd size: not a multiple of any block */
    unsigned char *data = malloc(len), *back = malloc(len);
    if (!data || !back) return 1;
    for (size_t i = 0; i < len; i++) data[i] = pattern(i);

    teraio_op *op = NULL;
    CHECK(teraio_offload(engine, 42, data, len, "layer0.weight", TERAIO_DEST_SSD,
                         TERAIO_PRIORITY_NORMAL, &op));
    CHECK(teraio_wait(op, -1));
    int32_t outcome = -1;
    CHECK(teraio_op_outcome(op, &outcome));
    CHECK(teraio_op_free(op));
    if (outcome != TERAIO_OUTCOME_SSD) {
        fprintf(stderr, "roundtrip: offload outcome %d, expected SSD\n", outcome);
        return 1;
    }

    uint64_t id = 0;
    CHECK(teraio_lookup(engine, "layer0.weight", &id));
    memset(back, 0, len);
    CHECK(teraio_prefetch(engine, id, back, len, TERAIO_PRIORITY_URGENT, &op));
    CHECK(teraio_wait(op, -1));
    CHECK(teraio_op_free(op));
    if (memcmp(data, back, len) != 0) {
        fprintf(stderr, "roundtrip: tensor 42 came back different\n");
        return 1;
    }

    /* 2. Engine buffers: no copy at all. */
    teraio_buffer *buf = NULL;
    void *mem = NULL;
    size_t mem_len = 0;
    CHECK(teraio_buffer_alloc(len, &buf));
    CHECK(teraio_buffer_data(buf, &mem, &mem_len));
    memcpy(mem, data, len);
    CHECK(teraio_offload_buffer(engine, 43, buf, NULL, TERAIO_DEST_SSD, TERAIO_PRIORITY_NORMAL,
                                &op));
    CHECK(teraio_wait(op, -1));
    CHECK(teraio_op_free(op));
    memset(mem, 0, mem_len);
    CHECK(teraio_prefetch_buffer(engine, 43, buf, TERAIO_PRIORITY_URGENT, &op));
    CHECK(teraio_wait(op, -1));
    CHECK(teraio_op_free(op));
    if (mem_len != len || memcmp(mem, data, len) != 0) {
        fprintf(stderr, "roundtrip: tensor 43 came back different\n");
        return 1;
    }
    CHECK(teraio_buffer_free(buf));

    char *json = NULL;
    CHECK(teraio_list_tensors(engine, &json));
    printf("tensors: %s\n", json);
    CHECK(teraio_string_free(json));

    /* 3. Mistakes are status codes, not crashes. */
    teraio_status s = teraio_wait(op, 0); /* already freed */
    if (s != TERAIO_ERR_INVALID_HANDLE) {
        fprintf(stderr, "roundtrip: waiting a freed op gave %d\n", s);
        return 1;
    }
    printf("expected error: %s: %s\n", teraio_status_name(s), teraio_last_error_message());

    CHECK(teraio_engine_close(engine));
    s = teraio_engine_close(engine);
    if (s != TERAIO_ERR_CLOSED) {
        fprintf(stderr, "roundtrip: closing twice gave %d\n", s);
        return 1;
    }
    free(data);
    free(back);
    printf("roundtrip: ok (%zu bytes through caller memory and through an engine buffer)\n", len);
    return 0;
}
