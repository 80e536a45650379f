//! Incremental detokenization: turns a growing list of token ids into text deltas, never emitting
//! half of a multi-byte UTF-8 character that spans tokens (a lossy read marks such a tail with
//! U+FFFD; we wait for the next token). Where the tokenizer gives each token's bytes
//! ([`ModelTokenizer::byte_pieces`]), a token appends its bytes to those not yet emitted; else the
//! window of tokens decoded each time stays small: only the tokens since the last emitted
//! boundary, plus the ones before it for context. Both emit the same deltas.

use crate::tokenizer::{ModelTokenizer, TokenizerError};

#[derive(Debug, Default)]
pub struct IncrementalDetokenizer {
    /// The window path's tokens.
    tokens: Vec<u32>,
    /// Start of the decode window.
    prefix_offset: usize,
    /// Tokens before this index have had their text emitted.
    read_offset: usize,
    /// The byte path's bytes not yet emitted.
    pending: Vec<u8>,
}

impl IncrementalDetokenizer {
    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &ModelTokenizer, token: u32) -> Result<String, TokenizerError> {
        let Some(pieces) = tokenizer.byte_pieces() else {
            return self.push_windowed(tokenizer, token);
        };
        self.pending.extend_from_slice(pieces.get(token));
        let text = String::from_utf8_lossy(&self.pending);
        if text.is_empty() || text.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let text = text.into_owned();
        self.pending.clear();
        Ok(text)
    }

    /// [`Self::push`] by decoding a window of tokens, as any tokenizer allows.
    pub fn push_windowed(&mut self, tokenizer: &ModelTokenizer, token: u32) -> Result<String, TokenizerError> {
        self.tokens.push(token);
        let prefix_text = tokenizer.decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let full_text = tokenizer.decode(&self.tokens[self.prefix_offset..])?;
        if full_text.len() > prefix_text.len() && !full_text.ends_with('\u{FFFD}') {
            if let Some(delta) = full_text.get(prefix_text.len()..) {
                self.prefix_offset = self.read_offset;
                self.read_offset = self.tokens.len();
                return Ok(delta.to_owned());
            }
        }
        Ok(String::new())
    }

    /// Text still held back when the sequence ends (an incomplete character decodes lossily).
    pub fn flush(&mut self, tokenizer: &ModelTokenizer) -> Result<String, TokenizerError> {
        let pending = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        let prefix_text = tokenizer.decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let full_text = tokenizer.decode(&self.tokens[self.prefix_offset..])?;
        self.prefix_offset = self.tokens.len();
        self.read_offset = self.tokens.len();
        Ok(pending + full_text.get(prefix_text.len()..).unwrap_or_default())
    }
}
