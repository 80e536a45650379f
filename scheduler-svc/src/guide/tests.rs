use super::*;

/// Every printable ASCII character as a token of its own (ids 0..95), then longer tokens.
const LONGER: [&str; 9] = ["ab", "abc", "yes", "no", "{\"", "\":", " 1", "12", "yesterday"];

fn tokens() -> Vec<String> {
    let mut tokens: Vec<String> = (b' '..=b'~').map(|b| char::from(b).to_string()).collect();
    tokens.extend(LONGER.iter().map(|t| t.to_string()));
    tokens
}

fn guides() -> Guides {
    let tokens = tokens();
    let vocabulary = GuideVocabulary::new(tokens.len() as u32, |id| tokens[id as usize].as_bytes(), 128);
    Guides::new(vocabulary)
}

fn id_of(token: &str) -> u32 {
    tokens().iter().position(|t| t == token).expect("token") as u32
}

fn allowed(mask: &StateMask, token: &str) -> bool {
    let id = id_of(token) as usize;
    mask.tokens[id / 64] >> (id % 64) & 1 == 1
}

fn guide(spec: GuideSpec) -> Arc<Guide> {
    guides()
        .compile(&GuideRequest { spec, whitespace: None })
        .expect("compiles")
}

/// The cursor after writing `text` token by token, as the given tokens.
fn after(guide: &Arc<Guide>, pieces: &[&str]) -> GuideCursor {
    let mut cursor = GuideCursor::new(Arc::clone(guide));
    for piece in pieces {
        assert!(allowed(&cursor.mask(), piece), "{piece:?} refused after {pieces:?}");
        cursor.advance(piece.as_bytes());
    }
    cursor
}

#[test]
fn a_choice_allows_the_prefixes_of_its_texts_and_ends_only_on_a_whole_one() {
    let guide = guide(GuideSpec::Choice(vec!["yes".into(), "no".into(), "a.b".into()]));
    let start = GuideCursor::new(Arc::clone(&guide)).mask();
    for token in ["yes", "no", "y", "n", "a"] {
        assert!(allowed(&start, token), "{token}");
    }
    // Longer than every choice, another text, and the regex meaning of `.` all refused.
    for token in ["yesterday", "ab", "x", "Y"] {
        assert!(!allowed(&start, token), "{token}");
    }
    assert!(start.continues && !start.complete);
    let part = after(&guide, &["y", "e"]).mask();
    assert!(allowed(&part, "s") && !part.complete);
    let whole = after(&guide, &["yes"]).mask();
    assert!(whole.complete && !whole.continues, "nothing may follow a whole choice");
    assert!(!allowed(&after(&guide, &["a"]).mask(), "ab"));
    assert!(after(&guide, &["a", ".", "b"]).mask().complete);
}

#[test]
fn a_token_reaching_past_an_alternatives_end_is_allowed_where_a_longer_one_matches() {
    // "ab" passes the end of `a` on the way to `abc`: allowed, and not complete until `c`.
    let guide = guide(GuideSpec::Regex("a|abc".into()));
    let start = GuideCursor::new(Arc::clone(&guide)).mask();
    assert!(allowed(&start, "a") && allowed(&start, "ab") && allowed(&start, "abc"));
    assert!(after(&guide, &["a"]).mask().complete);
    let mid = after(&guide, &["ab"]).mask();
    assert!(!mid.complete && allowed(&mid, "c"));
}

#[test]
fn a_regex_holds_its_counts_and_classes() {
    let guide = guide(GuideSpec::Regex("[0-9]{3}".into()));
    let start = GuideCursor::new(Arc::clone(&guide)).mask();
    assert!(allowed(&start, "1") && allowed(&start, "12") && !allowed(&start, "a") && !allowed(&start, " 1"));
    let two = after(&guide, &["12"]).mask();
    assert!(allowed(&two, "7") && !allowed(&two, "12") && !two.complete);
    let three = after(&guide, &["12", "7"]).mask();
    assert!(three.complete && !three.continues);
}

