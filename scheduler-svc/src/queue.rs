//! The waiting queue: requests by priority class (Critical, High, Normal, Low), first come first
//! served within a class. Preempted sequences go back to the front of their class.

use std::collections::VecDeque;

use crate::request::Priority;
use crate::sequence::{Sequence, SequenceId};

#[derive(Default)]
pub struct WaitingQueue {
    /// Indexed by `Priority as usize` (Low = 0 … Critical = 3).
    classes: [VecDeque<Sequence>; 4],
}

impl WaitingQueue {
    pub fn len(&self) -> usize {
        self.classes.iter().map(VecDeque::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.classes.iter().all(VecDeque::is_empty)
    }

    /// A new arrival: behind everything of its class.
    pub fn push_back(&mut self, seq: Sequence) {
        self.classes[seq.request.priority as usize].push_back(seq);
    }

    /// A preempted sequence: ahead of everything of its class.
    pub fn push_front(&mut self, seq: Sequence) {
        self.classes[seq.request.priority as usize].push_front(seq);
    }

    /// The next to admit: the oldest of the highest non-empty class.
    pub fn front(&self) -> Option<&Sequence> {
        Priority::ALL_HIGHEST_FIRST
            .iter()
            .find_map(|&p| self.classes[p as usize].front())
    }

    pub fn pop_front(&mut self) -> Option<Sequence> {
        Priority::ALL_HIGHEST_FIRST
            .iter()
            .find_map(|&p| self.classes[p as usize].pop_front())
    }

    /// Takes out the sequence with this id, wherever it waits.
    pub fn remove(&mut self, id: SequenceId) -> Option<Sequence> {
        self.classes.iter_mut().find_map(|class| {
            let index = class.iter().position(|seq| seq.id == id)?;
            class.remove(index)
        })
    }

    /// Every waiting sequence, highest class first, FCFS within a class.
    pub fn iter(&self) -> impl Iterator<Item = &Sequence> {
        self.classes.iter().rev().flat_map(|class| class.iter())
    }

    pub fn retain_mut(&mut self, mut keep: impl FnMut(&mut Sequence) -> bool) {
        for class in &mut self.classes {
            class.retain_mut(&mut keep);
        }
    }

    pub fn iter_mut(&mut self) -> impl Iterator<Item = &mut Sequence> {
        self.classes.iter_mut().flat_map(|class| class.iter_mut())
    }

    pub fn drain(&mut self) -> impl Iterator<Item = Sequence> + '_ {
        self.classes.iter_mut().rev().flat_map(|class| class.drain(..))
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;
    use crate::queue_ticket::QueueTicket;
    use crate::request::{GenerationRequest, SamplingParams, StoppingParams};

    fn seq(id: u64, priority: Priority) -> Sequence {
        let (tx, _rx) = mpsc::unbounded_channel();
        let request = GenerationRequest {
            id: String::new(),
            prompt_ids: vec![1],
            sampling: SamplingParams::greedy(),
            stopping: StoppingParams {
                max_new_tokens: 1,
                ..Default::default()
            },
            priority,
        };
        Sequence::new(id, request, tx, QueueTicket::untracked())
    }

    #[test]
    fn higher_classes_first_and_fcfs_within_a_class() {
        let mut queue = WaitingQueue::default();
        queue.push_back(seq(1, Priority::Normal));
        queue.push_back(seq(2, Priority::Low));
        queue.push_back(seq(3, Priority::Critical));
        queue.push_back(seq(4, Priority::Normal));
        queue.push_back(seq(5, Priority::High));
        queue.push_front(seq(6, Priority::Normal));
        assert_eq!(queue.len(), 6);
        assert_eq!(queue.front().map(|s| s.id), Some(3));
        assert_eq!(queue.iter().map(|s| s.id).collect::<Vec<_>>(), vec![3, 5, 6, 1, 4, 2]);
        assert_eq!(queue.remove(4).map(|s| s.id), Some(4));
        queue.push_back(seq(4, Priority::Normal));
        let order: Vec<u64> = std::iter::from_fn(|| queue.pop_front()).map(|s| s.id).collect();
        assert_eq!(order, vec![3, 5, 6, 1, 4, 2]);
        assert!(queue.is_empty());
    }
}
