//! A mapped step buffer. The scheduler creates (and owns, so its drop unlinks the segment) one
//! per worker; the worker opens the same segment by name.
//!
//! Turn-taking is the synchronization: the scheduler writes inputs and then sends `Step`; the
//! worker reads them, writes outputs and then sends `StepDone`. Neither side touches the buffer
//! during the other's turn, so plain (non-atomic) access is sound.

use shared_memory::{Shmem, ShmemConf, ShmemError};
use thiserror::Error;

use crate::layout::{ArraySpan, StepCapacity, StepElement, StepHeader, StepLayout, STEP_LAYOUT_VERSION, STEP_MAGIC};

#[derive(Debug, Error)]
pub enum StepBufferError {
    #[error("shared memory: {0}")]
    SharedMemory(#[from] ShmemError),
    #[error("step buffer `{os_id}` has {actual} bytes, the layout needs {needed}")]
    TooSmall {
        os_id: String,
        actual: usize,
        needed: usize,
    },
    #[error("step buffer header is invalid (magic {magic:#x}, version {version})")]
    BadHeader { magic: u32, version: u32 },
    #[error("step {requested} does not match the buffer's step {in_buffer}")]
    StepMismatch { requested: u64, in_buffer: u64 },
    #[error("{what} = {value} exceeds the buffer's capacity {capacity}")]
    OverCapacity {
        what: &'static str,
        value: usize,
        capacity: usize,
    },
}

pub struct StepBuffer {
    shmem: Shmem,
    layout: StepLayout,
}

// SAFETY: `Shmem` is a mapping plus an OS handle; it is not tied to the creating thread. Access
// to the bytes is governed by the step protocol described in the module docs.
unsafe impl Send for StepBuffer {}

impl StepBuffer {
    /// Creates a new segment sized for `capacity` (scheduler side). The segment is unlinked when
    /// this value is dropped.
    pub fn create(capacity: StepCapacity) -> Result<Self, StepBufferError> {
        let layout = StepLayout::new(capacity);
        let shmem = ShmemConf::new().size(layout.total_bytes).create()?;
        let mut buffer = Self { shmem, layout };
        *buffer.header_mut() = StepHeader {
            magic: STEP_MAGIC,
            version: STEP_LAYOUT_VERSION,
            ..StepHeader::default()
        };
        Ok(buffer)
    }

    /// Opens a segment the scheduler created (worker side).
    pub fn open(os_id: &str, capacity: StepCapacity) -> Result<Self, StepBufferError> {
        let layout = StepLayout::new(capacity);
        let shmem = ShmemConf::new().os_id(os_id).open()?;
        if shmem.len() < layout.total_bytes {
            return Err(StepBufferError::TooSmall {
                os_id: os_id.to_owned(),
                actual: shmem.len(),
                needed: layout.total_bytes,
            });
        }
        let buffer = Self { shmem, layout };
        let header = buffer.header();
        if header.magic != STEP_MAGIC || header.version != STEP_LAYOUT_VERSION {
            return Err(StepBufferError::BadHeader {
                magic: header.magic,
                version: header.version,
            });
        }
        Ok(buffer)
    }

    pub fn os_id(&self) -> &str {
        self.shmem.get_os_id()
    }

    /// Makes dropping this mapping remove the segment's name too, as its creator's drop does: for
    /// a peer that outlives the creator (a worker whose scheduler was killed), so that no segment
    /// is left in `/dev/shm` with nobody to remove it.
    pub fn remove_when_dropped(&mut self) {
        self.shmem.set_owner(true);
    }

    pub fn layout(&self) -> &StepLayout {
        &self.layout
    }

    pub fn capacity(&self) -> StepCapacity {
        self.layout.capacity
    }

    /// The first byte of the mapping in this process.
    pub fn base_ptr(&self) -> *mut u8 {
        self.shmem.as_ptr()
    }

