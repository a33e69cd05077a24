//! TupleData: the column values of a row in Insert, Update and Delete messages.

use bytes::Bytes;

use super::cursor::Cursor;
use super::error::{DecodeError, DecodeErrorKind};

/// One column's value as pgoutput sends it. Text and binary values are slices of the frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// 'n'
    Null,
    /// 'u': a TOASTed value that did not change; the server does not send it again.
    UnchangedToast,
    /// 't': the type's text output.
    Text(Bytes),
    /// 'b': the type's binary send format (only with the `binary` option).
    Binary(Bytes),
}

impl Value {
    pub fn is_null(&self) -> bool {
        matches!(self, Value::Null)
    }
}

/// A row's values, validated when decoded and read lazily so that no per-column memory is allocated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tuple {
    count: u16,
    data: Bytes,
}

impl Tuple {
    /// Reads a TupleData at the cursor: Int16 column count, then per column a kind byte and,
    /// for 't' and 'b', an Int32 length and the value.
    pub(crate) fn decode(cursor: &mut Cursor) -> Result<Tuple, DecodeError> {
        let count_at = cursor.position();
        let count = cursor.i16("tuple column count")?;
        let count = u16::try_from(count).map_err(|_| {
            let mut e = cursor.error(
                "tuple column count",
                DecodeErrorKind::InvalidLength(count.into()),
            );
            e.offset = count_at;
            e
        })?;
        let start = cursor.position();
        let mut end = start;
        for column in 1..=usize::from(count) {
            let with_column = |mut e: DecodeError| {
                e.column = Some(column);
                e
            };
            match cursor.u8("tuple value kind").map_err(with_column)? {
                b'n' | b'u' => {}
                b't' | b'b' => {
                    cursor.counted_bytes("tuple value").map_err(with_column)?;
                }
                other => {
                    let mut e =
                        cursor.error("tuple value kind", DecodeErrorKind::UnknownTag(other));
                    e.offset -= 1;
                    return Err(with_column(e));
                }
            }
            end = cursor.position();
        }
        let data = cursor.slice(start, end);
        Ok(Tuple { count, data })
    }

    /// A copy that does not keep alive the (possibly much larger) buffer this tuple was read
    /// from: for tuples held for a while.
    pub fn detached(&self) -> Tuple {
        Tuple {
            count: self.count,
            data: Bytes::copy_from_slice(&self.data),
        }
    }

    /// Number of columns the server sent.
    pub fn len(&self) -> usize {
        usize::from(self.count)
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn values(&self) -> Values {
        Values {
            data: self.data.clone(),
            pos: 0,
            left: self.count,
        }
    }
}

/// Iterator over a [`Tuple`]'s values, in column order.
pub struct Values {
    data: Bytes,
    pos: usize,
    left: u16,
}

impl Iterator for Values {
    type Item = Value;

    fn next(&mut self) -> Option<Value> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let kind = *self.data.get(self.pos)?;
        self.pos += 1;
        match kind {
            b'n' => Some(Value::Null),
            b'u' => Some(Value::UnchangedToast),
            _ => {
                // Validated in `Tuple::decode`; `get` keeps a bug here from becoming a panic.
                let len_bytes: [u8; 4] = self.data.get(self.pos..self.pos + 4)?.try_into().ok()?;
                let len = u32::from_be_bytes(len_bytes) as usize;
                let start = self.pos + 4;
                let end = start.checked_add(len).filter(|&e| e <= self.data.len())?;
                self.pos = end;
                let value = self.data.slice(start..end);
                Some(if kind == b'b' {
                    Value::Binary(value)
                } else {
                    Value::Text(value)
                })
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (usize::from(self.left), Some(usize::from(self.left)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decode(bytes: &[u8]) -> Result<Tuple, DecodeError> {
        let mut c = Cursor::new(Bytes::copy_from_slice(bytes), "Insert");
        Tuple::decode(&mut c)
    }

    #[test]
    fn reads_every_value_kind() {
        let mut raw = vec![
            0, 4, b'n', b'u', b't', 0, 0, 0, 2, b'h', b'i', b'b', 0, 0, 0, 1, 0xff,
        ];
        raw.extend_from_slice(b"after");
        let mut c = Cursor::new(Bytes::from(raw), "Insert");
        let tuple = Tuple::decode(&mut c).unwrap();
        assert_eq!(tuple.len(), 4);
        let values: Vec<Value> = tuple.values().collect();
        assert_eq!(
            values,
            vec![
                Value::Null,
                Value::UnchangedToast,
                Value::Text(Bytes::from_static(b"hi")),
                Value::Binary(Bytes::from_static(&[0xff])),
            ]
        );
        assert_eq!(c.remaining(), 5, "stops after the last column");
    }

    #[test]
    fn empty_tuple() {
        let tuple = decode(&[0, 0]).unwrap();
        assert!(tuple.is_empty());
        assert_eq!(tuple.values().count(), 0);
    }

    #[test]
    fn errors_name_column_and_offset() {
        let err = decode(&[0, 2, b'n', b'x']).unwrap_err();
        assert_eq!(err.kind, DecodeErrorKind::UnknownTag(b'x'));
        assert_eq!((err.column, err.offset), (Some(2), 3));
        assert!(
            err.to_string().contains("of column 2 at byte offset 3"),
            "{err}"
        );

        let err = decode(&[0, 1, b't', 0, 0, 0, 9, b'a']).unwrap_err();
        assert_eq!(err.kind, DecodeErrorKind::InvalidLength(9));
        assert_eq!(err.offset, 3);

        let err = decode(&[0, 1, b't', 0xff, 0xff, 0xff, 0xff]).unwrap_err();
        assert_eq!(err.kind, DecodeErrorKind::InvalidLength(-1));

        let err = decode(&[0xff, 0xff]).unwrap_err();
        assert_eq!(err.kind, DecodeErrorKind::InvalidLength(-1));

        let err = decode(&[0, 3, b'n']).unwrap_err();
        assert!(matches!(err.kind, DecodeErrorKind::Truncated { .. }));
        assert_eq!(err.column, Some(2));
    }
}
