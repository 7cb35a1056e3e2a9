//! Drives the frame decoder with arbitrary bytes: it must never panic, and a
//! decoded frame must re-encode to the same bytes.
#![no_main]

use backend_tcp_sim::wire;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The streaming path the NIC uses: prefix, then fields.
    if let Ok(p) = wire::decode_prefix(data) {
        let rest = &data[wire::PREFIX_LEN..];
        let n = p.fields_len().min(rest.len());
        let _ = wire::decode_fields(&p, &rest[..n]);
    }
    // The whole-frame path.
    if let Ok(d) = wire::decode(data) {
        assert!(d.consumed <= data.len());
        let head = wire::encode_head(&d.body, d.payload.len()).expect("decoded frames re-encode");
        assert_eq!(&data[..head.len()], &head[..], "re-encoding differs");
    }
});
