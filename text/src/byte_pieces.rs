//! Each token's bytes, for tokenizers whose decoder is GPT-2's byte-level mapping alone. There a
//! sequence's text is its tokens' bytes concatenated and read as UTF-8 (the decoder maps each
//! token on its own, then joins), so incremental detokenization can append one token's bytes
//! instead of decoding a window of tokens twice per token — at 1024 running sequences that
//! window was the scheduler's largest cost per token. Kept only where every token's bytes read
//! back as the tokenizer's own decode of that token, so any other decoder keeps the general path.

use std::collections::{HashMap, HashSet};

use tokenizers::{DecoderWrapper, Tokenizer};

/// Token id → the bytes the tokenizer's decoder gives it (empty for special tokens, which
/// decoding skips).
#[derive(Debug)]
pub struct BytePieces {
    pieces: Vec<Box<[u8]>>,
}

impl BytePieces {
    /// The table, or `None` where the decoder is not byte-level alone or any token disagrees
    /// with the tokenizer's own decode.
    pub fn build(tokenizer: &Tokenizer) -> Option<Self> {
        if !matches!(tokenizer.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let byte_of = char_bytes();
        let special: HashSet<u32> = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        let count = u32::try_from(tokenizer.get_vocab_size(true)).ok()?;
        let mut pieces = Vec::with_capacity(count as usize);
        for id in 0..count {
            let bytes = match tokenizer.id_to_token(id) {
                Some(_) if special.contains(&id) => Vec::new(),
                // As the decoder does: each char through the byte-level map, or the token's own
                // UTF-8 where any char is outside it (added tokens written as plain text).
                Some(token) => token
                    .chars()
                    .map(|c| byte_of.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| token.into_bytes()),
                None => Vec::new(),
            };
            if String::from_utf8_lossy(&bytes) != tokenizer.decode(&[id], true).ok()? {
                return None;
            }
            pieces.push(bytes.into_boxed_slice());
        }
        Some(Self { pieces })
    }

    /// Token `id`'s bytes (none for an id the tokenizer does not know, which decoding skips).
    pub fn get(&self, id: u32) -> &[u8] {
        self.pieces.get(id as usize).map_or(&[], |piece| piece)
    }
}

/// GPT-2's byte-level alphabet, char → byte: printable Latin-1 bytes stand for themselves, the
/// other 68 bytes for the chars from U+0100 on, in byte order.
fn char_bytes() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut shifted = 0u32;
    (0..=255u8)
        .map(|b| {
            let c = if printable(b) {
                char::from(b)
            } else {
                shifted += 1;
                char::from_u32(255 + shifted).unwrap_or(char::REPLACEMENT_CHARACTER)
            };
            (c, b)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_alphabet_is_the_byte_level_pre_tokenizers() {
        let ours: HashSet<char> = char_bytes().into_keys().collect();
        let theirs: HashSet<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
            .into_iter()
            .collect();
        assert_eq!(ours.len(), 256);
        assert_eq!(ours, theirs);
        assert_eq!(char_bytes()[&'Ġ'], b' ');
        assert_eq!(char_bytes()[&'Ċ'], b'\n');
    }
}
