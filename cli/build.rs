//! With the engine's `spdk` feature on, give the `teraio` binary an rpath to SPDK's libraries
//! (the engine's build script found them through pkg-config), so it runs without
//! LD_LIBRARY_PATH.

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TERAIO_SPDK_LIBDIR");
    if let Ok(dir) = std::env::var("DEP_TERAIO_SPDK_LIBDIR") {
        println!("cargo:rustc-link-arg-bins=-Wl,-rpath,{dir}");
    }
}
