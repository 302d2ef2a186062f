//! The export blob: what an importer needs to read one registered storage.
//!
//! Version 1, little-endian, 36-byte header then two variable fields:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `TWXB` |
//! | 4 | 2 | version (1) |
//! | 6 | 1 | engine (1 = UCX) |
//! | 7 | 1 | flags (0; no bit defined) |
//! | 8 | 8 | export id (the exporter's name for the release) |
//! | 16 | 8 | address of the storage in the exporter |
//! | 24 | 8 | length in bytes (1 ..= [`MAX_EXPORT_LEN`]) |
//! | 32 | 2 | worker address length *w* (1 ..= [`MAX_WORKER_ADDRESS_LEN`]) |
//! | 34 | 2 | remote key length *r* (1 ..= [`MAX_RKEY_LEN`]) |
//! | 36 | *w* | the exporter's worker address |
//! | 36 + *w* | *r* | the packed remote key |
//!
//! The blob must end exactly there. [`ExportBlob::decode`] copies the bytes it is given
//! first, then validates the copy, so a peer that still holds the source cannot change a
//! field between check and use.

use crate::error::BlobError;

/// Blob format version written and accepted by this build.
pub const BLOB_VERSION: u16 = 1;
/// Largest storage a blob may describe (1 TiB): a guard against absurd lengths, far above
/// any tensor a host can hold.
pub const MAX_EXPORT_LEN: u64 = 1 << 40;
/// Largest worker address accepted (UCX's are 77–180 bytes over tcp/sm here).
pub const MAX_WORKER_ADDRESS_LEN: usize = 1024;
/// Largest packed remote key accepted (UCX's are 9–11 bytes over tcp/sm here).
pub const MAX_RKEY_LEN: usize = 256;

const MAGIC: [u8; 4] = *b"TWXB";
const HEADER_LEN: usize = 36;

/// The bulk-transfer engine a blob was made by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// UCX (`ucp_get_nbx` against a `ucp_mem_map` registration).
    Ucx,
}

impl Engine {
    fn to_byte(self) -> u8 {
        match self {
            Engine::Ucx => 1,
        }
    }

    fn from_byte(b: u8) -> Result<Self, BlobError> {
        match b {
            1 => Ok(Engine::Ucx),
            other => Err(BlobError::UnknownEngine(other)),
        }
    }
}

/// A validated export blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportBlob {
    engine: Engine,
    export_id: u64,
    address: u64,
    length: u64,
    worker_address: Vec<u8>,
    rkey: Vec<u8>,
}

impl ExportBlob {
    /// Builds a blob from an engine's fields, checking them as `decode` would.
    pub(crate) fn new(
        engine: Engine,
        export_id: u64,
        address: u64,
        length: u64,
        worker_address: Vec<u8>,
        rkey: Vec<u8>,
    ) -> Result<Self, BlobError> {
        let blob = ExportBlob {
            engine,
            export_id,
            address,
            length,
            worker_address,
            rkey,
        };
        blob.validate()?;
        Ok(blob)
    }

    /// A blob from fields that travelled separately (e.g. as the fields of an RPC value),
    /// checked exactly as [`ExportBlob::decode`] checks an encoded one. Each variable field
    /// is bounds-checked before it is copied.
    pub fn from_parts(
        engine: Engine,
        export_id: u64,
        address: u64,
        length: u64,
        worker_address: &[u8],
        rkey: &[u8],
    ) -> Result<Self, BlobError> {
        let w = worker_address.len();
        if w == 0 || w > MAX_WORKER_ADDRESS_LEN {
            return Err(BlobError::BadWorkerAddress(w));
        }
        if rkey.is_empty() || rkey.len() > MAX_RKEY_LEN {
            return Err(BlobError::BadRkey("length out of range"));
        }
        ExportBlob::new(
            engine,
            export_id,
            address,
            length,
            worker_address.to_vec(),
            rkey.to_vec(),
        )
    }

    /// The engine that made the export.
    pub fn engine(&self) -> Engine {
        self.engine
    }
    /// The exporter's id for this export: what the importer sends back to release it.
    pub fn export_id(&self) -> u64 {
        self.export_id
    }
    /// Address of the storage in the exporter's address space.
    pub fn address(&self) -> u64 {
        self.address
    }
    /// Length of the storage in bytes.
    pub fn length(&self) -> u64 {
        self.length
    }
    /// The exporter's worker address (engine-specific bytes).
    pub fn worker_address(&self) -> &[u8] {
        &self.worker_address
    }
    /// The packed remote key (engine-specific bytes).
    pub fn rkey(&self) -> &[u8] {
        &self.rkey
    }

