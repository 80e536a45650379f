//! OpenAI-compatible `/v1/completions` with `stream: true`: server-sent events, one `data:` line
//! per chunk, ending with `data: [DONE]`.

use std::time::Instant;

use serde_json::{json, Value};

use super::RequestSettings;
use crate::dataset::BenchRequest;
use crate::metrics::RequestOutcome;

#[derive(Clone)]
pub struct OpenAiBackend {
    client: reqwest::Client,
    url: String,
    /// The `model` field; left out when not given (the server's own model).
    model: Option<String>,
}

impl OpenAiBackend {
    /// `base_url` is the server's root (e.g. `http://127.0.0.1:8080`); `/v1/completions` is added.
    pub fn new(base_url: &str, model: Option<&str>) -> Result<Self, reqwest::Error> {
        Ok(Self {
            // A fresh connection per request: servers close idle keep-alive connections on their own
            // schedule (llama-server after a few requests), and a request sent on a connection
            // the server is closing fails for reasons that are not the server's throughput.
            client: reqwest::Client::builder().pool_max_idle_per_host(0).build()?,
            url: format!("{}/v1/completions", base_url.trim_end_matches('/')),
            model: model.map(str::to_owned),
        })
    }

    pub async fn send(&self, request: &BenchRequest, settings: RequestSettings) -> RequestOutcome {
        let mut body = json!({
            "prompt": request.prompt,
            "max_tokens": request.max_tokens,
            "temperature": settings.temperature,
            "stream": true,
            "ignore_eos": settings.ignore_eos,
            "stream_options": {"include_usage": true},
        });
        // OpenAI's names, and vLLM's (and Rivulet's) top_k and repetition_penalty; llama-server
        // calls the latter repeat_penalty and ignores this one.
        let optional = [
            ("top_p", settings.top_p.map(|v| json!(v))),
            ("top_k", settings.top_k.map(|v| json!(v))),
            ("frequency_penalty", settings.frequency_penalty.map(|v| json!(v))),
            ("presence_penalty", settings.presence_penalty.map(|v| json!(v))),
            ("repetition_penalty", settings.repetition_penalty.map(|v| json!(v))),
        ];
        for (name, value) in optional {
            if let Some(value) = value {
                body[name] = value;
            }
        }
        if let Some(model) = &self.model {
            body["model"] = json!(model);
        }
        let sent = Instant::now();
        let mut response = match self.client.post(&self.url).json(&body).send().await {
            Ok(response) if response.status().is_success() => response,
            Ok(response) => {
                let status = response.status();
                let text = response.text().await.unwrap_or_default();
                return RequestOutcome::failed(format!("HTTP {status}: {text}"));
            }
            Err(error) => return RequestOutcome::failed(error.to_string()),
        };
        let mut events = SseParser::default();
        let mut arrivals = Vec::with_capacity(request.max_tokens as usize);
        let mut usage: Option<(usize, usize)> = None;
        loop {
            let bytes = match response.chunk().await {
                Ok(Some(bytes)) => bytes,
                Ok(None) => break,
                Err(error) => return RequestOutcome::failed(error.to_string()),
            };
            let now = sent.elapsed();
            for data in events.push(&bytes) {
                match classify_event(&data) {
                    Ok(SseEvent::Done) => {}
                    Ok(SseEvent::Chunk {
                        has_text,
                        usage: chunk_usage,
                    }) => {
                        if has_text {
                            arrivals.push(now);
                        }
                        usage = chunk_usage.or(usage);
                    }
                    Err(error) => return RequestOutcome::failed(error),
                }
            }
        }
        let e2e = sent.elapsed();
        let (prompt_tokens, output_tokens) = usage.unwrap_or((request.prompt_tokens, arrivals.len()));
        RequestOutcome::completed(prompt_tokens, output_tokens, &arrivals, e2e)
    }
}

/// Splits a byte stream into the `data:` payloads of complete server-sent events.
#[derive(Debug, Default)]
pub struct SseParser {
    pending: Vec<u8>,
}

impl SseParser {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut payloads = Vec::new();
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\r', '\n']);
            if let Some(data) = line.strip_prefix("data:") {
                payloads.push(data.trim_start().to_owned());
            }
        }
        payloads
    }
}

#[derive(Debug, PartialEq)]
pub enum SseEvent {
    Done,
    /// `has_text`: the chunk carries generated text; `usage`: (prompt, completion) tokens if reported.
    Chunk {
        has_text: bool,
        usage: Option<(usize, usize)>,
    },
}

pub fn classify_event(data: &str) -> Result<SseEvent, String> {
    if data == "[DONE]" {
        return Ok(SseEvent::Done);
    }
    let value: Value = serde_json::from_str(data).map_err(|e| format!("bad event `{data}`: {e}"))?;
    if let Some(error) = value.get("error") {
        return Err(format!("server error: {error}"));
    }
    let has_text = value["choices"].as_array().is_some_and(|choices| {
        choices
            .iter()
            .any(|c| c["text"].as_str().is_some_and(|t| !t.is_empty()))
    });
    let usage = value.get("usage").filter(|u| !u.is_null()).and_then(|u| {
        Some((
            u["prompt_tokens"].as_u64()? as usize,
            u["completion_tokens"].as_u64()? as usize,
        ))
    });
    Ok(SseEvent::Chunk { has_text, usage })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_reads_are_reassembled() {
        let mut parser = SseParser::default();
        assert!(parser.push(b"data: {\"choices\":[{\"te").is_empty());
        let events = parser.push(b"xt\":\"a\"}]}\r\n\r\ndata: [DONE]\n\n");
        assert_eq!(
            events,
            vec![r#"{"choices":[{"text":"a"}]}"#.to_owned(), "[DONE]".to_owned()]
        );
    }

    #[test]
    fn chunks_report_text_usage_and_errors() {
        assert_eq!(
            classify_event(r#"{"choices":[{"text":"hi"}]}"#),
            Ok(SseEvent::Chunk {
                has_text: true,
                usage: None
            })
        );
        assert_eq!(
            classify_event(r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":9}}"#),
            Ok(SseEvent::Chunk {
                has_text: false,
                usage: Some((5, 9))
            })
        );
        assert_eq!(classify_event("[DONE]"), Ok(SseEvent::Done));
        assert!(classify_event(r#"{"error":{"message":"no"}}"#).is_err());
        assert!(classify_event("not json").is_err());
    }
}
