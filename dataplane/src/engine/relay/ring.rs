//! The driver side of one split virtqueue (VIRTIO 1.2 §2.7) in the relay's shadow region:
//! acceld posts heads, QEMU's export pops them and puts them in the used ring. Every head is
//! one INDIRECT descriptor whose table lives in the head's own part of the region, so a head
//! index is also a request slot.
//!
//! The used ring is written by the export and is input: [`DriverRing::used`] returns what is
//! there, and the caller checks every id against what it posted.

use std::sync::atomic::{fence, AtomicU16, Ordering};

use super::shadow::{
    AVAIL_OFF, DESC_OFF, INDIRECT_MAX, INDIRECT_OFF, RING_SIZE, SLOT_LEN, SLOT_OFF, USED_OFF,
};

pub const DESC_F_NEXT: u16 = 1;
pub const DESC_F_WRITE: u16 = 2;
pub const DESC_F_INDIRECT: u16 = 4;

const N: usize = RING_SIZE as usize;

/// One descriptor as the driver fills it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub write: bool,
}

/// `vring_need_event` (VIRTIO 1.2 §2.7.10): whether moving an index from `old` to `new`
/// passed `event`.
pub fn need_event(event: u16, new: u16, old: u16) -> bool {
    new.wrapping_sub(event).wrapping_sub(1) < new.wrapping_sub(old)
}

/// One queue's ring, over acceld's mapping of its part of the shadow region, with the
/// export's addresses of the same bytes.
pub struct DriverRing {
    host: *mut u8,
    gpa: u64,
    /// The next avail index acceld writes, and the one last published to the export.
    avail_idx: u16,
    published: u16,
    /// The next used entry acceld reads.
    pub used_seen: u16,
}

// SAFETY: the ring's memory is the shadow region, which outlives every ring (the engine owns
// both); one thread drives a ring at a time (the queue's worker).
unsafe impl Send for DriverRing {}

impl DriverRing {
    /// A fresh ring at `host` (acceld's address) / `gpa` (the export's): everything zeroed.
    ///
    /// # Safety
    /// `host` must point to one queue's part of a live shadow region (`STRIDE` bytes, page
    /// aligned) that only this ring writes on acceld's side, and stay valid while it is used.
    pub unsafe fn new(host: *mut u8, gpa: u64) -> DriverRing {
        // SAFETY: the caller's contract: the avail and used parts are inside the queue's
        // part, which only this ring writes on acceld's side.
        unsafe { std::ptr::write_bytes(host.wrapping_add(AVAIL_OFF), 0, 6 + 2 * N) };
        // SAFETY: as above.
        unsafe { std::ptr::write_bytes(host.wrapping_add(USED_OFF), 0, 6 + 8 * N) };
        DriverRing {
            host,
            gpa,
            avail_idx: 0,
            published: 0,
            used_seen: 0,
        }
    }

    pub fn desc_gpa(&self) -> u64 {
        self.gpa + DESC_OFF as u64
    }
    pub fn avail_gpa(&self) -> u64 {
        self.gpa + AVAIL_OFF as u64
    }
    pub fn used_gpa(&self) -> u64 {
        self.gpa + USED_OFF as u64
    }

    /// acceld's and the export's address of byte `off` of head `head`'s slot.
    pub fn slot(&self, head: u16, off: usize) -> (*mut u8, u64) {
        let o = SLOT_OFF + usize::from(head) * SLOT_LEN + off;
        // head < RING_SIZE and off < SLOT_LEN keep `o` inside the slots part.
        (self.host.wrapping_add(o), self.gpa + o as u64)
    }

    fn indirect(&self, head: u16) -> (*mut u8, u64) {
        let o = INDIRECT_OFF + usize::from(head) * 16 * INDIRECT_MAX;
        // head < RING_SIZE keeps the table inside the indirect part.
        (self.host.wrapping_add(o), self.gpa + o as u64)
    }

    /// Writes head `head`'s chain (at most [`INDIRECT_MAX`] descriptors, readable ones
    /// first) into its indirect table and points the head at it. Returns false when the
    /// chain is empty or too long (nothing written).
    pub fn set_chain(&mut self, head: u16, chain: &[Desc]) -> bool {
        if chain.is_empty() || chain.len() > INDIRECT_MAX || head >= RING_SIZE {
            return false;
        }
        let (table, table_gpa) = self.indirect(head);
        for (i, d) in chain.iter().enumerate() {
            let next = i + 1 < chain.len();
            let flags = if next { DESC_F_NEXT } else { 0 } | if d.write { DESC_F_WRITE } else { 0 };
            // SAFETY: i < INDIRECT_MAX keeps the descriptor inside the head's table.
            unsafe {
                write_desc(
                    table.wrapping_add(16 * i),
                    d.addr,
                    d.len,
                    flags,
                    (i + 1) as u16,
                )
            };
        }
        // SAFETY: head < RING_SIZE keeps the descriptor inside the table.
        unsafe {
            write_desc(
                self.host.wrapping_add(DESC_OFF + 16 * usize::from(head)),
                table_gpa,
                (16 * chain.len()) as u32,
                DESC_F_INDIRECT,
                0,
            )
        };
        true
    }

