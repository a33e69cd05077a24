//! Arbitrary bytes through every decoding entry point: none may panic.
#![no_main]

use bytes::Bytes;
use pgapply::protocol::pgoutput::{decode, Context, LogicalMessage, OldRow};
use pgapply::protocol::{MessageDecoder, ReplicationFrame, Tuple, Value};

/// Reads every value of a tuple, so that lazy value decoding is exercised too.
fn walk(tuple: &Tuple) -> usize {
    tuple
        .values()
        .map(|v| match v {
            Value::Null | Value::UnchangedToast => 0,
            Value::Text(b) | Value::Binary(b) => b.len(),
        })
        .sum()
}

fn walk_old(old: &OldRow) -> usize {
    walk(old.tuple())
}

fn touch(message: &LogicalMessage) -> usize {
    match message {
        LogicalMessage::Insert(i) => i.new.values().count() + walk(&i.new),
        LogicalMessage::Update(u) => walk(&u.new) + u.old.as_ref().map_or(0, walk_old),
        LogicalMessage::Delete(d) => walk_old(&d.old),
        _ => 0,
    }
}

fn decode_all_contexts(data: &[u8]) {
    for in_stream_block in [false, true] {
        for abort_info in [false, true] {
            let context = Context { in_stream_block, abort_info };
            if let Ok(message) = decode(Bytes::copy_from_slice(data), context) {
                std::hint::black_box(touch(&message));
            }
        }
    }
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    // The walsender frame; an XLogData payload is a pgoutput message, so decode it too.
    if let Ok(ReplicationFrame::XLogData { data: payload, .. }) =
        ReplicationFrame::parse(Bytes::copy_from_slice(data))
    {
        decode_all_contexts(&payload);
    }

    // The data as one pgoutput message, with every context.
    decode_all_contexts(data);

    // The data as a sequence of messages (split at 0xFF) through the stateful decoder,
    // which tracks stream blocks across messages.
    let mut decoder = MessageDecoder::new(false);
    for chunk in data.split(|&b| b == 0xFF) {
        if let Ok(message) = decoder.decode(Bytes::copy_from_slice(chunk)) {
            std::hint::black_box(touch(&message));
        }
    }
});
