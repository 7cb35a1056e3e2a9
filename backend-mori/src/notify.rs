//! MORI notifications as application messages on a transport's control
//! channel: one fixed-size head (kind, seq, uid, code, tag), then the text.
//! Shared by the simulated and the verbs transports.

use crate::transport::Notification;
use crate::types::Tag;

/// First byte of an application message: a MORI notification.
pub(crate) const MSG_NOTIFY: u8 = 1;

/// Bytes of a notification message before its text: kind, seq, uid, code, tag.
pub(crate) const NOTIFY_HEAD: usize = 33;

/// Writes `n`'s head (its kind byte and fixed fields) into `b`.
pub(crate) fn encode_notification_head(b: &mut [u8; NOTIFY_HEAD], n: &Notification) {
    b[0] = MSG_NOTIFY;
    b[1..5].copy_from_slice(&n.seq.to_le_bytes());
    b[5..13].copy_from_slice(&n.uid.to_le_bytes());
    b[13..17].copy_from_slice(&n.code.to_le_bytes());
    b[17..25].copy_from_slice(&n.tag.slot.to_le_bytes());
    b[25..33].copy_from_slice(&n.tag.generation.to_le_bytes());
}

/// A notification as an application message: [`MSG_NOTIFY`], the fixed
/// fields, then the text.
pub(crate) fn encode_notification(n: &Notification) -> Vec<u8> {
    let mut head = [0u8; NOTIFY_HEAD];
    encode_notification_head(&mut head, n);
    let mut v = Vec::with_capacity(NOTIFY_HEAD + n.message.len());
    v.extend_from_slice(&head);
    v.extend_from_slice(n.message.as_bytes());
    v
}

/// The notification in `b`, a message's body after its kind byte; `None`
/// if `b` is shorter than the fixed fields.
pub(crate) fn decode_notification(b: &[u8]) -> Option<Notification> {
    let u32_at = |i: usize| b.get(i..i + 4).and_then(|s| s.try_into().ok()).map(u32::from_le_bytes);
    let u64_at = |i: usize| b.get(i..i + 8).and_then(|s| s.try_into().ok()).map(u64::from_le_bytes);
    Some(Notification {
        seq: u32_at(0)?,
        uid: u64_at(4)?,
        code: u32_at(12)?,
        tag: Tag::new(u64_at(16)?, u64_at(24)?),
        message: String::from_utf8_lossy(b.get(32..)?).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_notification_round_trips_and_a_short_one_is_refused() {
        let n = Notification { seq: 7, uid: 9, code: 3, tag: Tag::new(5, 2), message: "done".into() };
        let bytes = encode_notification(&n);
        assert_eq!((bytes[0], bytes.len()), (MSG_NOTIFY, NOTIFY_HEAD + 4));
        assert_eq!(decode_notification(&bytes[1..]), Some(n));
        assert!(decode_notification(&bytes[1..NOTIFY_HEAD - 1]).is_none());
    }
}
