//! `TensorDesc`: the fixed-size wire descriptor of a tensor view, and `Layout`, the
//! shape/stride part of it that callers build views with.
//!
//! A descriptor from a peer is untrusted bytes. [`TensorDesc::decode`] copies them into a
//! private value and validates everything before anything else reads a field: version,
//! dtype, device, storage kind, ndim limit, zero padding, non-negative sizes, strides and
//! offset, overflow anywhere in the extent arithmetic, and that the whole strided extent
//! lies inside the storage it names. Whether that storage really is that large is checked
//! again against the actual mapping when the descriptor is resolved.

use crate::error::{Error, Result};
use bytemuck::{Pod, Zeroable};

/// Most dimensions a descriptor can describe.
pub const MAX_NDIM: usize = 16;
/// `b"TWD1"` little-endian.
pub const DESC_MAGIC: u32 = u32::from_le_bytes(*b"TWD1");
/// Wire version of [`TensorDesc`].
pub const DESC_VERSION: u16 = 1;

/// Element types, numbered exactly like `c10::ScalarType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    UInt8 = 0,
    Int8 = 1,
    Int16 = 2,
    Int32 = 3,
    Int64 = 4,
    Float16 = 5,
    Float32 = 6,
    Float64 = 7,
    Complex32 = 8,
    Complex64 = 9,
    Complex128 = 10,
    Bool = 11,
    BFloat16 = 15,
    Float8E5M2 = 23,
    Float8E4M3Fn = 24,
    Float8E5M2Fnuz = 25,
    Float8E4M3Fnuz = 26,
    UInt16 = 27,
    UInt32 = 28,
    UInt64 = 29,
    Float8E8M0Fnu = 44,
}

impl DType {
    /// Every supported dtype.
    pub const ALL: [DType; 21] = [
        DType::UInt8,
        DType::Int8,
        DType::Int16,
        DType::Int32,
        DType::Int64,
        DType::Float16,
        DType::Float32,
        DType::Float64,
        DType::Complex32,
        DType::Complex64,
        DType::Complex128,
        DType::Bool,
        DType::BFloat16,
        DType::Float8E5M2,
        DType::Float8E4M3Fn,
        DType::Float8E5M2Fnuz,
        DType::Float8E4M3Fnuz,
        DType::UInt16,
        DType::UInt32,
        DType::UInt64,
        DType::Float8E8M0Fnu,
    ];

    /// The dtype with this `c10::ScalarType` number, if tensorwire supports it.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| *d as u8 == code)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        use DType::*;
        match self {
            UInt8 | Int8 | Bool | Float8E5M2 | Float8E4M3Fn | Float8E5M2Fnuz | Float8E4M3Fnuz | Float8E8M0Fnu => 1,
            Int16 | UInt16 | Float16 | BFloat16 => 2,
            Int32 | UInt32 | Float32 | Complex32 => 4,
            Int64 | UInt64 | Float64 | Complex64 => 8,
            Complex128 => 16,
        }
    }

    /// PyTorch's name (`torch.<name>`).
    pub fn name(self) -> &'static str {
        use DType::*;
        match self {
            UInt8 => "uint8",
            Int8 => "int8",
            Int16 => "int16",
            Int32 => "int32",
            Int64 => "int64",
            Float16 => "float16",
            Float32 => "float32",
            Float64 => "float64",
            Complex32 => "complex32",
            Complex64 => "complex64",
            Complex128 => "complex128",
            Bool => "bool",
            BFloat16 => "bfloat16",
            Float8E5M2 => "float8_e5m2",
            Float8E4M3Fn => "float8_e4m3fn",
            Float8E5M2Fnuz => "float8_e5m2fnuz",
            Float8E4M3Fnuz => "float8_e4m3fnuz",
            UInt16 => "uint16",
            UInt32 => "uint32",
            UInt64 => "uint64",
            Float8E8M0Fnu => "float8_e8m0fnu",
        }
    }
}

/// Device kinds, numbered like `c10::DeviceType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DeviceType {
    Cpu = 0,
    Cuda = 1,
}

/// What kind of storage a descriptor refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum StorageKind {
    /// A region of a shared CPU segment, kept alive by a lease.
    Segment = 1,
    /// A slot of a bounce-buffer ring.
    RingSlot = 2,
    /// A CUDA IPC memory handle plus offset from the allocation base.
    CudaIpc = 3,
    /// A CUDA VMM allocation shared by fd.
    CudaVmm = 4,
}

