//! Self-describing KV payloads.
//!
//! A slot's bytes are 16-byte words; word `i` of a slot written for request
//! `r` into tenancy `(slot, generation)` holds, little-endian,
//! `[r: u32][generation: u32][slot: u32][i: u32]` (the generation's low 32
//! bits). A consumer that knows its own request id and tenancy checks every
//! word: a word naming another request is a *foreign* byte run (someone
//! else's late write), anything else that does not match is *garbage*
//! (a torn or missing write). A tail shorter than a word repeats the first
//! bytes of the word.
//!
//! ```
//! use kv_transfer_testkit::payload::{fill, verify, Tag};
//! let mine = Tag { request: 7, generation: 3, slot: 1 };
//! let mut buf = vec![0u8; 100];
//! fill(&mut buf, mine);
//! assert!(verify(&buf, mine).is_clean());
//! let theirs = Tag { request: 6, generation: 2, slot: 1 };
//! fill(&mut buf[..32], theirs);
//! let c = verify(&buf, mine);
//! assert_eq!((c.foreign_bytes, c.foreign_request), (32, Some(6)));
//! ```

use serde::{Deserialize, Serialize};

/// Bytes per self-describing word.
pub const WORD: usize = 16;

/// Who owns a slot's bytes: the request and the destination tenancy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Tag {
    /// Request id (non-zero in practice: zero is what unwritten memory says).
    pub request: u32,
    /// Low 32 bits of the destination slot's generation.
    pub generation: u32,
    /// Destination slot id.
    pub slot: u32,
}

impl Tag {
    /// A tag for request `request` writing tenancy `(slot, generation)`.
    pub fn new(request: u64, slot: u32, generation: u64) -> Self {
        Self { request: request as u32, generation: generation as u32, slot }
    }

    fn word(&self, i: usize) -> [u8; WORD] {
        let mut w = [0u8; WORD];
        w[0..4].copy_from_slice(&self.request.to_le_bytes());
        w[4..8].copy_from_slice(&self.generation.to_le_bytes());
        w[8..12].copy_from_slice(&self.slot.to_le_bytes());
        w[12..16].copy_from_slice(&(i as u32).to_le_bytes());
        w
    }
}

/// Fills `buf` (one slot's bytes) with `tag`'s pattern.
pub fn fill(buf: &mut [u8], tag: Tag) {
    for (i, chunk) in buf.chunks_mut(WORD).enumerate() {
        let w = tag.word(i);
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// The pattern of `tag` over `len` bytes.
pub fn pattern(len: usize, tag: Tag) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill(&mut v, tag);
    v
}

/// What a consumer found in one slot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotCheck {
    /// Bytes that are the consumer's own.
    pub own_bytes: usize,
    /// Bytes in words that name another request: someone else's data.
    pub foreign_bytes: usize,
    /// Bytes that match nobody (unwritten, torn).
    pub garbage_bytes: usize,
    /// One foreign request seen, if any.
    pub foreign_request: Option<u32>,
}

impl SlotCheck {
    /// Every byte is the consumer's own.
    pub fn is_clean(&self) -> bool {
        self.foreign_bytes == 0 && self.garbage_bytes == 0
    }
    /// Adds another slot's findings.
    pub fn merge(&mut self, o: SlotCheck) {
        self.own_bytes += o.own_bytes;
        self.foreign_bytes += o.foreign_bytes;
        self.garbage_bytes += o.garbage_bytes;
        self.foreign_request = self.foreign_request.or(o.foreign_request);
    }
}

/// Checks every word of `buf` against `mine`.
pub fn verify(buf: &[u8], mine: Tag) -> SlotCheck {
    let mut c = SlotCheck::default();
    for (i, chunk) in buf.chunks(WORD).enumerate() {
        let w = mine.word(i);
        if chunk == &w[..chunk.len()] {
            c.own_bytes += chunk.len();
            continue;
        }
        let req = if chunk.len() >= 4 { u32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]) } else { 0 };
        if req != 0 && req != mine.request {
            c.foreign_bytes += chunk.len();
            c.foreign_request.get_or_insert(req);
        } else {
            c.garbage_bytes += chunk.len();
        }
    }
    c
}
