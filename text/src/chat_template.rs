//! The model's chat template (a Jinja template from GGUF metadata or `tokenizer_config.json`),
//! rendered with minijinja into the prompt of a chat request. Python string methods that Hugging
//! Face templates use (`.strip()`, `.startswith()`, …) come from minijinja-contrib's pycompat.

use minijinja::{context, Environment, Error as JinjaError, ErrorKind, Value};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ChatTemplateError {
    #[error("the chat template does not compile: {0}")]
    Compile(String),
    #[error("rendering the chat template: {0}")]
    Render(String),
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
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source)
            .map_err(|e| ChatTemplateError::Compile(e.to_string()))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The prompt for `messages`, ending with the opening of the assistant's turn.
    pub fn render(&self, messages: &[ChatMessage]) -> Result<String, ChatTemplateError> {
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| ChatTemplateError::Render(e.to_string()))?;
        template
            .render(context! {
                messages => Value::from(messages.iter().map(ChatMessage::to_value).collect::<Vec<_>>()),
                add_generation_prompt => true,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            })
            .map_err(|e| ChatTemplateError::Render(e.to_string()))
    }
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
            template.render(&messages).expect("renders"),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
        );
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
        let error = raising.render(&[]).expect_err("raises").to_string();
        assert!(error.contains("roles must alternate"), "{error}");
    }
}
