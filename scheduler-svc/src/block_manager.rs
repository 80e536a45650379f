//! Paged KV accounting (DESIGN.md §3): which of the worker's fixed-size KV blocks are free, shared
//! or cached. Sequences keep their own block tables; this hands blocks out, counts references
//! (prefix-cache hits share blocks), and decides admission:
//!
//! - a fraction of the blocks (`reserved_block_ratio`) is kept back from new admissions, so that
//!   running sequences can grow without preempting each other at once;
//! - past `backpressure_threshold` of memory pressure (1 − available/total) nothing new is
//!   admitted while something runs;
//! - blocks whose last user left but which hold a cached prefix stay *evictable*: they count as
//!   available and are reused least recently used first.
//!
//! Allocation and release are O(1) per block.

use std::time::{Duration, Instant};

use crate::prefix_cache::{chain_hash, PrefixCache, ROOT_HASH};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockManagerConfig {
    pub reserved_block_ratio: f64,
    pub backpressure_threshold: f64,
    pub prefix_cache: bool,
    pub prefix_cache_ttl: Option<Duration>,
}

impl Default for BlockManagerConfig {
    fn default() -> Self {
        Self {
            reserved_block_ratio: 0.1,
            backpressure_threshold: 0.8,
            prefix_cache: true,
            prefix_cache_ttl: None,
        }
    }
}

/// The answer to "can this request start now?".
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    Accepted { remaining_blocks: u32 },
    Rejected(RejectReason),
}

#[derive(Debug, Clone, PartialEq)]
pub enum RejectReason {
    /// Over `backpressure_threshold`; retried next iteration.
    Backpressure { memory_pressure: f64 },
    /// Not enough blocks outside the reserve now; retried next iteration.
    NotEnoughBlocks { needed: u32, admissible: u32 },
}

/// Blocks a sequence got from the prefix cache.
#[derive(Debug, Default, PartialEq)]
pub struct PrefixMatch {
    pub blocks: Vec<u32>,
    pub hashes: Vec<u64>,
    pub tokens: usize,
}

pub struct BlockManager {
    block_size: u32,
    total: u32,
    ref_counts: Vec<u32>,
    free: Vec<u32>,
    reserved: u32,
    config: BlockManagerConfig,
    cache: PrefixCache,
}

