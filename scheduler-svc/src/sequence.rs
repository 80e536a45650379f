//! A request being served: its tokens, how many of them have KV in the cache, its block table and
//! the channel its results go to.

use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use crate::block_manager::BlockManager;
use crate::completion::OutputText;
use crate::detokenizer::IncrementalDetokenizer;
use crate::guide::GuideCursor;
use crate::queue_ticket::QueueTicket;
use crate::request::{GenerationRequest, PromptTokenLogprob, SequenceEvent};

pub type SequenceId = u64;

pub struct Sequence {
    pub id: SequenceId,
    pub request: GenerationRequest,
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    /// Leading tokens of `tokens` whose K and V are in the cache.
    pub num_computed: usize,
    /// KV blocks holding this sequence's tokens, in order.
    pub blocks: Vec<u32>,
    /// Prefix-cache chain hashes of the full blocks offered to the cache so far.
    pub block_hashes: Vec<u64>,
    /// Prompt tokens served from the prefix cache at first admission.
    pub cached_prompt_tokens: usize,
    /// The prompt logprobs read so far (entry `i` for prompt token `i + 1`), until the first
    /// token takes them to the client.
    pub prompt_logprobs: Vec<PromptTokenLogprob>,
    pub detokenizer: IncrementalDetokenizer,
    /// Stop strings and the character limit, applied to the detokenized text.
    pub output: OutputText,
    /// Its place in the admission queue, held until its first admission.
    pub queue_ticket: Option<QueueTicket>,
    pub events: UnboundedSender<SequenceEvent>,
    /// Since when it waits for a replica to take it (none is ready); `None` once routed.
    pub unrouted_since: Option<Instant>,
    pub submitted_at: Instant,
    /// From submission to its first admission into a step, once admitted.
    pub queue_time: Option<Duration>,
    /// Where its output is in its structured output's guide, if it has one.
    pub guide: Option<GuideCursor>,
}

impl Sequence {
    pub fn new(
        id: SequenceId,
        request: GenerationRequest,
        events: UnboundedSender<SequenceEvent>,
        queue_ticket: QueueTicket,
    ) -> Self {
        let stopping = &request.stopping;
        let output = OutputText::new(
            stopping.stop_strings.clone(),
            stopping.include_stop_str_in_output,
            stopping.max_response_chars.map(|c| c as usize),
        );
        let guide = request.sampling.guide.clone().map(GuideCursor::new);
        Self {
            id,
            output,
            guide,
            queue_ticket: Some(queue_ticket),
            tokens: request.prompt_ids.clone(),
            request,
            num_computed: 0,
            blocks: Vec::new(),
            block_hashes: Vec::new(),
            cached_prompt_tokens: 0,
            prompt_logprobs: Vec::new(),
            detokenizer: IncrementalDetokenizer::default(),
            events,
            unrouted_since: Some(Instant::now()),
            submitted_at: Instant::now(),
            queue_time: None,
        }
    }

    pub fn prompt_len(&self) -> usize {
        self.request.prompt_ids.len()
    }

    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.prompt_len()
    }

    /// Whether its steps score its prompt tokens: it asked for prompt logprobs and has not yet
    /// had its first token, which takes them to the client.
    pub fn scores_prompt(&self) -> bool {
        self.request.sampling.prompt_logprobs.is_some() && self.num_generated() == 0
    }

    /// Tokens not yet in the KV cache: the prompt (or a preempted sequence's whole history) before
    /// its prefill is done, one token while decoding.
    pub fn num_uncomputed(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Gives its KV blocks back to `blocks` (the manager they came from) and forgets them: it will
    /// be recomputed from its tokens. The one way a sequence lets go of its blocks.
    pub fn release_kv(&mut self, blocks: &mut BlockManager) {
        blocks.release(&mut self.blocks);
        self.forget_kv();
    }

    /// Its replica is gone, and the KV with it: nothing to give back, everything to recompute
    /// (prompt and generated tokens) on whichever replica takes it next.
    pub fn forget_kv(&mut self) {
        self.blocks.clear();
        self.block_hashes.clear();
        self.num_computed = 0;
    }
}
