//! TensorRecord::decode (no checksum of its own, so every byte reaches the parser): never
//! panics; whatever decodes re-encodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use teraio_layout::format::TensorRecord;

fuzz_target!(|data: &[u8]| {
    if let Ok(rec) = TensorRecord::decode(data) {
        assert_eq!(rec.encode().expect("a decoded record encodes"), data, "round trip");
    }
});