#[test]
fn a_json_schema_output_follows_its_properties_in_order() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "required": ["a", "b"]
    });
    let guide = guide(GuideSpec::JsonSchema(schema));
    let start = GuideCursor::new(Arc::clone(&guide)).mask();
    assert!(allowed(&start, "{") && allowed(&start, "{\"") && !allowed(&start, "[") && !start.complete);
    let text = r#"{"a": 12, "b": true}"#;
    let pieces: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
    let done = after(&guide, &pieces).mask();
    assert!(done.complete && !done.continues);
    // `b` before `a`, a string for the integer: refused.
    assert!(!allowed(&after(&guide, &["{\""]).mask(), "b"));
    assert!(!allowed(&after(&guide, &["{\"", "a", "\":", " "]).mask(), "\""));
}

#[test]
fn any_json_object_may_nest_and_ends_at_its_closing_brace() {
    let guide = guide(GuideSpec::JsonObject);
    let text = r#"{"k": [1, {"x": null}], "s": "t"}"#;
    let pieces: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
    assert!(after(&guide, &pieces).mask().complete);
    assert!(
        !allowed(&GuideCursor::new(guide).mask(), "1"),
        "an object, not a number"
    );
}

#[test]
fn a_refused_token_leaves_only_an_end() {
    let guide = guide(GuideSpec::Regex("ab".into()));
    let mut cursor = GuideCursor::new(guide);
    cursor.advance(b"x");
    let mask = cursor.mask();
    assert!(!mask.continues && !mask.complete && mask.tokens.iter().all(|&word| word == 0));
}

#[test]
fn bad_patterns_schemas_and_choices_are_refused() {
    let guides = guides();
    let compile = |spec| guides.compile(&GuideRequest { spec, whitespace: None });
    assert!(matches!(
        compile(GuideSpec::Regex("a(".into())),
        Err(GuideError::Pattern(_))
    ));
    assert!(matches!(
        compile(GuideSpec::JsonSchema(serde_json::json!({"type": "no-such-type"}))),
        Err(GuideError::Schema(_))
    ));
    assert_eq!(compile(GuideSpec::Choice(Vec::new())), Err(GuideError::EmptyChoice));
    assert_eq!(
        compile(GuideSpec::Choice(vec!["a".into(), String::new()])),
        Err(GuideError::EmptyChoice)
    );
}

#[test]
fn a_pattern_compiles_once_and_is_shared() {
    let guides = guides();
    let request = GuideRequest {
        spec: GuideSpec::Regex("[a-c]+".into()),
        whitespace: None,
    };
    let first = guides.compile(&request).expect("compiles");
    let second = guides.compile(&request).expect("compiles");
    assert!(Arc::ptr_eq(&first, &second));
}

