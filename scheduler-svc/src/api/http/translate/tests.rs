//! The HTTP front's translation: each endpoint's shape, refusals by name, choices, chat endings,
//! priorities and what a wrongly shaped value is told.

use super::*;
use crate::chat_template::ChatEnding;

fn body(json: serde_json::Value) -> GenerationBody {
    serde_json::from_value(json).expect("a valid body")
}

/// The first choice's draft.
fn to_draft(endpoint: Endpoint, id: String, body: GenerationBody) -> Result<RequestDraft, ApiError> {
    to_drafts(endpoint, id, body).map(|(mut drafts, _)| drafts.remove(0))
}

fn refused(endpoint: Endpoint, json: serde_json::Value) -> Option<String> {
    to_draft(endpoint, "id".to_owned(), body(json))
        .err()
        .and_then(|e| e.param)
}

#[test]
fn each_endpoint_takes_its_own_shape_and_names_what_it_refuses() {
    let draft = to_draft(
        Endpoint::Completions,
        "id".to_owned(),
        body(serde_json::json!({"prompt": [[1, 2, 3]], "logprobs": 2, "max_tokens": 5, "stop": "x"})),
    )
    .expect("completions");
    assert_eq!(draft.prompt, Prompt::TokenIds(vec![1, 2, 3]));
    assert_eq!((draft.sampling.logprobs, draft.sampling.top_logprobs), (true, 2));
    assert_eq!(draft.stopping.max_new_tokens, Some(5));
    assert_eq!(draft.stopping.stop, vec!["x".to_owned()]);

    let chat = to_draft(
        Endpoint::Chat,
        "id".to_owned(),
        body(serde_json::json!({
            "messages": [{"role": "developer", "content": [
                {"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in English."}
            ]}],
            "logprobs": true, "top_logprobs": 3, "max_completion_tokens": 7, "max_tokens": 9
        })),
    )
    .expect("chat");
    let Prompt::Messages { messages, .. } = chat.prompt else {
        panic!("messages")
    };
    assert_eq!(
        (messages[0].role.as_str(), messages[0].content.as_str()),
        ("developer", "Be brief.\nAnswer in English.")
    );
    assert_eq!((chat.sampling.top_logprobs, chat.stopping.max_new_tokens), (3, Some(7)));
    // Completions: vLLM knows only max_tokens there, so it wins; the newer name alone still counts.
    let limit = |json: serde_json::Value| {
        to_draft(Endpoint::Completions, "id".to_owned(), body(json))
            .expect("completions")
            .stopping
            .max_new_tokens
    };
    assert_eq!(
        limit(serde_json::json!({"prompt": "x", "max_tokens": 9, "max_completion_tokens": 7})),
        Some(9)
    );
    assert_eq!(
        limit(serde_json::json!({"prompt": "x", "max_completion_tokens": 7})),
        Some(7)
    );

    let p = |s: &str| Some(s.to_owned());
    assert_eq!(refused(Endpoint::Chat, serde_json::json!({"prompt": "x"})), p("prompt"));
    assert_eq!(
        refused(Endpoint::Completions, serde_json::json!({"prompt": "x", "n": 0})),
        p("n")
    );
    assert_eq!(
        refused(
            Endpoint::Completions,
            serde_json::json!({"prompt": "x", "n": 2, "best_of": 3})
        ),
        p("best_of")
    );

    assert_eq!(
        refused(
            Endpoint::Completions,
            serde_json::json!({"prompt": "x", "logprobs": true})
        ),
        p("logprobs")
    );
    assert_eq!(
        refused(
            Endpoint::Chat,
            serde_json::json!({"messages": [], "tools": [{"type": "function"}]})
        ),
        p("tools")
    );
    assert_eq!(
        refused(
            Endpoint::Chat,
            serde_json::json!({"messages": [], "priority": "urgent"})
        ),
        p("priority")
    );
    assert!(serde_json::from_value::<GenerationBody>(serde_json::json!({"prompt": "x", "best_of_n": 2})).is_err());

    // Alternatives without logprobs, as vLLM refuses them; content parts without their text or
    // with fields of their own.
    let user = |content: serde_json::Value| serde_json::json!([{"role": "user", "content": content}]);
    for contradiction in [
        serde_json::json!({"messages": user("x".into()), "top_logprobs": 2}),
        serde_json::json!({"messages": user("x".into()), "logprobs": false, "top_logprobs": 2}),
    ] {
        assert_eq!(refused(Endpoint::Chat, contradiction), p("top_logprobs"));
    }
    for part in [
        serde_json::json!({"type": "text"}),
        serde_json::json!({"type": "text", "text": "Hi", "cache_control": {}}),
    ] {
        let json = serde_json::json!({"messages": user(serde_json::json!([part]))});
        assert_eq!(refused(Endpoint::Chat, json), p("messages"));
    }
}

