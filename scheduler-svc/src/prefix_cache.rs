//! The prefix cache: full KV blocks keyed by a hash chained over (parent hash, the block's
//! tokens), so that a block's key identifies the whole prefix up to and including it. A new
//! prompt reuses the longest chain of cached blocks and prefills only the rest.
//!
//! Cached blocks that no sequence uses any more stay here, *evictable*, until their space is
//! needed (least recently used first) or, when a TTL is set, until they have been unused that
//! long. The block manager owns this structure and asks it for blocks to evict.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::time::{Duration, Instant};

/// Key of the empty prefix (the parent of a sequence's first block).
pub const ROOT_HASH: u64 = 0x5256_4C54_5052_4658;

/// Chains `tokens` (one full block) onto the prefix identified by `parent`.
pub fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    parent.hash(&mut hasher);
    tokens.hash(&mut hasher);
    hasher.finish()
}

struct CachedBlock {
    block: u32,
    parent: u64,
    /// Kept to rule out hash collisions: a hit must match the tokens exactly.
    tokens: Vec<u32>,
}

#[derive(Default)]
pub struct PrefixCache {
    by_hash: HashMap<u64, CachedBlock>,
    hash_of_block: HashMap<u32, u64>,
    /// Evictable blocks (cached, used by no sequence) by last-use tick: oldest first.
    evictable: BTreeMap<u64, u32>,
    evictable_since: HashMap<u32, (u64, Instant)>,
    tick: u64,
    ttl: Option<Duration>,
    queried_tokens: u64,
    hit_tokens: u64,
}

impl PrefixCache {
    pub fn new(ttl: Option<Duration>) -> Self {
        Self { ttl, ..Self::default() }
    }

    /// The cached block holding exactly `tokens` after the prefix `parent`, if any.
    pub fn lookup(&self, parent: u64, tokens: &[u32]) -> Option<(u64, u32)> {
        let hash = chain_hash(parent, tokens);
        self.by_hash
            .get(&hash)
            .filter(|cached| cached.parent == parent && cached.tokens == tokens)
            .map(|cached| (hash, cached.block))
    }

    /// Counts a lookup of `prompt_tokens` of which `hit` were served from the cache.
    pub fn record_lookup(&mut self, prompt_tokens: usize, hit: usize) {
        self.queried_tokens += prompt_tokens as u64;
        self.hit_tokens += hit as u64;
    }

    /// (prompt tokens looked up, of them served from the cache), for pooling over replicas.
    pub fn lookup_counts(&self) -> (u64, u64) {
        (self.queried_tokens, self.hit_tokens)
    }

    /// Share of looked-up prompt tokens that were served from the cache.
    pub fn hit_rate(&self) -> f64 {
        if self.queried_tokens == 0 {
            0.0
        } else {
            self.hit_tokens as f64 / self.queried_tokens as f64
        }
    }

    /// Registers a newly filled block; false if an equal block is already cached (then this one
    /// stays private to its sequence and is freed normally).
    pub fn insert(&mut self, parent: u64, tokens: &[u32], block: u32) -> bool {
        let hash = chain_hash(parent, tokens);
        if self.by_hash.contains_key(&hash) || self.hash_of_block.contains_key(&block) {
            return false;
        }
        self.by_hash.insert(
            hash,
            CachedBlock {
                block,
                parent,
                tokens: tokens.to_vec(),
            },
        );
        self.hash_of_block.insert(block, hash);
        true
    }

    pub fn is_cached(&self, block: u32) -> bool {
        self.hash_of_block.contains_key(&block)
    }

    /// A cached block lost its last user: it becomes evictable, most recently used.
    pub fn mark_evictable(&mut self, block: u32, now: Instant) {
        self.tick += 1;
        self.evictable.insert(self.tick, block);
        self.evictable_since.insert(block, (self.tick, now));
    }

    /// A cached block is used again: it is no longer evictable.
    pub fn mark_in_use(&mut self, block: u32) {
        if let Some((tick, _)) = self.evictable_since.remove(&block) {
            self.evictable.remove(&tick);
        }
    }

    pub fn num_evictable(&self) -> usize {
        self.evictable.len()
    }

    /// Forgets the least recently used evictable block and returns it for reuse.
    pub fn evict_lru(&mut self) -> Option<u32> {
        let (_, block) = self.evictable.pop_first()?;
        self.forget(block);
        Some(block)
    }

    /// Forgets evictable blocks unused for longer than the TTL; returns them to be freed.
    pub fn evict_expired(&mut self, now: Instant) -> Vec<u32> {
        let Some(ttl) = self.ttl else { return Vec::new() };
        let mut expired = Vec::new();
        while let Some((&tick, &block)) = self.evictable.first_key_value() {
            let since = self.evictable_since.get(&block).map_or(now, |(_, at)| *at);
            if now.duration_since(since) < ttl {
                break;
            }
            self.evictable.remove(&tick);
            self.forget(block);
            expired.push(block);
        }
        expired
    }

    fn forget(&mut self, block: u32) {
        self.evictable_since.remove(&block);
        if let Some(hash) = self.hash_of_block.remove(&block) {
            self.by_hash.remove(&hash);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_keys_distinguish_equal_blocks_under_different_prefixes() {
        let mut cache = PrefixCache::new(None);
        let first = chain_hash(ROOT_HASH, &[1, 2]);
        assert!(cache.insert(ROOT_HASH, &[1, 2], 10));
        assert!(cache.insert(first, &[3, 4], 11));
        assert_eq!(cache.lookup(first, &[3, 4]).map(|(_, b)| b), Some(11));
        // The same tokens after another prefix are a different block.
        assert_eq!(cache.lookup(chain_hash(ROOT_HASH, &[9, 9]), &[3, 4]), None);
        assert!(!cache.insert(ROOT_HASH, &[1, 2], 12), "an equal block is cached once");
    }

    #[test]
    fn eviction_is_least_recently_used_and_reuse_protects_a_block() {
        let mut cache = PrefixCache::new(None);
        let now = Instant::now();
        for (i, block) in [5u32, 6, 7].into_iter().enumerate() {
            cache.insert(ROOT_HASH, &[i as u32], block);
            cache.mark_evictable(block, now);
        }
        cache.mark_in_use(5);
        assert_eq!(cache.num_evictable(), 2);
        assert_eq!(cache.evict_lru(), Some(6));
        assert!(!cache.is_cached(6));
        assert_eq!(cache.lookup(ROOT_HASH, &[1]), None);
        cache.mark_evictable(5, now);
        assert_eq!(cache.evict_lru(), Some(7));
        assert_eq!(cache.evict_lru(), Some(5));
        assert_eq!(cache.evict_lru(), None);
    }

    #[test]
    fn blocks_unused_past_the_ttl_expire() {
        let mut cache = PrefixCache::new(Some(Duration::from_secs(10)));
        let start = Instant::now();
        cache.insert(ROOT_HASH, &[1], 1);
        cache.mark_evictable(1, start);
        cache.insert(ROOT_HASH, &[2], 2);
        cache.mark_evictable(2, start + Duration::from_secs(8));
        assert_eq!(cache.evict_expired(start + Duration::from_secs(11)), vec![1]);
        assert_eq!(cache.num_evictable(), 1);
        assert!(cache.lookup(ROOT_HASH, &[2]).is_some());
    }
}
