//! Structured outputs (vLLM's guided decoding): an output held to a JSON schema, any JSON
//! object, a regular expression or one of a list of choices. Each becomes a regular expression
//! (a JSON schema through `outlines-core`'s translation, as vLLM's outlines backend does), then
//! a DFA over bytes ([`automaton`]); at each step the scheduler sends the worker, for a guided
//! sequence, the mask of the tokens whose bytes keep the text on a path the DFA accepts, and an
//! end (EOS or a stop token) only where the text is a whole match. The worker excludes the
//! others before sampling, so greedy decoding takes the likeliest allowed token; logprobs stay
//! the model's own.
//!
//! Why a DFA walked per state rather than an index built up front (outlines' `Index` walks every
//! state × every token at compile time): a schema's regex has hundreds of states, and a request
//! visits a few dozen of them, so masks are computed as sequences reach states and kept per
//! pattern, shared by every request of the same schema ([`Guides`] keeps compiled patterns).

pub mod automaton;
pub mod vocabulary;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use thiserror::Error;

pub use automaton::{Guide, GuideCursor, GuideState, StateMask};
pub use vocabulary::GuideVocabulary;

/// Compiled patterns (and refusals) kept for later requests; past that the cache starts over.
/// Each holds at most [`automaton::DFA_SIZE_LIMIT`] of DFA and [`automaton::MAX_MASK_BYTES`] of
/// masks: 512 MB at most for the cache, besides guides that running sequences still hold.
const MAX_CACHED_GUIDES: usize = 16;

/// Whitespace a JSON output may hold between its tokens unless the request says otherwise
/// (outlines' default, as vLLM's outlines backend): at most one space, so that a small model
/// cannot fill its output with newlines.
pub const DEFAULT_JSON_WHITESPACE: &str = "[ ]?";

/// What an output must be, as a request asked.
#[derive(Debug, Clone, PartialEq)]
pub enum GuideSpec {
    /// Valid for this JSON schema.
    JsonSchema(serde_json::Value),
    /// Any JSON object.
    JsonObject,
    /// A match of this regular expression, whole.
    Regex(String),
    /// Exactly one of these texts.
    Choice(Vec<String>),
}

/// A structured output and, for JSON, the whitespace allowed between its tokens (a regular
/// expression; [`DEFAULT_JSON_WHITESPACE`] when `None`).
#[derive(Debug, Clone, PartialEq)]
pub struct GuideRequest {
    pub spec: GuideSpec,
    pub whitespace: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Error)]
pub enum GuideError {
    #[error("{0}")]
    Schema(String),
    #[error("{0}")]
    Pattern(String),
    #[error("needs at least one choice, and no empty one")]
    EmptyChoice,
    #[error("the served model's tokenizer is not byte-level BPE, which structured outputs need")]
    Unsupported,
    #[error("no text matches it")]
    Unmatchable,
    #[error("recursive schemas are not supported ({0} refers to itself)")]
    Recursive(String),
}

/// Compiles structured outputs against the served model's vocabulary, keeping what it compiled
/// and what it refused (a refusal can take as long as a compile: a client repeating it should
/// not cost that again).
pub struct Guides {
    vocabulary: Arc<GuideVocabulary>,
    compiled: Mutex<HashMap<String, Result<Arc<Guide>, GuideError>>>,
}

impl Guides {
    pub fn new(vocabulary: GuideVocabulary) -> Self {
        Self {
            vocabulary: Arc::new(vocabulary),
            compiled: Mutex::new(HashMap::new()),
        }
    }

    /// What an earlier request of the same pattern compiled to, if one did.
    pub fn cached(&self, request: &GuideRequest) -> Option<Result<Arc<Guide>, GuideError>> {
        self.lookup(&pattern(request).ok()?)
    }