    /// Puts `head` in the avail ring (the export sees it at the next [`DriverRing::publish`]).
    pub fn post(&mut self, head: u16) {
        let slot = usize::from(self.avail_idx) % N;
        // SAFETY: the avail ring's entry `slot` < N is inside the avail part.
        unsafe {
            (self.host.wrapping_add(AVAIL_OFF + 4 + 2 * slot) as *mut u16)
                .write_volatile(head.to_le())
        };
        self.avail_idx = self.avail_idx.wrapping_add(1);
    }

    /// Heads posted and not yet published.
    pub fn unpublished(&self) -> u16 {
        self.avail_idx.wrapping_sub(self.published)
    }

    /// Publishes what was posted; returns whether the export asked to be kicked for it
    /// (EVENT_IDX: the export's avail_event lies in what was just published).
    pub fn publish(&mut self) -> bool {
        if self.avail_idx == self.published {
            return false;
        }
        self.avail()
            .store(self.avail_idx.to_le(), Ordering::Release);
        // The export's avail_event is read after the index is visible (VIRTIO 1.2 §2.7.10).
        fence(Ordering::SeqCst);
        let event = u16::from_le(self.avail_event().load(Ordering::Relaxed));
        let kick = need_event(event, self.avail_idx, self.published);
        self.published = self.avail_idx;
        kick
    }

    /// The export's used index (Acquire: the entries and the data before it are visible).
    pub fn used_idx(&self) -> u16 {
        u16::from_le(self.used_at().load(Ordering::Acquire))
    }

    /// The used entry at position `i` (modulo the ring): (id, len), as the export wrote it.
    pub fn used(&self, i: u16) -> (u32, u32) {
        let slot = usize::from(i) % N;
        // Entry `slot` < N is inside the used part.
        let p = self.host.wrapping_add(USED_OFF + 4 + 8 * slot);
        // SAFETY: 4-aligned bytes inside the used part; the export writes them before its
        // used index.
        let id = unsafe { (p as *const u32).read_volatile() };
        // SAFETY: as above.
        let len = unsafe { (p.wrapping_add(4) as *const u32).read_volatile() };
        (u32::from_le(id), u32::from_le(len))
    }

    /// Asks for a call once the used index passes `used_seen` (EVENT_IDX), then tells
    /// whether more was used meanwhile (the caller reads again instead of sleeping).
    pub fn arm(&mut self) -> bool {
        self.used_event()
            .store(self.used_seen.to_le(), Ordering::Relaxed);
        fence(Ordering::SeqCst);
        self.used_idx() != self.used_seen
    }

    fn avail(&self) -> &AtomicU16 {
        // SAFETY: avail->idx is 2-aligned inside the avail part and only accessed atomically.
        unsafe { &*(self.host.wrapping_add(AVAIL_OFF + 2) as *const AtomicU16) }
    }
    fn used_event(&self) -> &AtomicU16 {
        // SAFETY: avail->used_event (after the N entries) is 2-aligned inside the avail part.
        unsafe { &*(self.host.wrapping_add(AVAIL_OFF + 4 + 2 * N) as *const AtomicU16) }
    }
    fn used_at(&self) -> &AtomicU16 {
        // SAFETY: used->idx is 2-aligned inside the used part.
        unsafe { &*(self.host.wrapping_add(USED_OFF + 2) as *const AtomicU16) }
    }
    fn avail_event(&self) -> &AtomicU16 {
        // SAFETY: used->avail_event (after the N entries) is 2-aligned inside the used part.
        unsafe { &*(self.host.wrapping_add(USED_OFF + 4 + 8 * N) as *const AtomicU16) }
    }
}

/// # Safety
/// `p` must point to 16 writable bytes.
unsafe fn write_desc(p: *mut u8, addr: u64, len: u32, flags: u16, next: u16) {
    let mut b = [0u8; 16];
    b[0..8].copy_from_slice(&addr.to_le_bytes());
    b[8..12].copy_from_slice(&len.to_le_bytes());
    b[12..14].copy_from_slice(&flags.to_le_bytes());
    b[14..16].copy_from_slice(&next.to_le_bytes());
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), p, 16) };
}

#[cfg(test)]
mod tests {
    use super::super::shadow::{Shadow, STRIDE};
    use super::*;

    fn rd<const K: usize>(base: *const u8, off: usize) -> [u8; K] {
        let mut b = [0u8; K];
        // SAFETY: the tests read inside one queue's part.
        unsafe { std::ptr::copy_nonoverlapping(base.wrapping_add(off), b.as_mut_ptr(), K) };
        b
    }

