//! virtio-blk request layout and validation (VIRTIO 1.2 §5.2), pure: no I/O, no guest memory.
//!
//! A request is a descriptor chain: device-readable descriptors first (the 16-byte header
//! `struct virtio_blk_req { le32 type; le32 reserved; le64 sector; }`, then the data of OUT,
//! DISCARD and WRITE_ZEROES requests), then device-writable descriptors (the data of IN and
//! GET_ID), whose very last byte is the status (§5.2.6). The header and the data may be split
//! across descriptors any way the driver likes (§2.7.4 "message framing": the device MUST NOT
//! make assumptions about the layout).
//!
//! [`split_chain`] turns a chain (a list of [`Desc`]) into a [`Layout`]; [`validate`] checks the
//! header against the disk and gives the operation to run or the status to answer. Every length
//! and sector is a guest value and is checked here before it reaches an engine.

use thiserror::Error;

/// Sector size of the virtio-blk protocol, independent of the logical block size (§5.2.6).
pub const SECTOR_SHIFT: u32 = 9;
pub const SECTOR_SIZE: u64 = 1 << SECTOR_SHIFT;
/// Size of `struct virtio_blk_req`'s header.
pub const HEADER_LEN: u32 = 16;
/// Size of `struct virtio_blk_discard_write_zeroes`.
pub const DWZ_SEGMENT_LEN: u32 = 16;
/// GET_ID answers with at most 20 bytes (§5.2.6: `VIRTIO_BLK_ID_BYTES`).
pub const ID_BYTES: usize = 20;

// Request types (§5.2.6).
pub const T_IN: u32 = 0;
pub const T_OUT: u32 = 1;
pub const T_FLUSH: u32 = 4;
pub const T_GET_ID: u32 = 8;
pub const T_DISCARD: u32 = 11;
pub const T_WRITE_ZEROES: u32 = 13;

// Status values (§5.2.6).
pub const S_OK: u8 = 0;
pub const S_IOERR: u8 = 1;
pub const S_UNSUPP: u8 = 2;

/// `VIRTIO_BLK_WRITE_ZEROES_FLAG_UNMAP`.
pub const WZ_FLAG_UNMAP: u32 = 1;

// Device feature bits (§5.2.3).
pub const F_SIZE_MAX: u32 = 1;
pub const F_SEG_MAX: u32 = 2;
pub const F_RO: u32 = 5;
pub const F_BLK_SIZE: u32 = 6;
pub const F_FLUSH: u32 = 9;
pub const F_TOPOLOGY: u32 = 10;
pub const F_CONFIG_WCE: u32 = 11;
pub const F_MQ: u32 = 12;
pub const F_DISCARD: u32 = 13;
pub const F_WRITE_ZEROES: u32 = 14;

/// Limits QEMU 10's export advertises and enforces (block/export/virtio-blk-handler.h).
pub const MAX_DISCARD_SECTORS: u32 = 32768;
pub const MAX_WRITE_ZEROES_SECTORS: u32 = 32768;
/// `seg_max` QEMU's export advertises: 128 - 2 (header and status).
pub const SEG_MAX: u32 = 126;
/// `seg_max` of QEMU's virtio-blk device with its default 256-entry rings (`seg-max-adjust`:
/// the ring size - 2).
pub const VIRTIO_BLK_SEG_MAX: u32 = 256 - 2;
/// QEMU's virtio-blk device's `max-discard-sectors` and `max-write-zeroes-sectors` defaults:
/// `BDRV_REQUEST_MAX_SECTORS`.
pub const VIRTIO_BLK_MAX_DWZ_SECTORS: u32 = (i32::MAX as u32) >> SECTOR_SHIFT;
/// VIRTIO_BLK_F_GEOMETRY (legacy CHS geometry in the config space).
pub const F_GEOMETRY: u32 = 4;

/// Which of QEMU's two virtio-blk implementations the device looks like to the guest: its
/// feature bits, config space and discard limits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceModel {
    /// QEMU's vhost-user-blk export (qemu-storage-daemon's `--export type=vhost-user-blk`):
    /// for a drive whose rings may be lent to that export, which enforces its own limits.
    #[default]
    Export,
    /// QEMU's virtio-blk device (`virtio-blk-pci`): what the guest of a converted domain had
    /// before, so it sees no difference.
    VirtioBlk,
}

impl DeviceModel {
    pub fn max_discard_sectors(self) -> u32 {
        match self {
            DeviceModel::Export => MAX_DISCARD_SECTORS,
            DeviceModel::VirtioBlk => VIRTIO_BLK_MAX_DWZ_SECTORS,
        }
    }

    pub fn max_write_zeroes_sectors(self) -> u32 {
        match self {
            DeviceModel::Export => MAX_WRITE_ZEROES_SECTORS,
            DeviceModel::VirtioBlk => VIRTIO_BLK_MAX_DWZ_SECTORS,
        }
    }
}
/// QEMU's `BDRV_REQUEST_MAX_SECTORS`: the largest single request its block layer takes.
pub const MAX_REQUEST_SECTORS: u64 = (i32::MAX as u64 & !0x1ff) >> SECTOR_SHIFT;

/// One descriptor as the guest gave it: never trusted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Desc {
    pub addr: u64,
    pub len: u32,
    pub writable: bool,
}

/// A guest-physical byte range, a piece of a descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seg {
    pub addr: u64,
    pub len: u32,
}

