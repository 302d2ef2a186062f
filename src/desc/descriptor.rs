//! `TensorDesc` and `StorageRef`: the fixed-size wire descriptor, and the validation
//! every descriptor from a peer passes before any field is read.

use super::{DType, DeviceType, Layout, Signal, StorageKind, DESC_MAGIC, DESC_VERSION, MAX_NDIM};
use crate::error::{Error, Result};
use bytemuck::{Pod, Zeroable};

/// Where a descriptor's storage lives. Which fields matter depends on `storage_kind`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct StorageRef {
    /// The producer's id for the segment (CPU) on this connection; for CudaVmm, the size
    /// of the exported allocation (its fd does not carry it).
    pub segment_id: u64,
    /// Byte offset of the storage's first byte in the segment / allocation.
    pub base_offset: u64,
    /// Size of the storage in bytes; the view's extent must fit inside.
    pub nbytes: u64,
    /// Lease slot in the producer's per-peer lease table.
    pub lease_slot: u32,
    /// Generation of that slot when the lease was granted.
    pub lease_gen: u32,
    /// CUDA IPC memory handle (CudaIpc).
    pub cuda_ipc_handle: [u8; 64],
    /// What the consumer waits for (CUDA): IPC event slot and the sequence number
    /// recorded in it, or — with [`FLAG_SIGNAL_WORD`] in the descriptor's flags — the
    /// producer's signal lane and the value its word reaches (≤ `u32::MAX`).
    pub event_slot: u32,
    pub reserved0: u32,
    pub event_seq: u64,
    /// Ring record sequence (RingSlot).
    pub ring_seq: u64,
}

/// The fixed-size wire descriptor. `#[repr(C)]`, no padding, `Pod`: its bytes are the
/// wire format (little-endian hosts only: both ends are on one machine).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Pod, Zeroable)]
pub struct TensorDesc {
    pub magic: u32,
    pub version: u16,
    pub dtype: u8,
    pub ndim: u8,
    pub device_type: u8,
    pub device_index: u8,
    pub storage_kind: u8,
    pub flags: u8,
    pub reserved0: u32,
    pub storage_offset: i64,
    pub sizes: [i64; MAX_NDIM],
    pub strides: [i64; MAX_NDIM],
    pub storage: StorageRef,
}

pub use crate::wire::descriptor::{DESC_SIZE, FLAG_SIGNAL_WORD};
const _: () = assert!(std::mem::size_of::<TensorDesc>() == DESC_SIZE);

impl TensorDesc {
    /// A CPU descriptor for `layout` over `storage` of kind `kind`.
    pub fn new(layout: &Layout, kind: StorageKind, storage: StorageRef) -> TensorDesc {
        let mut d = TensorDesc::zeroed();
        d.magic = DESC_MAGIC;
        d.version = DESC_VERSION;
        d.dtype = layout.dtype as u8;
        d.ndim = layout.ndim;
        d.device_type = DeviceType::Cpu as u8;
        d.storage_kind = kind as u8;
        d.storage_offset = layout.storage_offset;
        d.sizes = layout.sizes;
        d.strides = layout.strides;
        d.storage = storage;
        d
    }

    /// A descriptor of a CUDA tensor on `device`.
    pub fn new_cuda(layout: &Layout, device: u8, kind: StorageKind, storage: StorageRef) -> TensorDesc {
        let mut d = TensorDesc::new(layout, kind, storage);
        d.device_type = DeviceType::Cuda as u8;
        d.device_index = device;
        d
    }

    /// The descriptor's bytes.
    pub fn encode(&self) -> &[u8] {
        bytemuck::bytes_of(self)
    }

    /// Copy untrusted bytes into a private descriptor and validate it.
    pub fn decode(bytes: &[u8]) -> Result<TensorDesc> {
        if bytes.len() != DESC_SIZE {
            return Err(Error::InvalidDescriptor(format!(
                "descriptor is {} bytes, expected {DESC_SIZE}",
                bytes.len()
            )));
        }
        let d: TensorDesc = bytemuck::pod_read_unaligned(bytes);
        d.validate()?;
        Ok(d)
    }

