//! A sequence's generated text on its way to the client: stop strings matched on the incrementally
//! detokenized text (including one that spans several tokens), trimmed from the output, and a
//! character limit. Only text that could still begin a stop string is held back.
//!
//! Why searching only unsent text is enough: the held-back tail is the *longest* suffix that is a
//! prefix of some stop string, so no match can start inside text already sent.

/// What the text of one new token allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TextProgress {
    /// Send this (possibly empty) text; generation goes on.
    Continue(String),
    /// A stop string matched: send this last text and finish with `STOP_STRING`.
    StopString(String),
    /// The character limit was reached: send this last text and finish with `LENGTH`.
    CharLimit(String),
}

#[derive(Debug, Clone, Default)]
pub struct OutputText {
    stop_strings: Vec<String>,
    include_stop_string: bool,
    max_chars: Option<usize>,
    text: String,
    /// Bytes of `text` already sent.
    sent: usize,
    /// Characters of `text[..sent]`.
    sent_chars: usize,
    /// The stop string that ended the text, once one has.
    matched_stop: Option<usize>,
}

impl OutputText {
    pub fn new(stop_strings: Vec<String>, include_stop_string: bool, max_chars: Option<usize>) -> Self {
        let stop_strings = stop_strings.into_iter().filter(|s| !s.is_empty()).collect();
        Self {
            stop_strings,
            include_stop_string,
            max_chars,
            ..Self::default()
        }
    }

    /// Adds a token's text. `match_stops` is false while stop strings may not end the sequence
    /// yet (before `min_new_tokens`).
    pub fn push(&mut self, delta: &str, match_stops: bool) -> TextProgress {
        self.text.push_str(delta);
        if match_stops {
            if let Some((start, stop_len, stop)) = self.earliest_match() {
                self.matched_stop = Some(stop);
                let end = if self.include_stop_string {
                    start + stop_len
                } else {
                    start
                };
                let last = self.unsent_until(end);
                return match self.limit_chars(last) {
                    Some(limited) => limited,
                    None => TextProgress::StopString(self.flush_taken(last)),
                };
            }
        }
        let hold = if match_stops { self.held_back_len() } else { 0 };
        let end = self.text.len() - hold;
        let ready = self.unsent_until(end);
        match self.limit_chars(ready) {
            Some(limited) => limited,
            None => TextProgress::Continue(self.flush_taken(ready)),
        }
    }

    /// The sequence ended for another reason: everything held back is sent.
    pub fn finish(&mut self) -> String {
        let end = self.text.len();
        let rest = self.unsent_until(end);
        match self.limit_chars(rest) {
            Some(TextProgress::CharLimit(text)) => text,
            _ => self.flush_taken(rest),
        }
    }

    /// All text sent so far.
    pub fn sent_text(&self) -> &str {
        &self.text[..self.sent]
    }

    /// The stop string that ended the text, if one did.
    pub fn matched_stop(&self) -> Option<&str> {
        self.matched_stop.map(|stop| self.stop_strings[stop].as_str())
    }

    /// (start, length, which stop string) of the earliest stop-string match in the unsent text
    /// (of two at the same place, the shorter and then the first listed).
    fn earliest_match(&self) -> Option<(usize, usize, usize)> {
        let unsent = &self.text[self.sent..];
        self.stop_strings
            .iter()
            .enumerate()
            .filter_map(|(i, stop)| unsent.find(stop.as_str()).map(|at| (self.sent + at, stop.len(), i)))
            .min()
    }

    /// Length of the longest unsent suffix that is a proper prefix of some stop string.
    fn held_back_len(&self) -> usize {
        let unsent = &self.text[self.sent..];
        unsent
            .char_indices()
            .map(|(i, _)| &unsent[i..])
            .find(|suffix| {
                self.stop_strings
                    .iter()
                    .any(|stop| stop.len() > suffix.len() && stop.starts_with(suffix))
            })
            .map_or(0, str::len)
    }

    /// The unsent byte range up to `end`.
    fn unsent_until(&self, end: usize) -> (usize, usize) {
        (self.sent, end.max(self.sent))
    }