#[test]
fn prompts_and_n_fan_out_into_one_draft_per_choice() {
    let drafts = to_drafts(
        Endpoint::Completions,
        "id".to_owned(),
        body(serde_json::json!({"prompt": ["a", "b"], "n": 3, "seed": 7, "best_of": 3})),
    )
    .expect("a batch")
    .0;
    let described: Vec<_> = drafts
        .iter()
        .map(|d| (d.id.as_str(), d.prompt.clone(), d.sampling.seed))
        .collect();
    let text = |t: &str| Prompt::Text(t.to_owned());
    assert_eq!(
        described,
        vec![
            ("id", text("a"), Some(7)),
            ("id-1", text("a"), Some(8)),
            ("id-2", text("a"), Some(9)),
            ("id-3", text("b"), Some(7)),
            ("id-4", text("b"), Some(8)),
            ("id-5", text("b"), Some(9)),
        ]
    );
    let chat = to_drafts(
        Endpoint::Chat,
        "id".to_owned(),
        body(serde_json::json!({"messages": [{"role": "user", "content": "x"}], "n": 2})),
    )
    .expect("chat choices")
    .0;
    assert_eq!((chat.len(), chat[1].sampling.seed), (2, None));
    let too_many = serde_json::json!({"prompt": ["a", "b"], "n": MAX_CHOICES / 2 + 1});
    assert_eq!(refused(Endpoint::Completions, too_many), Some("n".to_owned()));
}

#[test]
fn chat_takes_vllms_options_for_how_the_conversation_ends() {
    let ending = |extra: serde_json::Value| {
        let mut json = serde_json::json!({"messages": [{"role": "user", "content": "x"}]});
        json.as_object_mut()
            .expect("object")
            .extend(extra.as_object().expect("object").clone());
        match to_draft(Endpoint::Chat, "id".to_owned(), body(json)) {
            Ok(draft) => match draft.prompt {
                Prompt::Messages { ending, .. } => Ok(ending),
                other => panic!("not messages: {other:?}"),
            },
            Err(error) => Err(error.param),
        }
    };
    assert_eq!(ending(serde_json::json!({})), Ok(ChatEnding::AssistantTurn));
    assert_eq!(
        ending(serde_json::json!({"add_generation_prompt": false})),
        Ok(ChatEnding::MessagesOnly)
    );
    assert_eq!(
        ending(serde_json::json!({"continue_final_message": true})),
        Ok(ChatEnding::ContinueLastMessage)
    );
    assert_eq!(
        ending(serde_json::json!({"continue_final_message": true, "add_generation_prompt": false})),
        Ok(ChatEnding::ContinueLastMessage)
    );
    assert_eq!(
        ending(serde_json::json!({"continue_final_message": true, "add_generation_prompt": true})),
        Err(Some("continue_final_message".to_owned()))
    );
    assert_eq!(
        refused(
            Endpoint::Completions,
            serde_json::json!({"prompt": "x", "continue_final_message": true})
        ),
        Some("continue_final_message".to_owned())
    );
}

