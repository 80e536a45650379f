//! The model's chat template (a Jinja template from GGUF metadata or `tokenizer_config.json`),
//! rendered with minijinja into the prompt of a chat request. Python string methods that Hugging
//! Face templates use (`.strip()`, `.startswith()`, …) come from minijinja-contrib's pycompat.

use minijinja::{context, Environment, Error as JinjaError, ErrorKind, Value};
use thiserror::Error;

mod developer_role;

#[derive(Debug, Error)]
pub enum ChatTemplateError {
    #[error("the chat template does not compile: {0}")]
    Compile(String),
    #[error("rendering the chat template: {0}")]
    Render(String),
}

/// How the rendered conversation ends: vLLM's (and transformers') `add_generation_prompt` and
/// `continue_final_message`, as one choice since they exclude each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChatEnding {
    /// The template's opening of the assistant's turn (`add_generation_prompt`): the model
    /// answers the last message. The default.
    #[default]
    AssistantTurn,
    /// The messages alone, no turn opened.
    MessagesOnly,
    /// The last message left open, without its end-of-turn (`continue_final_message`): the model
    /// continues it, e.g. an assistant's answer begun by the client.
    ContinueLastMessage,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    /// The `{"role": …, "content": …}` mapping templates index into.
    fn to_value(&self) -> Value {
        Value::from_pairs([("role", self.role.as_str()), ("content", self.content.as_str())])
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    /// Whether the template's source names the `developer` role ([`developer_role`]).
    names_developer: bool,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

fn raise_exception(message: String) -> Result<String, JinjaError> {
    Err(JinjaError::new(ErrorKind::InvalidOperation, message))
}

impl ChatTemplate {
    pub fn new(source: String, bos_token: String, eos_token: String) -> Result<Self, ChatTemplateError> {
        let names_developer = developer_role::template_names_developer(&source);
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source)
            .map_err(|e| ChatTemplateError::Compile(e.to_string()))?;
        Ok(Self {
            env,
            names_developer,
            bos_token,
            eos_token,
        })
    }

    /// The prompt for `messages`, ending as `ending` says (`developer` messages as
    /// [`developer_role`] says).
    pub fn render(&self, messages: &[ChatMessage], ending: ChatEnding) -> Result<String, ChatTemplateError> {
        let messages = developer_role::as_vllm_hands_them(messages, self.names_developer);
        let messages = &*messages;
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| ChatTemplateError::Render(e.to_string()))?;
        let continuing = match (ending, messages.split_last()) {
            (ChatEnding::ContinueLastMessage, Some(split)) => Some(split),
            _ => None,
        };
        let values: Vec<Value> = match continuing {
            // The last message carries a marker where its content ends (see `cut_at_marker`).
            Some((last, earlier)) => earlier
                .iter()
                .map(ChatMessage::to_value)
                .chain([ChatMessage {
                    role: last.role.clone(),
                    content: format!("{}{CONTINUE_MARKER}", last.content),
                }
                .to_value()])
                .collect(),
            None => messages.iter().map(ChatMessage::to_value).collect(),
        };
        let rendered = template
            .render(context! {
                messages => Value::from(values),
                add_generation_prompt => ending == ChatEnding::AssistantTurn,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            })
            .map_err(|e| ChatTemplateError::Render(e.to_string()))?;
        match continuing {
            Some((last, _)) => cut_at_marker(rendered, &last.content),
            None => Ok(rendered),
        }
    }
}