#[test]
fn recursive_schemas_and_patterns_no_text_matches_are_refused_and_refusals_kept() {
    let guides = guides();
    let compile = |spec| guides.compile(&GuideRequest { spec, whitespace: None });
    let tree = serde_json::json!({
        "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"
    });
    assert_eq!(
        compile(GuideSpec::JsonSchema(tree)),
        Err(GuideError::Recursive("#/$defs/node".into()))
    );
    let itself =
        serde_json::json!({"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}});
    assert_eq!(
        compile(GuideSpec::JsonSchema(itself)),
        Err(GuideError::Recursive("#".into()))
    );
    // A definition used twice, without a cycle, is fine.
    let shared = serde_json::json!({
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}
    });
    assert!(compile(GuideSpec::JsonSchema(shared)).is_ok());
    for regex in ["[^\\s\\S]", "a$b", "a\\zb"] {
        assert_eq!(
            compile(GuideSpec::Regex(regex.into())),
            Err(GuideError::Unmatchable),
            "{regex}"
        );
    }
    let empty_enum = GuideRequest {
        spec: GuideSpec::JsonSchema(serde_json::json!({"enum": []})),
        whitespace: None,
    };
    assert_eq!(guides.compile(&empty_enum), Err(GuideError::Unmatchable));
    assert_eq!(
        guides.cached(&empty_enum),
        Some(guides.compile(&empty_enum)),
        "the refusal is kept"
    );
}

#[test]
fn string_formats_take_valid_json_strings_only_and_compile_small() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "e": {"type": "string", "format": "email"},
            "u": {"type": "string", "format": "uri"},
            "d": {"type": "string", "format": "date-time"},
            "t": {"type": "string", "format": "time"}
        },
        "required": ["e", "u", "d", "t"]
    });
    let guide = guide(GuideSpec::JsonSchema(schema));
    let text = r#"{"e": "a.b@c.org", "u": "https://x.io/p?q=1", "d": "2024-02-29T10:00:00Z", "t": "23:59:01.5"}"#;
    let pieces: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
    assert!(after(&guide, &pieces).mask().complete);
    // No quote or backslash inside a formatted string (outlines' own email, URI and time took them).
    let in_email = after(&guide, &["{\"", "e", "\":", " ", "\"", "a"]).mask();
    assert!(allowed(&in_email, "@") && !allowed(&in_email, "\"") && !allowed(&in_email, "\\"));
    let in_time = after(&guide, &pieces[..pieces.len() - 4]).mask();
    assert!(
        allowed(&in_time, ".") && !allowed(&in_time, "\\"),
        "after {:?}",
        &pieces[..pieces.len() - 4].concat()
    );
}

#[test]
fn huge_repetitions_escapes_and_hopeless_branches_are_handled() {
    let guides = guides();
    let compile = |regex: &str| {
        guides.compile(&GuideRequest {
            spec: GuideSpec::Regex(regex.into()),
            whitespace: None,
        })
    };
    // Bounded before the NFA takes gigabytes.
    assert!(matches!(compile("a{100000000}"), Err(GuideError::Pattern(_))));
    // The pattern is parsed, never pasted into a wrapper it could close.
    assert!(matches!(compile("a)|(b"), Err(GuideError::Pattern(_))));
    // After `x` nothing completes `x$y`: `x` is not offered, `z` is.
    let guide = compile("x$y|z").expect("compiles");
    let start = GuideCursor::new(guide).mask();
    assert!(allowed(&start, "z") && !allowed(&start, "x"));
}

#[test]
fn a_schemas_patterns_are_grouped_and_its_data_left_alone() {
    let pet = guide(GuideSpec::JsonSchema(
        serde_json::json!({"type": "string", "pattern": "cat|dog"}),
    ));
    assert!(after(&pet, &["\"", "c", "a", "t"])
        .mask()
        .tokens
        .iter()
        .any(|&word| word != 0));
    assert!(after(&pet, &["\"", "c", "a", "t", "\""]).mask().complete);
    assert!(
        !allowed(&GuideCursor::new(Arc::clone(&pet)).mask(), "d"),
        "`dog` is inside the quotes too"
    );
    let closed = guide(GuideSpec::JsonSchema(
        serde_json::json!({"type": "string", "pattern": "^[a-z]+$"}),
    ));
    assert!(after(&closed, &["\"", "a", "b", "\""]).mask().complete);

    let mut data = serde_json::json!({"const": {"format": "date"}, "enum": [{"pattern": "x"}]});
    let before = data.clone();
    prepare_schema(&mut data);
    assert_eq!(data, before);
    let mut named = serde_json::json!({"properties": {"const": {"type": "string", "format": "date"}}});
    prepare_schema(&mut named);
    assert!(named["properties"]["const"]["pattern"].is_string());
}

#[test]
fn a_long_chain_of_refs_is_refused_without_walking_it() {
    let defs: serde_json::Map<String, serde_json::Value> = (0..20_000)
        .map(|i| {
            (
                format!("d{i}"),
                serde_json::json!({"$ref": format!("#/$defs/d{}", i + 1)}),
            )
        })
        .collect();
    let schema = serde_json::json!({"$defs": defs, "$ref": "#/$defs/d0"});
    assert!(matches!(refuse_recursion(&schema), Err(GuideError::Schema(_))));
}