impl StorageKind {
    fn from_code(c: u8) -> Option<StorageKind> {
        Some(match c {
            1 => StorageKind::Segment,
            2 => StorageKind::RingSlot,
            3 => StorageKind::CudaIpc,
            4 => StorageKind::CudaVmm,
            _ => return None,
        })
    }
}

/// Shape, strides (in elements), storage offset (in elements) and dtype of a view.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub dtype: DType,
    ndim: u8,
    sizes: [i64; MAX_NDIM],
    strides: [i64; MAX_NDIM],
    pub storage_offset: i64,
}

impl std::fmt::Debug for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Layout({}, sizes={:?}, strides={:?}, offset={})",
            self.dtype.name(),
            self.sizes(),
            self.strides(),
            self.storage_offset
        )
    }
}

fn dim_err(ndim: usize) -> Error {
    Error::InvalidArgument(format!("{ndim} dimensions; tensorwire supports at most {MAX_NDIM}"))
}

impl Layout {
    /// A contiguous (row-major) view of `sizes` at storage offset 0.
    pub fn contiguous(dtype: DType, sizes: &[i64]) -> Result<Layout> {
        if sizes.len() > MAX_NDIM {
            return Err(dim_err(sizes.len()));
        }
        let mut strides = [0i64; MAX_NDIM];
        let mut acc: i64 = 1;
        for (i, &s) in sizes.iter().enumerate().rev() {
            if s < 0 {
                return Err(Error::InvalidArgument(format!("size {s} of dim {i} is negative")));
            }
            strides[i] = acc;
            acc = acc
                .checked_mul(s.max(1))
                .ok_or_else(|| Error::InvalidArgument(format!("sizes {sizes:?} overflow 64 bits")))?;
        }
        Layout::strided(dtype, sizes, &strides[..sizes.len()], 0)
    }

    /// An arbitrary strided view. Checked for sign and overflow (not against a storage).
    pub fn strided(dtype: DType, sizes: &[i64], strides: &[i64], storage_offset: i64) -> Result<Layout> {
        if sizes.len() > MAX_NDIM {
            return Err(dim_err(sizes.len()));
        }
        if sizes.len() != strides.len() {
            return Err(Error::InvalidArgument(format!("{} sizes but {} strides", sizes.len(), strides.len())));
        }
        let mut l = Layout {
            dtype,
            ndim: sizes.len() as u8,
            sizes: [0; MAX_NDIM],
            strides: [0; MAX_NDIM],
            storage_offset,
        };
        l.sizes[..sizes.len()].copy_from_slice(sizes);
        l.strides[..strides.len()].copy_from_slice(strides);
        l.extent_elements().map_err(|e| Error::InvalidArgument(e.to_string()))?;
        Ok(l)
    }

    pub fn ndim(&self) -> usize {
        self.ndim as usize
    }
    pub fn sizes(&self) -> &[i64] {
        &self.sizes[..self.ndim()]
    }
    pub fn strides(&self) -> &[i64] {
        &self.strides[..self.ndim()]
    }

    /// Number of elements. Every constructor and `TensorDesc::decode` check that the
    /// packed size (`numel × element size`) fits in 64 bits, so this cannot overflow.
    pub fn numel(&self) -> u64 {
        self.sizes().iter().fold(1u64, |n, &s| n.saturating_mul(s.max(0) as u64))
    }

    /// Bytes the elements occupy when packed contiguously.
    pub fn packed_bytes(&self) -> u64 {
        self.numel().saturating_mul(self.dtype.size() as u64)
    }

    /// Row-major contiguous (size-1 dims may have any stride, as in PyTorch).
    pub fn is_contiguous(&self) -> bool {
        // An empty view touches no memory, whatever its strides (as in PyTorch).
        if (0..self.ndim()).any(|i| self.sizes[i] <= 0) {
            return true;
        }
        let mut expect: u64 = 1;
        for i in (0..self.ndim()).rev() {
            let (size, stride) = (self.sizes[i] as u64, self.strides[i]);
            if size != 1 && u64::try_from(stride) != Ok(expect) {
                return false;
            }
            expect = expect.saturating_mul(size);
        }
        true
    }

