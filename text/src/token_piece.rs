//! One token as a logprobs listing shows it, apart from the text it is part of: OpenAI's
//! `token` and `bytes` for each token, and completions' `text_offset` (where in the choice's
//! text each token starts, in characters).
//!
//! A byte-level token can hold part of a UTF-8 character (a CJK character or an emoji is often
//! two or three tokens). Its `token` then reads `�`, as in vLLM, but its `bytes` are the token's
//! own bytes, so a client joining them recovers the character — what OpenAI's `bytes` are for —
//! and the offsets count the characters the text really has, not one per `�`.

use crate::tokenizer::ModelTokenizer;

/// How one token shows in a logprobs listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenPiece {
    /// The token read alone (lossy where it holds part of a character); special tokens, which
    /// the text leaves out, by their written form (`<|im_end|>`), as vLLM lists them.
    pub text: String,
    /// The token's own bytes where the decoder is byte-level, else `text`'s.
    pub bytes: Vec<u8>,
    /// What the token adds to the choice's text (nothing for a special token).
    pub text_bytes: Vec<u8>,
}

impl TokenPiece {
    pub fn of(tokenizer: &ModelTokenizer, id: u32) -> Self {
        let text_bytes = match tokenizer.byte_pieces() {
            Some(pieces) => pieces.get(id).to_vec(),
            None => tokenizer.decode(&[id]).unwrap_or_default().into_bytes(),
        };
        if text_bytes.is_empty() {
            // Left out of the text: a special token (or one the tokenizer does not know).
            let text = tokenizer.decode_with_special(&[id]).unwrap_or_default();
            return Self {
                bytes: text.clone().into_bytes(),
                text,
                text_bytes,
            };
        }
        Self {
            text: String::from_utf8_lossy(&text_bytes).into_owned(),
            bytes: text_bytes.clone(),
            text_bytes,
        }
    }
}

/// Characters of a choice's text so far, fed token by token: a character split across tokens
/// counts once, when its last byte arrives; a byte sequence that can never be UTF-8 counts as the
/// one `�` the text shows for it.
#[derive(Debug, Default)]
pub struct CharOffsets {
    chars: usize,
    pending: Vec<u8>,
}

impl CharOffsets {
    /// The offset (in characters) at which the next token starts.
    pub fn offset(&self) -> usize {
        self.chars
    }

    /// Appends one token's bytes of text.
    pub fn push(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(valid) => {
                    self.chars += valid.chars().count();
                    rest = &[];
                    break;
                }
                Err(error) => {
                    let (valid, after) = rest.split_at(error.valid_up_to());
                    // Valid by `valid_up_to`'s contract.
                    self.chars += std::str::from_utf8(valid).map_or(0, |s| s.chars().count());
                    match error.error_len() {
                        // An invalid sequence: one replacement character, then go on after it.
                        Some(len) => {
                            self.chars += 1;
                            rest = &after[len..];
                        }
                        // A character begun but not finished: wait for the next token.
                        None => {
                            rest = after;
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let start = self.pending.len() - keep;
        self.pending.drain(..start);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_character_split_across_tokens_counts_once() {
        let mut offsets = CharOffsets::default();
        let pieces: [&[u8]; 4] = [b"a ", &[0xE4, 0xBD], &[0xA0], b"b"];
        let mut starts = Vec::new();
        for piece in pieces {
            starts.push(offsets.offset());
            offsets.push(piece);
        }
        assert_eq!(starts, vec![0, 2, 2, 3]);
        assert_eq!(offsets.offset(), "a 你b".chars().count());
    }

    #[test]
    fn invalid_bytes_count_as_one_replacement_each() {
        let mut offsets = CharOffsets::default();
        offsets.push(&[0xFF, b'x']);
        assert_eq!(offsets.offset(), String::from_utf8_lossy(&[0xFF, b'x']).chars().count());
        // A lead byte followed by a byte that cannot continue it.
        offsets.push(&[0xE4]);
        offsets.push(b"y");
        assert_eq!(
            offsets.offset(),
            2 + String::from_utf8_lossy(&[0xE4, b'y']).chars().count()
        );
    }
}
