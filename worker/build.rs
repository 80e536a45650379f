//! Links `libtorch_cuda` explicitly when the torch installation has it. Nothing in the worker
//! calls into it directly, so the linker's `--as-needed` would drop it, and libtorch would then
//! report that CUDA is absent even on a GPU machine.
//!
//! With it, and with the CUDA runtime's headers beside torch (the `nvidia` wheels PyPI's torch
//! depends on), also compiles `cuda/graph_shim.cpp` (CUDA graph capture, which tch does not wrap)
//! and sets `cfg(rivulet_cuda_graphs)`, and, where NVRTC's and the driver's headers are there
//! too, `cuda/kernel_shim.cpp` (kernels of our own, compiled at run time by NVRTC) and
//! `cfg(rivulet_cuda_kernels)`; without them the worker runs every CUDA step eagerly, on
//! libtorch's ops alone.

use std::path::{Path, PathBuf};
use std::process::Command;

fn python(code: &str) -> Option<String> {
    let python = std::env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".to_owned());
    let output = Command::new(python).args(["-c", code]).output().ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

fn torch_lib_dir() -> Option<PathBuf> {
    if let Some(libtorch) = std::env::var_os("LIBTORCH") {
        return Some(PathBuf::from(libtorch).join("lib"));
    }
    python("import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))").map(PathBuf::from)
}

/// The folders holding the CUDA runtime's headers: CUDA_HOME's; or, from the wheels beside torch,
/// `nvidia`'s runtime headers with the `crt/` folder they include (part of nvcc, which is not
/// installed; Triton, a torch dependency, ships one with its own CUDA headers).
fn cuda_include_dirs(torch_lib: &Path) -> Option<Vec<PathBuf>> {
    if let Some(home) = std::env::var_os("CUDA_HOME") {
        let include = PathBuf::from(home).join("include");
        if include.join("crt/host_config.h").exists() {
            return Some(vec![include]);
        }
    }
    let site_packages = torch_lib.parent().and_then(Path::parent)?;
    let runtime = ["cu13", "cu12"]
        .iter()
        .map(|version| site_packages.join("nvidia").join(version).join("include"))
        .find(|dir| dir.join("cuda_runtime_api.h").exists())?;
    if runtime.join("crt/host_config.h").exists() {
        return Some(vec![runtime]);
    }
    let crt = site_packages.join("triton/backends/nvidia/include");
    crt.join("crt/host_config.h").exists().then(|| vec![runtime, crt])
}

/// What the C++ shims could be built with.
struct CudaShims {
    graphs: bool,
    kernels: bool,
}

fn build_cuda_shims(torch_lib: &Path) -> CudaShims {
    let none = CudaShims {
        graphs: false,
        kernels: false,
    };
    let Some(torch_include) = torch_lib.parent().map(|torch| torch.join("include")) else {
        return none;
    };
    if !torch_include.join("ATen/cuda/CUDAGraph.h").exists() {
        return none;
    }
    let Some(cuda_includes) = cuda_include_dirs(torch_lib) else {
        println!("cargo:warning=no CUDA runtime headers found: CUDA steps run without graphs");
        return none;
    };
    // The kernel shim declares NVRTC's and the driver's calls from their headers (it opens the
    // libraries at run time); without them decode attention gathers its blocks.
    let kernels = ["nvrtc.h", "cuda.h"]
        .iter()
        .all(|header| cuda_includes.iter().any(|dir| dir.join(header).exists()));
    if !kernels {
        println!(
            "cargo:warning=no nvrtc.h/cuda.h beside the CUDA runtime's headers: decode attention gathers its KV blocks"
        );
    }
    let cxx11_abi = python("import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))").unwrap_or_else(|| "1".into());
    let mut build = cc::Build::new();
    build.cpp(true).file("cuda/graph_shim.cpp");
    if kernels {
        build.file("cuda/kernel_shim.cpp");
    }
    build
        .include(&torch_include)
        .include(torch_include.join("torch/csrc/api/include"))
        .includes(cuda_includes)
        .flag("-std=c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", cxx11_abi.as_str())
        .warnings(false)
        .compile("rivulet_cuda_shim");
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-lc10_cuda,--as-needed");
    if kernels {
        println!("cargo:rustc-link-lib=dl");
    }
    CudaShims { graphs: true, kernels }
}

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    println!("cargo:rerun-if-changed=cuda/graph_shim.cpp");
    println!("cargo:rerun-if-changed=cuda/kernel_shim.cpp");
    println!("cargo:rerun-if-changed=cuda/shim_answer.h");
    println!("cargo::rustc-check-cfg=cfg(rivulet_cuda_graphs)");
    println!("cargo::rustc-check-cfg=cfg(rivulet_cuda_kernels)");
    if let Some(dir) = torch_lib_dir() {
        if dir.join("libtorch_cuda.so").exists() {
            println!("cargo:rustc-link-search=native={}", dir.display());
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
            let shims = build_cuda_shims(&dir);
            if shims.graphs {
                println!("cargo:rustc-cfg=rivulet_cuda_graphs");
            }
            if shims.kernels {
                println!("cargo:rustc-cfg=rivulet_cuda_kernels");
            }
        }
    }
}
