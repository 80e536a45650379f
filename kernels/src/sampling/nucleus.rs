//! Which tokens top-k and top-p keep, without sorting the vocabulary.
//!
//! Both keep a head of the tokens ordered by weight, heaviest first (equal weights in token
//! order): top-k its first k, top-p every token while the mass before it is at most p of the
//! whole (of top-k's head, where both apply). The head ends at a *cut*, its lightest token, and
//! the kept tokens are exactly those at or before the cut in that order.
//!
//! Finding the cut in linear time: top-k keeps a buffer of the heaviest tokens seen in one pass
//! (`select_nth_unstable` whenever it fills); top-p alone reads a histogram of the weights' mass
//! by float exponent (a quarter octave per bucket) to learn, in one pass, how far down the head
//! reaches to within a bucket, gathers only the tokens above that bucket's floor and selects
//! the cut among them by a mass-weighted quickselect. Sorting the candidates instead cost ~1.4
//! ms a row where the distribution is flat (a nucleus of tens of thousands of tokens).

use std::cmp::Ordering;

/// The lightest kept token: every token at or before it in the order is kept.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cut {
    pub weight: f32,
    pub token: u32,
}

/// A candidate: `(weight, token)`.
type Candidate = (f32, u32);

/// Heaviest first; equal weights in token order. A total order: no two candidates tie.
fn heavier_first(a: &Candidate, b: &Candidate) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// Bits of an f32 kept as its bucket: the exponent and the top two mantissa bits.
const BUCKET_SHIFT: u32 = 21;
/// Weights are in (0, 1]: 1.0's bucket is the highest.
const BUCKETS: usize = (1.0f32.to_bits() >> BUCKET_SHIFT) as usize + 1;
/// Histograms filled in turn, so that runs of weights in one bucket do not wait on each other's
/// stores.
const LANES: usize = 4;

/// Masses of the positive weights per bucket.
struct Histogram {
    mass: [[f64; BUCKETS]; LANES],
}

impl Histogram {
    fn of(weights: &[f32]) -> Box<Self> {
        let mut histogram = Box::new(Self {
            mass: [[0.0; BUCKETS]; LANES],
        });
        let mut add = |lane: usize, w: f32| {
            // Weights are finite and in [0, 1] (the caller's): the bucket is in range; 0 is not
            // counted.
            if w > 0.0 {
                let bucket = ((w.to_bits() >> BUCKET_SHIFT) as usize).min(BUCKETS - 1);
                histogram.mass[lane][bucket] += f64::from(w);
            }
        };
        let mut groups = weights.chunks_exact(LANES);
        for group in &mut groups {
            for (lane, &w) in group.iter().enumerate() {
                add(lane, w);
            }
        }
        for &w in groups.remainder() {
            add(0, w);
        }
        histogram
    }

    /// Mass of bucket `bucket`, all lanes.
    fn bucket(&self, bucket: usize) -> f64 {
        (0..LANES).map(|lane| self.mass[lane][bucket]).sum()
    }

    /// The floor of the highest bucket at which the tokens at or above it are enough to decide:
    /// `enough(mass)` of everything from the top down to it; 0 (every positive weight) where no
    /// bucket is.
    fn floor(&self, enough: impl Fn(f64) -> bool) -> f32 {
        let mut mass = 0f64;
        for bucket in (0..BUCKETS).rev() {
            let m = self.bucket(bucket);
            mass += m;
            if m > 0.0 && enough(mass) {
                return f32::from_bits((bucket as u32) << BUCKET_SHIFT);
            }
        }
        0.0
    }
}

