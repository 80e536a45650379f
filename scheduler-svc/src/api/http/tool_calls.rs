//! OpenAI's function calling on chat: named and "required" calls as vLLM makes them (structured
//! outputs over the tools' schemas, its `get_json_schema_from_tools`), "auto" as text.
//!
//! `tool_choice` naming a function makes the output that function's arguments: a JSON object
//! held to its `parameters` schema by a structured output (`crate::guide`), returned as one call
//! in `message.tool_calls`. `"required"` makes the output a JSON list of calls, each
//! `{"name": …, "parameters": …}` for one of the tools (vLLM's shape; one call at most when
//! `parallel_tool_calls` is false), returned as one entry each with `finish_reason`
//! "tool_calls". `"none"` and `"auto"` (the default where tools are given) leave the output as
//! text: finding calls in free text takes a parser for the model's own call syntax, which
//! SmolLM2-135M has none of; vLLM without a tool-call parser answers with text too. The default
//! model's chat template shows no tools to the model (it has no place for them), so the calls it
//! makes follow their schemas but not their descriptions.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Map, Value};

use super::errors::ApiError;
use super::openai::{GenerationBody, ToolKind};
use crate::guide::{GuideRequest, GuideSpec};

/// What a request's tool choice makes of its output.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolOutput {
    /// The arguments of this function.
    Named(String),
    /// A list of calls, `{"name", "parameters"}` each.
    Required,
}

/// One entry of `tools`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Tool {
    #[serde(rename = "type")]
    #[allow(dead_code)]
    kind: ToolKind,
    function: FunctionDefinition,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FunctionDefinition {
    name: String,
    #[allow(dead_code)]
    description: Option<String>,
    parameters: Option<Map<String, Value>>,
    /// Taken: the arguments hold to the schema either way.
    #[allow(dead_code)]
    strict: Option<bool>,
}

/// `{"type": "function", "function": {"name": …}}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NamedChoice {
    #[serde(rename = "type")]
    #[allow(dead_code)]
    kind: ToolKind,
    function: NamedFunction,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NamedFunction {
    name: String,
}

/// OpenAI's rule for a function's name: 1 to 64 letters, digits, `_` or `-`.
fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A listed function: its name and its parameters' schema.
struct Function {
    name: String,
    parameters: Option<Map<String, Value>>,
}

/// The functions of a chat request's `tools`.
fn parse_tools(tools: Value) -> Result<Vec<Function>, ApiError> {
    const PARAM: &str = "tools";
    let tools: Vec<Tool> = serde_json::from_value(tools).map_err(|e| ApiError::invalid(PARAM, e))?;
    let mut parsed: Vec<Function> = Vec::with_capacity(tools.len());
    for tool in tools {
        let FunctionDefinition { name, parameters, .. } = tool.function;
        if !valid_name(&name) {
            return Err(ApiError::invalid(
                PARAM,
                format!("function name {name:?} must be 1 to 64 letters, digits, '_' or '-'"),
            ));
        }
        if parsed.iter().any(|known| known.name == name) {
            return Err(ApiError::invalid(PARAM, format!("function {name:?} is listed twice")));
        }
        // Arguments are an object (OpenAI's rule): a schema of another type cannot describe them.
        if let Some(kind) = parameters.as_ref().and_then(|p| p.get("type")) {
            if kind != "object" {
                return Err(ApiError::invalid(
                    PARAM,
                    format!("the parameters of function {name:?} must be an object's schema, not type {kind}"),
                ));
            }
        }
        parsed.push(Function { name, parameters });
    }
    Ok(parsed)
}

/// A function's parameters as a schema: none, or `{}`, is an empty object (vLLM's reading; `{}`
/// as a schema would take any JSON value, `null` too).
fn parameters_schema(parameters: Option<Map<String, Value>>) -> Value {
    match parameters {
        Some(parameters) if !parameters.is_empty() => Value::Object(parameters),
        _ => json!({"type": "object", "properties": {}}),
    }
}

