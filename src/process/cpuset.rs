//! CPU sets as the kernel writes them: cpulists (`0-15,32-47`) in sysfs
//! and /proc/<pid>/status, and the set operations the planner needs.

use std::collections::BTreeSet;

/// A set of CPU (or NUMA node) numbers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct CpuSet(BTreeSet<u32>);

/// A cpulist that does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("bad cpu list {0:?}")]
pub struct CpuListError(pub String);

impl CpuSet {
    /// Parse `0-3,8,10-11` (whitespace around it ignored; empty = empty set).
    pub fn parse(list: &str) -> Result<Self, CpuListError> {
        let bad = || CpuListError(list.to_string());
        let mut set = BTreeSet::new();
        for part in list.trim().split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.split_once('-') {
                Some((a, b)) => {
                    let (a, b): (u32, u32) = (a.parse().map_err(|_| bad())?, b.parse().map_err(|_| bad())?);
                    if a > b || b - a > 65_536 {
                        return Err(bad());
                    }
                    set.extend(a..=b);
                }
                None => {
                    set.insert(part.parse().map_err(|_| bad())?);
                }
            }
        }
        Ok(Self(set))
    }

    /// From explicit members.
    pub fn of(cpus: impl IntoIterator<Item = u32>) -> Self {
        Self(cpus.into_iter().collect())
    }

    /// Members in ascending order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.iter().copied()
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// No members.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Is `cpu` a member?
    pub fn contains(&self, cpu: u32) -> bool {
        self.0.contains(&cpu)
    }

    /// Members of both.
    pub fn intersect(&self, other: &Self) -> Self {
        Self(self.0.intersection(&other.0).copied().collect())
    }

    /// Members of either.
    pub fn union(&self, other: &Self) -> Self {
        Self(self.0.union(&other.0).copied().collect())
    }

    /// Is every member also in `other`?
    pub fn is_subset(&self, other: &Self) -> bool {
        self.0.is_subset(&other.0)
    }
}

impl std::fmt::Display for CpuSet {
    /// The kernel's compact form: `0-3,8,10-11`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut first = true;
        let mut it = self.0.iter().copied().peekable();
        while let Some(start) = it.next() {
            let mut end = start;
            while it.peek() == Some(&(end + 1)) {
                end += 1;
                it.next();
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if start == end { write!(f, "{start}")? } else { write!(f, "{start}-{end}")? }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use test_case::test_case;

    #[test_case("0-15,32-47", 32; "two ranges")]
    #[test_case("0", 1; "one")]
    #[test_case("", 0; "empty")]
    #[test_case(" 1,3-4\n", 3; "spaces and newline")]
    fn parses(list: &str, n: usize) {
        assert_eq!(CpuSet::parse(list).expect("parse").len(), n);
    }

    #[test]
    fn round_trips_compactly() {
        let s = CpuSet::parse("8,0-3,10,11,9").expect("parse");
        assert_eq!(s.to_string(), "0-3,8-11");
        assert_eq!(CpuSet::parse(&s.to_string()).expect("parse"), s);
        assert_eq!(CpuSet::parse("3-1"), Err(CpuListError("3-1".into())));
        assert!(CpuSet::parse("a").is_err());
    }
}
