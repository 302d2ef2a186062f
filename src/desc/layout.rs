//! `Layout`: shape, strides, storage offset and dtype of a view; building views
//! (contiguous, strided, transpose, slice, expand) and their extent arithmetic.

use super::{DType, MAX_NDIM};
use crate::error::{Error, Result};

/// Shape, strides (in elements), storage offset (in elements) and dtype of a view.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub dtype: DType,
    pub(super) ndim: u8,
    pub(super) sizes: [i64; MAX_NDIM],
    pub(super) strides: [i64; MAX_NDIM],
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
}
