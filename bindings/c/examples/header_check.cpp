// The header as a C++ program includes it: compiled with `c++ -fsyntax-only` by .ci/bindings.sh.
#include "teraio.h"

#include <cstdio>

int main() {
    teraio_engine *engine = nullptr;
    teraio_status s = teraio_engine_open_toml("dir = \"/tmp/x\"\n", &engine);
    if (s != TERAIO_OK) std::printf("%s: %s\n", teraio_status_name(s), teraio_last_error_message());
    teraio_op *op = nullptr;
    unsigned char data[16] = {0};
    s = teraio_offload(engine, 1, data, sizeof data, nullptr, TERAIO_DEST_SSD,
                       TERAIO_PRIORITY_NORMAL, &op);
    s = teraio_wait(op, -1);
    int32_t outcome = 0;
    s = teraio_op_outcome(op, &outcome);
    return teraio_op_free(op) == TERAIO_OK && teraio_engine_close(engine) == TERAIO_OK ? 0 : 1;
}