    /// [`Self::compile`], off the async runtime's worker threads where it runs on one (compiling
    /// may take seconds, a DFA being determinized up to its limit), so that other requests and
    /// `/health` are served meanwhile; a pattern compiled before is simply taken.
    pub fn compile_off_runtime(&self, request: &GuideRequest) -> Result<Arc<Guide>, GuideError> {
        let pattern = pattern(request)?;
        if let Some(outcome) = self.lookup(&pattern) {
            return outcome;
        }
        let build = || self.build(pattern, request);
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) if runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                tokio::task::block_in_place(build)
            }
            _ => build(),
        }
    }

    /// The guide for `request`, compiled now or taken from an earlier request's.
    pub fn compile(&self, request: &GuideRequest) -> Result<Arc<Guide>, GuideError> {
        let pattern = pattern(request)?;
        self.lookup(&pattern).unwrap_or_else(|| self.build(pattern, request))
    }

    fn lookup(&self, pattern: &str) -> Option<Result<Arc<Guide>, GuideError>> {
        self.compiled
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(pattern)
            .cloned()
    }

    /// `pattern` (`request`'s) compiled, and kept with its outcome.
    fn build(&self, pattern: String, request: &GuideRequest) -> Result<Arc<Guide>, GuideError> {
        let json = matches!(request.spec, GuideSpec::JsonSchema(_) | GuideSpec::JsonObject);
        let outcome = Guide::compile(pattern.clone(), Arc::clone(&self.vocabulary))
            // An empty JSON schema translation (`"enum": []`) would end every output at once.
            .and_then(|guide| {
                if json && guide.matches_empty() {
                    Err(GuideError::Unmatchable)
                } else {
                    Ok(guide)
                }
            })
            .map(Arc::new);
        let mut compiled = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
        if compiled.len() >= MAX_CACHED_GUIDES {
            compiled.clear();
        }
        compiled.insert(pattern, outcome.clone());
        outcome
    }
}

/// The regular expression an output of `request` must match whole.
pub fn pattern(request: &GuideRequest) -> Result<String, GuideError> {
    let whitespace = request.whitespace.as_deref().unwrap_or(DEFAULT_JSON_WHITESPACE);
    let from_schema = |schema: &serde_json::Value| {
        outlines_core::json_schema::regex_from_value(schema, Some(whitespace), None)
            .map_err(|error| GuideError::Schema(error.to_string()))
    };
    match &request.spec {
        GuideSpec::JsonSchema(schema) => {
            refuse_recursion(schema)?;
            let mut schema = schema.clone();
            prepare_schema(&mut schema);
            from_schema(&schema)
        }
        GuideSpec::JsonObject => from_schema(&serde_json::json!({"type": "object"})),
        GuideSpec::Regex(regex) => Ok(regex.clone()),
        GuideSpec::Choice(choices) => {
            if choices.is_empty() || choices.iter().any(String::is_empty) {
                return Err(GuideError::EmptyChoice);
            }
            let escaped: Vec<String> = choices.iter().map(|choice| regex_syntax::escape(choice)).collect();
            Ok(escaped.join("|"))
        }
    }
}

/// String formats as patterns of printable ASCII without `"` or `\`, so that every match is a
/// valid JSON string and the DFA stays small. `outlines-core`'s own let invalid JSON through (an
/// email's quoted local part and a URI's user part may hold `"`; its time matches `\` and any
/// character where it meant `\.`; its date takes any Unicode digit) and, being Unicode-wide,
/// made an object of an email, a URI and a date-time determinize to ~40 MB of DFA.
const FORMAT_PATTERNS: [(&str, &str); 5] = [
    (
        "email",
        r"[a-zA-Z0-9.!#$%&'*+/=?^_`{|}~-]+@[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)+",
    ),
    (
        "uri",
        r"(?:https?|ftp)://[a-zA-Z0-9.-]+(?::[0-9]{1,5})?(?:/[!#-\[\]-~]*)?",
    ),
    (
        "date-time",
        r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])T(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])",
    ),
    ("date", r"[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"),
    (
        "time",
        r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]+)?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])?",
    ),
];

