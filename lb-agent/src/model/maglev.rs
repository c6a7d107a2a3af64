//! Maglev consistent hashing (Eisenbud et al., "Maglev: A Fast and
//! Reliable Software Network Load Balancer", NSDI 2016, section 3.4) for
//! outside traffic: a lookup table of prime size M in which every backend
//! owns about M/N entries; a flow's hash picks an entry.
//!
//! The table depends only on the backends' addresses and ports, the seed
//! and M, never on the order they come in or on anything node-local, so
//! every node with the same `--maglev-seed` builds the same table and sends
//! a flow to the same backend. When a backend joins or leaves, about 1/N of
//! the entries change owner, plus a little more (measured in the tests).
//!
//! Pure: backends in, indexes out. The dataplane turns indexes into its
//! backend ids.
use std::hash::Hasher as _;
use std::net::SocketAddr;

use siphasher::sip::SipHasher13;

/// The default table size: a prime, ~100 entries per backend at 160
/// backends (Cilium's default too).
pub const DEFAULT_SIZE: u32 = 16381;
/// Table sizes allowed: primes in this range.
pub const MIN_SIZE: u32 = 251;
pub const MAX_SIZE: u32 = 131_071;

/// A Maglev table builder: its size and seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Maglev {
    size: u32,
    k0: u64,
    k1: u64,
}

fn is_prime(n: u32) -> bool {
    n >= 2 && (2..).take_while(|d: &u32| d * d <= n).all(|d| !n.is_multiple_of(d))
}

impl Maglev {
    /// `size` must be a prime in MIN_SIZE..=MAX_SIZE; `seed` is any string,
    /// the same on every node.
    pub fn new(size: u32, seed: &str) -> Result<Self, String> {
        if !(MIN_SIZE..=MAX_SIZE).contains(&size) || !is_prime(size) {
            return Err(format!("{size} is not a prime between {MIN_SIZE} and {MAX_SIZE} (16381, 32749 and 65521 are)"));
        }
        let key = |k: u64| {
            let mut h = SipHasher13::new_with_keys(k, 0);
            h.write(seed.as_bytes());
            h.finish()
        };
        Ok(Self { size, k0: key(0), k1: key(1) })
    }

    pub fn size(&self) -> u32 {
        self.size
    }

    /// A backend's (offset, skip): where its preference list starts in the
    /// table and how it steps (skip is in 1..M, so with M prime the list
    /// visits every entry once).
    fn permutation(&self, b: &SocketAddr) -> (u64, u64) {
        let name = b.to_string();
        let hash = |k0: u64, k1: u64| {
            let mut h = SipHasher13::new_with_keys(k0, k1);
            h.write(name.as_bytes());
            h.finish()
        };
        let m = self.size as u64;
        (hash(self.k0, self.k1) % m, hash(self.k1, self.k0) % (m - 1) + 1)
    }

