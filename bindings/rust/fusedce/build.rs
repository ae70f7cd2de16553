//! Gives this crate's tests and examples an rpath to the libfusedce that fusedce-sys linked
//! (DEP_FUSEDCE_LIB_DIR), so that `cargo test` / `cargo run --example` find it at run time
//! without LD_LIBRARY_PATH. Libraries that depend on `fusedce` are not affected.
fn main() {
    println!("cargo:rerun-if-env-changed=DEP_FUSEDCE_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_FUSEDCE_LIB_DIR") {
        if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("windows") {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        }
    }
}
