use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Seconds from the Unix epoch to PostgreSQL's epoch, 2000-01-01 00:00:00 UTC.
const POSTGRES_EPOCH_UNIX_SECONDS: u64 = 946_684_800;

/// A server timestamp on the wire: microseconds since 2000-01-01 00:00:00 UTC.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PgTimestamp(pub i64);

impl PgTimestamp {
    pub fn now() -> Self {
        Self::from_system_time(SystemTime::now())
    }

    pub fn from_system_time(time: SystemTime) -> Self {
        let epoch = UNIX_EPOCH + Duration::from_secs(POSTGRES_EPOCH_UNIX_SECONDS);
        let micros = match time.duration_since(epoch) {
            Ok(after) => i64::try_from(after.as_micros()).unwrap_or(i64::MAX),
            Err(before) => i64::try_from(before.duration().as_micros()).map_or(i64::MIN, |m| -m),
        };
        PgTimestamp(micros)
    }

    /// The same instant as a `SystemTime`; `None` when it is out of the platform's range.
    pub fn to_system_time(self) -> Option<SystemTime> {
        let epoch = UNIX_EPOCH + Duration::from_secs(POSTGRES_EPOCH_UNIX_SECONDS);
        let offset = Duration::from_micros(self.0.unsigned_abs());
        if self.0 >= 0 {
            epoch.checked_add(offset)
        } else {
            epoch.checked_sub(offset)
        }
    }

    /// As text in ISO 8601 / RFC 3339, UTC, for logs, status output and timestamptz
    /// parameters. The formatter covers the years 1970 to 9999 only (it panics outside them), so
    /// a time before or after those is PostgreSQL's `-infinity` or `infinity`: no server clock
    /// sends one of those for a real commit, but the bytes come from the network.
    pub fn to_rfc3339(self) -> String {
        // 1970-01-01 and 9999-12-31 23:59:59.999999, in microseconds since 2000-01-01.
        const FIRST: i64 = -(POSTGRES_EPOCH_UNIX_SECONDS as i64) * 1_000_000;
        const LAST: i64 = 252_455_615_999_999_999;
        if self.0 < FIRST {
            return "-infinity".into();
        }
        if self.0 > LAST {
            return "infinity".into();
        }
        match self.to_system_time() {
            Some(t) => humantime::format_rfc3339_micros(t).to_string(),
            None => "infinity".into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoch_is_2000() {
        assert_eq!(PgTimestamp(0).to_rfc3339(), "2000-01-01T00:00:00.000000Z");
        let t = PgTimestamp(86_400_000_000 + 1);
        assert_eq!(
            PgTimestamp::from_system_time(t.to_system_time().unwrap()),
            t
        );
        assert_eq!(PgTimestamp(-1).to_rfc3339(), "1999-12-31T23:59:59.999999Z");
    }

    #[test]
    fn times_the_formatter_cannot_show_are_infinities_not_panics() {
        assert_eq!(PgTimestamp(i64::MAX).to_rfc3339(), "infinity");
        assert_eq!(PgTimestamp(i64::MIN).to_rfc3339(), "-infinity");
        assert_eq!(
            PgTimestamp(252_455_615_999_999_999).to_rfc3339(),
            "9999-12-31T23:59:59.999999Z"
        );
        assert_eq!(
            PgTimestamp(252_455_616_000_000_000).to_rfc3339(),
            "infinity"
        );
        assert_eq!(
            PgTimestamp(-946_684_800_000_000).to_rfc3339(),
            "1970-01-01T00:00:00.000000Z"
        );
        assert_eq!(PgTimestamp(-946_684_800_000_001).to_rfc3339(), "-infinity");
    }
}
