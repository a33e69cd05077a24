use std::fmt;
use std::str::FromStr;

/// A position in the write-ahead log, shown and parsed as PostgreSQL does: `16/B374D848`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl Lsn {
    /// `0/0`: PostgreSQL's InvalidXLogRecPtr, "no position".
    pub const INVALID: Lsn = Lsn(0);

    pub fn is_valid(self) -> bool {
        self.0 != 0
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xffff_ffff)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid LSN {input:?}: expected two hexadecimal numbers separated by '/', like 16/B374D848"
)]
pub struct ParseLsnError {
    input: String,
}

impl FromStr for Lsn {
    type Err = ParseLsnError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || ParseLsnError {
            input: s.to_owned(),
        };
        let (hi, lo) = s.trim().split_once('/').ok_or_else(err)?;
        let part = |p: &str| {
            if p.is_empty() || p.len() > 8 || !p.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(err());
            }
            u32::from_str_radix(p, 16).map_err(|_| err())
        };
        Ok(Lsn((u64::from(part(hi)?) << 32) | u64::from(part(lo)?)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_like_postgres() {
        assert_eq!(Lsn(0).to_string(), "0/0");
        assert_eq!(Lsn(0x16_B374_D848).to_string(), "16/B374D848");
        assert_eq!(Lsn(u64::MAX).to_string(), "FFFFFFFF/FFFFFFFF");
    }

    #[test]
    fn parses_and_round_trips() {
        for text in ["0/0", "16/B374D848", "FFFFFFFF/FFFFFFFF", "0/1"] {
            let lsn: Lsn = text.parse().unwrap();
            assert_eq!(lsn.to_string(), text);
        }
        assert_eq!("16/b374d848".parse::<Lsn>().unwrap(), Lsn(0x16_B374_D848));
    }

    #[test]
    fn rejects_malformed() {
        for text in [
            "",
            "/",
            "1/",
            "/1",
            "1",
            "1/2/3",
            "G/0",
            "1/100000000",
            "-1/0",
            "1 /2",
        ] {
            let err = text.parse::<Lsn>().unwrap_err();
            assert!(err.to_string().contains("invalid LSN"), "{text}: {err}");
        }
    }
}
