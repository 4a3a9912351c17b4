//! Who a job belongs to and how much it matters: the envelope's optional `tenant` and
//! `priority`. Both are signed with the rest of the body; an envelope without
//! them belongs to [`Tenant::DEFAULT`] at [`Priority::Standard`], so an old producer keeps
//! working unchanged.

use std::fmt;

/// A tenant name: 1–64 bytes of `[A-Za-z0-9._:-]` (the job id's characters).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tenant(String);

impl Tenant {
    /// The longest tenant name.
    pub const MAX_LEN: usize = 64;
    /// The tenant of a job that names none.
    pub const DEFAULT: &'static str = "default";

    pub fn parse(s: &str) -> Result<Self, crate::ids::IdError> {
        if s.is_empty() || s.len() > Self::MAX_LEN {
            return Err(crate::ids::IdError("must be 1-64 characters long"));
        }
        if !s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
        {
            return Err(crate::ids::IdError(
                "may only contain the characters [A-Za-z0-9._:-]",
            ));
        }
        Ok(Self(s.to_owned()))
    }

    /// [`Tenant::DEFAULT`].
    pub fn default_tenant() -> Self {
        Self(Self::DEFAULT.to_owned())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Tenant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The broker queues ("lanes") jobs are spread over by tenant and tier: lane 0 is the work
/// queue of before (the `default` tenant's `standard` jobs, and every job published to the
/// jobs exchange), lanes `1..LANES` take the rest by a hash ([`lane_of`]). A bounded number
/// of queues for any number of tenants (stochastic fair queueing): a flood fills its own
/// lane, and a job in another lane does not wait behind it in the broker — nor does a
/// tenant's `critical` job behind its own `batch` flood, unless the two hash alike.
pub const LANES: u8 = 8;

/// The lane of a job of `tenant` at `priority`: 0 for the `default` tenant's `standard`
/// jobs, else `1 + FNV-1a-64(key) mod (LANES − 1)` where the key is the tenant, followed
/// by `/` and the tier for `critical` and `batch` (`team-a`, `team-a/batch`). Producers in
/// other languages compute the same (docs/wire-format.md §1 has test vectors).
pub fn lane_of(tenant: &str, priority: Priority) -> u8 {
    lane_in(tenant, priority, usize::from(LANES)) as u8
}

/// [`lane_of`]'s rule for any number of lanes (the simulator varies it).
pub fn lane_in(tenant: &str, priority: Priority, lanes: usize) -> usize {
    let standard = priority == Priority::Standard;
    if lanes <= 1 || (standard && tenant == Tenant::DEFAULT) {
        return 0;
    }
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(tenant.as_bytes());
    if !standard {
        eat(b"/");
        eat(priority.as_str().as_bytes());
    }
    1 + (h % (lanes as u64 - 1)) as usize
}

/// A job's priority tier. Under overload a higher tier is always served first: a lower
/// tier gets a model slot only when no job of a higher tier waits that can still finish in
/// time, so sustained overload of a higher tier can starve a lower one completely (by
/// design: `batch` is the work that may be dropped).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Priority {
    /// Served before everything else (an incident page).
    Critical,
    /// The default.
    #[default]
    Standard,
    /// Served only when nothing of a higher tier waits; refused and shed first.
    Batch,
}

impl Priority {
    pub const ALL: [Priority; 3] = [Priority::Critical, Priority::Standard, Priority::Batch];

    pub const fn as_str(self) -> &'static str {
        match self {
            Priority::Critical => "critical",
            Priority::Standard => "standard",
            Priority::Batch => "batch",
        }
    }

    /// 0 for the highest tier: the rank a scheduler orders by.
    pub const fn rank(self) -> u8 {
        match self {
            Priority::Critical => 0,
            Priority::Standard => 1,
            Priority::Batch => 2,
        }
    }
}

impl std::str::FromStr for Priority {
    type Err = crate::ids::IdError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "critical" => Ok(Priority::Critical),
            "standard" => Ok(Priority::Standard),
            "batch" => Ok(Priority::Batch),
            _ => Err(crate::ids::IdError(
                "must be one of `critical`, `standard`, `batch`",
            )),
        }
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_names_follow_the_job_id_charset() {
        assert_eq!(
            Tenant::parse("team-a.prod:1").unwrap().as_str(),
            "team-a.prod:1"
        );
        assert!(Tenant::parse("").is_err());
        assert!(Tenant::parse(&"x".repeat(65)).is_err());
        assert!(Tenant::parse(&"x".repeat(64)).is_ok());
        assert!(Tenant::parse("a b").is_err());
        assert!(Tenant::parse("ä").is_err());
    }

    #[test]
    fn lanes_keep_the_default_tenant_on_the_work_queue_and_spread_the_rest() {
        use Priority::*;
        assert_eq!(lane_of("default", Standard), 0);
        // Test vectors for producers in other languages (docs/wire-format.md §1).
        for (tenant, p, lane) in [
            ("team-a", Standard, 1),
            ("team-b", Standard, 5),
            ("flood", Standard, 1),
            ("light", Standard, 5),
            ("default", Critical, 7),
            ("default", Batch, 3),
            ("bulk", Batch, 2),
            ("bulk", Critical, 1),
        ] {
            assert_eq!(lane_of(tenant, p), lane, "{tenant} {p}");
        }
        let mut seen = [0u32; LANES as usize];
        for i in 0..7_000 {
            seen[usize::from(lane_of(&format!("t{i}"), Standard))] += 1;
        }
        assert_eq!(seen[0], 0);
        for n in &seen[1..] {
            assert!((800..1_200).contains(n), "{seen:?}");
        }
    }

    #[test]
    fn priorities_parse_and_rank_critical_first() {
        for p in Priority::ALL {
            assert_eq!(p.as_str().parse::<Priority>().unwrap(), p);
        }
        assert!("urgent".parse::<Priority>().is_err());
        assert!(Priority::Critical < Priority::Standard && Priority::Standard < Priority::Batch);
        assert_eq!(Priority::default(), Priority::Standard);
    }
}
