//! The prompts of a run: random real tokens, groups sharing a long prefix, or a file.

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rivulet_text::tokenizer::ModelTokenizer;

/// One request of the workload.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchRequest {
    pub prompt: String,
    /// Tokens of `prompt` under the model's tokenizer (what the server should report).
    pub prompt_tokens: usize,
    pub max_tokens: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] rivulet_text::tokenizer::TokenizerError),
    #[error("{path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error("{path} line {line}: {message}")]
    Parse { path: String, line: usize, message: String },
    #[error("{0}")]
    Invalid(String),
}

/// A length drawn uniformly from `[len·(1 − ratio), len·(1 + ratio)]` (vLLM's `--random-range-ratio`).
pub fn sample_length(rng: &mut StdRng, len: u32, range_ratio: f64) -> u32 {
    let low = ((len as f64) * (1.0 - range_ratio)).round().max(1.0) as u32;
    let high = ((len as f64) * (1.0 + range_ratio)).round().max(low as f64) as u32;
    rng.random_range(low..=high)
}

/// Text of about `len` tokens made of random vocabulary entries. Random ids are decoded (control
/// tokens drop out), re-encoded and cut to `len`, as vLLM does, so the text is real tokens that
/// tokenize back to (nearly always exactly) `len`.
pub fn random_text(tokenizer: &ModelTokenizer, rng: &mut StdRng, len: usize) -> Result<(String, usize), DatasetError> {
    let vocab = tokenizer.vocab_size();
    let mut ids: Vec<u32> = Vec::with_capacity(len);
    let mut text = String::new();
    // Decoding then re-encoding can merge tokens; draw more until the re-encoding is long enough.
    for _ in 0..8 {
        while ids.len() < len + len / 4 + 4 {
            ids.push(rng.random_range(0..vocab));
        }
        let mut encoded = tokenizer.encode(&tokenizer.decode(&ids)?)?;
        if encoded.len() >= len {
            encoded.truncate(len);
            text = tokenizer.decode(&encoded)?;
            break;
        }
        ids = encoded;
    }
    let actual = tokenizer.encode(&text)?.len();
    if actual == 0 && len > 0 {
        return Err(DatasetError::Invalid(
            "could not build a random prompt from the vocabulary".into(),
        ));
    }
    Ok((text, actual))
}

pub struct RandomSpec {
    pub num_prompts: usize,
    pub input_len: u32,
    pub output_len: u32,
    pub range_ratio: f64,
    pub seed: u64,
}

pub fn random_dataset(tokenizer: &ModelTokenizer, spec: &RandomSpec) -> Result<Vec<BenchRequest>, DatasetError> {
    let mut rng = StdRng::seed_from_u64(spec.seed);
    (0..spec.num_prompts)
        .map(|_| {
            let input_len = sample_length(&mut rng, spec.input_len, spec.range_ratio);
            let max_tokens = sample_length(&mut rng, spec.output_len, spec.range_ratio);
            let (prompt, prompt_tokens) = random_text(tokenizer, &mut rng, input_len as usize)?;
            Ok(BenchRequest {
                prompt,
                prompt_tokens,
                max_tokens,
            })
        })
        .collect()
}

pub struct SharedPrefixSpec {
    pub num_prompts: usize,
    pub num_groups: usize,
    pub prefix_len: u32,
    pub suffix_len: u32,
    pub output_len: u32,
    pub seed: u64,
}

/// `num_groups` long prefixes; request `i` is prefix `i % num_groups` plus its own random suffix,
/// so a prefix cache can reuse the prefix's KV blocks across the group.
pub fn shared_prefix_dataset(
    tokenizer: &ModelTokenizer,
    spec: &SharedPrefixSpec,
) -> Result<Vec<BenchRequest>, DatasetError> {
    if spec.num_groups == 0 {
        return Err(DatasetError::Invalid("--num-prefix-groups must be at least 1".into()));
    }
    let mut rng = StdRng::seed_from_u64(spec.seed);
    let prefixes = (0..spec.num_groups)
        .map(|_| random_text(tokenizer, &mut rng, spec.prefix_len as usize).map(|(text, _)| text))
        .collect::<Result<Vec<_>, _>>()?;
    (0..spec.num_prompts)
        .map(|i| {
            let (suffix, _) = random_text(tokenizer, &mut rng, spec.suffix_len as usize)?;
            let prompt = format!("{}\n{suffix}", prefixes[i % spec.num_groups]);
            Ok(BenchRequest {
                prompt_tokens: tokenizer.encode(&prompt)?.len(),
                prompt,
                max_tokens: spec.output_len,
            })
        })
        .collect()
}

/// Prompts from a file: JSON Lines with a `prompt` field (and optionally `max_tokens`), or else
/// one prompt per non-empty line. Prompts are cycled when `num_prompts` exceeds the file.
pub fn file_dataset(
    tokenizer: &ModelTokenizer,
    path: &Path,
    num_prompts: usize,
    default_max_tokens: u32,
) -> Result<Vec<BenchRequest>, DatasetError> {
    let display = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| DatasetError::Read {
        path: display.clone(),
        source,
    })?;
    let mut entries = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let (prompt, max_tokens) = if line.starts_with('{') {
            parse_json_line(line).map_err(|message| DatasetError::Parse {
                path: display.clone(),
                line: index + 1,
                message,
            })?
        } else {
            (line.to_owned(), None)
        };
        entries.push((prompt, max_tokens.unwrap_or(default_max_tokens)));
    }
    if entries.is_empty() {
        return Err(DatasetError::Invalid(format!("{display} holds no prompts")));
    }
    entries
        .iter()
        .cycle()
        .take(num_prompts)
        .map(|(prompt, max_tokens)| {
            Ok(BenchRequest {
                prompt_tokens: tokenizer.encode(prompt)?.len(),
                prompt: prompt.clone(),
                max_tokens: *max_tokens,
            })
        })
        .collect()
}

fn parse_json_line(line: &str) -> Result<(String, Option<u32>), String> {
    let value: serde_json::Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let prompt = value
        .get("prompt")
        .and_then(|p| p.as_str())
        .ok_or("expected a string field `prompt`")?
        .to_owned();
    let max_tokens = match value.get("max_tokens") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or("`max_tokens` must be a non-negative integer")?,
        ),
    };
    Ok((prompt, max_tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_stay_in_the_range_and_cover_it() {
        let mut rng = StdRng::seed_from_u64(3);
        let drawn: Vec<u32> = (0..2000).map(|_| sample_length(&mut rng, 100, 0.25)).collect();
        assert!(drawn.iter().all(|&n| (75..=125).contains(&n)));
        assert!(drawn.contains(&75) && drawn.contains(&125));
        let mut rng = StdRng::seed_from_u64(3);
        assert!((0..50).all(|_| sample_length(&mut rng, 128, 0.0) == 128));
    }

    #[test]
    fn json_lines_need_a_prompt() {
        assert_eq!(
            parse_json_line(r#"{"prompt": "hi", "max_tokens": 7}"#),
            Ok(("hi".to_owned(), Some(7)))
        );
        assert_eq!(parse_json_line(r#"{"prompt": "hi"}"#), Ok(("hi".to_owned(), None)));
        assert!(parse_json_line(r#"{"text": "hi"}"#).is_err());
        assert!(parse_json_line(r#"{"prompt": "hi", "max_tokens": -1}"#).is_err());
    }
}