/// The cut of top-k (`Some(k)`, 0 < k) and top-p (`top_p` in [0, 1)) over `weights` (finite,
/// in [0, 1], the heaviest 1): always `Some` under top-k (its head's lightest token, or a
/// heavier one top-p cuts at); under top-p alone, `None` where it keeps every positive weight.
pub fn find_cut(weights: &[f32], top_k: Option<usize>, top_p: f32) -> Option<Cut> {
    if let Some(k) = top_k {
        // Top-p, if any, applies within top-k's head: the k heaviest are all the candidates.
        let mut head = heaviest(weights, k);
        let head_mass = head.iter().map(|&(w, _)| f64::from(w)).sum();
        return cut_of(&mut head, top_p, head_mass, true);
    }
    let histogram = Histogram::of(weights);
    let total: f64 = (0..BUCKETS).map(|bucket| histogram.bucket(bucket)).sum();
    let floor = histogram.floor(|mass| mass > f64::from(top_p) * total);
    let mut candidates = gather(weights, floor);
    let cut = cut_of(&mut candidates, top_p, total, false);
    if cut.is_none() && floor > 0.0 {
        // The histogram's sums and the candidates' differ in their last bits: where that left
        // the candidates just short of top-p's mass, decide over every positive weight.
        let mut everything = gather(weights, 0.0);
        return cut_of(&mut everything, top_p, total, false);
    }
    cut
}

/// Weights [`heaviest`] checks at once before looking at each.
const SCAN_CHUNK: usize = 64;

/// The `k` (≥ 1) heaviest positive weights, in one pass: a buffer of up to 4·max(k, 16)
/// candidates (fewer for a short row) is cut back to its k heaviest whenever it fills, and from
/// then on only tokens heavier than the k-th can enter (a later token of equal weight comes after
/// it in the order).
fn heaviest(weights: &[f32], k: usize) -> Vec<Candidate> {
    let capacity = (4 * k.max(16)).min(weights.len().max(k + 1));
    let mut buffer: Vec<Candidate> = Vec::with_capacity(capacity);
    let mut threshold = 0f32;
    for (chunk_index, chunk) in weights.chunks(SCAN_CHUNK).enumerate() {
        // Most chunks hold nothing heavier than the threshold once it has risen: one vectorized
        // maximum says so.
        let mut lanes = [0f32; 16];
        for part in chunk.chunks(16) {
            for (lane, &w) in lanes.iter_mut().zip(part) {
                *lane = if w > *lane { w } else { *lane };
            }
        }
        if lanes.iter().all(|&m| m <= threshold) {
            continue;
        }
        for (offset, &w) in chunk.iter().enumerate() {
            if w > threshold {
                buffer.push((w, (chunk_index * SCAN_CHUNK + offset) as u32));
                if buffer.len() == capacity {
                    buffer.select_nth_unstable_by(k - 1, heavier_first);
                    buffer.truncate(k);
                    threshold = buffer[k - 1].0;
                }
            }
        }
    }
    if buffer.len() > k {
        buffer.select_nth_unstable_by(k - 1, heavier_first);
        buffer.truncate(k);
    }
    buffer
}

/// Every token of positive weight at or above `floor`.
fn gather(weights: &[f32], floor: f32) -> Vec<Candidate> {
    weights
        .iter()
        .enumerate()
        .filter(|&(_, &w)| w > 0.0 && w >= floor)
        .map(|(token, &w)| (w, token as u32))
        .collect()
}

/// The cut among `candidates` (every token that could be kept, reordered in place): top-p's of
/// `mass` where `top_p < 1`; otherwise, for top-k's `head`, its lightest token. `None` where every
/// candidate is kept and they are not a head.
fn cut_of(candidates: &mut [Candidate], top_p: f32, mass: f64, head: bool) -> Option<Cut> {
    if top_p < 1.0 {
        if let Some(cut) = weighted_cut(candidates, f64::from(top_p) * mass) {
            return Some(cut);
        }
    }
    if !head {
        return None;
    }
    candidates
        .iter()
        .copied()
        .max_by(heavier_first)
        .map(|(weight, token)| Cut { weight, token })
}

/// Slices this short are sorted and walked instead of split further.
const SORTED_WALK: usize = 32;