/// Why a chain cannot be a virtio-blk request at all.
#[derive(Debug, Error, Clone, Copy, PartialEq, Eq)]
pub enum LayoutError {
    #[error("descriptor chain is empty")]
    Empty,
    #[error("a device-readable descriptor follows a device-writable one")]
    ReadableAfterWritable,
    #[error("no device-writable byte for the status")]
    NoStatus,
    #[error("header is {0} bytes, needs {HEADER_LEN}")]
    ShortHeader(u64),
    #[error("request has more than {0} data segments")]
    TooManySegments(usize),
    /// The chain ended where it said it goes on (a loop, a next index past the table, an
    /// unreadable descriptor or a bad indirect table: virtio-queue stops there).
    #[error("descriptor chain cut short: its last descriptor has NEXT set")]
    Cut,
}

/// Where a request's parts are, as guest ranges: the header (split any way), the data and
/// the status byte. `data` is either readable (OUT, DISCARD, WRITE_ZEROES) or writable (IN,
/// GET_ID); `data_writable` says which.
#[derive(Debug, Default)]
pub struct Layout {
    pub header: Vec<Seg>,
    pub readable_data: Vec<Seg>,
    pub writable_data: Vec<Seg>,
    pub readable_data_len: u64,
    pub writable_data_len: u64,
    pub status: Option<u64>,
}

impl Layout {
    /// A layout whose vectors keep `cap` entries without reallocating; reuse it with `clear`.
    pub fn with_capacity(cap: usize) -> Self {
        Layout {
            header: Vec::with_capacity(4),
            readable_data: Vec::with_capacity(cap),
            writable_data: Vec::with_capacity(cap),
            ..Default::default()
        }
    }

    pub fn clear(&mut self) {
        self.header.clear();
        self.readable_data.clear();
        self.writable_data.clear();
        self.readable_data_len = 0;
        self.writable_data_len = 0;
        self.status = None;
    }
}

/// Splits a chain into header, data and status. `max_segs` bounds each data list, so the
/// caller's vectors never grow past what it allocated: a longer chain is an error, answered
/// with IOERR by the caller (the status address, when found, is still set).
pub fn split_chain(
    descs: impl IntoIterator<Item = Desc>,
    max_segs: usize,
    out: &mut Layout,
) -> Result<(), LayoutError> {
    out.clear();
    let mut header_left = u64::from(HEADER_LEN);
    let mut seen_writable = false;
    let mut any = false;
    let mut too_many = false;
    let mut misordered = false;
    // The last writable descriptor: its last byte is the status.
    let mut last_writable: Option<Desc> = None;
    for d in descs {
        any = true;
        if d.writable {
            seen_writable = true;
            if let Some(prev) = last_writable.replace(d) {
                push_seg(
                    &mut out.writable_data,
                    &mut out.writable_data_len,
                    prev.addr,
                    prev.len,
                    max_segs,
                    &mut too_many,
                );
            }
            continue;
        }
        if seen_writable {
            misordered = true;
            continue;
        }
        let mut addr = d.addr;
        let mut len = u64::from(d.len);
        if header_left > 0 && len > 0 {
            let take = header_left.min(len);
            out.header.push(Seg {
                addr,
                len: take as u32,
            });
            if out.header.len() > HEADER_LEN as usize {
                // Only reachable with many zero-progress pieces, which take > 0 forbids; a
                // defensive bound all the same.
                too_many = true;
            }
            header_left -= take;
            addr = addr.wrapping_add(take);
            len -= take;
        }
        if len > 0 {
            push_seg(
                &mut out.readable_data,
                &mut out.readable_data_len,
                addr,
                len as u32,
                max_segs,
                &mut too_many,
            );
        }
    }
    if !any {
        return Err(LayoutError::Empty);
    }
    // The status byte is the last byte of the last writable descriptor; the rest of that
    // descriptor is data.
    if let Some(last) = last_writable.filter(|d| d.len > 0) {
        out.status = Some(last.addr.wrapping_add(u64::from(last.len) - 1));
        if last.len > 1 {
            push_seg(
                &mut out.writable_data,
                &mut out.writable_data_len,
                last.addr,
                last.len - 1,
                max_segs,
                &mut too_many,
            );
        }
    }
    if misordered {
        return Err(LayoutError::ReadableAfterWritable);
    }
    if out.status.is_none() {
        return Err(LayoutError::NoStatus);
    }
    if header_left > 0 {
        return Err(LayoutError::ShortHeader(
            u64::from(HEADER_LEN) - header_left,
        ));
    }
    if too_many {
        return Err(LayoutError::TooManySegments(max_segs));
    }
    Ok(())
}

fn push_seg(
    v: &mut Vec<Seg>,
    total: &mut u64,
    addr: u64,
    len: u32,
    max: usize,
    too_many: &mut bool,
) {
    if len == 0 {
        return;
    }
    if v.len() >= max {
        *too_many = true;
        return;
    }
    v.push(Seg { addr, len });
    *total += u64::from(len);
}

/// The request header, decoded (little endian, §5.2.6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub req_type: u32,
    pub sector: u64,
}

impl Header {
    pub fn from_bytes(b: &[u8; HEADER_LEN as usize]) -> Self {
        Header {
            req_type: u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            sector: u64::from_le_bytes([b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]]),
        }
    }
}

/// One `struct virtio_blk_discard_write_zeroes`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DwzSegment {
    pub sector: u64,
    pub num_sectors: u32,
    pub flags: u32,
}

impl DwzSegment {
    pub fn from_bytes(b: &[u8; DWZ_SEGMENT_LEN as usize]) -> Self {
        DwzSegment {
            sector: u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]),
            num_sectors: u32::from_le_bytes([b[8], b[9], b[10], b[11]]),
            flags: u32::from_le_bytes([b[12], b[13], b[14], b[15]]),
        }
    }
}