    /// Check every field; see the module docs for the list.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidDescriptor(m));
        if self.magic != DESC_MAGIC {
            return bad(format!("bad magic {:#010x} (expected {DESC_MAGIC:#010x}): not a tensorwire descriptor", self.magic));
        }
        if self.version != DESC_VERSION {
            return bad(format!("version {} unsupported (this build speaks {DESC_VERSION})", self.version));
        }
        if DType::from_code(self.dtype).is_none() {
            return bad(format!("unknown dtype code {}", self.dtype));
        }
        if self.ndim as usize > MAX_NDIM {
            return bad(format!("ndim {} exceeds the limit of {MAX_NDIM}", self.ndim));
        }
        let nd = self.ndim as usize;
        if self.sizes[nd..].iter().chain(&self.strides[nd..]).any(|&v| v != 0) {
            return bad(format!("sizes/strides past ndim {nd} must be zero"));
        }
        if self.reserved0 != 0 || self.storage.reserved0 != 0 {
            return bad("reserved fields must be zero".into());
        }
        if self.flags & !FLAG_SIGNAL_WORD != 0 {
            return bad(format!("unknown flags {:#x}", self.flags));
        }
        let kind = match StorageKind::from_code(self.storage_kind) {
            Some(k) => k,
            None => return bad(format!("unknown storage kind {}", self.storage_kind)),
        };
        match (self.device_type, kind) {
            (0, StorageKind::Segment | StorageKind::RingSlot) => {
                if self.device_index != 0 {
                    return bad(format!("CPU descriptor with device index {}", self.device_index));
                }
            }
            (1, StorageKind::CudaIpc | StorageKind::CudaVmm | StorageKind::RingSlot) => {}
            (0 | 1, k) => return bad(format!("storage kind {k:?} is not valid for device type {}", self.device_type)),
            (t, _) => return bad(format!("unknown device type {t}")),
        }
        if self.flags & FLAG_SIGNAL_WORD != 0 {
            if !matches!(kind, StorageKind::CudaIpc | StorageKind::CudaVmm) {
                return bad(format!("storage kind {kind:?} names no CUDA signal, yet its signal-word flag is set"));
            }
            if self.storage.event_seq > u64::from(u32::MAX) {
                return bad(format!("signal word value {} does not fit the 32-bit word", self.storage.event_seq));
            }
        }
        let extent = self.layout_unchecked().extent_bytes()?;
        if self.storage.base_offset.checked_add(self.storage.nbytes).is_none() {
            return bad(format!(
                "storage of {} bytes at offset {} overflows 64 bits",
                self.storage.nbytes, self.storage.base_offset
            ));
        }
        if extent > self.storage.nbytes {
            return bad(format!(
                "view needs {extent} bytes of storage but the storage has {}",
                self.storage.nbytes
            ));
        }
        Ok(())
    }

    fn layout_unchecked(&self) -> Layout {
        Layout {
            dtype: DType::from_code(self.dtype).unwrap_or(DType::UInt8),
            ndim: self.ndim.min(MAX_NDIM as u8),
            sizes: self.sizes,
            strides: self.strides,
            storage_offset: self.storage_offset,
        }
    }

    /// The view's layout (call on a validated descriptor).
    pub fn layout(&self) -> Layout {
        self.layout_unchecked()
    }

    /// Bytes from the storage's first byte to element 0 of the view (call on a validated
    /// descriptor). Clamped to the storage: an empty view's offset is not bounded by its
    /// extent, so the peer may put it anywhere, up to past 64 bits.
    pub fn data_offset(&self) -> u64 {
        let l = self.layout();
        (l.storage_offset as u64).saturating_mul(l.dtype.size() as u64).min(self.storage.nbytes)
    }

    pub fn dtype(&self) -> DType {
        DType::from_code(self.dtype).unwrap_or(DType::UInt8)
    }

    /// What a (validated) CUDA descriptor says to wait for.
    #[cfg(not(loom))]
    pub fn signal(&self) -> super::Signal {
        if self.flags & FLAG_SIGNAL_WORD != 0 {
            Signal::Word { lane: self.storage.event_slot, value: self.storage.event_seq as u32 }
        } else {
            Signal::Event { slot: self.storage.event_slot, seq: self.storage.event_seq }
        }
    }

    /// Name `s` as what the consumer waits for.
    #[cfg(not(loom))]
    pub fn set_signal(&mut self, s: super::Signal) {
        match s {
            Signal::Word { lane, value } => {
                self.flags |= FLAG_SIGNAL_WORD;
                self.storage.event_slot = lane;
                self.storage.event_seq = u64::from(value);
            }
            Signal::Event { slot, seq } => {
                self.flags &= !FLAG_SIGNAL_WORD;
                self.storage.event_slot = slot;
                self.storage.event_seq = seq;
            }
        }
    }

    pub fn kind(&self) -> Option<StorageKind> {
        StorageKind::from_code(self.storage_kind)
    }

    /// Check the storage against the real size of the mapping it resolves to.
    pub fn check_fits(&self, mapping_len: u64) -> Result<()> {
        let end = self.storage.base_offset.saturating_add(self.storage.nbytes);
        if end > mapping_len {
            return Err(Error::InvalidDescriptor(format!(
                "segment too small: descriptor needs {} bytes at offset {}, segment has {mapping_len}",
                self.storage.nbytes, self.storage.base_offset
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc_for(l: &Layout, nbytes: u64) -> TensorDesc {
        TensorDesc::new(l, StorageKind::Segment, StorageRef { nbytes, ..Zeroable::zeroed() })
    }


    #[test]
    fn descriptor_has_no_padding_and_fixed_size() {
        assert_eq!(std::mem::size_of::<StorageRef>(), 120);
        assert_eq!(DESC_SIZE, 24 + 2 * 8 * MAX_NDIM + 120);
    }

    #[test]
    fn views_roundtrip_and_extent_is_exact() {
        let base = Layout::contiguous(DType::Float32, &[4, 6]).unwrap();
        assert_eq!(base.extent_bytes().unwrap(), 96);
        let t = base.transpose(0, 1).unwrap();
        assert_eq!(t.sizes(), &[6, 4]);
        assert_eq!(t.strides(), &[1, 6]);
        assert!(!t.is_contiguous());
        // An empty view is contiguous whatever its strides (PyTorch agrees).
        assert!(Layout::strided(DType::Float32, &[0, 3], &[1, 5], 0).unwrap().is_contiguous());
        assert!(!Layout::strided(DType::Float32, &[2, 3], &[1, 5], 0).unwrap().is_contiguous());
        let s = base.slice(1, 1, 5, 2).unwrap();
        assert_eq!((s.sizes(), s.strides(), s.storage_offset), (&[4i64, 2][..], &[6i64, 2][..], 1));
        assert_eq!(s.extent_elements().unwrap(), 1 + 3 * 6 + 2 + 1);
        let e = Layout::contiguous(DType::Int64, &[1, 5]).unwrap().expand(0, 1000).unwrap();
        assert_eq!(e.extent_bytes().unwrap(), 40);
        for l in [base, t, s, e] {
            let d = desc_for(&l, l.extent_bytes().unwrap());
            let back = TensorDesc::decode(d.encode()).unwrap();
            assert_eq!(back.layout(), l);
        }
    }

    #[test]
    fn data_offset_stays_inside_the_storage() {
        let l = Layout::strided(DType::Float32, &[2, 3], &[3, 1], 5).unwrap();
        assert_eq!(desc_for(&l, 64).data_offset(), 20);
        // An empty view may carry any offset: past the storage, and past 64 bits in bytes.
        for offset in [100, i64::MAX] {
            let empty = Layout::strided(DType::Float32, &[0, 3], &[3, 1], offset).unwrap();
            let d = TensorDesc::decode(desc_for(&empty, 16).encode()).unwrap();
            assert_eq!(d.data_offset(), 16, "offset {offset}");
        }
    }

    #[test]
    fn fuzzer_findings_are_refused_or_harmless() {
        // float32 sizes [1<<62] strides [0]: numel × 4 overflows 64 bits.
        let mut d = TensorDesc::new(&Layout::contiguous(DType::Float32, &[1]).unwrap(), StorageKind::Segment, StorageRef { nbytes: 4, ..Zeroable::zeroed() });
        d.sizes[0] = 1 << 62;
        d.strides[0] = 0;
        let err = TensorDesc::decode(d.encode()).unwrap_err().to_string();
        assert!(err.contains("overflow 64 bits when packed"), "{err}");
        // uint8 sizes [1<<62, 3] strides [3, 1]: numel > i64::MAX but valid; no panic.
        let l = Layout::strided(DType::UInt8, &[1 << 62, 3], &[3, 1], 0).unwrap();
        assert!(l.is_contiguous());
        assert_eq!(l.packed_bytes(), 3 << 62);
    }

    #[test]
    fn hostile_descriptors_are_refused_with_reasons() {
        let l = Layout::contiguous(DType::Float32, &[8]).unwrap();
        let good = desc_for(&l, 32);
        type Mutation = Box<dyn Fn(&mut TensorDesc)>;
        let cases: Vec<(Mutation, &str)> = vec![
            (Box::new(|d| d.magic = 0), "magic"),
            (Box::new(|d| d.version = 9), "version"),
            (Box::new(|d| d.dtype = 200), "dtype"),
            (Box::new(|d| d.ndim = 17), "ndim"),
            (Box::new(|d| d.sizes[0] = -1), "negative"),
            (Box::new(|d| d.strides[0] = -1), "negative"),
            (Box::new(|d| d.storage_offset = -3), "negative"),
            (Box::new(|d| d.sizes[0] = 9), "needs 36 bytes"),
            (Box::new(|d| d.strides[0] = i64::MAX), "overflow"),
            (Box::new(|d| { d.ndim = 2; d.sizes[1] = i64::MAX; d.strides[1] = 1; d.sizes[0] = i64::MAX }), "overflow"),
            (Box::new(|d| d.storage.base_offset = u64::MAX), "overflow"),
            (Box::new(|d| d.storage_kind = 77), "storage kind"),
            (Box::new(|d| d.device_type = 5), "device type"),
            (Box::new(|d| d.sizes[5] = 1), "past ndim"),
        ];
        for (mutate, needle) in cases {
            let mut d = good;
            mutate(&mut d);
            let err = TensorDesc::decode(d.encode()).unwrap_err().to_string();
            assert!(err.contains(needle), "expected {needle:?} in {err:?}");
        }
        {
        let e = TensorDesc::decode(&[0u8; 3]).unwrap_err();
        assert!(matches!(e, Error::InvalidDescriptor(_)) && e.to_string().contains("bytes, expected"), "{e}");
    }
        let err = good.check_fits(16).unwrap_err().to_string();
        assert!(err.contains("segment too small: descriptor needs 32 bytes at offset 0, segment has 16"), "{err}");
    }
}
