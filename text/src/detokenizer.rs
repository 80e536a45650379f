//! Incremental detokenization: turns a growing list of token ids into text deltas, never emitting
//! half of a multi-byte UTF-8 character that spans tokens (the decoder marks such a tail with
//! U+FFFD; we wait for the next token). The window of tokens decoded each time stays small: only
//! the tokens since the last emitted boundary, plus the ones before it for context.

use crate::tokenizer::{ModelTokenizer, TokenizerError};

#[derive(Debug, Default)]
pub struct IncrementalDetokenizer {
    tokens: Vec<u32>,
    /// Start of the decode window.
    prefix_offset: usize,
    /// Tokens before this index have had their text emitted.
    read_offset: usize,
}

impl IncrementalDetokenizer {
    /// Adds one token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &ModelTokenizer, token: u32) -> Result<String, TokenizerError> {
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
        let prefix_text = tokenizer.decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let full_text = tokenizer.decode(&self.tokens[self.prefix_offset..])?;
        self.prefix_offset = self.tokens.len();
        self.read_offset = self.tokens.len();
        Ok(full_text.get(prefix_text.len()..).unwrap_or_default().to_owned())
    }
}