    /// One past the last element index the view touches (0 for an empty view), with
    /// every step of the arithmetic checked.
    pub fn extent_elements(&self) -> Result<u64> {
        let bad = |m: String| Error::InvalidDescriptor(m);
        if self.storage_offset < 0 {
            return Err(bad(format!("storage offset {} is negative", self.storage_offset)));
        }
        let mut numel: u64 = 1;
        let mut last: u64 = self.storage_offset as u64;
        for i in 0..self.ndim() {
            let (s, st) = (self.sizes[i], self.strides[i]);
            if s < 0 {
                return Err(bad(format!("size {s} of dim {i} is negative")));
            }
            if st < 0 {
                return Err(bad(format!("stride {st} of dim {i} is negative")));
            }
            numel = numel
                .checked_mul(s as u64)
                .ok_or_else(|| bad(format!("sizes {:?} overflow 64 bits", self.sizes())))?;
            if s > 0 {
                let step = ((s - 1) as u64)
                    .checked_mul(st as u64)
                    .ok_or_else(|| bad(format!("dim {i}: (size {s} - 1) x stride {st} overflows 64 bits")))?;
                last = last.checked_add(step).ok_or_else(|| bad(format!("extent of dim {i} overflows 64 bits")))?;
            }
        }
        numel.checked_mul(self.dtype.size() as u64).ok_or_else(|| {
            bad(format!("{numel} elements of {} overflow 64 bits when packed", self.dtype.name()))
        })?;
        if numel == 0 {
            return Ok(0);
        }
        let end = last.checked_add(1).ok_or_else(|| bad("extent overflows 64 bits".into()))?;
        // The byte extent must be representable too.
        end.checked_mul(self.dtype.size() as u64)
            .ok_or_else(|| bad(format!("extent of {end} elements of {} overflows 64 bits", self.dtype.name())))?;
        Ok(end)
    }

    /// Bytes of storage, from its start, that the view needs.
    pub fn extent_bytes(&self) -> Result<u64> {
        Ok(self.extent_elements()? * self.dtype.size() as u64)
    }

    fn check_dim(&self, d: usize) -> Result<()> {
        if d >= self.ndim() {
            return Err(Error::InvalidArgument(format!("dim {d} out of range for a {}-d view", self.ndim())));
        }
        Ok(())
    }

    /// Swap two dims (like `Tensor.transpose`).
    pub fn transpose(mut self, a: usize, b: usize) -> Result<Layout> {
        self.check_dim(a)?;
        self.check_dim(b)?;
        self.sizes.swap(a, b);
        self.strides.swap(a, b);
        Ok(self)
    }

    /// Elements `start, start+step, …` below `end` of dim `d` (like `t[start:end:step]`).
    pub fn slice(mut self, d: usize, start: i64, end: i64, step: i64) -> Result<Layout> {
        self.check_dim(d)?;
        let size = self.sizes[d];
        if step <= 0 || start < 0 || start > end || end > size {
            return Err(Error::InvalidArgument(format!(
                "slice {start}:{end}:{step} invalid for dim {d} of size {size}"
            )));
        }
        self.storage_offset += start * self.strides[d];
        self.sizes[d] = (end - start + step - 1) / step;
        self.strides[d] *= step;
        Ok(self)
    }

    /// Broadcast a size-1 dim to `size` with stride 0 (like `Tensor.expand`).
    pub fn expand(mut self, d: usize, size: i64) -> Result<Layout> {
        self.check_dim(d)?;
        if self.sizes[d] != 1 || size < 0 {
            return Err(Error::InvalidArgument(format!("cannot expand dim {d} of size {} to {size}", self.sizes[d])));
        }
        self.sizes[d] = size;
        self.strides[d] = 0;
        Ok(self)
    }

