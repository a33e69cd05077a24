//! A bounds-checked reader over one message, handing out zero-copy `Bytes` slices.

use bytes::Bytes;

use super::error::{DecodeError, DecodeErrorKind};

pub(crate) struct Cursor {
    buf: Bytes,
    pos: usize,
    message: &'static str,
}

impl Cursor {
    pub(crate) fn new(buf: Bytes, message: &'static str) -> Self {
        Cursor {
            buf,
            pos: 0,
            message,
        }
    }

    /// Continues on the same bytes under another message name, once the tag has told which it is.
    pub(crate) fn rename(&mut self, message: &'static str) {
        self.message = message;
    }

    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    pub(crate) fn error(&self, field: &'static str, kind: DecodeErrorKind) -> DecodeError {
        DecodeError::new(self.message, field, self.pos, kind)
    }

    fn take<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let bytes = self
            .buf
            .get(self.pos..self.pos + N)
            .ok_or_else(|| self.truncated(field, N))?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        self.pos += N;
        Ok(out)
    }

    fn truncated(&self, field: &'static str, needed: usize) -> DecodeError {
        self.error(
            field,
            DecodeErrorKind::Truncated {
                needed,
                available: self.remaining(),
            },
        )
    }

    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(self.take::<1>(field)?[0])
    }

    pub(crate) fn peek_u8(&self) -> Option<u8> {
        self.buf.get(self.pos).copied()
    }

    pub(crate) fn i16(&mut self, field: &'static str) -> Result<i16, DecodeError> {
        Ok(i16::from_be_bytes(self.take(field)?))
    }

    pub(crate) fn i32(&mut self, field: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.take(field)?))
    }

    pub(crate) fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.take(field)?))
    }

    pub(crate) fn i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.take(field)?))
    }

    pub(crate) fn u64(&mut self, field: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_be_bytes(self.take(field)?))
    }

    /// `n` bytes as a slice of the message: no copy.
    pub(crate) fn bytes(&mut self, n: usize, field: &'static str) -> Result<Bytes, DecodeError> {
        if n > self.remaining() {
            return Err(self.truncated(field, n));
        }
        let out = self.buf.slice(self.pos..self.pos + n);
        self.pos += n;
        Ok(out)
    }

    /// A length-prefixed (Int32) byte string; the length is checked against what is left.
    pub(crate) fn counted_bytes(&mut self, field: &'static str) -> Result<Bytes, DecodeError> {
        let start = self.pos;
        let len = self.i32(field)?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&n| n <= self.remaining())
            .ok_or_else(|| {
                DecodeError::new(
                    self.message,
                    field,
                    start,
                    DecodeErrorKind::InvalidLength(len.into()),
                )
            })?;
        self.bytes(len, field)
    }

    /// A NUL-terminated string, validated as UTF-8.
    pub(crate) fn cstr(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let rest = &self.buf[self.pos..];
        let end = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or_else(|| self.error(field, DecodeErrorKind::MissingTerminator))?;
        let text = std::str::from_utf8(&rest[..end])
            .map_err(|_| self.error(field, DecodeErrorKind::InvalidUtf8))?
            .to_owned();
        self.pos += end + 1;
        Ok(text)
    }

    /// A view of bytes already read, `start..end` of the message.
    pub(crate) fn slice(&self, start: usize, end: usize) -> Bytes {
        self.buf.slice(start..end)
    }

    /// Everything left, as a slice.
    pub(crate) fn rest(&mut self) -> Bytes {
        let out = self.buf.slice(self.pos..);
        self.pos = self.buf.len();
        out
    }

    /// Fails when bytes are left: a field we do not know about means we would misread the stream.
    pub(crate) fn finish(&self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(self.error("end of message", DecodeErrorKind::TrailingBytes(n))),
        }
    }
}