/// What the disk looks like to the validator.
#[derive(Clone, Copy, Debug)]
pub struct DiskGeometry {
    /// Capacity in 512-byte sectors.
    pub sectors: u64,
    /// Logical block size in bytes (512 or 4096).
    pub block_size: u32,
    pub read_only: bool,
    /// Whose discard and write-zeroes limits apply.
    pub model: DeviceModel,
}

/// What a valid request asks the engine to do. Offsets and lengths are in bytes and inside
/// the disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read { offset: u64, len: u64 },
    Write { offset: u64, len: u64 },
    Flush,
    GetId,
    Discard { offset: u64, len: u64 },
    WriteZeroes { offset: u64, len: u64, unmap: bool },
}

/// Checks a byte range the way QEMU's `virtio_blk_sect_range_ok` does, plus the logical
/// block size: a multiple of 512 bytes, at most QEMU's largest request, aligned to the
/// logical block size, and inside the disk.
pub fn range_ok(g: &DiskGeometry, sector: u64, bytes: u64) -> bool {
    if bytes % SECTOR_SIZE != 0 || bytes % u64::from(g.block_size) != 0 {
        return false;
    }
    let nb = bytes >> SECTOR_SHIFT;
    if nb > MAX_REQUEST_SECTORS {
        return false;
    }
    let Some(off) = sector.checked_mul(SECTOR_SIZE) else {
        return false;
    };
    if off % u64::from(g.block_size) != 0 {
        return false;
    }
    sector <= g.sectors && nb <= g.sectors - sector
}

/// Validates a request: the header, the data lengths the layout found, and for DISCARD and
/// WRITE_ZEROES the one segment (`dwz`, read by the caller from the readable data when its
/// length is exactly one segment). Returns the operation or the status to answer with.
pub fn validate(
    g: &DiskGeometry,
    h: Header,
    layout: &Layout,
    dwz: Option<DwzSegment>,
) -> Result<Op, u8> {
    match h.req_type {
        T_IN => {
            let len = layout.writable_data_len;
            if layout.readable_data_len != 0 || !range_ok(g, h.sector, len) {
                return Err(S_IOERR);
            }
            Ok(Op::Read {
                offset: h.sector << SECTOR_SHIFT,
                len,
            })
        }
        T_OUT => {
            let len = layout.readable_data_len;
            if g.read_only {
                return Err(S_IOERR);
            }
            if layout.writable_data_len != 0 || !range_ok(g, h.sector, len) {
                return Err(S_IOERR);
            }
            Ok(Op::Write {
                offset: h.sector << SECTOR_SHIFT,
                len,
            })
        }
        T_FLUSH => Ok(Op::Flush),
        T_GET_ID => Ok(Op::GetId),
        T_DISCARD | T_WRITE_ZEROES => {
            if g.read_only {
                return Err(S_IOERR);
            }
            // QEMU's export takes exactly one segment (max_*_seg = 1): more is UNSUPP,
            // fewer bytes than one segment is IOERR.
            if layout.readable_data_len > u64::from(DWZ_SEGMENT_LEN) {
                return Err(S_UNSUPP);
            }
            let Some(seg) = dwz else {
                return Err(S_IOERR);
            };
            let max = if h.req_type == T_DISCARD {
                g.model.max_discard_sectors()
            } else {
                g.model.max_write_zeroes_sectors()
            };
            if seg.num_sectors > max {
                return Err(S_IOERR);
            }
            let len = u64::from(seg.num_sectors) << SECTOR_SHIFT;
            if !range_ok(g, seg.sector, len) {
                return Err(S_IOERR);
            }
            if seg.flags & !WZ_FLAG_UNMAP != 0 {
                return Err(S_UNSUPP);
            }
            let offset = seg.sector << SECTOR_SHIFT;
            if h.req_type == T_DISCARD {
                // §5.2.6.2: the device MUST answer UNSUPP to a discard with the unmap flag.
                if seg.flags & WZ_FLAG_UNMAP != 0 {
                    return Err(S_UNSUPP);
                }
                Ok(Op::Discard { offset, len })
            } else {
                Ok(Op::WriteZeroes {
                    offset,
                    len,
                    unmap: seg.flags & WZ_FLAG_UNMAP != 0,
                })
            }
        }
        _ => Err(S_UNSUPP),
    }
}

/// The GET_ID answer: the serial, truncated to 20 bytes and NUL-padded.
pub fn id_bytes(serial: &str) -> [u8; ID_BYTES] {
    let mut id = [0u8; ID_BYTES];
    let b = serial.as_bytes();
    let n = b.len().min(ID_BYTES);
    id[..n].copy_from_slice(&b[..n]);
    id
}

/// Device feature bits for a disk: the set QEMU 10's vhost-user-blk export offers, or its
/// virtio-blk device's (GEOMETRY for SIZE_MAX; MQ only with more than one queue).
pub fn device_features(read_only: bool, model: DeviceModel, num_queues: u16) -> u64 {
    let (size_or_geometry, mq) = match model {
        DeviceModel::Export => (F_SIZE_MAX, true),
        DeviceModel::VirtioBlk => (F_GEOMETRY, num_queues > 1),
    };
    let mut f = [
        size_or_geometry,
        F_SEG_MAX,
        F_TOPOLOGY,
        F_BLK_SIZE,
        F_FLUSH,
        F_DISCARD,
        F_WRITE_ZEROES,
        F_CONFIG_WCE,
    ]
    .iter()
    .fold(0u64, |acc, b| acc | (1u64 << b));
    if mq {
        f |= 1 << F_MQ;
    }
    if read_only {
        f |= 1 << F_RO;
    }
    f
}

/// A legacy CHS geometry (the GEOMETRY feature's config fields).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Chs {
    pub cylinders: u16,
    pub heads: u8,
    pub sectors: u8,
}