/// vLLM's schema of a list of calls: each item one tool's `{"name", "parameters"}`, the tools'
/// `$defs` gathered at the top, where their `#/$defs/…` references point.
fn calls_schema(tools: Vec<Function>, parallel: bool) -> Result<Value, ApiError> {
    let mut definitions = Map::new();
    let mut alternatives = Vec::with_capacity(tools.len());
    for Function { name, mut parameters } in tools {
        if let Some(defs) = parameters.as_mut().and_then(|p| p.remove("$defs")) {
            let Value::Object(defs) = defs else {
                return Err(ApiError::invalid(
                    "tools",
                    format!("$defs of function {name:?} must be an object"),
                ));
            };
            for (def_name, schema) in defs {
                match definitions.get(&def_name) {
                    Some(known) if *known != schema => {
                        return Err(ApiError::invalid(
                            "tools",
                            format!("$defs {def_name:?} differs between functions, which is not supported"),
                        ));
                    }
                    _ => {
                        definitions.insert(def_name, schema);
                    }
                }
            }
        }
        alternatives.push(json!({
            "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": parameters_schema(parameters),
            },
            "required": ["name", "parameters"],
        }));
    }
    let mut schema = json!({
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": alternatives},
    });
    if !parallel {
        schema["maxItems"] = json!(1);
    }
    if !definitions.is_empty() {
        schema["$defs"] = Value::Object(definitions);
    }
    Ok(schema)
}

/// The calls a chat request asks for, and the structured output that makes them; `None` for
/// text. Takes the tool fields out of `body`. `structured` names the parameter by which the
/// request also asks for a structured output (`response_format`, `structured_outputs`,
/// `guided_*`), which a call cannot take beside its own.
pub fn from_body(
    body: &mut GenerationBody,
    structured: Option<&'static str>,
) -> Result<Option<(GuideRequest, ToolOutput)>, ApiError> {
    let parallel = match body.parallel_tool_calls.take() {
        None | Some(Value::Null) => true,
        Some(Value::Bool(parallel)) => parallel,
        Some(other) => {
            return Err(ApiError::invalid(
                "parallel_tool_calls",
                format!("must be true or false, not {other}"),
            ))
        }
    };
    let tools = match body.tools.take() {
        None | Some(Value::Null) => Vec::new(),
        Some(tools) => parse_tools(tools)?,
    };
    let output = match body.tool_choice.take() {
        None | Some(Value::Null) => None,
        Some(Value::String(choice)) => match choice.as_str() {
            "none" | "auto" => None,
            "required" => Some(ToolOutput::Required),
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    format!("{other:?} is not one of \"none\", \"auto\", \"required\" or a named function"),
                ))
            }
        },
        Some(named) => {
            let named: NamedChoice = serde_json::from_value(named).map_err(|e| {
                ApiError::invalid(
                    "tool_choice",
                    format!("{e} (a named function is {{\"type\": \"function\", \"function\": {{\"name\": …}}}})"),
                )
            })?;
            Some(ToolOutput::Named(named.function.name))
        }
    };
    let Some(output) = output else {
        return Ok(None);
    };
    if tools.is_empty() {
        return Err(ApiError::invalid(
            "tool_choice",
            "a function call needs the functions in tools",
        ));
    }
    if let Some(param) = structured {
        return Err(ApiError::invalid(
            "tool_choice",
            format!("a function call's arguments are a structured output already; leave out {param}"),
        ));
    }
    if body.allowed_token_ids.is_some() {
        return Err(ApiError::invalid(
            "allowed_token_ids",
            "a function call's arguments follow their schema, not a list of tokens (tool_choice)",
        ));
    }
    let schema = match &output {
        ToolOutput::Named(name) => {
            let function = tools
                .into_iter()
                .find(|known| known.name == *name)
                .ok_or_else(|| ApiError::invalid("tool_choice", format!("function {name:?} is not among the tools")))?;
            parameters_schema(function.parameters)
        }
        ToolOutput::Required => calls_schema(tools, parallel)?,
    };
    let guide = GuideRequest {
        spec: GuideSpec::JsonSchema(schema),
        whitespace: None,
    };
    Ok(Some((guide, output)))
}

