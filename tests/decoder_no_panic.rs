//! The decoder never panics: arbitrary bytes, and real messages with bytes flipped, cut or
//! inserted, all come back as `Ok` or `Err`. (Long runs: `cargo fuzz run decode` in fuzz/.)

use bytes::Bytes;
use pgapply::protocol::pgoutput::{decode, Context};
use pgapply::protocol::ReplicationFrame;
use proptest::prelude::*;

fn fixture_messages() -> &'static [Vec<u8>] {
    static MESSAGES: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    MESSAGES.get_or_init(load_fixture_messages)
}

fn load_fixture_messages() -> Vec<Vec<u8>> {
    let mut all = Vec::new();
    for name in [
        "v1.txt",
        "v2-streaming.txt",
        "v3-two-phase.txt",
        "v4-parallel.txt",
        "v1-binary.txt",
    ] {
        let path = format!(
            "{}/tests/fixtures/pgoutput/{name}",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read_to_string(path).unwrap();
        // A sample of each file is enough: the shapes repeat.
        for line in text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .take(200)
        {
            let bytes: Vec<u8> = (0..line.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&line[i..i + 2], 16).unwrap())
                .collect();
            if bytes.len() <= 4096 {
                all.push(bytes);
            }
        }
    }
    all
}

fn decode_every_way(bytes: &[u8]) {
    for in_stream_block in [false, true] {
        for abort_info in [false, true] {
            let context = Context {
                in_stream_block,
                abort_info,
            };
            if let Ok(m) = decode(Bytes::copy_from_slice(bytes), context) {
                // Reading every value of a decoded tuple must not panic either.
                let _ = format!("{m:?}");
            }
        }
    }
    let mut framed = vec![b'w'];
    framed.extend_from_slice(&[0; 24]);
    framed.extend_from_slice(bytes);
    let _ = ReplicationFrame::parse(Bytes::from(framed));
    let _ = ReplicationFrame::parse(Bytes::copy_from_slice(bytes));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, .. ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        decode_every_way(&bytes);
    }

    #[test]
    fn arbitrary_bytes_after_a_valid_tag(tag in prop::sample::select(b"BCORYIUDTMSEcAbPKrpw".to_vec()), rest in proptest::collection::vec(any::<u8>(), 0..128)) {
        let mut bytes = vec![tag];
        bytes.extend(rest);
        decode_every_way(&bytes);
    }

    #[test]
    fn mutated_real_messages(index in any::<prop::sample::Index>(), edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..6)) {
        let messages = fixture_messages();
        let mut bytes = index.get(messages).clone();
        for (at, byte, kind) in edits {
            if bytes.is_empty() { break; }
            let i = at.index(bytes.len());
            match kind {
                0 => bytes[i] = byte,
                1 => bytes.truncate(i),
                _ => bytes.insert(i, byte),
            }
        }
        decode_every_way(&bytes);
    }
}
