use regex_automata::meta::Regex;
use serde_json::json;

use super::*;

fn asked(extra: Value) -> Result<Option<(GuideRequest, ToolOutput)>, ApiError> {
    let mut body = json!({"messages": []});
    for (key, value) in extra.as_object().expect("object") {
        body[key] = value.clone();
    }
    let mut body: GenerationBody = serde_json::from_value(body).expect("a body");
    from_body(&mut body, None)
}

fn weather() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    }})
}

fn time() -> Value {
    json!({"type": "function", "function": {"name": "get_time"}})
}

/// Whether `text` is a whole match of the output's pattern.
fn matches(guide: &GuideRequest, text: &str) -> bool {
    let pattern = crate::guide::pattern(guide).expect("a pattern");
    Regex::new(&format!("^(?:{pattern})$"))
        .expect("compiles")
        .is_match(text)
}

#[test]
fn text_unless_a_call_is_required_or_named() {
    for extra in [
        json!({}),
        json!({"tools": [weather()]}),
        json!({"tools": [weather()], "tool_choice": "auto"}),
        json!({"tools": [weather()], "tool_choice": "none"}),
        json!({"tool_choice": "auto", "parallel_tool_calls": true}),
        json!({"tool_choice": null, "tools": null}),
    ] {
        assert!(asked(extra.clone()).expect("taken").is_none(), "{extra}");
    }
}

