//! Wall-clock time as reports print it: UTC civil dates from Unix
//! microseconds, with no time-zone database and no allocation beyond the
//! string.

/// `2026-11-22_17:52:16` (UTC), torchrun's report time format.
pub fn format_time(at_us: u64) -> String {
    let secs = at_us / 1_000_000;
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let rem = secs % 86_400;
    // Civil-from-days (Howard Hinnant's algorithm), proleptic Gregorian.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}_{:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// RFC 3339 UTC, `2026-11-22T17:52:16Z`: Kubernetes' `date-time`.
pub fn rfc3339(at_us: u64) -> String {
    format!("{}Z", format_time(at_us).replacen('_', "T", 1))
}

/// Now, in Unix microseconds.
pub fn now_us() -> u64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_times() {
        assert_eq!(format_time(0), "1970-01-01_00:00:00");
        assert_eq!(format_time(1_795_369_936_000_000), "2026-11-22_17:52:16");
        assert_eq!(rfc3339(1_795_369_936_000_000), "2026-11-22T17:52:16Z");
    }
}