    /// Applies the character limit to a range about to be sent.
    fn limit_chars(&mut self, (start, end): (usize, usize)) -> Option<TextProgress> {
        let max_chars = self.max_chars?;
        let chunk = &self.text[start..end];
        let chunk_chars = chunk.chars().count();
        if self.sent_chars + chunk_chars < max_chars {
            return None;
        }
        let allowed = max_chars - self.sent_chars;
        let cut = chunk.char_indices().nth(allowed).map_or(chunk.len(), |(i, _)| i);
        let last = chunk[..cut].to_owned();
        self.sent = start + cut;
        self.sent_chars = max_chars;
        self.text.truncate(self.sent);
        Some(TextProgress::CharLimit(last))
    }

    fn flush_taken(&mut self, (start, end): (usize, usize)) -> String {
        let chunk = self.text[start..end].to_owned();
        self.sent = end;
        self.sent_chars += chunk.chars().count();
        chunk
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(output: &mut OutputText, deltas: &[&str]) -> (String, Option<TextProgress>) {
        let mut sent = String::new();
        for delta in deltas {
            match output.push(delta, true) {
                TextProgress::Continue(text) => sent.push_str(&text),
                done => return (sent, Some(done)),
            }
        }
        sent.push_str(&output.finish());
        (sent, None)
    }

    #[test]
    fn a_stop_string_across_tokens_is_matched_and_trimmed() {
        let mut output = OutputText::new(vec!["END".to_owned()], false, None);
        let (sent, done) = feed(&mut output, &["Hello E", "N", "D more"]);
        assert_eq!(sent, "Hello ");
        assert_eq!(done, Some(TextProgress::StopString(String::new())));
        assert_eq!(output.sent_text(), "Hello ");
    }

    #[test]
    fn only_a_possible_stop_prefix_is_held_back() {
        let mut output = OutputText::new(vec!["\n\nUser:".to_owned()], false, None);
        assert_eq!(
            output.push("Hi there\n", true),
            TextProgress::Continue("Hi there".to_owned())
        );
        assert_eq!(output.push("\nUs", true), TextProgress::Continue(String::new()));
        // Not a stop string after all: the held text goes out.
        assert_eq!(
            output.push("ually", true),
            TextProgress::Continue("\n\nUsually".to_owned())
        );
    }

    #[test]
    fn included_stop_strings_and_the_earliest_of_several() {
        let mut output = OutputText::new(vec!["world".to_owned(), "lo w".to_owned()], true, None);
        assert_eq!(output.matched_stop(), None);
        assert_eq!(
            output.push("hello world", true),
            TextProgress::StopString("hello w".to_owned())
        );
        // The earliest match names the stop (`stop_reason`) where it cuts the text; vLLM's names
        // the first listed stop string that matches, and cuts there.
        assert_eq!(output.matched_stop(), Some("lo w"));
    }

    #[test]
    fn stop_strings_are_not_matched_before_min_tokens() {
        let mut output = OutputText::new(vec!["stop".to_owned()], false, None);
        assert_eq!(output.push("stop", false), TextProgress::Continue("stop".to_owned()));
        assert_eq!(output.push(" stop", true), TextProgress::StopString(" ".to_owned()));
    }

    #[test]
    fn the_character_limit_cuts_at_a_character_boundary() {
        let mut output = OutputText::new(Vec::new(), false, Some(4));
        assert_eq!(output.push("né", true), TextProgress::Continue("né".to_owned()));
        assert_eq!(output.push("€€€", true), TextProgress::CharLimit("€€".to_owned()));
        assert_eq!(output.sent_text(), "né€€");
    }

    #[test]
    fn multibyte_stop_strings_hold_back_on_character_boundaries() {
        let mut output = OutputText::new(vec!["。終".to_owned()], false, None);
        assert_eq!(output.push("はい。", true), TextProgress::Continue("はい".to_owned()));
        assert_eq!(output.push("終わり", true), TextProgress::StopString(String::new()));
    }
}