    /// What a device reads: the head at avail position `i`, and its chain.
    fn device_pop(base: *const u8, gpa: u64, i: u16) -> (u16, Vec<(u64, u32, u16)>) {
        let slot = usize::from(i) % N;
        let head = u16::from_le_bytes(rd(base, AVAIL_OFF + 4 + 2 * slot));
        let d: [u8; 16] = rd(base, DESC_OFF + 16 * usize::from(head));
        let addr = u64::from_le_bytes(d[0..8].try_into().unwrap());
        let len = u32::from_le_bytes(d[8..12].try_into().unwrap());
        let flags = u16::from_le_bytes(d[12..14].try_into().unwrap());
        assert_eq!(flags, DESC_F_INDIRECT);
        assert_eq!(len % 16, 0);
        let off = (addr - gpa) as usize;
        assert!(off + len as usize <= STRIDE);
        let mut chain = Vec::new();
        let mut k = 0usize;
        loop {
            let e: [u8; 16] = rd(base, off + 16 * k);
            let f = u16::from_le_bytes(e[12..14].try_into().unwrap());
            chain.push((
                u64::from_le_bytes(e[0..8].try_into().unwrap()),
                u32::from_le_bytes(e[8..12].try_into().unwrap()),
                f,
            ));
            if f & DESC_F_NEXT == 0 {
                break;
            }
            k = usize::from(u16::from_le_bytes(e[14..16].try_into().unwrap()));
        }
        (head, chain)
    }

    fn device_push(base: *mut u8, used_idx: u16, id: u32, len: u32) {
        let slot = usize::from(used_idx) % N;
        let p = base.wrapping_add(USED_OFF + 4 + 8 * slot);
        // SAFETY: inside the used part of the test's region (4-aligned).
        unsafe { (p as *mut u32).write(id) };
        // SAFETY: as above.
        unsafe { (p.wrapping_add(4) as *mut u32).write(len) };
        // SAFETY: used->idx, inside the used part.
        unsafe { (base.wrapping_add(USED_OFF + 2) as *mut u16).write(used_idx.wrapping_add(1)) };
    }

    #[test]
    fn a_device_reads_what_the_driver_posted_and_the_driver_reads_what_it_used() {
        let s = Shadow::new(1).unwrap();
        let base = s.host(0);
        // SAFETY: queue 0's part of a live region, used by this ring alone.
        let mut r = unsafe { DriverRing::new(base, Shadow::gpa(0)) };
        let chain = [
            Desc {
                addr: 0x1000,
                len: 16,
                write: false,
            },
            Desc {
                addr: 0x2000,
                len: 4096,
                write: true,
            },
            Desc {
                addr: 0x3000,
                len: 1,
                write: true,
            },
        ];
        assert!(r.set_chain(5, &chain));
        assert!(!r.set_chain(6, &[]));
        r.post(5);
        assert_eq!(r.unpublished(), 1);
        // avail_event is 0: the first publish asks for a kick.
        assert!(r.publish());
        assert_eq!(r.unpublished(), 0);
        let (head, got) = device_pop(base, Shadow::gpa(0), 0);
        assert_eq!(head, 5);
        assert_eq!(
            got,
            vec![
                (0x1000, 16, DESC_F_NEXT),
                (0x2000, 4096, DESC_F_NEXT | DESC_F_WRITE),
                (0x3000, 1, DESC_F_WRITE)
            ]
        );
        assert_eq!(r.used_idx(), 0);
        device_push(base, 0, 5, 4097);
        assert_eq!(r.used_idx(), 1);
        assert_eq!(r.used(0), (5, 4097));
        r.used_seen = 1;
        assert!(!r.arm());
    }

    #[test]
    fn kicks_follow_the_devices_avail_event() {
        let s = Shadow::new(1).unwrap();
        let base = s.host(0);
        // SAFETY: as above.
        let mut r = unsafe { DriverRing::new(base, Shadow::gpa(0)) };
        let d = [Desc {
            addr: 1,
            len: 1,
            write: true,
        }];
        for h in 0..3 {
            assert!(r.set_chain(h, &d));
        }
        r.post(0);
        assert!(r.publish());
        // The device popped one and asks to hear of index 5 only.
        // SAFETY: avail_event inside the used part.
        unsafe { (base.wrapping_add(USED_OFF + 4 + 8 * N) as *mut u16).write(5) };
        r.post(1);
        assert!(!r.publish(), "1 -> 2 does not pass 5");
        for h in 0..4 {
            r.post(h % 3);
        }
        assert!(r.publish(), "2 -> 6 passes 5");
        assert!(!r.publish(), "nothing new");
    }

    #[test]
    fn need_event_matches_the_spec_across_wrap_around() {
        assert!(need_event(0, 1, 0));
        assert!(!need_event(1, 1, 0));
        assert!(need_event(65535, 0, 65535));
        assert!(need_event(65534, 2, 65530));
        assert!(!need_event(3, 2, 65530));
    }
}
