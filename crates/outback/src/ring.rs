//! Consistent hashing of keys onto shards (paper §4.1).
//!
//! Each shard owns `vnodes` points on a 64-bit ring; a key belongs to the
//! shard of the first point at or after its ring hash. Replicas follow the
//! shards' own ring, 0 → 1 → … → K-1 → 0: shard `p`'s KV data is mirrored on
//! the next `r` shards, `p+1 .. p+r` (mod K). (The paper picks "the two
//! successive shards in the consistent hashing ring"; with virtual points
//! that phrase is ambiguous, so the shard ring is kept separate from the
//! key ring, which needs many points per shard to balance load.)

use crate::hash::{mix64, ring};

/// The key → shard map every compute node computes alike.
#[derive(Debug, Clone)]
pub struct Ring {
    points: Vec<(u64, u16)>,
    shards: u16,
}

impl Ring {
    pub fn new(shards: u16, vnodes: u32) -> Ring {
        assert!(shards > 0 && vnodes > 0);
        let mut points: Vec<(u64, u16)> = (0..shards)
            .flat_map(|s| {
                (0..vnodes).map(move |v| {
                    (
                        mix64(((s as u64) << 32 | v as u64) ^ 0x0DD5_1DE5_0F0D_D5ED),
                        s,
                    )
                })
            })
            .collect();
        points.sort_unstable();
        Ring { points, shards }
    }

    pub fn shards(&self) -> u16 {
        self.shards
    }

    /// The shard that owns `key`.
    pub fn shard_of(&self, key: u64) -> u16 {
        let h = ring(key);
        let i = self.points.partition_point(|p| p.0 < h);
        self.points[i % self.points.len()].1
    }

    /// Bytes a compute node keeps for the ring.
    pub fn bytes(&self) -> u64 {
        (self.points.len() * std::mem::size_of::<(u64, u16)>()) as u64
    }
}

/// The shards that mirror shard `p`'s KV data, in takeover order.
pub fn replicas_of(p: u16, shards: u16, replicas: usize) -> Vec<u16> {
    (1..=replicas.min(shards as usize - 1) as u16)
        .map(|i| (p + i) % shards)
        .collect()
}

/// The shards whose KV data shard `s` mirrors.
pub fn mirrored_by(s: u16, shards: u16, replicas: usize) -> Vec<u16> {
    (0..shards)
        .filter(|&p| p != s && replicas_of(p, shards, replicas).contains(&s))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_spread_and_replicas_follow() {
        let r = Ring::new(3, 64);
        let mut count = [0u32; 3];
        for k in 0..30_000u64 {
            count[r.shard_of(k) as usize] += 1;
        }
        assert!(count.iter().all(|&c| c > 7_000), "{count:?}");
        assert_eq!(replicas_of(2, 3, 2), vec![0, 1]);
        assert_eq!(replicas_of(0, 2, 2), vec![1]);
        assert!(replicas_of(0, 1, 2).is_empty());
        assert_eq!(mirrored_by(0, 3, 2), vec![1, 2]);
        assert_eq!(mirrored_by(1, 4, 2), vec![0, 3]);
    }
}