/// What transformers' `apply_chat_template` appends to the last message's content for
/// `continue_final_message`, to find where the template put its end (the same text, so that a
/// template that looks at the content sees what it sees there).
const CONTINUE_MARKER: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// `rendered` (with [`CONTINUE_MARKER`] after the last message's content) cut where that content
/// ends, as transformers cuts it: at the marker's last occurrence, and where the template dropped
/// the marker's trailing space (it strips messages), without the whitespace before it either. An
/// empty or blank last message leaves its turn open with nothing (or its blanks) in it.
fn cut_at_marker(mut rendered: String, content: &str) -> Result<String, ChatTemplateError> {
    let marker = CONTINUE_MARKER.trim_end();
    let at = rendered
        .rfind(marker)
        .filter(|_| rendered.contains(content.trim()))
        .ok_or_else(|| {
            ChatTemplateError::Render(
                "continue_final_message: the chat template does not show the last message's content, so it cannot be continued"
                    .to_owned(),
            )
        })?;
    let spacing_kept = rendered[at..].starts_with(CONTINUE_MARKER);
    rendered.truncate(at);
    if !spacing_kept {
        rendered.truncate(rendered.trim_end().len());
    }
    Ok(rendered)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + \
                          message['content'].strip() + '<|im_end|>\\n'}}{% endfor %}\
                          {% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn renders_messages_with_python_string_methods_and_a_generation_prompt() {
        let template = ChatTemplate::new(CHATML.to_owned(), "<s>".to_owned(), "</s>".to_owned()).expect("compiles");
        let messages = vec![
            ChatMessage {
                role: "system".to_owned(),
                content: "Be brief.".to_owned(),
            },
            ChatMessage {
                role: "user".to_owned(),
                content: "  Hi!  ".to_owned(),
            },
        ];
        assert_eq!(
            template.render(&messages, ChatEnding::AssistantTurn).expect("renders"),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            template.render(&messages, ChatEnding::MessagesOnly).expect("renders"),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
        );
    }

    #[test]
    fn a_last_message_is_left_open_to_be_continued() {
        let template = ChatTemplate::new(CHATML.to_owned(), String::new(), String::new()).expect("compiles");
        let message = |role: &str, content: &str| ChatMessage {
            role: role.to_owned(),
            content: content.to_owned(),
        };
        // The template strips the content: the cut falls after the stripped text.
        let messages = [message("user", "Hi!"), message("assistant", "Hello, I am ")];
        assert_eq!(
            template
                .render(&messages, ChatEnding::ContinueLastMessage)
                .expect("renders"),
            "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello, I am"
        );
        // Content that also appears earlier: the last occurrence.
        let messages = [message("user", "Say yes"), message("assistant", "yes")];
        assert_eq!(
            template
                .render(&messages, ChatEnding::ContinueLastMessage)
                .expect("renders"),
            "<|im_start|>user\nSay yes<|im_end|>\n<|im_start|>assistant\nyes"
        );
        // An empty or blank last message: its turn opened (this template strips messages, and
        // transformers then strips what comes before the cut too), with its blanks where a
        // template keeps them. Every expectation here is transformers' own rendering.
        for content in ["", "   "] {
            let messages = [message("user", "Count"), message("assistant", content)];
            assert_eq!(
                template
                    .render(&messages, ChatEnding::ContinueLastMessage)
                    .expect("renders"),
                "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant",
                "{content:?}"
            );
        }
        let keeping = ChatTemplate::new(
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}".to_owned(),
            String::new(),
            String::new(),
        )
        .expect("compiles");
        assert_eq!(
            keeping
                .render(&[message("assistant", "  ")], ChatEnding::ContinueLastMessage)
                .expect("renders"),
            "<assistant>  "
        );
        assert_eq!(
            keeping
                .render(&[message("assistant", "It is ")], ChatEnding::ContinueLastMessage)
                .expect("renders"),
            "<assistant>It is "
        );
        let hidden = ChatTemplate::new(
            "{% for m in messages %}[{{ m.role }}]{% endfor %}".to_owned(),
            String::new(),
            String::new(),
        )
        .expect("compiles");
        let error = hidden
            .render(&[message("assistant", "unseen")], ChatEnding::ContinueLastMessage)
            .expect_err("content not in the rendering");
        assert!(error.to_string().contains("continue_final_message"), "{error}");
    }

    #[test]
    fn template_errors_are_reported() {
        assert!(ChatTemplate::new("{% for %}".to_owned(), String::new(), String::new()).is_err());
        let raising = ChatTemplate::new(
            "{{ raise_exception('roles must alternate') }}".to_owned(),
            String::new(),
            String::new(),
        )
        .expect("compiles");
        let error = raising
            .render(&[], ChatEnding::AssistantTurn)
            .expect_err("raises")
            .to_string();
        assert!(error.contains("roles must alternate"), "{error}");
    }
}
