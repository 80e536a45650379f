//! A request's structured output, by whichever parameter its client uses: OpenAI's
//! `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` object, or
//! vLLM's older `guided_json`, `guided_regex` and `guided_choice`. One kind a request; grammars
//! (`guided_grammar`, `structured_outputs.grammar`) and structural tags are refused by name.

use serde::Deserialize;
use serde_json::Value;

use super::errors::ApiError;
use super::openai::GenerationBody;
use crate::guide::{GuideRequest, GuideSpec};

/// vLLM's `structured_outputs` (`StructuredOutputsParams`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct StructuredOutputs {
    json: Option<Value>,
    regex: Option<String>,
    choice: Option<Vec<String>>,
    grammar: Option<String>,
    json_object: Option<bool>,
    structural_tag: Option<Value>,
    whitespace_pattern: Option<String>,
    /// Taken: Rivulet has one backend and never falls back, allows at most one space between a
    /// JSON output's tokens unless `whitespace_pattern` says otherwise, and an object holds its
    /// schema's properties only.
    #[allow(dead_code)]
    disable_fallback: Option<bool>,
    #[allow(dead_code)]
    disable_any_whitespace: Option<bool>,
    #[allow(dead_code)]
    disable_additional_properties: Option<bool>,
}

/// OpenAI's `response_format.json_schema`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonSchemaFormat {
    /// OpenAI's field is `schema`; vLLM also reads it as `json_schema`.
    #[serde(alias = "json_schema")]
    schema: Option<Value>,
    #[allow(dead_code)]
    name: Option<String>,
    #[allow(dead_code)]
    description: Option<String>,
    /// Taken: the output holds to the schema either way.
    #[allow(dead_code)]
    strict: Option<bool>,
}

/// A JSON schema given as an object, or as a string holding one (vLLM takes both).
fn schema(param: &'static str, value: Value) -> Result<GuideSpec, ApiError> {
    let schema = match value {
        Value::String(text) => {
            serde_json::from_str(&text).map_err(|e| ApiError::invalid(param, format!("not a JSON schema: {e}")))?
        }
        Value::Object(_) | Value::Bool(_) => value,
        other => {
            return Err(ApiError::invalid(
                param,
                format!("a JSON schema is an object, not {other}"),
            ))
        }
    };
    Ok(GuideSpec::JsonSchema(schema))
}

/// OpenAI's `response_format`: `text` (no structure), `json_object` or `json_schema`.
fn response_format(format: Value) -> Result<Option<GuideSpec>, ApiError> {
    const PARAM: &str = "response_format";
    let kind = format.get("type").and_then(Value::as_str).map(str::to_owned);
    match kind.as_deref() {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(GuideSpec::JsonObject)),
        Some("json_schema") => {
            let inner = format
                .get("json_schema")
                .cloned()
                .ok_or_else(|| ApiError::invalid(PARAM, "type json_schema needs its \"json_schema\" object"))?;
            let inner: JsonSchemaFormat =
                serde_json::from_value(inner).map_err(|e| ApiError::invalid(PARAM, format!("json_schema: {e}")))?;
            let schema_value = inner
                .schema
                .ok_or_else(|| ApiError::invalid(PARAM, "json_schema needs its \"schema\""))?;
            schema(PARAM, schema_value).map(Some)
        }
        Some("structural_tag") => Err(ApiError::invalid(PARAM, "structural tags are not supported")),
        _ => Err(ApiError::invalid(
            PARAM,
            "type must be text, json_object or json_schema",
        )),
    }
}

/// vLLM's `structured_outputs` object: exactly one of its kinds.
fn structured_outputs(value: Value) -> Result<(Option<GuideSpec>, Option<String>), ApiError> {
    const PARAM: &str = "structured_outputs";
    let outputs: StructuredOutputs = serde_json::from_value(value).map_err(|e| ApiError::invalid(PARAM, e))?;
    if outputs.grammar.is_some() {
        return Err(ApiError::invalid(
            PARAM,
            "grammar is not supported (a JSON schema, regex or choice is)",
        ));
    }
    if outputs.structural_tag.is_some() {
        return Err(ApiError::invalid(PARAM, "structural_tag is not supported"));
    }
    let mut kinds = Vec::new();
    if let Some(json) = outputs.json {
        kinds.push(schema(PARAM, json)?);
    }
    if let Some(regex) = outputs.regex {
        kinds.push(GuideSpec::Regex(regex));
    }
    if let Some(choice) = outputs.choice {
        kinds.push(GuideSpec::Choice(choice));
    }
    if outputs.json_object == Some(true) {
        kinds.push(GuideSpec::JsonObject);
    }
    if kinds.len() != 1 {
        return Err(ApiError::invalid(
            PARAM,
            "give one of json, regex, choice and json_object: true",
        ));
    }
    Ok((kinds.pop(), outputs.whitespace_pattern))
}

