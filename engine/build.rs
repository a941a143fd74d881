//! Build script of the engine. Without the `spdk` feature it does nothing. With it, it finds
//! an installed SPDK through pkg-config (PKG_CONFIG_PATH=PREFIX/lib/pkgconfig; build one with
//! scripts/build-spdk.sh), generates the bindings with bindgen and links SPDK's shared
//! libraries (docs/SPDK.md).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "spdk")]
    spdk::main();
}

#[cfg(feature = "spdk")]
mod spdk {
    use std::path::PathBuf;

    /// pkg-config packages of the SPDK libraries the backend uses (with their dependencies).
    const PACKAGES: &[&str] = &[
        "spdk_env_dpdk",
        "spdk_thread",
        "spdk_init",
        "spdk_bdev",
        "spdk_bdev_aio",
        "spdk_bdev_uring",
        "spdk_nvme",
        "spdk_event_bdev",
        "spdk_sock_posix",
        "spdk_syslibs",
    ];

    pub fn main() {
        println!("cargo:rerun-if-changed=src/backend/spdk/wrapper.h");
        println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
        let mut cfg = pkg_config::Config::new();
        cfg.cargo_metadata(false).print_system_libs(false).statik(true);
        let lib = match cfg.probe(&PACKAGES.join(" ")) {
            Ok(l) => l,
            Err(e) => {
                panic!(
                    "teraio-engine feature `spdk`: SPDK was not found through pkg-config ({e}).\n\
                     Build it with scripts/build-spdk.sh SRC_TARBALL PATCH PREFIX and set\n\
                     PKG_CONFIG_PATH=PREFIX/lib/pkgconfig (docs/SPDK.md)."
                )
            }
        };
        let libdir =
            lib.link_paths.first().cloned().expect("pkg-config names SPDK's library folder (-L)");
        for p in &lib.link_paths {
            println!("cargo:rustc-link-search=native={}", p.display());
        }
        // SPDK's own libraries are linked statically and whole: its shared module libraries
        // export no symbols (version scripts), and its modules (bdev_aio, bdev_uring, the
        // subsystems, the posix socket layer) register themselves from C constructors that
        // nothing references. DPDK and the system libraries stay shared.
        let mut seen = std::collections::HashSet::new();
        let (spdk, other): (Vec<&String>, Vec<&String>) = lib
            .libs
            .iter()
            .filter(|l| seen.insert(l.as_str()))
            .partition(|l| l.starts_with("spdk_"));
        for l in spdk {
            println!("cargo:rustc-link-lib=static:+whole-archive,-bundle={l}");
        }
        for l in other {
            println!("cargo:rustc-link-lib=dylib={l}");
        }
        // Dependents read DEP_TERAIO_SPDK_LIBDIR (rpath of their binaries, if ever needed).
        println!("cargo:libdir={}", libdir.display());
        // The tests start PREFIX/bin/nvmf_tgt (NVMe/TCP on loopback).
        println!("cargo:rustc-env=TERAIO_SPDK_LIBDIR={}", libdir.display());

        let mut builder = bindgen::Builder::default()
            .header("src/backend/spdk/wrapper.h")
            .allowlist_function("spdk_.*")
            .allowlist_function(
                "create_aio_bdev|bdev_aio_delete|create_uring_bdev|delete_uring_bdev",
            )
            .allowlist_type("spdk_.*|bdev_uring_opts")
            .allowlist_var("SPDK_.*")
            // Packed structs holding aligned fields cannot be represented (E0588); the backend
            // never reads their fields.
            .opaque_type("spdk_bdev_ext_io_opts")
            .opaque_type("spdk_nvme_ns_cmd_ext_io_opts")
            .opaque_type("spdk_nvme_ctrlr_data")
            .opaque_type("spdk_nvme_ns_data")
            .opaque_type("spdk_nvme_cmd")
            .opaque_type("spdk_nvme_cpl")
            .opaque_type("spdk_nvme_health_information_page")
            .opaque_type("spdk_nvme_tcp_.*")
            .opaque_type("spdk_nvmf_.*")
            .opaque_type("spdk_bdev_io")
            .opaque_type("spdk_bdev")
            .derive_default(true)
            .layout_tests(false)
            .generate_comments(false)
            .prepend_enum_name(false)
            .size_t_is_usize(true);
        for p in &lib.include_paths {
            builder = builder.clang_arg(format!("-I{}", p.display()));
        }
        let bindings = builder.generate().expect("bindgen over SPDK's headers");
        let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
        bindings.write_to_file(out.join("spdk_bindings.rs")).expect("writing the SPDK bindings");
    }
}
