//! Finds libfusedce for the linker, in this order:
//!   1. FUSEDCE_LIB_DIR: the directory holding libfusedce.so (a CMake build dir, or
//!      <prefix>/lib); FUSEDCE_INCLUDE_DIR optionally names the directory of fusedce.h.
//!   2. `pkg-config --libs --cflags fusedce` (the fusedce.pc that `make install` puts in
//!      <prefix>/lib/pkgconfig; PKG_CONFIG_PATH reaches other prefixes).
//!
//! Nothing else: no bindgen here (src/bindings.rs is pre-generated and committed) and no
//! dependency (pkg-config runs through std::process::Command).
//!
//! For crates that depend on this one (`links = "fusedce"`), it exports DEP_FUSEDCE_LIB_DIR
//! and, when known, DEP_FUSEDCE_INCLUDE (the directory of fusedce.h). It also adds an rpath to
//! this crate's own test binaries so that they find the library without LD_LIBRARY_PATH.
use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const ENV_VARS: &[&str] = &[
    "FUSEDCE_LIB_DIR",
    "FUSEDCE_INCLUDE_DIR",
    "PKG_CONFIG",
    "PKG_CONFIG_PATH",
    "PKG_CONFIG_LIBDIR",
    "PKG_CONFIG_SYSROOT_DIR",
];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/bindings.rs");
    for var in ENV_VARS {
        println!("cargo:rerun-if-env-changed={var}");
    }
    // docs.rs-style builds have no library to link against; the declarations document fine.
    if env::var_os("DOCS_RS").is_some() {
        return;
    }

    let include_dir = env::var_os("FUSEDCE_INCLUDE_DIR").map(PathBuf::from);
    if let Some(lib_dir) = env::var_os("FUSEDCE_LIB_DIR") {
        let lib_dir = PathBuf::from(lib_dir);
        if !has_library(&lib_dir) {
            panic!(
                "\n\nfusedce-sys: FUSEDCE_LIB_DIR={} holds no libfusedce (libfusedce.so, \
                 libfusedce.dylib or libfusedce.a).\nPoint it at the directory that does, \
                 e.g. the CMake build dir after `make` (build/), or <prefix>/lib after \
                 `make install`.\n\n",
                lib_dir.display()
            );
        }
        link(&[lib_dir], include_dir);
        return;
    }

    match pkg_config() {
        Ok((lib_dirs, include_dirs)) => {
            link(&lib_dirs, include_dir.or_else(|| include_dirs.into_iter().next()))
        }
        Err(why) => panic!(
            "\n\nfusedce-sys: cannot find libfusedce.\n\
             - FUSEDCE_LIB_DIR is not set: set it to the directory holding libfusedce.so, e.g.\n\
             \x20   FUSEDCE_LIB_DIR=/path/to/fusedce/build cargo build\n\
             \x20 (and FUSEDCE_INCLUDE_DIR=/path/to/fusedce/include if you want the header found);\n\
             - pkg-config did not find it either: {why}\n\
             \x20 install fusedce (`make install PREFIX=...`) and set \
             PKG_CONFIG_PATH=<prefix>/lib/pkgconfig.\n\
             At run time the dynamic loader must find libfusedce.so too (LD_LIBRARY_PATH, or \
             an installed library).\n\n"
        ),
    }
}

fn has_library(dir: &Path) -> bool {
    let Ok(entries) = fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().any(|e| {
        let name = e.file_name();
        let name = name.to_string_lossy();
        name == "libfusedce.so"
            || name.starts_with("libfusedce.so.")
            || name == "libfusedce.dylib"
            || name == "libfusedce.a"
            || name == "fusedce.lib"
    })
}

/// Runs `pkg-config --libs --cflags fusedce`; returns its -L and -I directories.
fn pkg_config() -> Result<(Vec<PathBuf>, Vec<PathBuf>), String> {
    let program = env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".to_string());
    let output = Command::new(&program)
        .args(["--libs", "--cflags", "fusedce"])
        .output()
        .map_err(|e| format!("could not run `{program}`: {e}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        return Err(format!(
            "`{program} --libs --cflags fusedce` failed ({}): {}",
            output.status,
            stderr.trim()
        ));
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let mut lib_dirs = Vec::new();
    let mut include_dirs = Vec::new();
    let mut names_fusedce = false;
    for flag in stdout.split_whitespace() {
        if let Some(dir) = flag.strip_prefix("-L") {
            lib_dirs.push(PathBuf::from(dir));
        } else if let Some(dir) = flag.strip_prefix("-I") {
            include_dirs.push(PathBuf::from(dir));
        } else if flag == "-lfusedce" {
            names_fusedce = true;
        } else if let Some(lib) = flag.strip_prefix("-l") {
            // Anything else the .pc file asks for (none today).
            println!("cargo:rustc-link-lib={lib}");
        }
    }
    if !names_fusedce {
        return Err(format!(
            "`{program}` answered without -lfusedce: {}",
            stdout.trim()
        ));
    }
    Ok((lib_dirs, include_dirs))
}

fn link(lib_dirs: &[PathBuf], include_dir: Option<PathBuf>) {
    for dir in lib_dirs {
        println!("cargo:rustc-link-search=native={}", dir.display());
    }
    println!("cargo:rustc-link-lib=fusedce");
    if let Some(dir) = lib_dirs.first() {
        // Metadata for dependents (DEP_FUSEDCE_LIB_DIR), and an rpath for our own tests.
        println!("cargo:lib_dir={}", dir.display());
        let os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
        if os != "windows" {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
        }
    }
    if let Some(dir) = include_dir {
        println!("cargo:include={}", dir.display());
        check_header_version(&dir);
    }
}

/// Warns when the fusedce.h found differs in version from the one src/bindings.rs came from.
fn check_header_version(include_dir: &Path) {
    let header = include_dir.join("fusedce.h");
    println!("cargo:rerun-if-changed={}", header.display());
    let Ok(text) = fs::read_to_string(&header) else {
        println!(
            "cargo:warning=fusedce-sys: no fusedce.h in {} (FUSEDCE_INCLUDE_DIR / pkg-config -I)",
            include_dir.display()
        );
        return;
    };
    let bindings = include_str!("src/bindings.rs");
    for part in ["MAJOR", "MINOR", "PATCH"] {
        let name = format!("FCE_VERSION_{part}");
        let in_header = text.lines().find_map(|l| {
            let rest = l.trim().strip_prefix("#define")?.trim();
            rest.strip_prefix(name.as_str())?.trim().parse::<u32>().ok()
        });
        let in_bindings = bindings.lines().find_map(|l| {
            let rest = l.trim().strip_prefix(&format!("pub const {name}: u32 ="))?;
            rest.trim().trim_end_matches(';').trim().parse::<u32>().ok()
        });
        if in_header != in_bindings {
            println!(
                "cargo:warning=fusedce-sys: {} has {name} {:?} but src/bindings.rs was generated \
                 from {:?}: run bindings/rust/regen.sh",
                header.display(),
                in_header,
                in_bindings
            );
        }
    }
}