/// The structured output `body` asks for, and the parameter it asked by; `None` for none.
pub fn from_body(body: &mut GenerationBody) -> Result<Option<(GuideRequest, &'static str)>, ApiError> {
    if body.guided_grammar.is_some() {
        return Err(ApiError::invalid(
            "guided_grammar",
            "grammars are not supported (a JSON schema, regex or choice is)",
        ));
    }
    let mut asked: Vec<(GuideSpec, &'static str)> = Vec::new();
    let mut whitespace = body.guided_whitespace_pattern.take();
    if let Some(format) = body.response_format.take() {
        asked.extend(response_format(format)?.map(|spec| (spec, "response_format")));
    }
    if let Some(outputs) = body.structured_outputs.take() {
        let (spec, pattern) = structured_outputs(outputs)?;
        asked.extend(spec.map(|spec| (spec, "structured_outputs")));
        whitespace = whitespace.or(pattern);
    }
    if let Some(json) = body.guided_json.take() {
        asked.push((schema("guided_json", json)?, "guided_json"));
    }
    if let Some(regex) = body.guided_regex.take() {
        asked.push((GuideSpec::Regex(regex), "guided_regex"));
    }
    if let Some(choice) = body.guided_choice.take() {
        asked.push((GuideSpec::Choice(choice), "guided_choice"));
    }
    match asked.len() {
        0 => Ok(None),
        1 => Ok(asked
            .pop()
            .map(|(spec, param)| (GuideRequest { spec, whitespace }, param))),
        _ => {
            let params: Vec<&str> = asked.iter().map(|(_, param)| *param).collect();
            Err(ApiError::invalid(
                asked[1].1,
                format!(
                    "one structured output a request; this one asks by {}",
                    params.join(" and ")
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn asked(extra: Value) -> Result<Option<(GuideRequest, &'static str)>, ApiError> {
        let mut body = json!({"prompt": "x"});
        for (key, value) in extra.as_object().expect("object") {
            body[key] = value.clone();
        }
        let mut body: GenerationBody = serde_json::from_value(body).expect("a body");
        from_body(&mut body)
    }

    fn spec(extra: Value) -> (GuideSpec, Option<String>, &'static str) {
        let (request, param) = asked(extra).expect("taken").expect("a structured output");
        (request.spec, request.whitespace, param)
    }

    #[test]
    fn each_way_of_asking_gives_its_kind_under_its_own_name() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let as_schema = GuideSpec::JsonSchema(schema.clone());
        let format =
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}});
        assert_eq!(spec(format), (as_schema.clone(), None, "response_format"));
        assert_eq!(
            spec(json!({"response_format": {"type": "json_object"}})),
            (GuideSpec::JsonObject, None, "response_format")
        );
        assert!(asked(json!({"response_format": {"type": "text"}}))
            .expect("taken")
            .is_none());
        // vLLM takes a schema as an object or as JSON text.
        assert_eq!(
            spec(json!({"guided_json": schema.to_string()})),
            (as_schema.clone(), None, "guided_json")
        );
        assert_eq!(
            spec(json!({"guided_regex": "a+", "guided_whitespace_pattern": "[ ]*"})),
            (GuideSpec::Regex("a+".into()), Some("[ ]*".into()), "guided_regex")
        );
        assert_eq!(
            spec(json!({"structured_outputs": {"choice": ["a", "b"], "whitespace_pattern": " "}})),
            (
                GuideSpec::Choice(vec!["a".into(), "b".into()]),
                Some(" ".into()),
                "structured_outputs"
            )
        );
        assert_eq!(
            spec(json!({"structured_outputs": {"json_object": true, "disable_any_whitespace": true}})),
            (GuideSpec::JsonObject, None, "structured_outputs")
        );
        assert!(asked(json!({"guided_decoding_backend": "xgrammar"}))
            .expect("taken")
            .is_none());
    }

    #[test]
    fn more_than_one_kind_grammars_and_malformed_formats_are_refused_by_name() {
        for (extra, param) in [
            (json!({"guided_regex": "a", "guided_choice": ["a"]}), "guided_choice"),
            (
                json!({"response_format": {"type": "json_object"}, "guided_regex": "a"}),
                "guided_regex",
            ),
            (
                json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}),
                "structured_outputs",
            ),
            (
                json!({"structured_outputs": {"grammar": "root ::= a"}}),
                "structured_outputs",
            ),
            (json!({"guided_grammar": "root ::= a"}), "guided_grammar"),
            (json!({"response_format": {"type": "json_schema"}}), "response_format"),
            (json!({"response_format": {"type": "xml"}}), "response_format"),
            (json!({"guided_json": "{not json"}), "guided_json"),
            (json!({"guided_json": 3}), "guided_json"),
            (json!({"structured_outputs": {}}), "structured_outputs"),
            (
                json!({"structured_outputs": {"json_object": false}}),
                "structured_outputs",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}}),
                "response_format",
            ),
        ] {
            let error = asked(extra.clone()).expect_err("refused");
            assert_eq!(error.param.as_deref(), Some(param), "{extra}: {}", error.message);
        }
    }
}
