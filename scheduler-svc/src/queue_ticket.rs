//! A place in the admission queue. `EngineHandle::submit` takes one (refusing the request when
//! `max_queued_requests` are out); the sequence carries it until its first admission, and dropping
//! it gives the place back — whether the sequence is admitted, cancelled, failed or never reaches
//! the engine. No code path has to remember to decrement the count.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Debug)]
pub struct QueueTicket {
    counter: Option<Arc<AtomicUsize>>,
}

impl QueueTicket {
    /// Takes a place if fewer than `limit` are out; otherwise returns how many are.
    pub fn take(counter: &Arc<AtomicUsize>, limit: usize) -> Result<Self, usize> {
        counter.fetch_update(Ordering::AcqRel, Ordering::Acquire, |out| {
            (out < limit).then_some(out + 1)
        })?;
        Ok(Self {
            counter: Some(counter.clone()),
        })
    }

    /// A ticket that counts nowhere (for sequences built outside a server, e.g. in tests).
    pub fn untracked() -> Self {
        Self { counter: None }
    }
}

impl Drop for QueueTicket {
    fn drop(&mut self) {
        if let Some(counter) = &self.counter {
            counter.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_limited_and_given_back_on_drop() {
        let counter = Arc::new(AtomicUsize::new(0));
        let first = QueueTicket::take(&counter, 2).expect("first");
        let second = QueueTicket::take(&counter, 2).expect("second");
        assert_eq!(QueueTicket::take(&counter, 2).expect_err("full"), 2);
        drop(first);
        let _third = QueueTicket::take(&counter, 2).expect("a place came back");
        drop(second);
        assert_eq!(counter.load(Ordering::Acquire), 1);
    }
}
