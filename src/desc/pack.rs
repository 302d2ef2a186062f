//! Packing a strided view row-major: whole (`Layout::gather`) or piece by piece
//! (`PackCursor`, e.g. straight into ring chunks).

use super::{Layout, MAX_NDIM};
use crate::error::{Error, Result};

impl Layout {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::desc::DType;

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
        assert!(matches!(err, Error::InvalidArgument(_)) && err.to_string().contains("cannot allocate"), "{err}");
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
}
