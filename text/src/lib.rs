//! The model's text side, shared by the scheduler and the benchmark (which need nothing else of
//! the server): the tokenizer read from a GGUF file or a Hugging Face folder, the chat template,
//! incremental detokenization that never splits a UTF-8 character, and how one token shows in a
//! logprobs listing.

pub mod byte_pieces;
pub mod chat_template;
pub mod detokenizer;
pub mod token_piece;
pub mod tokenizer;
