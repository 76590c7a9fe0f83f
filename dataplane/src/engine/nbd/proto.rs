//! The NBD protocol's numbers (NBD protocol spec): the option phase's ("Fixed newstyle
//! negotiation"), shared by acceld's NBD client and the QMP proxy's filter of management's
//! NBD connections, and the transmission phase's, acceld's client alone.

/// The server's greeting: "NBDMAGIC", then "IHAVEOPT" (also each option's magic).
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// The magic of each option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
/// Set in every error reply type.
pub const REP_ERR_BIT: u32 = 1 << 31;
pub const REP_ERR_POLICY: u32 = REP_ERR_BIT | 2;
pub const REP_ERR_INVALID: u32 = REP_ERR_BIT | 3;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR_BIT | 6;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR_BIT | 9;

// The transmission phase ("Transmission phase"): acceld's client only.

pub(super) const REQUEST_MAGIC: u32 = 0x2560_9513;
pub(super) const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub(super) const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

pub(super) const FLAG_FIXED_NEWSTYLE: u16 = 1;
pub(super) const FLAG_NO_ZEROES: u16 = 2;

pub(super) const INFO_EXPORT: u16 = 0;
pub(super) const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags (server side).
pub const TF_READ_ONLY: u16 = 1 << 1;
pub const TF_SEND_FLUSH: u16 = 1 << 2;
pub const TF_SEND_FUA: u16 = 1 << 3;
pub const TF_SEND_TRIM: u16 = 1 << 5;
pub const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TF_SEND_DF: u16 = 1 << 7;
pub const TF_CAN_MULTI_CONN: u16 = 1 << 8;

pub(super) const CMD_READ: u16 = 0;
pub(super) const CMD_WRITE: u16 = 1;
pub(super) const CMD_DISC: u16 = 2;
pub(super) const CMD_FLUSH: u16 = 3;
pub(super) const CMD_TRIM: u16 = 4;
pub(super) const CMD_WRITE_ZEROES: u16 = 6;
pub(super) const CMD_FLAG_FUA: u16 = 1;
pub(super) const CMD_FLAG_NO_HOLE: u16 = 2;
/// "Don't fragment": the read's data in one OFFSET_DATA chunk, holes included. QEMU then
/// skips the block-status walk it does for every sparse read (nbd/server.c).
pub(super) const CMD_FLAG_DF: u16 = 4;

pub(super) const REPLY_FLAG_DONE: u16 = 1;
pub(super) const REPLY_TYPE_NONE: u16 = 0;
pub(super) const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub(super) const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub(super) const REPLY_TYPE_ERROR_BIT: u16 = 1 << 15;