#[test]
fn priority_takes_a_class_or_vllms_integer() {
    let of = |priority: serde_json::Value| {
        to_draft(
            Endpoint::Completions,
            "id".to_owned(),
            body(serde_json::json!({"prompt": "x", "priority": priority})),
        )
        .map(|draft| draft.priority)
        .ok()
    };
    assert_eq!(of(serde_json::json!("high")), Some(Priority::High));
    assert_eq!(of(serde_json::json!(null)), Some(Priority::Normal));
    assert_eq!(of(serde_json::json!(0)), Some(Priority::Normal));
    assert_eq!(of(serde_json::json!(-1)), Some(Priority::High));
    assert_eq!(of(serde_json::json!(-7)), Some(Priority::Critical));
    assert_eq!(of(serde_json::json!(3)), Some(Priority::Low));
}

#[test]
fn a_value_of_the_wrong_shape_is_told_what_the_field_takes() {
    let message = |json: serde_json::Value| {
        serde_json::from_value::<GenerationBody>(json)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    for (json, expected) in [
        (serde_json::json!({"stop": 5}), "a string or an array of strings"),
        (serde_json::json!({"prompt": [1, "a"]}), "an array of token ids"),
        (
            serde_json::json!({"messages": [{"role": "user", "content": 5}]}),
            "a string or an array of content parts",
        ),
        (serde_json::json!({"priority": 1.5}), "or an integer"),
    ] {
        let text = message(json);
        assert!(text.contains(expected) && !text.contains("untagged"), "{text}");
    }
}

#[test]
fn logit_bias_keys_are_token_ids_and_its_values_numbers() {
    let of = |bias: serde_json::Value| {
        to_draft(
            Endpoint::Chat,
            "id".to_owned(),
            body(serde_json::json!({"messages": [{"role": "user", "content": "x"}], "logit_bias": bias})),
        )
        .map(|draft| draft.sampling.logit_bias)
        .map_err(|error| (error.param, error.message))
    };
    // In the object's order (a repeat of a token, spelled differently, comes later and wins).
    assert_eq!(
        of(serde_json::json!({"12": 1.5, " 7 ": -100, "012": 2})),
        Ok(vec![(12, 1.5), (7, -100.0), (12, 2.0)])
    );
    assert_eq!(of(serde_json::json!({})), Ok(Vec::new()));
    for (bias, says) in [
        (serde_json::json!({"abc": 1}), "key \"abc\" is not a token id"),
        (serde_json::json!({"-3": 1}), "key \"-3\" is not a token id"),
        (serde_json::json!({"5": "high"}), "the bias of token 5 must be a number"),
        (serde_json::json!({"5": null}), "the bias of token 5 must be a number"),
    ] {
        let (param, message) = of(bias.clone()).expect_err("refused");
        assert_eq!(param.as_deref(), Some("logit_bias"), "{bias}");
        assert!(
            message.starts_with("logit_bias: ") && message.contains(says),
            "{bias}: {message}"
        );
    }
    let allowed = to_draft(
        Endpoint::Completions,
        "id".to_owned(),
        body(serde_json::json!({"prompt": "x", "allowed_token_ids": [3, 1]})),
    )
    .expect("allowed");
    assert_eq!(allowed.sampling.allowed_token_ids, Some(vec![3, 1]));
}

#[test]
fn echo_and_prompt_logprobs_ask_the_engine_for_the_prompts_scores() {
    let draft = |json| to_draft(Endpoint::Completions, "id".to_owned(), body(json)).expect("draft");
    // echo alone needs no scores; with logprobs, as many alternatives as they list.
    let echo = draft(serde_json::json!({"prompt": "x", "echo": true}));
    assert_eq!(echo.sampling.prompt_logprobs, None);
    let echo = draft(serde_json::json!({"prompt": "x", "echo": true, "logprobs": 3}));
    assert_eq!(echo.sampling.prompt_logprobs, Some(3));
    // The larger of the two wants; max_tokens 0 with echo is the prompt alone (one token made).
    let both = draft(serde_json::json!({
        "prompt": "x", "echo": true, "logprobs": 1, "prompt_logprobs": 4, "max_tokens": 0
    }));
    assert_eq!(both.sampling.prompt_logprobs, Some(4));
    assert_eq!(both.stopping.max_new_tokens, Some(1));
    let chat = to_draft(
        Endpoint::Chat,
        "id".to_owned(),
        body(serde_json::json!({"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 0})),
    )
    .expect("chat");
    assert_eq!(chat.sampling.prompt_logprobs, Some(0));

    let p = |s: &str| Some(s.to_owned());
    let user = serde_json::json!([{"role": "user", "content": "x"}]);
    assert_eq!(
        refused(Endpoint::Chat, serde_json::json!({"messages": user, "echo": true})),
        p("echo")
    );
    assert_eq!(
        refused(
            Endpoint::Completions,
            serde_json::json!({"prompt": "x", "stream": true, "prompt_logprobs": 1})
        ),
        p("prompt_logprobs")
    );
    // Without echo, max_tokens 0 is left to validation, which refuses it.
    let zero = draft(serde_json::json!({"prompt": "x", "max_tokens": 0}));
    assert_eq!(zero.stopping.max_new_tokens, Some(0));
}

#[test]
fn a_seed_is_vllms_signed_integer_and_minus_one_is_none() {
    let seed = |value: i64| {
        to_draft(
            Endpoint::Completions,
            "id".to_owned(),
            body(serde_json::json!({"prompt": "x", "seed": value})),
        )
        .expect("draft")
        .sampling
        .seed
    };
    assert_eq!(seed(-1), None);
    assert_eq!(seed(7), Some(7));
    assert_eq!(seed(-2), Some(u64::MAX - 1));
    // Past i64, as vLLM refuses it: the body does not parse (a 400 naming `seed`).
    let too_big = serde_json::from_value::<GenerationBody>(serde_json::json!({"prompt": "x", "seed": u64::MAX}));
    assert!(too_big.is_err());
}

#[test]
fn vllms_extras_are_taken_at_their_defaults_and_refused_otherwise() {
    let defaults = serde_json::json!({
        "prompt": "x", "skip_special_tokens": true, "spaces_between_special_tokens": true,
        "use_beam_search": false, "length_penalty": 1.0, "truncate_prompt_tokens": null
    });
    assert!(to_draft(Endpoint::Completions, "id".to_owned(), body(defaults)).is_ok());
    for (param, value) in [
        ("skip_special_tokens", serde_json::json!(false)),
        ("spaces_between_special_tokens", serde_json::json!(false)),
        ("use_beam_search", serde_json::json!(true)),
        ("length_penalty", serde_json::json!(0.5)),
        ("truncate_prompt_tokens", serde_json::json!(8)),
    ] {
        let mut json = serde_json::json!({"prompt": "x"});
        json[param] = value;
        assert_eq!(refused(Endpoint::Completions, json), Some(param.to_owned()));
    }
}

#[test]
fn whole_floats_count_as_integers_in_every_integer_shape() {
    let draft = to_draft(
        Endpoint::Completions,
        "id".to_owned(),
        body(serde_json::json!({
            "prompt": "x", "logprobs": 2.0, "priority": -1.0, "max_tokens": 5.0,
            "stop_token_ids": [13.0, 2], "allowed_token_ids": [282.0]
        })),
    )
    .expect("whole floats");
    assert_eq!((draft.sampling.logprobs, draft.sampling.top_logprobs), (true, 2));
    assert_eq!(draft.priority, Priority::High);
    assert_eq!(draft.stopping.max_new_tokens, Some(5));
    assert_eq!(draft.stopping.stop_token_ids, vec![13, 2]);
    assert_eq!(draft.sampling.allowed_token_ids, Some(vec![282]));
    for fraction in [
        serde_json::json!({"prompt": "x", "logprobs": 2.5}),
        serde_json::json!({"prompt": "x", "stop_token_ids": [1.5]}),
    ] {
        assert!(serde_json::from_value::<GenerationBody>(fraction).is_err());
    }
}

#[test]
fn a_conversation_may_hold_tool_calls_and_their_results() {
    let call = serde_json::json!({"id": "c1", "type": "function",
        "function": {"name": "get_time", "arguments": "{}"}});
    let draft = to_draft(
        Endpoint::Chat,
        "id".to_owned(),
        body(serde_json::json!({"messages": [
            {"role": "user", "content": "What time is it?"},
            {"role": "assistant", "content": null, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        ]})),
    )
    .expect("taken");
    let Prompt::Messages { messages, .. } = draft.prompt else {
        panic!("a conversation")
    };
    let described: Vec<(&str, &str)> = messages.iter().map(|m| (m.role.as_str(), m.content.as_str())).collect();
    let shown = serde_json::Value::Array(vec![call.clone()]).to_string();
    assert_eq!(
        described,
        vec![
            ("user", "What time is it?"),
            ("assistant", shown.as_str()),
            ("tool", "noon")
        ]
    );
    // A response's message sent back as the `openai` package dumps it: empty content beside
    // its calls, and fields of its own; text beside calls comes first.
    let shown_after = |message: serde_json::Value| {
        let draft = to_draft(
            Endpoint::Chat,
            "id".to_owned(),
            body(serde_json::json!({"messages": [{"role": "user", "content": "?"}, message]})),
        )
        .expect("taken");
        let Prompt::Messages { messages, .. } = draft.prompt else {
            panic!("a conversation")
        };
        messages[1].content.clone()
    };
    let dumped = serde_json::json!({"role": "assistant", "content": "", "tool_calls": [call],
        "refusal": null, "annotations": [], "audio": null, "function_call": null});
    assert_eq!(shown_after(dumped), shown);
    let with_text = serde_json::json!({"role": "assistant", "content": "Let me look.", "tool_calls": [call]});
    assert_eq!(shown_after(with_text), format!("Let me look.\n{shown}"));
    // Null content only beside an assistant's calls; calls only on an assistant's message.
    for messages in [
        serde_json::json!([{"role": "user", "content": null}]),
        serde_json::json!([{"role": "user", "content": null, "tool_calls": []}]),
        serde_json::json!([{"role": "assistant"}]),
        serde_json::json!([{"role": "user", "content": "x", "tool_calls": [call]}]),
        serde_json::json!([{"role": "assistant", "content": "x", "function_call": {"name": "f"}}]),
    ] {
        let json = serde_json::json!({ "messages": messages });
        assert_eq!(refused(Endpoint::Chat, json), Some("messages".to_owned()));
    }
    // Calls sent back have OpenAI's shape (a malformed one is refused while parsing the body).
    for broken in [
        serde_json::json!({"id": "c1", "type": "function"}),
        serde_json::json!({"id": "c1", "type": "nonsense", "function": {"name": "f", "arguments": "{}"}}),
        serde_json::json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}),
    ] {
        let messages = serde_json::json!([{"role": "assistant", "content": null, "tool_calls": [broken]}]);
        assert!(serde_json::from_value::<GenerationBody>(serde_json::json!({ "messages": messages })).is_err());
    }
    // Tools belong to chat.
    let tools = serde_json::json!([{"type": "function", "function": {"name": "f"}}]);
    for extra in [
        serde_json::json!({"prompt": "x", "tools": tools}),
        serde_json::json!({"prompt": "x", "tool_choice": "required"}),
    ] {
        let param = extra.as_object().and_then(|o| o.keys().nth(1).cloned());
        assert_eq!(refused(Endpoint::Completions, extra), param);
    }
}
