//! Finds libfusedce for the linker, in this order:
//!   0. with the `bundled` feature: builds it from the repository's sources (FUSEDCE_SOURCE_DIR,
//!      default the CMakeLists.txt two folders above this crate) by running cmake into OUT_DIR,
//!      and links that: FUSEDCE_BUNDLED_CUDA=ON/OFF/auto (auto, the default: the CUDA backend
//!      when nvcc is found, as `make` decides), FUSEDCE_BUNDLED_CUDA_ARCHS (CMake's
//!      CMAKE_CUDA_ARCHITECTURES, default the library's), CMAKE (the cmake program);
//!   1. FUSEDCE_LIB_DIR: the directory holding libfusedce.so (a CMake build dir, or
//!      <prefix>/lib); FUSEDCE_INCLUDE_DIR optionally names the directory of fusedce.h.
//!   2. `pkg-config --libs --cflags fusedce` (the fusedce.pc that `make install` puts in
//!      <prefix>/lib/pkgconfig; PKG_CONFIG_PATH reaches other prefixes).
//!
//! Nothing else: no bindgen here (src/bindings.rs is pre-generated and committed) and no
//! dependency (pkg-config and cmake run through std::process::Command).
//!
//! For crates that depend on this one (`links = "fusedce"`), it exports DEP_FUSEDCE_LIB_DIR
//! and, when known, DEP_FUSEDCE_INCLUDE (the directory of fusedce.h). It also adds an rpath to
//! this crate's own test binaries so that they find the library without LD_LIBRARY_PATH.
use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const ENV_VARS: &[&str] = &[
    "FUSEDCE_SOURCE_DIR",
    "FUSEDCE_BUNDLED_CUDA",
    "FUSEDCE_BUNDLED_CUDA_ARCHS",
    "CMAKE",
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

    if env::var_os("CARGO_FEATURE_BUNDLED").is_some() {
        let (lib_dir, include_dir) = build_bundled();
        link(&[lib_dir], Some(include_dir));
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

/// The `bundled` feature: configures and builds the library target of the repository's
/// CMakeLists.txt into OUT_DIR/build (no tests, examples or NCCL companion); returns the
/// directory holding libfusedce.so and the one holding fusedce.h.
fn build_bundled() -> (PathBuf, PathBuf) {
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let source = env::var_os("FUSEDCE_SOURCE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| manifest.join("../../.."));
    let source = source.canonicalize().unwrap_or(source);
    if !source.join("CMakeLists.txt").is_file() || !source.join("include/fusedce.h").is_file() {
        panic!(
            "\n\nfusedce-sys (bundled): no fusedce sources in {} (CMakeLists.txt, \
             include/fusedce.h). The `bundled` feature builds the repository this crate sits in \
             (a path or git dependency); set FUSEDCE_SOURCE_DIR to a checkout otherwise.\n\n",
            source.display()
        );
    }
    for dir in ["lib", "include", "cmake"] {
        println!("cargo:rerun-if-changed={}", source.join(dir).display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        source.join("CMakeLists.txt").display()
    );

    let build = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR")).join("build");
    let cmake = env::var("CMAKE").unwrap_or_else(|_| "cmake".to_string());
    let mut configure = Command::new(&cmake);
    configure
        .arg("-S")
        .arg(&source)
        .arg("-B")
        .arg(&build)
        .args([
            "-DCMAKE_BUILD_TYPE=Release",
            "-DFCE_BUILD_TESTS=OFF",
            "-DFCE_BUILD_EXAMPLES=OFF",
            "-DFCE_WITH_NCCL=OFF",
        ]);
    let cuda = env::var("FUSEDCE_BUNDLED_CUDA").unwrap_or_else(|_| "auto".to_string());
    match cuda.as_str() {
        "ON" | "on" | "1" => {
            configure.arg("-DFCE_WITH_CUDA=ON");
        }
        "OFF" | "off" | "0" => {
            configure.arg("-DFCE_WITH_CUDA=OFF");
        }
        "auto" => {
            let nvcc = find_nvcc();
            configure.arg(format!(
                "-DFCE_WITH_CUDA={}",
                if nvcc.is_some() { "ON" } else { "OFF" }
            ));
            match nvcc {
                Some(nvcc) => {
                    configure.arg(format!("-DCMAKE_CUDA_COMPILER={}", nvcc.display()));
                }
                None => println!(
                    "cargo:warning=fusedce-sys (bundled): nvcc not found (PATH, CUDA_HOME, \
                     /usr/local/cuda/bin): libfusedce is built without its CUDA backend \
                     (FUSEDCE_BUNDLED_CUDA=ON to require it)"
                ),
            }
        }
        other => panic!("fusedce-sys (bundled): FUSEDCE_BUNDLED_CUDA={other}: ON, OFF or auto"),
    }
    if let Ok(archs) = env::var("FUSEDCE_BUNDLED_CUDA_ARCHS") {
        configure.arg(format!("-DCMAKE_CUDA_ARCHITECTURES={archs}"));
    }
    run(&mut configure, "configure");
    let jobs = env::var("NUM_JOBS").unwrap_or_else(|_| "2".to_string());
    run(
        Command::new(&cmake)
            .arg("--build")
            .arg(&build)
            .args(["--target", "fusedce", "-j", &jobs]),
        "build",
    );
    (build, source.join("include"))
}

fn find_nvcc() -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = env::var_os("PATH")
        .map(|p| env::split_paths(&p).collect())
        .unwrap_or_default();
    if let Some(home) = env::var_os("CUDA_HOME") {
        dirs.push(PathBuf::from(home).join("bin"));
    }
    dirs.push(PathBuf::from("/usr/local/cuda/bin"));
    dirs.into_iter()
        .map(|d| d.join("nvcc"))
        .find(|p| p.is_file())
}

fn run(command: &mut Command, what: &str) {
    let status = command
        .status()
        .unwrap_or_else(|e| panic!("fusedce-sys (bundled): cannot run cmake ({what}): {e}"));
    if !status.success() {
        panic!(
            "\n\nfusedce-sys (bundled): cmake {what} failed ({status}): {command:?}\n\
             It needs CMake >= 3.24, a C++ compiler and OpenBLAS (libopenblas-dev).\n\n"
        );
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