/// One call of a response (`message.tool_calls`) or one part of it in a stream's chunk
/// (`delta.tool_calls`: the first part names the call, the rest add to its arguments).
#[derive(Debug, Clone, serde::Serialize, PartialEq)]
pub struct ToolCall {
    /// In a stream only: which call of the message this part belongs to.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<ToolKind>,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, serde::Serialize, PartialEq)]
pub struct FunctionCall {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

/// A new call's id, unique as vLLM's are.
fn call_id() -> String {
    format!("chatcmpl-tool-{}", uuid::Uuid::new_v4().simple())
}

/// A call with its name and whole arguments (`index` in a stream).
fn whole_call(index: Option<u32>, name: String, arguments: String) -> ToolCall {
    ToolCall {
        index,
        id: Some(call_id()),
        kind: Some(ToolKind::Function),
        function: FunctionCall {
            name: Some(name),
            arguments,
        },
    }
}

/// One entry of a "required" output's list of calls.
#[derive(Deserialize)]
struct CallText<'a> {
    name: String,
    #[serde(borrow)]
    parameters: &'a RawValue,
}

/// One choice's calls as its output is streamed or returned.
#[derive(Debug)]
pub enum ToolCallBuilder {
    /// A named call, and whether its first part (id and name) went out.
    Named { name: String, opened: bool },
    /// A list of calls, and its text so far: it is parsed once whole.
    Required { text: String },
}

/// What a choice's message (or delta) says: its text, or calls.
#[derive(Debug, PartialEq)]
pub enum CallsOrText {
    Text(String),
    Calls(Vec<ToolCall>),
}

impl ToolCallBuilder {
    pub fn new(output: ToolOutput) -> Self {
        match output {
            ToolOutput::Named(name) => Self::Named { name, opened: false },
            ToolOutput::Required => Self::Required { text: String::new() },
        }
    }

    /// Whether the whole output finished as "tool_calls": a list of calls that ended as it
    /// should (vLLM's rule; a named call keeps the output's reason, as OpenAI's does).
    pub fn finishes_as_calls(&self, stopped: bool) -> bool {
        matches!(self, Self::Required { .. }) && stopped
    }

    /// A whole response's message for the output `text`: its calls, or the text where a list of
    /// calls did not parse (cut short by `max_tokens`).
    pub fn whole(&mut self, text: String) -> CallsOrText {
        match self {
            Self::Named { name, .. } => CallsOrText::Calls(vec![whole_call(None, name.clone(), text)]),
            Self::Required { .. } => parse_calls(&text, false).map_or(CallsOrText::Text(text), CallsOrText::Calls),
        }
    }

    /// A stream's next part for the new `text`; `last` on the choice's last chunk. A named call
    /// streams its arguments as they come; a list of calls goes out whole in the last chunk.
    pub fn delta(&mut self, text: String, last: bool) -> Option<CallsOrText> {
        match self {
            Self::Named { name, opened } => {
                if text.is_empty() && (*opened || !last) {
                    return None;
                }
                let call = if *opened {
                    ToolCall {
                        index: Some(0),
                        id: None,
                        kind: None,
                        function: FunctionCall {
                            name: None,
                            arguments: text,
                        },
                    }
                } else {
                    *opened = true;
                    whole_call(Some(0), name.clone(), text)
                };
                Some(CallsOrText::Calls(vec![call]))
            }
            Self::Required { text: so_far } => {
                so_far.push_str(&text);
                if !last {
                    return None;
                }
                let text = std::mem::take(so_far);
                Some(parse_calls(&text, true).map_or(CallsOrText::Text(text), CallsOrText::Calls))
            }
        }
    }
}

/// A list of calls' entries, each with its arguments as the model wrote them; `None` where the
/// text is not such a list.
fn parse_calls(text: &str, streamed: bool) -> Option<Vec<ToolCall>> {
    let calls: Vec<CallText> = serde_json::from_str(text).ok()?;
    Some(
        calls
            .into_iter()
            .enumerate()
            .map(|(index, call)| {
                let index = streamed.then_some(index as u32);
                whole_call(index, call.name, call.parameters.get().to_owned())
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests;
