//! The model's text side, shared by the scheduler and the benchmark (which need nothing else of
//! the server): the tokenizer read from a GGUF file or a Hugging Face folder, the chat template,
//! and incremental detokenization that never splits a UTF-8 character.

pub mod byte_pieces;
pub mod chat_template;
pub mod detokenizer;
pub mod tokenizer;