/// Readies a schema for `outlines-core`, which writes a string's `pattern` between quotes as it
/// is (stripping `^…$` only when both are there, so `cat|dog` became `"cat` or `dog"`, invalid
/// JSON, and `[a-z]+$` a string that never closes): each pattern loses its anchors and is
/// grouped; a string of a format in [`FORMAT_PATTERNS`] without a pattern of its own is given
/// that one (`outlines-core` reads a `pattern` before a `format`). Values that are data, not
/// schemas (`const`, `enum`, `default`, `examples`), are left as they are.
fn prepare_schema(schema: &mut serde_json::Value) {
    use serde_json::Value;
    match schema {
        Value::Object(map) => {
            let format = map.get("format").and_then(Value::as_str);
            let spelled = FORMAT_PATTERNS.iter().find(|(name, _)| Some(*name) == format);
            match (map.get_mut("pattern"), spelled) {
                (Some(Value::String(pattern)), _) => *pattern = grouped(pattern),
                (None, Some((_, pattern))) => {
                    map.insert("pattern".into(), Value::String(grouped(pattern)));
                }
                _ => {}
            }
            for (key, value) in map.iter_mut() {
                match (key.as_str(), value) {
                    ("const" | "enum" | "default" | "examples", _) => {}
                    // Maps of names to schemas: every value is a schema, whatever its name.
                    ("properties" | "patternProperties" | "$defs" | "definitions", Value::Object(named)) => {
                        named.values_mut().for_each(prepare_schema);
                    }
                    (_, value) => prepare_schema(value),
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(prepare_schema),
        _ => {}
    }
}

/// `pattern` without a leading `^` or a trailing (unescaped) `$`, as one group.
fn grouped(pattern: &str) -> String {
    let pattern = pattern.strip_prefix('^').unwrap_or(pattern);
    let pattern = match pattern.strip_suffix('$') {
        Some(stripped) if !stripped.ends_with('\\') => stripped,
        _ => pattern,
    };
    format!("(?:{pattern})")
}

/// `$ref`s one chain may follow (`outlines-core` itself refuses more than a few nested).
const MAX_REF_DEPTH: usize = 8;

/// Refuses a schema whose local `$ref`s lead back to themselves (a tree, a linked list): a
/// regular expression can only unroll them to a fixed depth, and `outlines-core` cuts them off
/// leaving a dangling comma and a required property missing — JSON that is not valid, ended as
/// if whole.
fn refuse_recursion(schema: &serde_json::Value) -> Result<(), GuideError> {
    use serde_json::Value;

    /// Every `$ref` under `value`, but those inside definitions (`$defs`, `definitions`), which
    /// count only where they are referred to.
    fn refs<'v>(value: &'v Value, found: &mut Vec<&'v str>) {
        match value {
            Value::Object(map) => {
                for (key, inner) in map {
                    match (key.as_str(), inner) {
                        ("$ref", Value::String(target)) => found.push(target),
                        ("$defs" | "definitions", _) => {}
                        _ => refs(inner, found),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|item| refs(item, found)),
            _ => {}
        }
    }
    fn target<'v>(schema: &'v Value, reference: &str) -> Option<&'v Value> {
        schema.pointer(reference.strip_prefix('#')?)
    }
    /// Depth first from `node`, `path` the references followed to it (at most
    /// [`MAX_REF_DEPTH`]: a chain of thousands would overflow the stack); `done` those whose every
    /// path was followed without coming back (a definition used twice is walked once).
    fn visit<'v>(
        schema: &'v Value,
        node: &'v Value,
        path: &mut Vec<&'v str>,
        done: &mut std::collections::HashSet<&'v str>,
    ) -> Result<(), GuideError> {
        let mut found = Vec::new();
        refs(node, &mut found);
        for reference in found {
            if path.contains(&reference) {
                return Err(GuideError::Recursive(reference.to_owned()));
            }
            if path.len() > MAX_REF_DEPTH {
                return Err(GuideError::Schema(format!("$refs nest more than {MAX_REF_DEPTH} deep")));
            }
            if done.contains(reference) {
                continue;
            }
            if let Some(next) = target(schema, reference) {
                path.push(reference);
                visit(schema, next, path, done)?;
                path.pop();
                done.insert(reference);
            }
        }
        Ok(())
    }
    visit(schema, schema, &mut vec!["#"], &mut std::collections::HashSet::new())
}

#[cfg(test)]
mod tests;