impl BlockManager {
    pub fn new(total: u32, block_size: u32, config: BlockManagerConfig) -> Self {
        let reserved = (f64::from(total) * config.reserved_block_ratio.clamp(0.0, 1.0)).floor() as u32;
        Self {
            block_size,
            total,
            ref_counts: vec![0; total as usize],
            // Reversed so that low block ids are handed out first (easier to read in logs).
            free: (0..total).rev().collect(),
            reserved,
            cache: PrefixCache::new(config.prefix_cache_ttl),
            config,
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    /// Blocks nobody uses and no cached prefix holds.
    pub fn num_free(&self) -> u32 {
        self.free.len() as u32
    }

    /// Blocks nobody uses that hold a cached prefix (reusable, evictable).
    pub fn num_cached(&self) -> u32 {
        self.cache.num_evictable() as u32
    }

    pub fn num_available(&self) -> u32 {
        self.num_free() + self.num_cached()
    }

    pub fn num_used(&self) -> u32 {
        self.total - self.num_available()
    }

    pub fn memory_pressure(&self) -> f64 {
        if self.total == 0 {
            return 0.0;
        }
        1.0 - f64::from(self.num_available()) / f64::from(self.total)
    }

    pub fn prefix_cache_hit_rate(&self) -> f64 {
        self.cache.hit_rate()
    }

    /// (prompt tokens looked up, of them served from the cache).
    pub fn prefix_lookup_counts(&self) -> (u64, u64) {
        self.cache.lookup_counts()
    }

    /// How many leading tokens of `tokens` [`match_prefix`](Self::match_prefix) would serve from
    /// the cache now, without taking anything or counting a lookup (for routing).
    pub fn cached_prefix_len(&self, tokens: &[u32]) -> usize {
        self.cached_chain(tokens).len() * self.block_size as usize
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> u32 {
        tokens.div_ceil(self.block_size as usize) as u32
    }

    /// Whether a new sequence needing `new_blocks` more blocks may start now. `others_running`
    /// turns the reserve and backpressure on: alone, anything that fits may start.
    pub fn admission(&self, new_blocks: u32, others_running: bool) -> Admission {
        let available = self.num_available();
        let (admissible, pressure_limited) = self.admissible(others_running);
        if pressure_limited {
            return Admission::Rejected(RejectReason::Backpressure {
                memory_pressure: self.memory_pressure(),
            });
        }
        if new_blocks > admissible {
            return Admission::Rejected(RejectReason::NotEnoughBlocks {
                needed: new_blocks,
                admissible,
            });
        }
        Admission::Accepted {
            remaining_blocks: available - new_blocks,
        }
    }

    /// Blocks a new sequence may take now (beside running ones the reserve stays untouched), and
    /// whether backpressure refuses every admission.
    fn admissible(&self, others_running: bool) -> (u32, bool) {
        let available = self.num_available();
        if others_running {
            (
                available.saturating_sub(self.reserved),
                self.memory_pressure() > self.config.backpressure_threshold,
            )
        } else {
            (available, false)
        }
    }

    /// The most tokens a new sequence could hold if admitted now (0 under backpressure).
    pub fn admissible_tokens(&self, others_running: bool) -> u32 {
        match self.admissible(others_running) {
            (_, true) => 0,
            (blocks, false) => blocks.saturating_mul(self.block_size),
        }
    }

    /// Takes `count` blocks (free ones first, then the least recently used cached ones), or none.
    pub fn allocate(&mut self, count: u32) -> Option<Vec<u32>> {
        if count > self.num_available() {
            return None;
        }
        let mut blocks = Vec::with_capacity(count as usize);
        while blocks.len() < count as usize {
            let block = match self.free.pop() {
                Some(block) => block,
                None => self.cache.evict_lru()?,
            };
            self.ref_counts[block as usize] = 1;
            blocks.push(block);
        }
        Some(blocks)
    }

    /// Drops one reference to each block; unreferenced blocks become free, or evictable when they
    /// hold a cached prefix.
    pub fn release(&mut self, blocks: &mut Vec<u32>) {
        let now = Instant::now();
        for block in blocks.drain(..) {
            let count = &mut self.ref_counts[block as usize];
            debug_assert!(*count > 0, "block {block} released more often than taken");
            *count = count.saturating_sub(1);
            if *count == 0 {
                if self.cache.is_cached(block) {
                    self.cache.mark_evictable(block, now);
                } else {
                    self.free.push(block);
                }
            }
        }
    }

    /// Takes a reference to the longest chain of cached full blocks that starts `tokens`, always
    /// leaving at least one token to compute (its logits give the next token).
    pub fn match_prefix(&mut self, tokens: &[u32]) -> PrefixMatch {
        let mut found = PrefixMatch::default();
        for (hash, block) in self.cached_chain(tokens) {
            if self.ref_counts[block as usize] == 0 {
                self.cache.mark_in_use(block);
            }
            self.ref_counts[block as usize] += 1;
            found.blocks.push(block);
            found.hashes.push(hash);
        }
        found.tokens = found.blocks.len() * self.block_size as usize;
        found
    }

    /// Counts a prompt's lookup for the hit rate: once per request, at its first admission (a
    /// refused or preempted sequence matches again without being a new query).
    pub fn record_prefix_lookup(&mut self, prompt_tokens: usize, hit_tokens: usize) {
        if self.config.prefix_cache && prompt_tokens > 0 {
            self.cache.record_lookup(prompt_tokens, hit_tokens);
        }
    }

    /// (chain hash, block) of the longest run of cached full blocks that starts `tokens`, leaving
    /// at least one token uncovered.
    fn cached_chain(&self, tokens: &[u32]) -> Vec<(u64, u32)> {
        let mut chain = Vec::new();
        if !self.config.prefix_cache || tokens.is_empty() {
            return chain;
        }
        let block_size = self.block_size as usize;
        let reusable = (tokens.len() - 1) / block_size;
        let mut parent = ROOT_HASH;
        for chunk in tokens.chunks(block_size).take(reusable) {
            let Some((hash, block)) = self.cache.lookup(parent, chunk) else {
                break;
            };
            chain.push((hash, block));
            parent = hash;
        }
        chain
    }

    /// Offers a sequence's newly completed blocks to the prefix cache. `hashes` holds the chain
    /// hashes of the blocks already offered and grows with the new ones.
    pub fn register_full_blocks(&mut self, tokens: &[u32], num_computed: usize, blocks: &[u32], hashes: &mut Vec<u64>) {
        if !self.config.prefix_cache {
            return;
        }
        let block_size = self.block_size as usize;
        let full = (num_computed / block_size).min(blocks.len());
        for index in hashes.len()..full {
            let parent = hashes.last().copied().unwrap_or(ROOT_HASH);
            let chunk = &tokens[index * block_size..(index + 1) * block_size];
            self.cache.insert(parent, chunk, blocks[index]);
            hashes.push(chain_hash(parent, chunk));
        }
    }

    /// Frees cached blocks unused for longer than the TTL.
    pub fn expire_cached(&mut self, now: Instant) {
        let expired = self.cache.evict_expired(now);
        self.free.extend(expired);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manager(total: u32, block_size: u32) -> BlockManager {
        BlockManager::new(total, block_size, BlockManagerConfig::default())
    }

    #[test]
    fn allocation_is_all_or_nothing_and_release_restores() {
        let mut blocks = manager(4, 16);
        assert_eq!(blocks.blocks_for(33), 3);
        let mut first = blocks.allocate(3).expect("3 of 4");
        assert!(blocks.allocate(2).is_none());
        assert_eq!(blocks.num_free(), 1);
        blocks.release(&mut first);
        assert!(first.is_empty());
        assert_eq!(blocks.num_free(), 4);
        let mut all = blocks.allocate(4).expect("all");
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3]);
    }

    #[test]
    fn the_reserve_and_backpressure_apply_only_beside_running_sequences() {
        let mut blocks = manager(10, 4);
        assert_eq!(blocks.admission(10, false), Admission::Accepted { remaining_blocks: 0 });
        assert!(matches!(
            blocks.admission(10, true),
            Admission::Rejected(RejectReason::NotEnoughBlocks { admissible: 9, .. })
        ));
        let _held = blocks.allocate(9).expect("9");
        assert!((blocks.memory_pressure() - 0.9).abs() < 1e-9);
        assert!(matches!(
            blocks.admission(1, true),
            Admission::Rejected(RejectReason::Backpressure { .. })
        ));
        assert_eq!(blocks.admission(1, false), Admission::Accepted { remaining_blocks: 0 });
    }

    #[test]
    fn shared_prefix_blocks_are_reference_counted_and_cached_after_release() {
        let mut blocks = manager(8, 2);
        let tokens = [1, 2, 3, 4, 5];
        let mut first = blocks.allocate(3).expect("3");
        let mut hashes = Vec::new();
        blocks.register_full_blocks(&tokens, 5, &first, &mut hashes);
        assert_eq!(hashes.len(), 2, "two full blocks of two tokens");

        // Routing may look without taking anything or counting a lookup.
        assert_eq!(blocks.cached_prefix_len(&tokens), 4);
        assert_eq!(blocks.cached_prefix_len(&[1, 2, 9, 9, 9]), 2);
        assert_eq!(blocks.prefix_lookup_counts(), (0, 0));

        // A second sequence with the same prompt reuses both full blocks.
        let hit = blocks.match_prefix(&tokens);
        assert_eq!(hit.blocks, first[..2]);
        assert_eq!(hit.tokens, 4);
        blocks.record_prefix_lookup(tokens.len(), hit.tokens);
        blocks.release(&mut first);
        assert_eq!(
            blocks.num_used(),
            2,
            "the shared blocks are still held by the second sequence"
        );
        let mut second = hit.blocks;
        blocks.release(&mut second);
        assert_eq!(blocks.num_used(), 0);
        assert_eq!(blocks.num_cached(), 2);
        assert_eq!(blocks.num_free() + blocks.num_cached(), 8);

        // A prompt that is exactly the cached blocks still leaves its last token to compute.
        let whole = blocks.match_prefix(&tokens[..4]);
        assert_eq!(whole.tokens, 2);
        blocks.record_prefix_lookup(4, whole.tokens);
        assert!((blocks.prefix_cache_hit_rate() - 6.0 / 9.0).abs() < 1e-9);
    }

    #[test]
    fn allocation_evicts_cached_blocks_when_nothing_is_free() {
        let mut blocks = manager(2, 2);
        let mut held = blocks.allocate(2).expect("2");
        let mut hashes = Vec::new();
        blocks.register_full_blocks(&[1, 2, 3, 4], 4, &held, &mut hashes);
        blocks.release(&mut held);
        assert_eq!((blocks.num_free(), blocks.num_cached()), (0, 2));
        let fresh = blocks.allocate(2).expect("evicts both");
        assert_eq!(fresh.len(), 2);
        assert_eq!(
            blocks.match_prefix(&[1, 2, 3, 4, 5]).tokens,
            0,
            "evicted blocks are no longer hits"
        );
    }
}