    /// Visit every element's storage index in row-major order of the view, batching
    /// runs where the innermost dim is unit-stride: `f(first_element_index, run_len)`.
    pub fn for_each_run(&self, mut f: impl FnMut(u64, u64)) {
        if self.numel() == 0 {
            return;
        }
        let nd = self.ndim();
        if nd == 0 {
            f(self.storage_offset as u64, 1);
            return;
        }
        let (inner_len, inner_stride) = (self.sizes[nd - 1] as u64, self.strides[nd - 1] as u64);
        let mut idx = [0i64; MAX_NDIM];
        loop {
            let base = (0..nd - 1).fold(self.storage_offset as u64, |b, d| b + idx[d] as u64 * self.strides[d] as u64);
            if inner_stride == 1 {
                f(base, inner_len);
            } else {
                for k in 0..inner_len {
                    f(base + k * inner_stride, 1);
                }
            }
            // Odometer over the outer dims.
            let mut d = nd - 1;
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < self.sizes[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }

    /// Gather the view's elements, packed row-major, from storage `base` into `out`.
    /// A stride-0 view can name far more elements than its storage holds, so the packed
    /// size is allocated fallibly: a view too large to copy is an error, not an abort.
    ///
    /// # Safety
    /// `base` must be valid for reads of `self.extent_bytes()` bytes.
    pub unsafe fn gather(&self, base: *const u8, out: &mut Vec<u8>) -> Result<()> {
        let packed = self.packed_bytes();
        let n = usize::try_from(packed)
            .ok()
            .filter(|n| out.try_reserve_exact(*n).is_ok())
            .ok_or_else(|| Error::InvalidArgument(format!("cannot allocate {packed} bytes for a packed copy of {self:?}")))?;
        let start = out.len();
        out.resize(start + n, 0);
        // SAFETY: forwarded from the caller: `base` covers the extent.
        let written = unsafe { PackCursor::new(self).fill(base, &mut out[start..]) };
        debug_assert_eq!(written, n);
        Ok(())
    }
}

/// Copy `n` elements of `ES` bytes, `step` bytes apart, to consecutive slots at `out`
/// (a fixed-size copy per element, which compiles to one load and one store).
///
/// # Safety
/// `src + k*step .. + ES` readable and `out .. + n*ES` writable for every k < n.
#[inline]
unsafe fn gather_strided<const ES: usize>(src: *const u8, step: usize, out: *mut u8, n: usize) {
    for k in 0..n {
        // SAFETY: per the function's contract.
        unsafe { std::ptr::copy_nonoverlapping(src.add(k * step), out.add(k * ES), ES) };
    }
}

/// Packs a strided view into a contiguous byte stream piece by piece, resuming where the
/// last piece ended (so a large view can be packed straight into ring chunks).
pub struct PackCursor<'l> {
    l: &'l Layout,
    idx: [i64; MAX_NDIM],
    inner: i64,
    done: bool,
}

impl<'l> PackCursor<'l> {
    pub fn new(l: &'l Layout) -> Self {
        PackCursor { l, idx: [0; MAX_NDIM], inner: 0, done: l.numel() == 0 }
    }

    /// True once every element has been packed.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Copy the next packed bytes of the view into `dst` (whole elements only); returns
    /// how many bytes were written (less than `dst.len()` only at the end of the view).
    ///
    /// # Safety
    /// `base` must be valid for reads of `l.extent_bytes()` bytes.
    pub unsafe fn fill(&mut self, base: *const u8, dst: &mut [u8]) -> usize {
        let l = self.l;
        let es = l.dtype.size();
        let nd = l.ndim();
        let mut w = 0;
        while !self.done && dst.len() - w >= es {
            if nd == 0 {
                // SAFETY: a 0-d view's one element lies inside the extent.
                unsafe { std::ptr::copy_nonoverlapping(base.add(l.storage_offset as usize * es), dst[w..].as_mut_ptr(), es) };
                w += es;
                self.done = true;
                break;
            }
            let (inner_len, inner_stride) = (l.sizes[nd - 1], l.strides[nd - 1]);
            let row = (0..nd - 1).fold(l.storage_offset, |b, d| b + self.idx[d] * l.strides[d]);
            if inner_stride == 1 {
                let n = ((inner_len - self.inner) as usize).min((dst.len() - w) / es);
                // SAFETY: elements row+inner .. row+inner+n are inside the extent (every
                // index of a validated view is), and dst has room for n*es bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(base.add((row + self.inner) as usize * es), dst[w..].as_mut_ptr(), n * es)
                };
                w += n * es;
                self.inner += n as i64;
            } else {
                let n = ((inner_len - self.inner) as usize).min((dst.len() - w) / es);
                let src = base.wrapping_add((row + self.inner * inner_stride) as usize * es);
                // Wrapping: a size-1 dim may carry any stride (validation ignores it, as
                // (size - 1) * stride = 0); the step is only used for k < n, and when n > 1
                // (n - 1) * step lies inside the validated extent, so it cannot wrap then.
                let step = (inner_stride as usize).wrapping_mul(es);
                let out = dst[w..w + n * es].as_mut_ptr();
                // SAFETY: elements row + (inner+k)*stride for k < n are inside the extent
                // (inner + n ≤ the dim's size), and `out` has room for n elements.
                unsafe {
                    match es {
                        1 => gather_strided::<1>(src, step, out, n),
                        2 => gather_strided::<2>(src, step, out, n),
                        4 => gather_strided::<4>(src, step, out, n),
                        8 => gather_strided::<8>(src, step, out, n),
                        _ => gather_strided::<16>(src, step, out, n),
                    }
                }
                w += n * es;
                self.inner += n as i64;
            }
            if self.inner == inner_len {
                self.inner = 0;
                let mut d = nd - 1;
                loop {
                    if d == 0 {
                        self.done = true;
                        break;
                    }
                    d -= 1;
                    self.idx[d] += 1;
                    if self.idx[d] < l.sizes[d] {
                        break;
                    }
                    self.idx[d] = 0;
                }
            }
        }
        w
    }
}

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
    /// IPC event slot and the sequence number recorded in it (CUDA).
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

