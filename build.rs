//! Generates the `rivulet.v1` gRPC code from `proto/` into `OUT_DIR` (never committed).
//! `protoc` comes from `protoc-bin-vendored`, so a fresh machine needs no system package.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY of intent: build scripts are single-threaded; prost-build reads PROTOC.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let protos = ["proto/rivulet/v1/generation.proto", "proto/rivulet/v1/admin.proto"];
    tonic_prost_build::configure()
        .file_descriptor_set_path(out_dir.join("rivulet_v1_descriptor.bin"))
        .compile_protos(&protos, &["proto"])?;
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    Ok(())
}
