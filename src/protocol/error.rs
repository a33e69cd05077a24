use std::fmt;

/// Bytes from the server that do not form the message they claim to be.
///
/// Names the message ("Insert", "XLogData"), the field being read, and the byte offset of that
/// field within the message, so a bad frame can be found again in a capture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    pub message: &'static str,
    pub field: &'static str,
    /// For fields inside tuple data: the 1-based column number.
    pub column: Option<usize>,
    pub offset: usize,
    pub kind: DecodeErrorKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeErrorKind {
    /// The message ends before the field does.
    Truncated {
        needed: usize,
        available: usize,
    },
    /// A tag byte that is not defined at this position.
    UnknownTag(u8),
    /// A length or count that is negative or larger than the rest of the message.
    InvalidLength(i64),
    /// A string without its terminating NUL byte.
    MissingTerminator,
    InvalidUtf8,
    /// Bytes left over after the last field.
    TrailingBytes(usize),
    /// The message is empty: not even a tag.
    Empty,
}

impl DecodeError {
    pub(crate) fn new(
        message: &'static str,
        field: &'static str,
        offset: usize,
        kind: DecodeErrorKind,
    ) -> Self {
        DecodeError {
            message,
            field,
            column: None,
            offset,
            kind,
        }
    }
}

fn tag_text(tag: u8) -> String {
    if tag.is_ascii_graphic() {
        format!("'{}' (0x{tag:02x})", tag as char)
    } else {
        format!("0x{tag:02x}")
    }
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "malformed {} message: {}", self.message, self.field)?;
        if let Some(column) = self.column {
            write!(f, " of column {column}")?;
        }
        write!(f, " at byte offset {}: ", self.offset)?;
        match &self.kind {
            DecodeErrorKind::Truncated { needed, available } => {
                write!(f, "truncated (needs {needed} bytes, {available} left)")
            }
            DecodeErrorKind::UnknownTag(tag) => write!(f, "unknown tag {}", tag_text(*tag)),
            DecodeErrorKind::InvalidLength(len) => {
                write!(f, "invalid length or count {len}")
            }
            DecodeErrorKind::MissingTerminator => write!(f, "string has no terminating NUL byte"),
            DecodeErrorKind::InvalidUtf8 => write!(f, "string is not valid UTF-8"),
            DecodeErrorKind::TrailingBytes(n) => {
                write!(f, "{n} unexpected bytes after the last field")
            }
            DecodeErrorKind::Empty => write!(f, "empty message"),
        }
    }
}

impl std::error::Error for DecodeError {}
