//! Drives the drain protocol's control-message decoders with arbitrary
//! bytes: neither may panic, and a decoded message must re-encode (binary
//! and text) to exactly the bytes it came from.
#![no_main]

use kv_transfer_core::drain::{ControlMessage, MAX_LEN, TEXT_PREFIX};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = ControlMessage::decode(data) {
        assert!(data.len() <= MAX_LEN);
        assert_eq!(m.encode().expect("decoded messages re-encode"), data, "binary re-encoding differs");
        let text = m.encode_text().expect("decoded messages re-encode as text");
        assert_eq!(ControlMessage::decode_text(text.as_bytes()), Ok(m), "text armor does not round-trip");
    }
    if let Ok(m) = ControlMessage::decode_text(data) {
        assert!(data.starts_with(TEXT_PREFIX.as_bytes()));
        assert_eq!(m.encode_text().expect("decoded messages re-encode").as_bytes(), data, "text re-encoding differs");
        let bin = m.encode().expect("decoded messages re-encode");
        assert_eq!(ControlMessage::decode(&bin), Ok(m), "binary form does not round-trip");
    }
});
