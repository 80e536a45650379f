//! OpenAI's `developer` role (its newer name for `system`), handled as vLLM hands it to a chat
//! template: kept where the template names the role, and otherwise renamed `system`, with every
//! system message then merged into one at the front (templates such as SmolLM2's look for the
//! system prompt in the first message only, and some refuse one anywhere else).

use std::borrow::Cow;

use super::ChatMessage;

/// Whether a template's source names the `developer` role (vLLM's test: the word quoted).
pub(super) fn template_names_developer(source: &str) -> bool {
    source.contains("\"developer\"") || source.contains("'developer'")
}

/// `messages` as the template sees them: unchanged unless one is `developer` and the template
/// does not name that role; then each `developer` becomes `system` and, where that leaves a
/// system message after the first position or more than one, the system messages are merged
/// into one at the front, their non-empty contents joined by a blank line.
pub(super) fn as_vllm_hands_them(messages: &[ChatMessage], template_names_developer: bool) -> Cow<'_, [ChatMessage]> {
    if template_names_developer || !messages.iter().any(|m| m.role == "developer") {
        return Cow::Borrowed(messages);
    }
    let renamed: Vec<ChatMessage> = messages
        .iter()
        .map(|m| ChatMessage {
            role: if m.role == "developer" {
                "system"
            } else {
                m.role.as_str()
            }
            .to_owned(),
            content: m.content.clone(),
        })
        .collect();
    let systems = renamed.iter().filter(|m| m.role == "system").count();
    let only_first = systems == 1 && renamed[0].role == "system";
    if only_first {
        return Cow::Owned(renamed);
    }
    let (system, rest): (Vec<ChatMessage>, Vec<ChatMessage>) = renamed.into_iter().partition(|m| m.role == "system");
    let merged = ChatMessage {
        role: "system".to_owned(),
        content: system
            .iter()
            .map(|m| m.content.as_str())
            .filter(|content| !content.is_empty())
            .collect::<Vec<_>>()
            .join("\n\n"),
    };
    Cow::Owned(std::iter::once(merged).chain(rest).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: &str, content: &str) -> ChatMessage {
        ChatMessage {
            role: role.to_owned(),
            content: content.to_owned(),
        }
    }

    #[test]
    fn developer_is_kept_only_where_the_template_names_it() {
        assert!(template_names_developer("{% if m.role == 'developer' %}"));
        assert!(template_names_developer(r#"{% if m.role == "developer" %}"#));
        assert!(!template_names_developer("{{ m.role }} developers"));
        let messages = [message("developer", "Be brief."), message("user", "Hi!")];
        assert_eq!(&*as_vllm_hands_them(&messages, true), &messages);
        assert_eq!(
            &*as_vllm_hands_them(&messages, false),
            &[message("system", "Be brief."), message("user", "Hi!")]
        );
        let plain = [message("system", "A"), message("user", "B"), message("system", "C")];
        assert_eq!(&*as_vllm_hands_them(&plain, false), &plain, "no developer: untouched");
    }

    #[test]
    fn system_messages_are_merged_at_the_front_once_a_developer_is_renamed() {
        let messages = [
            message("system", "A"),
            message("user", "B"),
            message("developer", "C"),
            message("system", ""),
            message("assistant", "D"),
        ];
        assert_eq!(
            &*as_vllm_hands_them(&messages, false),
            &[
                message("system", "A\n\nC"),
                message("user", "B"),
                message("assistant", "D")
            ]
        );
        let late = [message("user", "B"), message("developer", "C")];
        assert_eq!(
            &*as_vllm_hands_them(&late, false),
            &[message("system", "C"), message("user", "B")]
        );
    }
}