    /// The header, checked to describe `step` and to fit the capacity.
    pub fn header_for_step(&self, step: u64) -> Result<StepHeader, StepBufferError> {
        let header = *self.header();
        if header.step != step {
            return Err(StepBufferError::StepMismatch {
                requested: step,
                in_buffer: header.step,
            });
        }
        let capacity = self.layout.capacity;
        check_capacity("num_tokens", header.num_tokens as usize, capacity.max_tokens as usize)?;
        check_capacity("num_seqs", header.num_seqs as usize, capacity.max_seqs as usize)?;
        Ok(header)
    }

    pub fn header(&self) -> &StepHeader {
        // SAFETY: the mapping is at least `total_bytes` long, page-aligned (so 8-aligned), and
        // starts with a `StepHeader` (written by `create`).
        unsafe { &*(self.shmem.as_ptr() as *const StepHeader) }
    }

    pub fn header_mut(&mut self) -> &mut StepHeader {
        // SAFETY: as in `header`; `&mut self` gives exclusive access within this process.
        unsafe { &mut *(self.shmem.as_ptr() as *mut StepHeader) }
    }

    /// The array `span` describes, as its element type.
    pub fn array<T: StepElement>(&self, span: ArraySpan<T>) -> &[T] {
        assert!(span.offset + span.byte_len() <= self.layout.total_bytes);
        // SAFETY: the span lies inside the mapping (checked above; the mapping is at least
        // `total_bytes` long) at a multiple of 64 bytes from its page-aligned start, so it is
        // aligned for `T` (a `StepElement` is aligned to at most 64). `T: StepElement` is valid for
        // every bit pattern, so whatever the other process wrote is a value. The step protocol
        // (module docs) keeps the other process off the buffer while this borrow lives.
        unsafe { std::slice::from_raw_parts(self.shmem.as_ptr().add(span.offset) as *const T, span.len) }
    }

    /// The array `span` describes, writable.
    pub fn array_mut<T: StepElement>(&mut self, span: ArraySpan<T>) -> &mut [T] {
        assert!(span.offset + span.byte_len() <= self.layout.total_bytes);
        // SAFETY: as in `array`; `&mut self` gives exclusive access within this process, and a
        // `StepElement` has no padding, so every byte the other process reads back is defined.
        unsafe { std::slice::from_raw_parts_mut(self.shmem.as_ptr().add(span.offset) as *mut T, span.len) }
    }
}

fn check_capacity(what: &'static str, value: usize, capacity: usize) -> Result<(), StepBufferError> {
    if value > capacity {
        return Err(StepBufferError::OverCapacity { what, value, capacity });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::SeqSampling;

    #[test]
    fn a_second_mapping_sees_the_first_ones_writes() {
        let capacity = StepCapacity {
            max_tokens: 8,
            max_seqs: 2,
            max_blocks_per_seq: 4,
            max_history_tokens: 32,
            token_mask_words: 2,
        };
        let mut owner = StepBuffer::create(capacity).expect("create");
        let layout = *owner.layout();
        owner.header_mut().step = 7;
        owner.header_mut().num_tokens = 3;
        owner.array_mut(layout.input_ids)[..3].copy_from_slice(&[11, 22, 33]);
        owner.array_mut(layout.sampling)[1] = SeqSampling {
            temperature: 0.5,
            seed: -3,
            num_top_logprobs: 2,
            ..SeqSampling::default()
        };

        let mut peer = StepBuffer::open(owner.os_id(), capacity).expect("open");
        assert_eq!(peer.header_for_step(7).expect("header").num_tokens, 3);
        assert_eq!(&peer.array(layout.input_ids)[..3], &[11, 22, 33]);
        let row = peer.array(layout.sampling)[1];
        assert_eq!((row.temperature, row.seed, row.num_top_logprobs), (0.5, -3, 2));
        peer.array_mut(layout.sampled_tokens)[0] = 99;
        peer.array_mut(layout.sampled_logprobs)[0] = -0.25;
        assert_eq!(owner.array(layout.sampled_tokens)[0], 99);
        assert_eq!(owner.array(layout.sampled_logprobs)[0], -0.25);
        assert!(matches!(
            peer.header_for_step(8),
            Err(StepBufferError::StepMismatch { .. })
        ));
    }
}
