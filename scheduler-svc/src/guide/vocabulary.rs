//! The vocabulary as a structured output sees it: each ordinary token's bytes, sorted, so that
//! finding the tokens an automaton state allows walks each shared prefix once and skips every
//! token that starts with a prefix the automaton already refused (in a state that wants a digit,
//! the ~49k tokens cost one comparison each but the few hundred that start with one).

/// A token's bytes and its id.
#[derive(Debug)]
struct TokenEntry {
    bytes: Box<[u8]>,
    id: u32,
    /// Bytes it shares with the entry before it in sorted order.
    shared_prefix: usize,
}

/// Ordinary tokens (special tokens, whose bytes are empty, left out: a structured output never
/// writes `<|im_start|>` as text), sorted by their bytes.
#[derive(Debug)]
pub struct GuideVocabulary {
    entries: Vec<TokenEntry>,
    /// `u64` words of a token mask over the model's vocabulary (its logits' width).
    mask_words: usize,
    longest: usize,
}

impl GuideVocabulary {
    /// From each token id below `token_count` and its bytes (empty for a special token); masks
    /// span `model_vocab` tokens (the model's logits may be wider than the tokenizer).
    pub fn new<'a>(token_count: u32, bytes_of: impl Fn(u32) -> &'a [u8], model_vocab: u32) -> Self {
        let mut entries: Vec<TokenEntry> = (0..token_count.min(model_vocab))
            .filter_map(|id| {
                let bytes = bytes_of(id);
                (!bytes.is_empty()).then(|| TokenEntry {
                    bytes: bytes.into(),
                    id,
                    shared_prefix: 0,
                })
            })
            .collect();
        entries.sort_unstable_by(|a, b| a.bytes.cmp(&b.bytes).then(a.id.cmp(&b.id)));
        for i in 1..entries.len() {
            let (before, this) = entries.split_at_mut(i);
            let previous = &before[i - 1].bytes;
            this[0].shared_prefix = previous
                .iter()
                .zip(this[0].bytes.iter())
                .take_while(|(a, b)| a == b)
                .count();
        }
        let longest = entries.iter().map(|entry| entry.bytes.len()).max().unwrap_or(0);
        Self {
            entries,
            mask_words: (model_vocab as usize).div_ceil(64),
            longest,
        }
    }

    pub fn mask_words(&self) -> usize {
        self.mask_words
    }

    /// The tokens whose every byte `step` accepts, walking from `start`, and after whose last
    /// byte `can_finish` says a match is still reachable: `step(state, byte)` gives the next
    /// state, or `None` where the automaton refuses the byte. Returns the mask (bit `id % 64` of
    /// word `id / 64`) and whether any token is allowed.
    pub fn allowed<S: Copy>(
        &self,
        start: S,
        mut step: impl FnMut(S, u8) -> Option<S>,
        mut can_finish: impl FnMut(S) -> bool,
    ) -> (Box<[u64]>, bool) {
        let mut mask = vec![0u64; self.mask_words].into_boxed_slice();
        let mut any = false;
        // `states[d]`: the state after the current token's first `d` bytes, valid up to
        // `valid_depth`; a prefix of `refused_at` bytes of the last walked token was refused.
        let mut states = vec![start; self.longest + 1];
        let mut refused_at = usize::MAX;
        for entry in &self.entries {
            if entry.shared_prefix >= refused_at {
                continue; // it starts with the refused prefix
            }
            refused_at = usize::MAX;
            let mut depth = entry.shared_prefix;
            for &byte in &entry.bytes[depth..] {
                match step(states[depth], byte) {
                    Some(next) => {
                        depth += 1;
                        states[depth] = next;
                    }
                    None => {
                        refused_at = depth + 1;
                        break;
                    }
                }
            }
            if refused_at == usize::MAX && can_finish(states[depth]) {
                let id = entry.id as usize;
                mask[id / 64] |= 1 << (id % 64);
                any = true;
            }
        }
        (mask, any)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token `i`'s bytes in a small vocabulary with shared prefixes and a special token.
    const TOKENS: [&str; 9] = ["a", "ab", "abc", "b", "", "ba", "abd", "c", "aa"];

    fn vocabulary() -> GuideVocabulary {
        GuideVocabulary::new(TOKENS.len() as u32, |id| TOKENS[id as usize].as_bytes(), 70)
    }

    fn allowed_ids(mask: &[u64]) -> Vec<u32> {
        (0..70u32)
            .filter(|&id| mask[id as usize / 64] >> (id % 64) & 1 == 1)
            .collect()
    }

    /// The walk agrees with checking each token on its own, for automata that refuse at
    /// different depths (the skip over a refused prefix must not skip too much or too little).
    #[test]
    fn the_prefix_walk_matches_checking_every_token_alone() {
        let vocabulary = vocabulary();
        assert_eq!(vocabulary.mask_words(), 2);
        // Each automaton: the set of accepted strings' prefixes, as "text so far" states.
        let languages: [&[&str]; 4] = [&["abc", "ba"], &["a"], &["aab", "abd"], &["cab"]];
        for accepted in languages {
            let prefix_of_a_word = |bytes: &[u8]| accepted.iter().any(|word| word.as_bytes().starts_with(bytes));
            // States: indices of the prefixes read so far.
            let mut prefixes: Vec<Vec<u8>> = vec![Vec::new()];
            let step = |state: usize, byte: u8| {
                let mut next = prefixes[state].clone();
                next.push(byte);
                prefix_of_a_word(&next).then(|| {
                    prefixes.push(next);
                    prefixes.len() - 1
                })
            };
            let (mask, any) = vocabulary.allowed(0usize, step, |_| true);
            let expected: Vec<u32> = (0..TOKENS.len() as u32)
                .filter(|&id| !TOKENS[id as usize].is_empty() && prefix_of_a_word(TOKENS[id as usize].as_bytes()))
                .collect();
            assert_eq!(allowed_ids(&mask), expected, "language {accepted:?}");
            assert_eq!(any, !expected.is_empty());
        }
    }
}
