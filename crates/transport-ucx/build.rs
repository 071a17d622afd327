//! Generates Rust bindings for the system's UCP headers (Debian's
//! `libucx-dev`) with bindgen, and links libucp/libucs. Does nothing unless
//! the `ucx` feature is on, so default builds need neither libucx nor
//! libclang.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/ucx.h");
    #[cfg(feature = "ucx")]
    ucx::generate();
}

#[cfg(feature = "ucx")]
mod ucx {
    use std::path::PathBuf;

    pub fn generate() {
        let lib = pkg_config::Config::new()
            .atleast_version("1.10")
            .probe("ucx")
            .expect(
                "the `ucx` feature needs UCX's headers and libraries: install libucx-dev \
                 (and libclang-dev for bindgen)",
            );
        let mut builder = bindgen::Builder::default()
            .header("src/ucx.h")
            .allowlist_function("ucp_.*")
            .allowlist_function("ucs_status_string")
            .allowlist_type("ucp_.*")
            .allowlist_type("ucs_status_t")
            .allowlist_var("UCP_.*")
            .allowlist_var("UCS_.*")
            .newtype_enum("ucs_status_t")
            .prepend_enum_name(false)
            .derive_default(true)
            .layout_tests(false)
            .generate_comments(false);
        for p in &lib.include_paths {
            builder = builder.clang_arg(format!("-I{}", p.display()));
        }
        let bindings = builder
            .generate()
            .expect("bindgen over <ucp/api/ucp.h> (is libclang-dev installed?)");
        let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
        bindings
            .write_to_file(out.join("ucp_bindings.rs"))
            .expect("write the UCP bindings");
    }
}