#[test]
fn a_named_call_is_its_parameters_and_no_parameters_an_empty_object() {
    let (guide, output) = asked(json!({
        "tools": [weather(), time()],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}
    }))
    .expect("taken")
    .expect("a call");
    assert_eq!(output, ToolOutput::Named("get_weather".into()));
    assert!(matches(&guide, r#"{"city": "Paris"}"#));
    assert!(!matches(&guide, r#"{"town": "Paris"}"#));
    let (guide, _) = asked(json!({
        "tools": [weather(), time()],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}
    }))
    .expect("taken")
    .expect("a call");
    assert!(matches(&guide, "{}"));
    // `{}` as parameters is no parameters, not any value.
    let empty = json!({"type": "function", "function": {"name": "ping", "parameters": {}}});
    for choice in [
        json!({"type": "function", "function": {"name": "ping"}}),
        json!("required"),
    ] {
        let (guide, _) = asked(json!({"tools": [empty], "tool_choice": choice}))
            .expect("taken")
            .expect("a call");
        assert!(!matches(&guide, "null") && !matches(&guide, r#""text""#) && !matches(&guide, "[null]"));
        assert!(matches(&guide, "{}") || matches(&guide, r#"[{"name": "ping", "parameters": {}}]"#));
    }
}

#[test]
fn required_calls_are_a_list_of_the_tools_names_and_parameters() {
    let (guide, output) = asked(json!({"tools": [weather(), time()], "tool_choice": "required"}))
        .expect("taken")
        .expect("calls");
    assert_eq!(output, ToolOutput::Required);
    assert!(matches(
        &guide,
        r#"[{"name": "get_weather", "parameters": {"city": "Oslo"}}]"#
    ));
    assert!(matches(
        &guide,
        r#"[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Rome"}}]"#
    ));
    assert!(!matches(&guide, "[]"));
    assert!(!matches(&guide, r#"[{"name": "get_news", "parameters": {}}]"#));
    assert!(!matches(
        &guide,
        r#"[{"name": "get_time", "parameters": {"city": "Rome"}}]"#
    ));
    // One call at most without parallel calls.
    let (single, _) = asked(json!({"tools": [time()], "tool_choice": "required", "parallel_tool_calls": false}))
        .expect("taken")
        .expect("calls");
    assert!(matches(&single, r#"[{"name": "get_time", "parameters": {}}]"#));
    assert!(!matches(
        &single,
        r#"[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]"#
    ));
}

#[test]
fn definitions_move_to_the_top_where_their_references_point() {
    let tool = json!({"type": "function", "function": {"name": "locate", "parameters": {
        "type": "object",
        "properties": {"place": {"$ref": "#/$defs/place"}},
        "required": ["place"],
        "$defs": {"place": {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}}
    }}});
    let (guide, _) = asked(json!({"tools": [tool], "tool_choice": "required"}))
        .expect("taken")
        .expect("calls");
    assert!(matches(
        &guide,
        r#"[{"name": "locate", "parameters": {"place": {"zip": 12}}}]"#
    ));
    let other = json!({"type": "function", "function": {"name": "other", "parameters": {
        "$defs": {"place": {"type": "string"}}
    }}});
    let error = asked(json!({"tools": [tool, other], "tool_choice": "required"})).expect_err("refused");
    assert_eq!(error.param.as_deref(), Some("tools"), "{}", error.message);
}

#[test]
fn bad_tools_and_choices_are_refused_by_name() {
    let named = |name: &str| json!({"type": "function", "function": {"name": name}});
    for (extra, param) in [
        (json!({"tools": {"type": "function"}}), "tools"),
        (
            json!({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}),
            "tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "has space"}}]}),
            "tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": ""}}]}),
            "tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a", "extra": 1}}]}),
            "tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a", "parameters": 3}}]}),
            "tools",
        ),
        (json!({"tools": [time(), time()]}), "tools"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}]}),
            "tools",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"tool_choice": named("get_time")}), "tool_choice"),
        (
            json!({"tools": [time()], "tool_choice": named("get_news")}),
            "tool_choice",
        ),
        (json!({"tools": [time()], "tool_choice": "always"}), "tool_choice"),
        (
            json!({"tools": [time()], "tool_choice": {"type": "function"}}),
            "tool_choice",
        ),
        (
            json!({"tools": [time()], "tool_choice": {"type": "x", "function": {"name": "get_time"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": [time()], "parallel_tool_calls": "yes"}),
            "parallel_tool_calls",
        ),
        (
            json!({"tools": [time()], "tool_choice": "required", "allowed_token_ids": [1]}),
            "allowed_token_ids",
        ),
    ] {
        let error = asked(extra.clone()).expect_err("refused");
        assert_eq!(error.param.as_deref(), Some(param), "{extra}: {}", error.message);
    }
    // A call's arguments are its structured output: no second one beside it.
    let mut body: GenerationBody =
        serde_json::from_value(json!({"messages": [], "tools": [time()], "tool_choice": "required"})).expect("a body");
    let error = from_body(&mut body, Some("structured_outputs")).expect_err("refused");
    assert_eq!(error.param.as_deref(), Some("tool_choice"));
    assert!(error.message.contains("structured_outputs"), "{}", error.message);
}

fn arguments(calls: &CallsOrText) -> Vec<(Option<String>, String)> {
    match calls {
        CallsOrText::Calls(calls) => calls
            .iter()
            .map(|call| (call.function.name.clone(), call.function.arguments.clone()))
            .collect(),
        CallsOrText::Text(text) => panic!("text {text:?}, not calls"),
    }
}

#[test]
fn a_named_call_streams_its_arguments_after_its_name() {
    let mut whole = ToolCallBuilder::new(ToolOutput::Named("get_weather".into()));
    let said = whole.whole(r#"{"city": "Oslo"}"#.into());
    assert_eq!(
        arguments(&said),
        vec![(Some("get_weather".into()), r#"{"city": "Oslo"}"#.into())]
    );
    assert!(!whole.finishes_as_calls(true));

    let mut stream = ToolCallBuilder::new(ToolOutput::Named("get_weather".into()));
    let CallsOrText::Calls(first) = stream.delta(r#"{"ci"#.into(), false).expect("a part") else {
        panic!("calls")
    };
    assert_eq!(first[0].index, Some(0));
    assert!(first[0]
        .id
        .as_deref()
        .is_some_and(|id| id.starts_with("chatcmpl-tool-")));
    assert_eq!(first[0].function.name.as_deref(), Some("get_weather"));
    assert_eq!(stream.delta(String::new(), false), None);
    let CallsOrText::Calls(next) = stream.delta(r#"ty": "Oslo"}"#.into(), true).expect("a part") else {
        panic!("calls")
    };
    assert_eq!(
        (next[0].index, next[0].id.as_ref(), next[0].function.name.as_ref()),
        (Some(0), None, None)
    );
    assert_eq!(next[0].function.arguments, r#"ty": "Oslo"}"#);
}

#[test]
fn a_list_of_calls_goes_out_whole_with_the_models_own_arguments() {
    let text = r#"[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city":  "Rome"}}]"#;
    let mut whole = ToolCallBuilder::new(ToolOutput::Required);
    assert!(whole.finishes_as_calls(true) && !whole.finishes_as_calls(false));
    let expected = vec![
        (Some("get_time".to_owned()), "{}".to_owned()),
        (Some("get_weather".to_owned()), r#"{"city":  "Rome"}"#.to_owned()),
    ];
    assert_eq!(arguments(&whole.whole(text.into())), expected);

    let mut stream = ToolCallBuilder::new(ToolOutput::Required);
    let (head, tail) = text.split_at(30);
    assert_eq!(stream.delta(head.into(), false), None);
    let said = stream.delta(tail.into(), true).expect("the calls");
    assert_eq!(arguments(&said), expected);
    let CallsOrText::Calls(calls) = said else {
        panic!("calls")
    };
    assert_eq!(
        calls.iter().map(|call| call.index).collect::<Vec<_>>(),
        vec![Some(0), Some(1)]
    );
    assert_ne!(calls[0].id, calls[1].id);

    // Cut short (max_tokens): the text as it is.
    let cut = r#"[{"name": "get_time", "par"#;
    assert_eq!(
        ToolCallBuilder::new(ToolOutput::Required).whole(cut.into()),
        CallsOrText::Text(cut.into())
    );
}