    /// The table: for each of the M entries, the index (into `backends`)
    /// of the backend that owns it. Empty when there are no backends.
    /// `backends` are distinct.
    pub fn table(&self, backends: &[SocketAddr]) -> Vec<u32> {
        if backends.is_empty() {
            return Vec::new();
        }
        // The order callers give must not matter: fill in address order.
        let mut order: Vec<usize> = (0..backends.len()).collect();
        order.sort_by_key(|&i| backends[i]);
        let perms: Vec<(u64, u64)> = order.iter().map(|&i| self.permutation(&backends[i])).collect();
        let m = self.size as usize;
        let mut entry = vec![u32::MAX; m];
        let mut next = vec![0u64; order.len()];
        let mut filled = 0;
        // Each backend in turn takes the next free entry of its preference
        // list, until the table is full.
        loop {
            for (k, &i) in order.iter().enumerate() {
                let (offset, skip) = perms[k];
                let mut c = ((offset + next[k] * skip) % m as u64) as usize;
                while entry[c] != u32::MAX {
                    next[k] += 1;
                    c = ((offset + next[k] * skip) % m as u64) as usize;
                }
                entry[c] = i as u32;
                next[k] += 1;
                filled += 1;
                if filled == m {
                    return entry;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backends(n: usize) -> Vec<SocketAddr> {
        (0..n).map(|i| SocketAddr::from(([10, 244, (i / 200) as u8, (i % 200) as u8 + 10], 8080))).collect()
    }

    /// Entries whose backend (by address) differs between two tables.
    fn moved(a: &[u32], ab: &[SocketAddr], b: &[u32], bb: &[SocketAddr]) -> f64 {
        let n = a.iter().zip(b).filter(|(x, y)| ab[**x as usize] != bb[**y as usize]).count();
        n as f64 / a.len() as f64
    }

    #[test]
    fn only_prime_sizes_in_range_are_taken() {
        assert!(Maglev::new(DEFAULT_SIZE, "s").is_ok());
        assert!(Maglev::new(65521, "s").is_ok());
        for bad in [0, 1, 250, 16383, 16384, 131_072 + 1, 65537 * 3] {
            let e = Maglev::new(bad, "s").unwrap_err();
            assert!(e.contains(&bad.to_string()), "{e}");
        }
    }

    #[test]
    fn every_backend_owns_its_share_and_order_does_not_matter() {
        let m = Maglev::new(DEFAULT_SIZE, "seed").unwrap();
        for n in [1, 2, 3, 7, 10, 100, 1000] {
            let b = backends(n);
            let t = m.table(&b);
            assert_eq!(t.len(), DEFAULT_SIZE as usize);
            let mut count = vec![0u32; n];
            for e in &t {
                count[*e as usize] += 1;
            }
            let (lo, hi) = (DEFAULT_SIZE / n as u32, DEFAULT_SIZE.div_ceil(n as u32));
            assert!(count.iter().all(|c| (lo..=hi).contains(c)), "n={n}: {lo}..={hi}, got {:?}", &count[..n.min(10)]);
            // Reversed input: the same backend for every entry.
            let mut r = b.clone();
            r.reverse();
            let tr = m.table(&r);
            assert!(t.iter().zip(&tr).all(|(x, y)| b[*x as usize] == r[*y as usize]), "n={n}");
        }
        assert!(m.table(&[]).is_empty());
    }

    #[test]
    fn the_seed_and_the_size_make_the_table_and_nothing_else() {
        let b = backends(10);
        let t = |size, seed| Maglev::new(size, seed).unwrap().table(&b);
        assert_eq!(t(DEFAULT_SIZE, "a"), t(DEFAULT_SIZE, "a"), "two nodes, one table");
        let other = t(DEFAULT_SIZE, "b");
        let a = t(DEFAULT_SIZE, "a");
        assert!(moved(&a, &b, &other, &b) > 0.5, "another seed, another table");
        assert_eq!(t(251, "a").len(), 251);
    }

    /// A backend that joins or leaves moves its 1/N of the flows (the
    /// entries) and a little more: the extra is measured here for every
    /// join and the first 20 leaves. Within 1% up to 20 backends at the
    /// default size, up to 160 at 65521; within 2% at the default size up
    /// to 160 backends (the README says so and suggests the larger size).
    #[test]
    fn a_backend_joining_or_leaving_moves_about_one_nth_of_the_flows() {
        let cases: &[(u32, &[usize], f64)] =
            &[(DEFAULT_SIZE, &[2, 3, 5, 10, 20], 0.01), (DEFAULT_SIZE, &[30, 50, 100, 160], 0.02), (65521, &[10, 50, 100, 160], 0.01)];
        for (size, ns, extra) in cases {
            let m = Maglev::new(*size, "disruption").unwrap();
            for &n in *ns {
                let all = backends(n + 1);
                let before = &all[..n];
                let t_before = m.table(before);
                let join = moved(&t_before, before, &m.table(&all), &all);
                let bound = 1.0 / (n + 1) as f64 + extra;
                assert!(join <= bound, "M={size}, n={n}: a join moved {join:.4} > {bound:.4}");
                // The one that joined took about its share.
                assert!(join >= 1.0 / (n + 1) as f64 * 0.99, "M={size}, n={n}: {join:.4}");
                for gone in 0..n.min(20) {
                    let rest: Vec<SocketAddr> = before.iter().enumerate().filter(|(i, _)| *i != gone).map(|(_, b)| *b).collect();
                    let leave = moved(&t_before, before, &m.table(&rest), &rest);
                    let bound = 1.0 / n as f64 + extra;
                    assert!(leave <= bound, "M={size}, n={n}, backend {gone} left: moved {leave:.4} > {bound:.4}");
                }
            }
        }
    }
}