/// Top-p's cut: the last candidate in the order whose mass before it is at most `limit` (≥ 0),
/// found by quickselect on the order, recursing into the half the mass says holds it. `None`
/// only where every candidate is kept and their mass is within `limit`, so that whatever lies
/// below the candidates could still be kept.
fn weighted_cut(candidates: &mut [Candidate], limit: f64) -> Option<Cut> {
    let as_cut = |(weight, token): Candidate| Cut { weight, token };
    let mut before = 0f64;
    let mut last_kept: Option<Candidate> = None;
    // Whether a candidate after the current slice is known to be dropped: then a slice kept
    // whole ends at the cut.
    let mut dropped_after = false;
    let mut slice = candidates;
    loop {
        if slice.len() <= SORTED_WALK {
            slice.sort_unstable_by(heavier_first);
            for &candidate in slice.iter() {
                if before > limit {
                    return last_kept.map(as_cut);
                }
                before += f64::from(candidate.0);
                last_kept = Some(candidate);
            }
            // Kept whole: the cut if a later candidate is dropped, or if the mass reached the
            // limit (the tokens below the candidates are dropped).
            return if dropped_after || before > limit {
                last_kept.map(as_cut)
            } else {
                None
            };
        }
        let middle = slice.len() / 2;
        let (heavier, pivot, lighter) = slice.select_nth_unstable_by(middle, heavier_first);
        let pivot = *pivot;
        let heavier_mass: f64 = heavier.iter().map(|&(w, _)| f64::from(w)).sum();
        if before + heavier_mass > limit {
            // The pivot's mass-before exceeds the limit: the cut is among the heavier half.
            dropped_after = true;
            slice = heavier;
        } else {
            // Every heavier candidate's mass-before is within the limit, and so is the pivot's.
            before += heavier_mass + f64::from(pivot.0);
            last_kept = Some(pivot);
            if before > limit {
                return last_kept.map(as_cut);
            }
            if lighter.is_empty() {
                return if dropped_after { last_kept.map(as_cut) } else { None };
            }
            slice = lighter;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The definition: sort everything, walk.
    fn reference(weights: &[f32], top_k: Option<usize>, top_p: f32) -> Vec<bool> {
        let mut order: Vec<Candidate> = weights
            .iter()
            .enumerate()
            .filter(|&(_, &w)| w > 0.0)
            .map(|(t, &w)| (w, t as u32))
            .collect();
        order.sort_by(heavier_first);
        if let Some(k) = top_k {
            order.truncate(k);
        }
        let mass: f64 = order.iter().map(|&(w, _)| f64::from(w)).sum();
        let limit = f64::from(top_p) * mass;
        let mut before = 0f64;
        let mut kept = vec![false; weights.len()];
        for &(w, t) in &order {
            if top_p < 1.0 && before > limit {
                break;
            }
            before += f64::from(w);
            kept[t as usize] = true;
        }
        kept
    }

    fn kept_by(weights: &[f32], cut: Option<Cut>) -> Vec<bool> {
        weights
            .iter()
            .enumerate()
            .map(|(t, &w)| {
                let dropped = cut.is_some_and(|cut| w < cut.weight || (w == cut.weight && t > cut.token as usize));
                w > 0.0 && !dropped
            })
            .collect()
    }

    #[test]
    fn cuts_keep_what_sorting_keeps() {
        let mut rng = StdRng::seed_from_u64(9);
        for case in 0..300 {
            let len = [1, 5, 33, 1_000, 20_000][rng.random_range(0..5)];
            let spread: f32 = [1.0, 5.0, 20.0][rng.random_range(0..3)];
            let mut weights: Vec<f32> = (0..len).map(|_| (-rng.random::<f32>() * spread).exp()).collect();
            // Repeated weights and zeros, as masked and clamped rows have them.
            for _ in 0..len / 10 {
                let (a, b) = (rng.random_range(0..len), rng.random_range(0..len));
                weights[a] = weights[b];
                weights[rng.random_range(0..len)] = 0.0;
            }
            let top_k = [None, Some(1), Some(3), Some(40), Some(len + 5)][rng.random_range(0..5)];
            let top_p = [1.0f32, 0.9, 0.5, 0.999, 0.01][rng.random_range(0..5)];
            if top_k.is_none() && top_p >= 1.0 {
                continue;
            }
            let cut = find_cut(&weights, top_k, top_p);
            assert_eq!(
                kept_by(&weights, cut),
                reference(&weights, top_k, top_p),
                "case {case}: {len} weights, top-k {top_k:?}, top-p {top_p}"
            );
        }
    }
}
