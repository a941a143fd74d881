/* The SPDK API the `spdk` backend binds (bindgen, engine/build.rs). */
#include <spdk/stdinc.h>
#include <spdk/env.h>
#include <spdk/thread.h>
#include <spdk/bdev.h>
#include <spdk/accel.h>
#include <spdk/nvme.h>
#include <spdk/init.h>
#include <spdk/log.h>

/*
 * The file bdev modules' create/delete calls. Their headers (module/bdev/{aio,uring}/*.h) are
 * not installed by `make install`; these declarations are copied from the SPDK snapshot
 * scripts/build-spdk.sh builds (commit 3230130e6a) and the functions are exported by
 * libspdk_bdev_aio.so / libspdk_bdev_uring.so.
 */
typedef void (*delete_aio_bdev_complete)(void *cb_arg, int bdeverrno);
int create_aio_bdev(const char *name, const char *filename, uint32_t block_size, bool readonly,
		    bool falloc, const struct spdk_uuid *uuid, bool nowait);
void bdev_aio_delete(const char *name, delete_aio_bdev_complete cb_fn, void *cb_arg);

typedef void (*spdk_delete_uring_complete)(void *cb_arg, int bdeverrno);
struct bdev_uring_opts {
	const char *name;
	const char *filename;
	uint32_t block_size;
	struct spdk_uuid uuid;
};
struct spdk_bdev *create_uring_bdev(const struct bdev_uring_opts *opts);
void delete_uring_bdev(const char *name, spdk_delete_uring_complete cb_fn, void *cb_arg);
