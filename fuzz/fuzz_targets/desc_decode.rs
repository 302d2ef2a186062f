//! Fuzz `TensorDesc::decode`, the validator every descriptor from a peer goes through.
//!
//! Each input is tried several ways, so the fuzzer gets past the cheap checks (length,
//! magic, version, zero padding) and spends its time on the extent arithmetic:
//!
//! 1. the raw bytes, as a peer could send them (almost always the wrong length);
//! 2. the first `DESC_SIZE` bytes (zero-padded when shorter);
//! 3. those bytes with magic and version patched to valid values;
//! 4. a "plausible" descriptor: also dtype, ndim, device, storage kind, reserved
//!    fields and the padding past ndim forced to valid values, so only sizes, strides,
//!    offset and the storage range remain hostile. Half of these have their sizes
//!    masked small so that accepted views are cheap enough to walk.
//!
//! Whenever decode accepts, the promises of the validator are checked: the whole strided
//! extent lies inside `storage.nbytes`, nothing overflows, and walking the view
//! (`Layout::for_each_run`, `Layout::gather`) touches only indices below the extent.

#![no_main]

use libfuzzer_sys::fuzz_target;
use tensorwire::{DESC_SIZE, DType, MAX_NDIM, TensorDesc};

/// Most elements a view may have for the walk to run (keeps each input fast).
const WALK_MAX_ELEMENTS: u64 = 1 << 16;
/// Largest extent the gather check allocates a backing buffer for.
const GATHER_MAX_BYTES: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    // 1. Raw: any length, any content.
    check(data);

    // 2. Descriptor-shaped.
    let mut buf = [0u8; DESC_SIZE];
    let n = data.len().min(DESC_SIZE);
    buf[..n].copy_from_slice(&data[..n]);
    check(&buf);

    // 3. Magic and version valid.
    let mut d: TensorDesc = bytemuck::pod_read_unaligned(&buf);
    d.magic = tensorwire::desc::DESC_MAGIC;
    d.version = tensorwire::desc::DESC_VERSION;
    check(d.encode());

    // 4. Plausible: everything but the geometry valid. Steering bits come from the
    //    bytes after the descriptor, so the geometry bytes stay free for the fuzzer.
    let ctl = data.get(DESC_SIZE).copied().unwrap_or(0);
    d.dtype = DType::ALL[d.dtype as usize % DType::ALL.len()] as u8;
    d.ndim %= MAX_NDIM as u8 + 1;
    d.device_type = 0;
    d.device_index = 0;
    d.storage_kind = if ctl & 1 == 0 { 1 } else { 2 }; // Segment or RingSlot
    d.flags = 0;
    d.reserved0 = 0;
    d.storage.reserved0 = 0;
    let nd = d.ndim as usize;
    d.sizes[nd..].fill(0);
    d.strides[nd..].fill(0);
    if ctl & 2 != 0 {
        // Small, walkable geometry: sizes 0..=7, strides 0..=255, offset < 4096, and
        // storage exactly as large as the view needs (when that is representable).
        for v in &mut d.sizes[..nd] {
            *v &= 7;
        }
        for v in &mut d.strides[..nd] {
            *v &= 0xff;
        }
        d.storage_offset &= 0xfff;
        if ctl & 4 != 0 {
            if let Ok(e) = d.layout().extent_bytes() {
                d.storage.nbytes = e;
            }
        }
    }
    check(d.encode());
});

/// Decode `bytes`; if accepted, assert everything the validator promises.
fn check(bytes: &[u8]) {
    let Ok(d) = TensorDesc::decode(bytes) else {
        return;
    };

    // Decoding is a plain copy of the bytes.
    assert_eq!(d.encode(), bytes, "decode must not change the bytes");
    assert_eq!(
        TensorDesc::decode(d.encode()).ok(),
        Some(d),
        "decode must be idempotent"
    );

    assert!(d.ndim as usize <= MAX_NDIM, "ndim {} accepted", d.ndim);
    assert!(
        DType::from_code(d.dtype).is_some(),
        "dtype {} accepted",
        d.dtype
    );
    assert!(
        d.kind().is_some(),
        "storage kind {} accepted",
        d.storage_kind
    );

    let l = d.layout();
    assert_eq!(l.ndim(), d.ndim as usize);
    assert_eq!(l.sizes(), &d.sizes[..l.ndim()]);
    assert_eq!(l.strides(), &d.strides[..l.ndim()]);
    assert!(
        l.sizes().iter().chain(l.strides()).all(|&v| v >= 0),
        "negative size/stride accepted: {l:?}"
    );
    assert!(
        l.storage_offset >= 0,
        "negative storage offset accepted: {l:?}"
    );

    let extent_el = l
        .extent_elements()
        .expect("accepted descriptor must have a computable extent");
    let extent = l
        .extent_bytes()
        .expect("accepted descriptor must have a computable byte extent");
    assert_eq!(Some(extent), extent_el.checked_mul(l.dtype.size() as u64));
    assert!(
        extent <= d.storage.nbytes,
        "extent {extent} > storage {} for {l:?}",
        d.storage.nbytes
    );
    let end = d.storage.base_offset.checked_add(d.storage.nbytes);
    assert!(
        end.is_some(),
        "base_offset {} + nbytes {} overflows",
        d.storage.base_offset,
        d.storage.nbytes
    );
    assert!(d.check_fits(end.unwrap()).is_ok());
    if let Some(short) = end.unwrap().checked_sub(1) {
        if d.storage.nbytes > 0 {
            assert!(
                d.check_fits(short).is_err(),
                "check_fits accepted a mapping one byte short"
            );
        }
    }

    // Element count: the product of sizes, checked.
    let numel = l
        .sizes()
        .iter()
        .try_fold(1u64, |acc, &s| acc.checked_mul(s as u64));
    let numel = numel.expect("accepted descriptor's sizes overflow 64 bits");
    assert_eq!(numel, l.numel());
    if numel == 0 {
        assert_eq!(extent_el, 0);
    } else {
        assert!(extent_el > l.storage_offset as u64);
    }

    // Views a consumer would build from it must not panic either.
    let _ = l.is_contiguous();
    let _ = l.packed_bytes();

    if numel == 0 || numel > WALK_MAX_ELEMENTS {
        return;
    }
    let (mut visited, mut max_end) = (0u64, 0u64);
    l.for_each_run(|first, len| {
        assert!(len >= 1, "empty run at {first}");
        let run_end = first.checked_add(len).expect("run end overflows");
        assert!(
            run_end <= extent_el,
            "run {first}+{len} passes the extent {extent_el} of {l:?}"
        );
        assert!(
            first >= l.storage_offset as u64,
            "run {first} before the storage offset of {l:?}"
        );
        visited += len;
        max_end = max_end.max(run_end);
    });
    assert_eq!(
        visited, numel,
        "walk visited {visited} elements, view has {numel}: {l:?}"
    );
    assert_eq!(
        max_end, extent_el,
        "walk's last element is not the extent's last: {l:?}"
    );

    if extent <= GATHER_MAX_BYTES {
        // A buffer exactly the extent long: ASan flags any read past it.
        let storage = vec![0xa5u8; extent as usize];
        let mut out = Vec::new();
        // SAFETY: `storage` is valid for reads of `extent_bytes()` bytes, which is what
        // `gather` requires.
        unsafe { l.gather(storage.as_ptr(), &mut out) }.expect("a view this small must gather");
        assert_eq!(out.len() as u64, l.packed_bytes());
    }
}
