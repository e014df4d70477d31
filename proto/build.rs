//! Generates the wire types with `protox` (a pure-Rust protobuf compiler), so a fresh
//! machine needs nothing but cargo: no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = [
        "proto/relay/v1/tunnel.proto",
        "proto/relay/v1/dispatch.proto",
    ];
    for f in files {
        println!("cargo:rerun-if-changed={f}");
    }
    let fds = protox::compile(files, ["proto"])?;
    // `build_transport(false)`: the generated `connect` constructor would clash with the
    // `Tunnel.Connect` RPC; clients are built from a `Channel` instead.
    // `bytes(["."])`: every `bytes` field is a `bytes::Bytes`, so body chunks and header
    // values move between the socket buffers, hyper and the frames without a copy.
    tonic_prost_build::configure()
        .build_transport(false)
        .bytes(".")
        // Smaller per-RPC codec buffers than tonic's 8 KiB (see `codec`).
        .codec_path("crate::codec::RelayCodec")
        .compile_fds(fds)?;
    Ok(())
}
