//! Rivulet's public gRPC contract, package `rivulet.v1`, generated from `proto/` at build time.
//!
//! Both the server (`rivulet-scheduler`) and clients (the end-to-end tests, benchmarks) use these
//! types; domain types live in the scheduler and convert at its edge.

pub mod proto {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("rivulet.v1");

    /// Encoded file descriptor set, served by gRPC server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("rivulet_v1_descriptor");
}