    /// Serialises the blob (see the module documentation for the layout).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + self.worker_address.len() + self.rkey.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&BLOB_VERSION.to_le_bytes());
        out.push(self.engine.to_byte());
        out.push(0);
        out.extend_from_slice(&self.export_id.to_le_bytes());
        out.extend_from_slice(&self.address.to_le_bytes());
        out.extend_from_slice(&self.length.to_le_bytes());
        // Lengths fit: `validate` bounds both far below u16::MAX.
        out.extend_from_slice(&(self.worker_address.len() as u16).to_le_bytes());
        out.extend_from_slice(&(self.rkey.len() as u16).to_le_bytes());
        out.extend_from_slice(&self.worker_address);
        out.extend_from_slice(&self.rkey);
        out
    }

    /// Copies `bytes`, then parses and validates the copy. Every rejection is a named
    /// [`BlobError`].
    pub fn decode(bytes: &[u8]) -> Result<Self, BlobError> {
        let copy = bytes.to_vec();
        let b = copy.as_slice();
        if b.len() < HEADER_LEN {
            return Err(BlobError::Truncated {
                needed: HEADER_LEN,
                got: b.len(),
            });
        }
        if b[0..4] != MAGIC {
            return Err(BlobError::BadMagic);
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != BLOB_VERSION {
            return Err(BlobError::UnsupportedVersion(version));
        }
        let engine = Engine::from_byte(b[6])?;
        if b[7] != 0 {
            return Err(BlobError::UnknownFlags(b[7]));
        }
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        let export_id = u64_at(8);
        let address = u64_at(16);
        let length = u64_at(24);
        let w = u16::from_le_bytes([b[32], b[33]]) as usize;
        let r = u16::from_le_bytes([b[34], b[35]]) as usize;
        let needed = HEADER_LEN + w + r;
        if b.len() < needed {
            return Err(BlobError::Truncated {
                needed,
                got: b.len(),
            });
        }
        if b.len() > needed {
            return Err(BlobError::TrailingBytes {
                extra: b.len() - needed,
            });
        }
        ExportBlob::new(
            engine,
            export_id,
            address,
            length,
            b[HEADER_LEN..HEADER_LEN + w].to_vec(),
            b[HEADER_LEN + w..needed].to_vec(),
        )
    }

    fn validate(&self) -> Result<(), BlobError> {
        if self.length == 0
            || self.length > MAX_EXPORT_LEN
            || self.address.checked_add(self.length).is_none()
        {
            return Err(BlobError::BadLength(self.length));
        }
        let w = self.worker_address.len();
        if w == 0 || w > MAX_WORKER_ADDRESS_LEN {
            return Err(BlobError::BadWorkerAddress(w));
        }
        match self.engine {
            Engine::Ucx => {
                // UCX aborts (`ucs_assertv_always`) on an address whose low nibble is not a
                // version it knows: `UCP_OBJECT_VERSION_V1` (0, the default) or `_V2` (1).
                if self.worker_address[0] & 0x0f > 1 {
                    return Err(BlobError::BadWorkerAddress(w));
                }
                check_ucx_rkey(&self.rkey)
            }
        }
    }
}

