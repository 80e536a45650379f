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
    ///
    /// Each class is searched from both ends at once: FAIR and THROUGHPUT_FIRST admit from a
    /// class's front and LATENCY_FIRST its youngest, at the back, so either is found in a step or
    /// two however many of its class wait (a search from the front made LATENCY_FIRST's
    /// admissions quadratic in the queue's length). The classes are searched highest first, as
    /// every policy admits them, so only a lower class's admission passes over the classes above
    /// it.
    pub fn remove(&mut self, id: SequenceId) -> Option<Sequence> {
        self.classes.iter_mut().rev().find_map(|class| {
            let index = position_from_both_ends(class, id)?;
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

/// The index of the sequence with this id in `class`, looking at both ends first and moving
/// inwards.
fn position_from_both_ends(class: &VecDeque<Sequence>, id: SequenceId) -> Option<usize> {
    let (mut front, mut back) = (0, class.len());
    while front < back {
        if class[front].id == id {
            return Some(front);
        }
        back -= 1;
        if class[back].id == id {
            return Some(back);
        }
        front += 1;
    }
    None
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

    /// A sequence is found wherever it waits in its class (either end, the middle, next to the
    /// middle of an even or odd count), and an id that does not wait is not.
    #[test]
    fn removes_from_any_position_of_a_class() {
        for count in 1..=6u64 {
            for target in 1..=count {
                let mut queue = WaitingQueue::default();
                (1..=count).for_each(|id| queue.push_back(seq(id, Priority::Normal)));
                queue.push_back(seq(100, Priority::High));
                assert_eq!(queue.remove(target).map(|s| s.id), Some(target), "{target} of {count}");
                assert!(queue.remove(target).is_none());
                assert!(queue.remove(99).is_none());
                let rest: Vec<u64> = queue.iter().map(|s| s.id).collect();
                let expected: Vec<u64> = std::iter::once(100)
                    .chain((1..=count).filter(|&id| id != target))
                    .collect();
                assert_eq!(rest, expected);
            }
        }
    }
}