/// The geometry QEMU 10 gives a disk of `capacity_sectors` whose first sector is `mbr`
/// (`hd_geometry_guess` without a geometry probe, which only DASDs answer): a DOS partition
/// table's first partition whose end head is set names the heads (end head + 1) and sectors
/// (its end sector's low 6 bits) if that gives 1 to 16,383 cylinders; with at most 16 heads
/// that is the geometry, else (a BIOS's LBA translation) and without a table the size
/// decides: 16 heads, 63 sectors, 2 to 16,383 cylinders.
pub fn guess_chs(capacity_sectors: u64, mbr: Option<&[u8; 512]>) -> Chs {
    let by_size = Chs {
        cylinders: (capacity_sectors / (16 * 63)).clamp(2, 16383) as u16,
        heads: 16,
        sectors: 63,
    };
    let Some(b) = mbr.filter(|b| b[510] == 0x55 && b[511] == 0xaa) else {
        return by_size;
    };
    for i in 0..4 {
        let p = &b[0x1be + 16 * i..0x1be + 16 * (i + 1)];
        let nr_sects = u32::from_le_bytes([p[12], p[13], p[14], p[15]]);
        let end_head = p[5];
        if nr_sects == 0 || end_head == 0 {
            continue;
        }
        let heads = u64::from(end_head) + 1;
        let sectors = u64::from(p[6] & 63);
        if sectors == 0 {
            continue;
        }
        let cylinders = capacity_sectors / (heads * sectors);
        if !(1..=16383).contains(&cylinders) {
            continue;
        }
        if heads > 16 {
            return by_size;
        }
        return Chs {
            cylinders: cylinders as u16,
            heads: heads as u8,
            sectors: sectors as u8,
        };
    }
    by_size
}

/// Size of `struct virtio_blk_config` up to and including `write_zeroes_may_unmap` and its
/// padding (§5.2.4).
pub const CONFIG_LEN: usize = 60;
/// Offset of the `writeback` byte in the config space.
pub const CONFIG_WRITEBACK_OFFSET: usize = 32;

/// The config space values; `to_bytes` lays them out as `struct virtio_blk_config`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlkConfig {
    pub capacity: u64,
    pub size_max: u32,
    pub seg_max: u32,
    /// Legacy CHS geometry (GEOMETRY): cylinders, heads, sectors per track.
    pub cylinders: u16,
    pub heads: u8,
    pub sectors: u8,
    pub blk_size: u32,
    pub physical_block_exp: u8,
    pub min_io_size: u16,
    pub opt_io_size: u32,
    pub writeback: u8,
    pub num_queues: u16,
    pub max_discard_sectors: u32,
    pub max_discard_seg: u32,
    pub discard_sector_alignment: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_write_zeroes_seg: u32,
    pub write_zeroes_may_unmap: u8,
}

impl BlkConfig {
    /// The values QEMU 10's export reports for a disk (vu_blk_initialize_config).
    pub fn qemu_like(capacity_sectors: u64, blk_size: u32, num_queues: u16) -> Self {
        BlkConfig {
            capacity: capacity_sectors,
            size_max: 0,
            seg_max: SEG_MAX,
            cylinders: 0,
            heads: 0,
            sectors: 0,
            blk_size,
            physical_block_exp: 0,
            min_io_size: 1,
            opt_io_size: 1,
            writeback: 0,
            num_queues,
            max_discard_sectors: MAX_DISCARD_SECTORS,
            max_discard_seg: 1,
            discard_sector_alignment: blk_size >> SECTOR_SHIFT,
            max_write_zeroes_sectors: MAX_WRITE_ZEROES_SECTORS,
            max_write_zeroes_seg: 1,
            write_zeroes_may_unmap: 0,
        }
    }

    /// [`BlkConfig::virtio_blk_like`] with the CHS geometry `chs` (cylinders, heads, sectors)
    /// instead of the size-based guess ([`guess_chs`] from the disk's first sector gives
    /// QEMU's).
    pub fn virtio_blk_with_chs(
        capacity_sectors: u64,
        blk_size: u32,
        num_queues: u16,
        chs: Chs,
    ) -> Self {
        BlkConfig {
            cylinders: chs.cylinders,
            heads: chs.heads,
            sectors: chs.sectors,
            ..Self::virtio_blk_like(capacity_sectors, blk_size, num_queues)
        }
    }

    /// The values QEMU 10's virtio-blk device reports for a disk of `capacity_sectors` with
    /// its defaults (`virtio_blk_update_config`): 256-entry rings, no I/O size hints,
    /// `BDRV_REQUEST_MAX_SECTORS` discards and write-zeroes, and the CHS geometry QEMU guesses
    /// for a disk without a partition table (16 heads, 63 sectors, 2 to 16,383 cylinders).
    pub fn virtio_blk_like(capacity_sectors: u64, blk_size: u32, num_queues: u16) -> Self {
        BlkConfig {
            capacity: capacity_sectors,
            size_max: 0,
            seg_max: VIRTIO_BLK_SEG_MAX,
            cylinders: (capacity_sectors / (16 * 63)).clamp(2, 16383) as u16,
            heads: 16,
            sectors: 63,
            blk_size,
            physical_block_exp: 0,
            min_io_size: 0,
            opt_io_size: 0,
            writeback: 0,
            num_queues,
            max_discard_sectors: VIRTIO_BLK_MAX_DWZ_SECTORS,
            max_discard_seg: 1,
            discard_sector_alignment: blk_size >> SECTOR_SHIFT,
            max_write_zeroes_sectors: VIRTIO_BLK_MAX_DWZ_SECTORS,
            max_write_zeroes_seg: 1,
            write_zeroes_may_unmap: 1,
        }
    }