/// Structural check of a UCX 1.22 packed remote key (`ucp_rkey_pack`'s output, parsed by
/// `ucp_ep_rkey_unpack_internal` without a length): a little-endian `u64` map of memory
/// domain indices, a memory-type byte, then per set bit a size byte and that many bytes;
/// UCX may append a trailer (system device and distances) which is left to UCX, read from
/// a zero-padded copy (see `ucx::rkey`).
///
/// Host memory only in this version (memory type 0), and at most 16 memory domains (UCX's
/// `UCP_MAX_MDS`): a forged map cannot make UCX index past its tables.
pub(crate) fn check_ucx_rkey(rkey: &[u8]) -> Result<(), BlobError> {
    if rkey.is_empty() || rkey.len() > MAX_RKEY_LEN {
        return Err(BlobError::BadRkey("length out of range"));
    }
    if rkey.len() < 9 {
        return Err(BlobError::BadRkey("shorter than its header"));
    }
    let mut a = [0u8; 8];
    a.copy_from_slice(&rkey[0..8]);
    let md_map = u64::from_le_bytes(a);
    if md_map >> 16 != 0 {
        return Err(BlobError::BadRkey("memory domain index above 15"));
    }
    if rkey[8] != 0 {
        return Err(BlobError::BadRkey("memory type is not host"));
    }
    let mut p = 9usize;
    for _ in 0..md_map.count_ones() {
        let Some(&size) = rkey.get(p) else {
            return Err(BlobError::BadRkey("memory domain entry truncated"));
        };
        p += 1 + size as usize;
        if p > rkey.len() {
            return Err(BlobError::BadRkey("memory domain entry truncated"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ExportBlob {
        let mut rkey = vec![0u8; 9];
        rkey[0] = 0b11;
        rkey.extend_from_slice(&[2, 0xaa, 0xbb, 0]);
        ExportBlob::new(Engine::Ucx, 7, 0x1000, 4096, vec![0x11; 100], rkey).unwrap()
    }

    #[test]
    fn round_trip() {
        let b = sample();
        assert_eq!(ExportBlob::decode(&b.encode()).unwrap(), b);
    }

    #[test]
    fn from_parts_checks_as_decode_does() {
        let b = sample();
        let parts = |wa: &[u8], rkey: &[u8], len: u64| {
            ExportBlob::from_parts(Engine::Ucx, 7, 0x1000, len, wa, rkey)
        };
        assert_eq!(parts(b.worker_address(), b.rkey(), 4096), Ok(b.clone()));
        assert_eq!(parts(&[], b.rkey(), 4096), Err(BlobError::BadWorkerAddress(0)));
        assert_eq!(
            parts(&[0x11; 2000], b.rkey(), 4096),
            Err(BlobError::BadWorkerAddress(2000))
        );
        assert_eq!(
            parts(&[0x1f; 100], b.rkey(), 4096),
            Err(BlobError::BadWorkerAddress(100))
        );
        assert!(matches!(parts(b.worker_address(), &[0; 300], 4096), Err(BlobError::BadRkey(_))));
        assert!(matches!(parts(b.worker_address(), &[0xff; 12], 4096), Err(BlobError::BadRkey(_))));
        assert_eq!(parts(b.worker_address(), b.rkey(), 0), Err(BlobError::BadLength(0)));
        assert_eq!(
            ExportBlob::from_parts(Engine::Ucx, 7, u64::MAX, 2, b.worker_address(), b.rkey()),
            Err(BlobError::BadLength(2))
        );
    }

    #[test]
    fn every_truncation_is_named() {
        let bytes = sample().encode();
        for n in 0..bytes.len() {
            assert!(
                matches!(
                    ExportBlob::decode(&bytes[..n]),
                    Err(BlobError::Truncated { .. })
                ),
                "prefix {n}"
            );
        }
    }

    #[test]
    fn header_fields_are_checked() {
        let good = sample().encode();
        let with = |o: usize, v: &[u8]| {
            let mut b = good.clone();
            b[o..o + v.len()].copy_from_slice(v);
            ExportBlob::decode(&b)
        };
        assert_eq!(with(0, b"XXXX"), Err(BlobError::BadMagic));
        assert_eq!(
            with(4, &2u16.to_le_bytes()),
            Err(BlobError::UnsupportedVersion(2))
        );
        assert_eq!(with(6, &[9]), Err(BlobError::UnknownEngine(9)));
        assert_eq!(with(7, &[1]), Err(BlobError::UnknownFlags(1)));
        assert_eq!(with(24, &0u64.to_le_bytes()), Err(BlobError::BadLength(0)));
        assert_eq!(
            with(24, &u64::MAX.to_le_bytes()),
            Err(BlobError::BadLength(u64::MAX))
        );
        assert_eq!(
            with(16, &u64::MAX.to_le_bytes()),
            Err(BlobError::BadLength(4096)),
            "address + length overflows"
        );
        let mut long = good.clone();
        long.push(0);
        assert_eq!(
            ExportBlob::decode(&long),
            Err(BlobError::TrailingBytes { extra: 1 })
        );
    }

    #[test]
    fn forged_rkeys_are_named() {
        let good = sample();
        let forge = |rkey: Vec<u8>| {
            ExportBlob::new(Engine::Ucx, 1, 0, 1, good.worker_address().to_vec(), rkey)
        };
        let mut map_high = good.rkey().to_vec();
        map_high[7] = 0x80;
        assert!(matches!(forge(map_high), Err(BlobError::BadRkey(_))));
        let mut cuda = good.rkey().to_vec();
        cuda[8] = 2;
        assert!(matches!(forge(cuda), Err(BlobError::BadRkey(_))));
        let mut oversize = good.rkey().to_vec();
        oversize[9] = 200;
        assert!(matches!(forge(oversize), Err(BlobError::BadRkey(_))));
        assert!(matches!(forge(vec![]), Err(BlobError::BadRkey(_))));
        assert!(matches!(
            forge(vec![0; MAX_RKEY_LEN + 1]),
            Err(BlobError::BadRkey(_))
        ));
    }
}
