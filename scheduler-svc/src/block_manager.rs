//! Paged KV accounting: which of the worker's fixed-size KV blocks are free. Sequences keep their
//! own block tables; this hands blocks out and takes them back, O(1) per block.

#[derive(Debug)]
pub struct BlockManager {
    free: Vec<u32>,
    total: u32,
    block_size: u32,
}

impl BlockManager {
    pub fn new(total: u32, block_size: u32) -> Self {
        // Reversed so that low block ids are handed out first (easier to read in logs).
        Self {
            free: (0..total).rev().collect(),
            total,
            block_size,
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn total(&self) -> u32 {
        self.total
    }

    pub fn num_free(&self) -> u32 {
        self.free.len() as u32
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> u32 {
        tokens.div_ceil(self.block_size as usize) as u32
    }

    /// Takes `count` blocks, or none if fewer are free.
    pub fn allocate(&mut self, count: u32) -> Option<Vec<u32>> {
        let count = count as usize;
        if count > self.free.len() {
            return None;
        }
        Some(self.free.split_off(self.free.len() - count))
    }

    pub fn release(&mut self, blocks: &mut Vec<u32>) {
        debug_assert!(blocks.iter().all(|b| *b < self.total));
        self.free.append(blocks);
        debug_assert!(self.free.len() <= self.total as usize, "a block was freed twice");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_is_all_or_nothing_and_release_restores() {
        let mut manager = BlockManager::new(4, 16);
        assert_eq!(manager.blocks_for(33), 3);
        let mut first = manager.allocate(3).expect("3 of 4");
        assert!(manager.allocate(2).is_none());
        assert_eq!(manager.num_free(), 1);
        manager.release(&mut first);
        assert!(first.is_empty());
        assert_eq!(manager.num_free(), 4);
        let all = manager.allocate(4).expect("all");
        let mut sorted = all.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![0, 1, 2, 3]);
    }
}
