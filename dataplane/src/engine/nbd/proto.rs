//! The NBD option phase's numbers (NBD protocol spec, "Fixed newstyle negotiation"), shared by
//! acceld's NBD client and the QMP proxy's filter of management's NBD connections.

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