/// Size of an encoded descriptor in bytes.
pub const DESC_SIZE: usize = std::mem::size_of::<TensorDesc>();

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
        if self.reserved0 != 0 || self.flags != 0 || self.storage.reserved0 != 0 {
            return bad("reserved fields must be zero".into());
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

    pub fn dtype(&self) -> DType {
        DType::from_code(self.dtype).unwrap_or(DType::UInt8)
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
    fn gather_packs_a_transposed_view() {
        let storage: Vec<u8> = (0..6u8).collect();
        let l = Layout::contiguous(DType::UInt8, &[2, 3]).unwrap().transpose(0, 1).unwrap();
        let mut out = Vec::new();
        // SAFETY: storage holds the 6-byte extent.
        unsafe { l.gather(storage.as_ptr(), &mut out) }.unwrap();
        assert_eq!(out, vec![0, 3, 1, 4, 2, 5]);
        // A huge broadcast of one element: valid, but refused as a copy, not an abort.
        let huge = Layout::contiguous(DType::UInt8, &[1]).unwrap().expand(0, 1 << 50).unwrap();
        let mut out = Vec::new();
        // SAFETY: the extent is one byte.
        let err = unsafe { huge.gather(storage.as_ptr(), &mut out) }.unwrap_err();
        assert!(err.to_string().contains("cannot allocate"), "{err}");
    }

    #[test]
    fn pack_cursor_matches_gather_in_any_piece_size() {
        let storage: Vec<u8> = (0..=255u8).cycle().take(4096).collect();
        let views = [
            Layout::contiguous(DType::Int16, &[8, 12]).unwrap(),
            Layout::contiguous(DType::Int16, &[8, 12]).unwrap().transpose(0, 1).unwrap(),
            Layout::contiguous(DType::Float64, &[6, 10]).unwrap().slice(1, 1, 9, 3).unwrap(),
            Layout::contiguous(DType::UInt8, &[1, 7]).unwrap().expand(0, 5).unwrap(),
            Layout::contiguous(DType::Complex128, &[]).unwrap(),
            Layout::contiguous(DType::Int32, &[0, 3]).unwrap(),
        ];
        for l in views {
            let mut want = Vec::new();
            // SAFETY: storage covers every view's extent (≤ 960 bytes).
            unsafe { l.gather(storage.as_ptr(), &mut want) }.unwrap();
            for piece in [16usize, 48, 64, 1000] {
                let mut cur = PackCursor::new(&l);
                let mut got = Vec::new();
                while !cur.is_done() {
                    let mut buf = vec![0u8; piece];
                    // SAFETY: as above.
                    let n = unsafe { cur.fill(storage.as_ptr(), &mut buf) };
                    assert!(n > 0 || cur.is_done());
                    got.extend_from_slice(&buf[..n]);
                }
                assert_eq!(got, want, "{l:?} in pieces of {piece}");
            }
        }
    }

    #[test]
    fn size_one_dims_with_huge_strides_pack_without_overflow() {
        // Fuzzer finding: a valid view whose size-1 inner dim has an enormous stride.
        let storage = [5u8, 6, 7, 8];
        for dt in [DType::UInt8, DType::Float32] {
            let l = Layout::strided(dt, &[1, 1], &[1, i64::MAX], 0).unwrap();
            let mut out = Vec::new();
            // SAFETY: the view's extent is one element (≤ 4 bytes of `storage`).
            unsafe { l.gather(storage.as_ptr(), &mut out) }.unwrap();
            assert_eq!(out, storage[..dt.size()]);
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
        assert!(TensorDesc::decode(&[0u8; 3]).unwrap_err().to_string().contains("bytes, expected"));
        let err = good.check_fits(16).unwrap_err().to_string();
        assert!(err.contains("segment too small: descriptor needs 32 bytes at offset 0, segment has 16"), "{err}");
    }
}