    pub fn to_bytes(&self) -> [u8; CONFIG_LEN] {
        let mut b = [0u8; CONFIG_LEN];
        b[0..8].copy_from_slice(&self.capacity.to_le_bytes());
        b[8..12].copy_from_slice(&self.size_max.to_le_bytes());
        b[12..16].copy_from_slice(&self.seg_max.to_le_bytes());
        b[16..18].copy_from_slice(&self.cylinders.to_le_bytes());
        b[18] = self.heads;
        b[19] = self.sectors;
        b[20..24].copy_from_slice(&self.blk_size.to_le_bytes());
        b[24] = self.physical_block_exp;
        // 25: alignment_offset = 0.
        b[26..28].copy_from_slice(&self.min_io_size.to_le_bytes());
        b[28..32].copy_from_slice(&self.opt_io_size.to_le_bytes());
        b[CONFIG_WRITEBACK_OFFSET] = self.writeback;
        b[34..36].copy_from_slice(&self.num_queues.to_le_bytes());
        b[36..40].copy_from_slice(&self.max_discard_sectors.to_le_bytes());
        b[40..44].copy_from_slice(&self.max_discard_seg.to_le_bytes());
        b[44..48].copy_from_slice(&self.discard_sector_alignment.to_le_bytes());
        b[48..52].copy_from_slice(&self.max_write_zeroes_sectors.to_le_bytes());
        b[52..56].copy_from_slice(&self.max_write_zeroes_seg.to_le_bytes());
        b[56] = self.write_zeroes_may_unmap;
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(addr: u64, len: u32) -> Desc {
        Desc {
            addr,
            len,
            writable: false,
        }
    }
    fn w(addr: u64, len: u32) -> Desc {
        Desc {
            addr,
            len,
            writable: true,
        }
    }
    const G: DiskGeometry = DiskGeometry {
        sectors: 2048,
        block_size: 512,
        read_only: false,
        model: DeviceModel::Export,
    };

    fn layout(descs: &[Desc]) -> Result<Layout, LayoutError> {
        let mut l = Layout::with_capacity(8);
        split_chain(descs.iter().copied(), 8, &mut l).map(|_| l)
    }

    fn hdr(t: u32, sector: u64) -> Header {
        Header {
            req_type: t,
            sector,
        }
    }

    #[test]
    fn classic_three_descriptor_read() {
        let l = layout(&[r(0x1000, 16), w(0x2000, 4096), w(0x3000, 1)]).unwrap();
        assert_eq!(
            l.header,
            vec![Seg {
                addr: 0x1000,
                len: 16
            }]
        );
        assert_eq!(
            l.writable_data,
            vec![Seg {
                addr: 0x2000,
                len: 4096
            }]
        );
        assert_eq!(l.writable_data_len, 4096);
        assert_eq!(l.status, Some(0x3000));
        assert_eq!(
            validate(&G, hdr(T_IN, 8), &l, None),
            Ok(Op::Read {
                offset: 4096,
                len: 4096
            })
        );
    }

    #[test]
    fn header_split_and_merged_with_data_and_status() {
        // header split 3+13 bytes, its tail merged with the write data; data and status share
        // the last writable descriptor.
        let l = layout(&[r(0x100, 3), r(0x200, 13 + 512)]).unwrap_err();
        assert_eq!(l, LayoutError::NoStatus);
        let l = layout(&[r(0x100, 3), r(0x200, 13 + 512), w(0x900, 1)]).unwrap();
        assert_eq!(
            l.header,
            vec![
                Seg {
                    addr: 0x100,
                    len: 3
                },
                Seg {
                    addr: 0x200,
                    len: 13
                }
            ]
        );
        assert_eq!(
            l.readable_data,
            vec![Seg {
                addr: 0x20d,
                len: 512
            }]
        );
        let l = layout(&[r(0x100, 16), w(0x400, 513)]).unwrap();
        assert_eq!(
            l.writable_data,
            vec![Seg {
                addr: 0x400,
                len: 512
            }]
        );
        assert_eq!(l.status, Some(0x400 + 512));
    }

    #[test]
    fn zero_length_descriptors_are_skipped() {
        let l = layout(&[r(0x100, 0), r(0x100, 16), w(0x0, 0), w(0x500, 1)]).unwrap();
        assert_eq!(l.writable_data_len, 0);
        assert_eq!(l.status, Some(0x500));
    }

    #[test]
    fn malformed_layouts() {
        assert_eq!(layout(&[]).unwrap_err(), LayoutError::Empty);
        assert_eq!(
            layout(&[r(0, 8), w(0x10, 1)]).unwrap_err(),
            LayoutError::ShortHeader(8)
        );
        assert_eq!(
            layout(&[r(0, 16), w(0x10, 1), r(0x20, 1)]).unwrap_err(),
            LayoutError::ReadableAfterWritable
        );
        assert_eq!(
            layout(&[r(0, 16), w(0x10, 0)]).unwrap_err(),
            LayoutError::NoStatus
        );
        let many: Vec<Desc> = (0..20).map(|i| w(i * 0x1000, 512)).collect();
        let mut d = vec![r(0, 16)];
        d.extend(many);
        let mut l = Layout::with_capacity(8);
        assert_eq!(
            split_chain(d.iter().copied(), 8, &mut l).unwrap_err(),
            LayoutError::TooManySegments(8)
        );
        // The status byte is still known, so the caller can answer IOERR.
        assert!(l.status.is_some());
        assert!(l.writable_data.len() <= 8);
    }

    #[test]
    fn four_gib_descriptor_lengths_do_not_overflow() {
        let l = layout(&[r(0, 16), w(0x1000, u32::MAX), w(0x1000, u32::MAX)]).unwrap();
        assert_eq!(l.writable_data_len, u64::from(u32::MAX) * 2 - 1);
        assert_eq!(validate(&G, hdr(T_IN, 0), &l, None), Err(S_IOERR));
    }

    #[test]
    fn validation_table() {
        let rd = |n: u32| layout(&[r(0, 16), w(0x1000, n), w(0x9000, 1)]).unwrap();
        let wr = |n: u32| layout(&[r(0, 16), r(0x1000, n), w(0x9000, 1)]).unwrap();
        let bare = || layout(&[r(0, 16), w(0x9000, 1)]).unwrap();
        let ro = DiskGeometry {
            read_only: true,
            ..G
        };
        let g4k = DiskGeometry {
            block_size: 4096,
            ..G
        };
        type Case = (&'static str, DiskGeometry, Header, Layout, Result<Op, u8>);
        let cases: Vec<Case> = vec![
            (
                "read last sector",
                G,
                hdr(T_IN, 2047),
                rd(512),
                Ok(Op::Read {
                    offset: 2047 * 512,
                    len: 512,
                }),
            ),
            ("read past end", G, hdr(T_IN, 2047), rd(1024), Err(S_IOERR)),
            (
                "read sector huge",
                G,
                hdr(T_IN, u64::MAX),
                rd(512),
                Err(S_IOERR),
            ),
            (
                "read sector overflow mul",
                G,
                hdr(T_IN, u64::MAX / 256),
                rd(512),
                Err(S_IOERR),
            ),
            (
                "read not 512 multiple",
                G,
                hdr(T_IN, 0),
                rd(100),
                Err(S_IOERR),
            ),
            (
                "read with readable data",
                G,
                hdr(T_IN, 0),
                wr(512),
                Err(S_IOERR),
            ),
            (
                "zero-length read",
                G,
                hdr(T_IN, 0),
                bare(),
                Ok(Op::Read { offset: 0, len: 0 }),
            ),
            (
                "write",
                G,
                hdr(T_OUT, 1),
                wr(1024),
                Ok(Op::Write {
                    offset: 512,
                    len: 1024,
                }),
            ),
            ("write read-only", ro, hdr(T_OUT, 1), wr(512), Err(S_IOERR)),
            (
                "write with writable data",
                G,
                hdr(T_OUT, 0),
                rd(512),
                Err(S_IOERR),
            ),
            ("write at end+1", G, hdr(T_OUT, 2048), wr(512), Err(S_IOERR)),
            (
                "4k disk unaligned sector",
                g4k,
                hdr(T_IN, 1),
                rd(4096),
                Err(S_IOERR),
            ),
            (
                "4k disk short len",
                g4k,
                hdr(T_IN, 8),
                rd(512),
                Err(S_IOERR),
            ),
            (
                "4k disk ok",
                g4k,
                hdr(T_IN, 8),
                rd(4096),
                Ok(Op::Read {
                    offset: 4096,
                    len: 4096,
                }),
            ),
            ("flush", G, hdr(T_FLUSH, 0), bare(), Ok(Op::Flush)),
            (
                "flush on read-only",
                ro,
                hdr(T_FLUSH, 0),
                bare(),
                Ok(Op::Flush),
            ),
            ("get id", G, hdr(T_GET_ID, 0), rd(20), Ok(Op::GetId)),
            ("unknown type", G, hdr(99, 0), bare(), Err(S_UNSUPP)),
            (
                "secure erase unsupported",
                G,
                hdr(14, 0),
                bare(),
                Err(S_UNSUPP),
            ),
        ];
        for (name, g, h, l, want) in cases {
            assert_eq!(validate(&g, h, &l, None), want, "{name}");
        }
    }

    #[test]
    fn discard_and_write_zeroes_table() {
        let one = || layout(&[r(0, 32), w(0x9000, 1)]).unwrap();
        let two = || layout(&[r(0, 48), w(0x9000, 1)]).unwrap();
        let short = || layout(&[r(0, 24), w(0x9000, 1)]).unwrap();
        let seg = |sector, n, flags| {
            Some(DwzSegment {
                sector,
                num_sectors: n,
                flags,
            })
        };
        let big_export = DiskGeometry {
            sectors: 1 << 24,
            ..G
        };
        let big_vblk = DiskGeometry {
            model: DeviceModel::VirtioBlk,
            ..big_export
        };
        let ro = DiskGeometry {
            read_only: true,
            ..G
        };
        type Case = (
            &'static str,
            DiskGeometry,
            u32,
            Layout,
            Option<DwzSegment>,
            Result<Op, u8>,
        );
        let cases: Vec<Case> = vec![
            (
                "discard",
                G,
                T_DISCARD,
                one(),
                seg(8, 8, 0),
                Ok(Op::Discard {
                    offset: 4096,
                    len: 4096,
                }),
            ),
            (
                "discard unmap flag",
                G,
                T_DISCARD,
                one(),
                seg(8, 8, 1),
                Err(S_UNSUPP),
            ),
            (
                "discard unknown flag",
                G,
                T_DISCARD,
                one(),
                seg(8, 8, 2),
                Err(S_UNSUPP),
            ),
            (
                "discard two segments",
                G,
                T_DISCARD,
                two(),
                None,
                Err(S_UNSUPP),
            ),
            (
                "discard short segment",
                G,
                T_DISCARD,
                short(),
                None,
                Err(S_IOERR),
            ),
            (
                "discard too many sectors",
                G,
                T_DISCARD,
                one(),
                seg(0, MAX_DISCARD_SECTORS + 1, 0),
                Err(S_IOERR),
            ),
            (
                "discard past end",
                G,
                T_DISCARD,
                one(),
                seg(2040, 16, 0),
                Err(S_IOERR),
            ),
            (
                "discard read-only",
                ro,
                T_DISCARD,
                one(),
                seg(0, 8, 0),
                Err(S_IOERR),
            ),
            (
                "write zeroes",
                G,
                T_WRITE_ZEROES,
                one(),
                seg(0, 8, 0),
                Ok(Op::WriteZeroes {
                    offset: 0,
                    len: 4096,
                    unmap: false,
                }),
            ),
            (
                "write zeroes unmap",
                G,
                T_WRITE_ZEROES,
                one(),
                seg(0, 8, 1),
                Ok(Op::WriteZeroes {
                    offset: 0,
                    len: 4096,
                    unmap: true,
                }),
            ),
            (
                "write zeroes bad flag",
                G,
                T_WRITE_ZEROES,
                one(),
                seg(0, 8, 4),
                Err(S_UNSUPP),
            ),
            (
                "write zeroes sector overflow",
                G,
                T_WRITE_ZEROES,
                one(),
                seg(u64::MAX, 8, 0),
                Err(S_IOERR),
            ),
            // The limits are the device model's: QEMU's export refuses more than 32,768
            // sectors, its virtio-blk device takes up to BDRV_REQUEST_MAX_SECTORS.
            (
                "discard over the export's limit (export)",
                big_export,
                T_DISCARD,
                one(),
                seg(0, MAX_DISCARD_SECTORS + 1, 0),
                Err(S_IOERR),
            ),
            (
                "discard over the export's limit (virtio-blk)",
                big_vblk,
                T_DISCARD,
                one(),
                seg(0, MAX_DISCARD_SECTORS + 1, 0),
                Ok(Op::Discard {
                    offset: 0,
                    len: u64::from(MAX_DISCARD_SECTORS + 1) << SECTOR_SHIFT,
                }),
            ),
            (
                "discard at virtio-blk's limit",
                big_vblk,
                T_DISCARD,
                one(),
                seg(0, VIRTIO_BLK_MAX_DWZ_SECTORS, 0),
                Ok(Op::Discard {
                    offset: 0,
                    len: u64::from(VIRTIO_BLK_MAX_DWZ_SECTORS) << SECTOR_SHIFT,
                }),
            ),
            (
                "discard over virtio-blk's limit",
                big_vblk,
                T_DISCARD,
                one(),
                seg(0, VIRTIO_BLK_MAX_DWZ_SECTORS + 1, 0),
                Err(S_IOERR),
            ),
            (
                "write zeroes over the export's limit (export)",
                big_export,
                T_WRITE_ZEROES,
                one(),
                seg(0, MAX_WRITE_ZEROES_SECTORS + 1, 0),
                Err(S_IOERR),
            ),
            (
                "write zeroes over the export's limit (virtio-blk)",
                big_vblk,
                T_WRITE_ZEROES,
                one(),
                seg(0, MAX_WRITE_ZEROES_SECTORS + 1, 0),
                Ok(Op::WriteZeroes {
                    offset: 0,
                    len: u64::from(MAX_WRITE_ZEROES_SECTORS + 1) << SECTOR_SHIFT,
                    unmap: false,
                }),
            ),
            (
                "write zeroes over virtio-blk's limit",
                big_vblk,
                T_WRITE_ZEROES,
                one(),
                seg(0, VIRTIO_BLK_MAX_DWZ_SECTORS + 1, 0),
                Err(S_IOERR),
            ),
        ];
        for (name, g, t, l, s, want) in cases {
            assert_eq!(validate(&g, hdr(t, 0), &l, s), want, "{name}");
        }
    }

    #[test]
    fn header_and_segment_decoding() {
        let mut b = [0u8; 16];
        b[0] = 1;
        b[8..16].copy_from_slice(&0x0102_0304_0506_0708u64.to_le_bytes());
        assert_eq!(
            Header::from_bytes(&b),
            Header {
                req_type: 1,
                sector: 0x0102_0304_0506_0708
            }
        );
        let mut s = [0u8; 16];
        s[0] = 9;
        s[8] = 3;
        s[12] = 1;
        assert_eq!(
            DwzSegment::from_bytes(&s),
            DwzSegment {
                sector: 9,
                num_sectors: 3,
                flags: 1
            }
        );
    }

    #[test]
    fn id_is_padded_and_truncated() {
        assert_eq!(&id_bytes("abc")[..4], b"abc\0");
        assert_eq!(
            id_bytes("0123456789abcdefghijKLMN"),
            *b"0123456789abcdefghij"
        );
    }

    #[test]
    fn config_layout() {
        let c = BlkConfig::qemu_like(2048, 4096, 2).to_bytes();
        assert_eq!(u64::from_le_bytes(c[0..8].try_into().unwrap()), 2048);
        assert_eq!(u32::from_le_bytes(c[12..16].try_into().unwrap()), 126);
        assert_eq!(u32::from_le_bytes(c[20..24].try_into().unwrap()), 4096);
        assert_eq!(u16::from_le_bytes(c[34..36].try_into().unwrap()), 2);
        assert_eq!(u32::from_le_bytes(c[44..48].try_into().unwrap()), 8);
    }

    /// QEMU 10's virtio-blk device for a 64 MiB disk with two queues, as a Linux guest saw
    /// it next to the converted twin (integration/tests/libvirt.rs): features, then the
    /// config space.
    #[test]
    fn the_virtio_blk_model_is_qemus_virtio_blk() {
        let f = device_features(false, DeviceModel::VirtioBlk, 2);
        for (bit, on) in [
            (F_SIZE_MAX, false),
            (F_SEG_MAX, true),
            (F_GEOMETRY, true),
            (F_RO, false),
            (F_BLK_SIZE, true),
            (F_FLUSH, true),
            (F_TOPOLOGY, true),
            (F_CONFIG_WCE, true),
            (F_MQ, true),
            (F_DISCARD, true),
            (F_WRITE_ZEROES, true),
        ] {
            assert_eq!(f & (1 << bit) != 0, on, "feature bit {bit}");
        }
        // One queue: QEMU's virtio-blk offers no MQ.
        assert_eq!(
            device_features(false, DeviceModel::VirtioBlk, 1) & (1 << F_MQ),
            0
        );
        assert_ne!(
            device_features(true, DeviceModel::VirtioBlk, 1) & (1 << F_RO),
            0
        );
        // The export keeps its own set.
        let e = device_features(false, DeviceModel::Export, 1);
        assert_ne!(e & (1 << F_SIZE_MAX), 0);
        assert_eq!(e & (1 << F_GEOMETRY), 0);

        let c = BlkConfig::virtio_blk_like(131_072, 512, 2);
        let b = c.to_bytes();
        assert_eq!(u64::from_le_bytes(b[0..8].try_into().unwrap()), 131_072);
        assert_eq!(
            u32::from_le_bytes(b[8..12].try_into().unwrap()),
            0,
            "size_max"
        );
        assert_eq!(
            u32::from_le_bytes(b[12..16].try_into().unwrap()),
            254,
            "seg_max"
        );
        // 131,072 / (16 * 63) = 130 cylinders of 16 heads and 63 sectors.
        assert_eq!(u16::from_le_bytes(b[16..18].try_into().unwrap()), 130);
        assert_eq!((b[18], b[19]), (16, 63));
        assert_eq!(u32::from_le_bytes(b[20..24].try_into().unwrap()), 512);
        assert_eq!(&b[24..32], &[0u8; 8], "no topology hints");
        assert_eq!(u16::from_le_bytes(b[34..36].try_into().unwrap()), 2);
        for (at, want, what) in [
            (36, 4_194_303u32, "max_discard_sectors"),
            (40, 1, "max_discard_seg"),
            (44, 1, "discard_sector_alignment"),
            (48, 4_194_303, "max_write_zeroes_sectors"),
            (52, 1, "max_write_zeroes_seg"),
        ] {
            assert_eq!(
                u32::from_le_bytes(b[at..at + 4].try_into().unwrap()),
                want,
                "{what}"
            );
        }
        assert_eq!(b[56], 1, "write_zeroes_may_unmap");
        // The cylinder count stays within CHS's range.
        assert_eq!(BlkConfig::virtio_blk_like(100, 512, 1).cylinders, 2);
        assert_eq!(BlkConfig::virtio_blk_like(1 << 40, 512, 1).cylinders, 16383);
    }

    /// A DOS partition table with one partition ending at (`end_head`, `end_sector`).
    fn mbr(end_head: u8, end_sector: u8, nr_sects: u32, sig: bool) -> [u8; 512] {
        let mut b = [0u8; 512];
        let p = 0x1be;
        b[p + 5] = end_head;
        b[p + 6] = end_sector;
        b[p + 12..p + 16].copy_from_slice(&nr_sects.to_le_bytes());
        if sig {
            b[510] = 0x55;
            b[511] = 0xaa;
        }
        b
    }

    /// QEMU 10's `hd_geometry_guess` for a virtio-blk disk, case by case.
    #[test]
    fn the_geometry_is_guessed_as_qemu_does() {
        let c = |cylinders, heads, sectors| Chs {
            cylinders,
            heads,
            sectors,
        };
        let size = 131_072; // 64 MiB
        for (what, mbr, want) in [
            ("no first sector", None, c(130, 16, 63)),
            (
                "no signature",
                Some(mbr(15, 63, 1000, false)),
                c(130, 16, 63),
            ),
            ("a blank table", Some(mbr(0, 0, 0, true)), c(130, 16, 63)),
            // An old-style table: 16 heads, 32 sectors (the partition's end sector).
            (
                "16 heads, 32 sectors",
                Some(mbr(15, 32, 1000, true)),
                c(256, 16, 32),
            ),
            (
                "4 heads, 32 sectors",
                Some(mbr(3, 32, 1000, true)),
                c(1024, 4, 32),
            ),
            // fdisk's 255 heads: a BIOS translation, so the size decides.
            ("255 heads", Some(mbr(254, 63, 1000, true)), c(130, 16, 63)),
            // The sector's high bits belong to the cylinder.
            (
                "sector with cylinder bits",
                Some(mbr(15, 0xc0 | 32, 1000, true)),
                c(256, 16, 32),
            ),
            ("end sector 0", Some(mbr(15, 0, 1000, true)), c(130, 16, 63)),
            (
                "no sectors in the partition",
                Some(mbr(15, 32, 0, true)),
                c(130, 16, 63),
            ),
        ] {
            assert_eq!(guess_chs(size, mbr.as_ref()), want, "{what}");
        }
        // Too many cylinders for the table's geometry: the size decides (clamped).
        assert_eq!(
            guess_chs(1 << 32, Some(&mbr(1, 1, 10, true))),
            c(16383, 16, 63)
        );
        // Too few (a disk smaller than one cylinder of the table's geometry).
        assert_eq!(guess_chs(100, Some(&mbr(15, 63, 10, true))), c(2, 16, 63));
        // A later partition may name the geometry when the first names none.
        let mut b = mbr(0, 0, 0, true);
        b[0x1ce + 5] = 7;
        b[0x1ce + 6] = 32;
        b[0x1ce + 12] = 1;
        assert_eq!(guess_chs(size, Some(&b)), c(512, 8, 32));
    }
}
