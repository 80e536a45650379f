//! The events a finished step has for its clients, held until the engine has started the next
//! step and sent then, while the worker computes it.
//!
//! Each send wakes the client's task on the async runtime (a lock on its queue from this thread,
//! often a system call to wake one of its threads): at 1024 sequences that was most of the engine's
//! time between two steps on a GPU, time in which the GPU waited. Sent after the next step is out,
//! the same events cost the step nothing. Each client's events keep their order: only the engine
//! thread sends, it flushes before it waits for anything, a sequence that the next step's planning
//! finds cannot run at all is failed through the outbox, and the paths that fail sequences
//! directly between a step's return and the flush (a lost worker, the drain's deadline) flush
//! first.

use tokio::sync::mpsc::UnboundedSender;

use crate::request::SequenceEvent;

#[derive(Default)]
pub struct Outbox {
    pending: Vec<(UnboundedSender<SequenceEvent>, SequenceEvent)>,
}

impl Outbox {
    /// Holds `event` for the client behind `to`.
    pub fn push(&mut self, to: UnboundedSender<SequenceEvent>, event: SequenceEvent) {
        self.pending.push((to, event));
    }

    /// Sends every held event, in the order it came (a client that went away gets nothing).
    pub fn flush(&mut self) {
        for (to, event) in self.pending.drain(..) {
            let _ = to.send(event);
        }
    }
}
