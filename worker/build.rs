//! Links `libtorch_cuda` explicitly when the torch installation has it. Nothing in the worker
//! calls into it directly, so the linker's `--as-needed` would drop it, and libtorch would then
//! report that CUDA is absent even on a GPU machine.

use std::path::PathBuf;
use std::process::Command;

fn torch_lib_dir() -> Option<PathBuf> {
    if let Some(libtorch) = std::env::var_os("LIBTORCH") {
        return Some(PathBuf::from(libtorch).join("lib"));
    }
    let python = std::env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".to_owned());
    let output = Command::new(python)
        .args([
            "-c",
            "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))",
        ])
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| PathBuf::from(String::from_utf8_lossy(&output.stdout).trim()))
}

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    if let Some(dir) = torch_lib_dir() {
        if dir.join("libtorch_cuda.so").exists() {
            println!("cargo:rustc-link-search=native={}", dir.display());
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
        }
    }
}
