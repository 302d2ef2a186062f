//! Connection limits in C: `tw_peer_config_t` and its defaults.

use super::{guard, ms_of_wait, put, tw_result_e, wait_ms, Fail};
use tensorwire::peer::options::{ConnectionOption, CONNECTION_OPTIONS};
use tensorwire::peer::PeerConfig;
use std::ffi::{c_char, CStr};
use std::time::Duration;

/// How a connection waits for the peer's CUDA work (`tw_peer_config_t::cuda_wait`); see
/// `docs/DESIGN.md`, "CUDA events and stream order", for what each costs and blocks.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum tw_cuda_wait_e {
    /// The GPU waits on the producer's signal word; the call returns at once (default).
    TW_CUDA_WAIT_STREAM = 0,
    /// The receiving thread waits until the producer's work completed.
    TW_CUDA_WAIT_HOST = 1,
    /// The stream waits on the producer's IPC event (`cuStreamWaitEvent`; slow without MPS).
    TW_CUDA_WAIT_EVENT = 2,
}

/// Limits for one connection (`tw_peer_config_default` fills the defaults, `size`
/// included: start from it, then change fields).
#[repr(C)]
#[derive(Debug, Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
pub struct tw_peer_config_t {
    /// `sizeof(tw_peer_config_t)` as the caller's header has it (`tw_peer_config_default`
    /// sets it), so the struct can grow: a caller built against an older header passes a
    /// smaller size and the fields it does not know take their defaults; a newer header's
    /// larger size is accepted when the fields this library does not know are all zero.
    /// A multiple of 8 from 8 to 4096; anything else is `TW_ERR_INVALID_ARGUMENT`.
    pub size: u64,
    /// Leases the peer may hold at once.
    pub max_leases: u32,
    /// Largest lease table accepted from the peer.
    pub max_peer_table_capacity: u32,
    /// Bytes the peer may hold under lease at once.
    pub max_lease_bytes: u64,
    /// Window for exports that name none, in ms (0: none).
    pub default_window_ms: u64,
    /// Largest control message.
    pub max_message: u64,
    /// Most peer segments mapped at once.
    pub max_import_segments: u64,
    /// How long (ms) each step of connection setup may wait for the peer (negative: no
    /// limit, 0: do not wait).
    pub handshake_timeout_ms: i64,
    /// Data area of the ring this side sends through (power of two ≥ 4096; 0: none).
    pub ring_bytes: u64,
    /// Largest ring accepted from the peer.
    pub max_peer_ring_bytes: u64,
    /// Largest message reassembled from ring chunks.
    pub max_ring_message: u64,
    /// Polls before a ring wait sleeps.
    pub ring_spin: u32,
    /// How this side waits for the peer's CUDA work (`tw_cuda_wait_e`: 0 stream, 1 host,
    /// 2 event); an unknown value fails the connection's creation with
    /// `TW_ERR_INVALID_ARGUMENT`.
    pub cuda_wait: u32,
    /// While leases are live, how often (µs) released leases are collected and their
    /// release callbacks run (also at each export and `tw_peer_reap`).
    pub reap_interval_us: u64,
    /// How long (µs) a receive polls before sleeping (0: sleep at once).
    pub recv_spin_us: u64,
    /// Device of this side's GPU bounce ring (-1: no GPU ring). With one, creating the
    /// peer needs a CUDA driver.
    pub cuda_ring_device: i32,
    /// Slots in the GPU ring's arena.
    pub cuda_ring_slots: u32,
    /// Bytes per GPU ring slot (a multiple of 256, at least 4096); larger tensors go
    /// through in chunks.
    pub cuda_ring_slot_bytes: u64,
    /// Most bytes of the peer's segments mapped here at once (only the ranges its
    /// descriptors name are mapped); over it an import fails with
    /// `TW_ERR_QUOTA_EXCEEDED`. Default: RAM plus swap.
    pub max_import_mapped_bytes: u64,
    /// How long (ms) a send may wait for room in the peer's socket buffer before it fails
    /// with `TW_ERR_TIMEOUT` (the export's lease is taken back); negative: no limit, 0: do
    /// not wait.
    pub send_timeout_ms: i64,
    /// The longest (ms) a wait for the peer's CUDA work may take (negative: no limit):
    /// a host wait then fails with `TW_ERR_TIMEOUT`; a stream's wait is ended by this
    /// side and `tw_imported_cuda_status` reports it. The peer's death ends either.
    pub cuda_wait_timeout_ms: i64,
}

impl TryFrom<&tw_peer_config_t> for PeerConfig {
    type Error = tensorwire::Error;
    fn try_from(c: &tw_peer_config_t) -> tensorwire::Result<Self> {
        Ok(PeerConfig {
            max_leases: c.max_leases,
            max_lease_bytes: c.max_lease_bytes,
            default_window: (c.default_window_ms > 0).then(|| Duration::from_millis(c.default_window_ms)),
            max_message: c.max_message as usize,
            max_import_segments: c.max_import_segments as usize,
            max_import_mapped_bytes: c.max_import_mapped_bytes,
            send_timeout: wait_ms(c.send_timeout_ms),
            max_peer_table_capacity: c.max_peer_table_capacity,
            handshake_timeout: wait_ms(c.handshake_timeout_ms),
            ring_bytes: c.ring_bytes as usize,
            max_peer_ring_bytes: c.max_peer_ring_bytes as usize,
            max_ring_message: c.max_ring_message,
            ring_spin: c.ring_spin,
            reap_interval: Duration::from_micros(c.reap_interval_us.max(1)),
            recv_spin: Duration::from_micros(c.recv_spin_us),
            cuda_ring: (c.cuda_ring_device >= 0).then_some(tensorwire::cuda::ring::CudaRingConfig {
                device: c.cuda_ring_device,
                slots: c.cuda_ring_slots,
                slot_bytes: c.cuda_ring_slot_bytes,
            }),
            cuda_wait: tensorwire::cuda::CudaWait::from_code(c.cuda_wait)?,
            cuda_wait_timeout: wait_ms(c.cuda_wait_timeout_ms),
        })
    }
}

/// Fill `out` with the default limits.
///
/// # Safety
/// `out` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_config_default(out: *mut tw_peer_config_t) -> tw_result_e {
    guard("tw_peer_config_default", || {
        let c = tw_peer_config_t::from_default();
        // SAFETY: writable per the contract; NULL refused.
        unsafe { put(out, c, "out") }
    })
}

impl tw_peer_config_t {
    fn from_default() -> tw_peer_config_t {
        let d = PeerConfig::default();
        tw_peer_config_t {
            size: std::mem::size_of::<tw_peer_config_t>() as u64,
            max_leases: d.max_leases,
            max_peer_table_capacity: d.max_peer_table_capacity,
            max_lease_bytes: d.max_lease_bytes,
            default_window_ms: d.default_window.map_or(0, |w| w.as_millis() as u64),
            max_message: d.max_message as u64,
            max_import_segments: d.max_import_segments as u64,
            handshake_timeout_ms: ms_of_wait(d.handshake_timeout),
            ring_bytes: d.ring_bytes as u64,
            max_peer_ring_bytes: d.max_peer_ring_bytes as u64,
            max_ring_message: d.max_ring_message,
            ring_spin: d.ring_spin,
            cuda_wait: d.cuda_wait as u32,
            reap_interval_us: d.reap_interval.as_micros() as u64,
            recv_spin_us: d.recv_spin.as_micros() as u64,
            cuda_ring_device: -1,
            cuda_ring_slots: tensorwire::cuda::ring::CudaRingConfig::default().slots,
            cuda_ring_slot_bytes: tensorwire::cuda::ring::CudaRingConfig::default().slot_bytes,
            max_import_mapped_bytes: d.max_import_mapped_bytes,
            send_timeout_ms: ms_of_wait(d.send_timeout),
            cuda_wait_timeout_ms: ms_of_wait(d.cuda_wait_timeout),
        }
    }
}

/// Largest `tw_peer_config_t::size` accepted (a newer header's struct, grown).
const MAX_CONFIG_SIZE: u64 = 4096;

/// The caller's config as this library reads it: its first `size` bytes over the
/// defaults (see `tw_peer_config_t::size`).
///
/// # Safety
/// `cfg` NULL, or readable for 8 bytes and then for the `size` bytes its first field says.
pub(super) unsafe fn config(cfg: *const tw_peer_config_t) -> tensorwire::Result<PeerConfig> {
    if cfg.is_null() {
        return Ok(PeerConfig::default());
    }
    // SAFETY: the contract is `read_struct`'s.
    let (c, _) = unsafe { read_struct(cfg) }?;
    PeerConfig::try_from(&c)
}

/// The caller's struct, its first `size` bytes over the defaults, and that size (checked:
/// see `tw_peer_config_t::size`).
///
/// # Safety
/// `cfg` non-null, readable for 8 bytes and then for the `size` bytes its first field says.
unsafe fn read_struct(cfg: *const tw_peer_config_t) -> tensorwire::Result<(tw_peer_config_t, u64)> {
    let bad = |m: String| tensorwire::Error::InvalidArgument(format!("tw_peer_config_t: {m}"));
    // SAFETY: readable for its first 8 bytes (the size field) per the contract.
    let size = unsafe { std::ptr::read_unaligned(cfg.cast::<u64>()) };
    let ours = std::mem::size_of::<tw_peer_config_t>() as u64;
    if size == 0 {
        return Err(bad("size is 0: fill the struct with tw_peer_config_default first".into()));
    }
    if size % 8 != 0 || !(8..=MAX_CONFIG_SIZE).contains(&size) {
        return Err(bad(format!("size {size} is not a multiple of 8 in 8..={MAX_CONFIG_SIZE} (this library's is {ours})")));
    }
    let mut c = tw_peer_config_t::from_default();
    let known = size.min(ours) as usize;
    // SAFETY: the caller's struct is readable for `size` ≥ `known` bytes (contract); `c`
    // is ours, `known` ≤ its size; it is plain integers without padding (`Pod`), so any
    // bytes make a valid value (the fields are validated later, as `PeerConfig`).
    unsafe { std::ptr::copy_nonoverlapping(cfg.cast::<u8>(), bytemuck::bytes_of_mut(&mut c).as_mut_ptr(), known) };
    if size > ours {
        // SAFETY: readable for `size` bytes (contract); the slice covers bytes ours..size.
        let newer = unsafe { std::slice::from_raw_parts(cfg.cast::<u8>().add(ours as usize), (size - ours) as usize) };
        if let Some(i) = newer.iter().position(|&b| b != 0) {
            return Err(bad(format!(
                "size {size} (a newer header) sets byte {} past this library's {ours}-byte struct: that setting is unknown here",
                ours as usize + i
            )));
        }
    }
    Ok((c, size))
}

macro_rules! c_field_setter {
    ($( $(#[doc = $doc:literal])* $name:ident => $field:ident { $($rest:tt)* } )*) => {
        /// Set the `tw_peer_config_t` field of the option `name` to `v` (in the option's
        /// range, which fits the field's type: `every_option_fits_its_field`); the offset
        /// just past that field, or `None` for a name that is no option.
        fn set_field(c: &mut tw_peer_config_t, name: &str, v: i64) -> Option<usize> {
            match name {
                $(stringify!($name) => {
                    c.$field = v as _;
                    Some(std::mem::offset_of!(tw_peer_config_t, $field) + std::mem::size_of_val(&c.$field))
                })*
                _ => None,
            }
        }
    };
}
tensorwire::ffi_support::with_connection_options!(c_field_setter);

/// Set the connection option `name` on `cfg` as the torch ops' opening calls take it (the
/// same names, ranges and defaults; `tensorwire::peer::options::CONNECTION_OPTIONS` in
/// Rust): each sets the field of its name (`window_ms` sets `default_window_ms`). A value
/// out of the option's range is `TW_ERR_INVALID_ARGUMENT`, its message naming the option
/// and what it must be; the value that means "the library's default" (0 for most options)
/// leaves the field as it is. An unknown name, or an option whose field lies past
/// `cfg->size` (a struct of an older header), is `TW_ERR_INVALID_ARGUMENT` too; `cfg` is
/// left as it was on every failure.
///
/// # Safety
/// `cfg` readable and writable for the `size` bytes its first field says (a struct filled
/// by `tw_peer_config_default`); `name` a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn tw_peer_config_set_option(
    cfg: *mut tw_peer_config_t,
    name: *const c_char,
    value: i64,
) -> tw_result_e {
    guard("tw_peer_config_set_option", || {
        let bad = |m: String| Fail::Err(tensorwire::Error::InvalidArgument(m));
        if name.is_null() {
            return Err(Fail::Null("name"));
        }
        if cfg.is_null() {
            return Err(Fail::Null("cfg"));
        }
        // SAFETY: non-null, and a NUL-terminated string per the contract.
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        let option = ConnectionOption::named(&name).ok_or_else(|| {
            let all: Vec<&str> = CONNECTION_OPTIONS.iter().map(|o| o.name).collect();
            bad(format!("no connection option `{name}` (the options: {})", all.join(", ")))
        })?;
        option.check(value)?;
        if !option.sets(value) {
            return Ok(());
        }
        // SAFETY: non-null; readable for `size` bytes per the contract.
        let (mut c, size) = unsafe { read_struct(cfg) }?;
        let end = set_field(&mut c, option.name, value)
            .ok_or_else(|| bad(format!("option `{name}` has no tw_peer_config_t field (a tensorwire bug)")))?;
        if end as u64 > size {
            return Err(bad(format!(
                "option `{name}` sets tw_peer_config_t::{}, past this struct's size {size} (an older header's): \
                 rebuild against this library's header",
                option.c_field
            )));
        }
        let known = (size as usize).min(std::mem::size_of::<tw_peer_config_t>());
        // SAFETY: writable for `size` ≥ `known` bytes per the contract; `c` is ours and at
        // least `known` bytes; the two do not overlap (`c` is a local).
        unsafe { std::ptr::copy_nonoverlapping(bytemuck::bytes_of(&c).as_ptr(), cfg.cast::<u8>(), known) };
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tensorwire::cuda::CudaWait;

    #[test]
    fn the_c_wait_policies_are_the_rust_ones() {
        for (c, rust) in [
            (tw_cuda_wait_e::TW_CUDA_WAIT_STREAM, CudaWait::Stream),
            (tw_cuda_wait_e::TW_CUDA_WAIT_HOST, CudaWait::Host),
            (tw_cuda_wait_e::TW_CUDA_WAIT_EVENT, CudaWait::Event),
        ] {
            assert_eq!(CudaWait::from_code(c as u32).unwrap(), rust);
        }
        let mut c = tw_peer_config_t::from_default();
        c.cuda_wait = 9;
        // SAFETY: a live struct of our own size.
        let e = unsafe { config(&c) }.unwrap_err();
        assert!(matches!(e, tensorwire::error::Error::InvalidArgument(_)) && e.to_string().contains("policy 9 unknown"), "{e}");
    }

    /// A struct of an older header (shorter `size`): what it sets is read, what it does not
    /// know takes its default; a newer header's longer struct is read when its extra
    /// fields are zero; a size that was never filled in is refused by name.
    #[test]
    fn the_struct_can_grow_both_ways() {
        let ours = std::mem::size_of::<tw_peer_config_t>();
        let d = PeerConfig::default();
        let mut c = tw_peer_config_t::from_default();
        assert_eq!(c.size as usize, ours);
        c.max_leases = 7;
        c.cuda_wait_timeout_ms = 1234;
        // As a caller whose header ended before `cuda_wait_timeout_ms` (its last field).
        c.size = std::mem::offset_of!(tw_peer_config_t, cuda_wait_timeout_ms) as u64;
        // SAFETY: a live struct, longer than the size it names.
        let got = unsafe { config(&c) }.unwrap();
        assert_eq!(got.max_leases, 7, "a field the old header knows is read");
        assert_eq!(got.cuda_wait_timeout, d.cuda_wait_timeout, "one it does not know takes its default");
        c.size = ours as u64;
        // SAFETY: as above.
        assert_eq!(unsafe { config(&c) }.unwrap().cuda_wait_timeout, tensorwire::Wait::For(Duration::from_millis(1234)));
        // A newer header's struct: 16 more bytes, zero, then one of them set.
        let mut newer = [0u64; 64];
        let words = ours / 8;
        newer[..words].copy_from_slice(bytemuck::cast_slice(bytemuck::bytes_of(&c)));
        newer[0] = ours as u64 + 16;
        // SAFETY: `newer` is readable for the 64 words, more than the size it names, and
        // 8-aligned; config reads it as bytes.
        let got = unsafe { config(newer.as_ptr().cast()) }.unwrap();
        assert_eq!(got.max_leases, 7);
        newer[words + 1] = 5;
        // SAFETY: as above.
        let e = unsafe { config(newer.as_ptr().cast()) }.unwrap_err();
        assert!(matches!(e, tensorwire::error::Error::InvalidArgument(_)) && e.to_string().contains(&format!("byte {}", ours + 8)), "{e}");
        for (size, needle) in [(0u64, "fill the struct with tw_peer_config_default"), (12, "not a multiple of 8"), (8192, "not a multiple of 8 in 8..=4096")] {
            c.size = size;
            // SAFETY: as above (no size past the struct is read: each is refused first).
            let e = unsafe { config(&c) }.unwrap_err();
            assert!(matches!(e, tensorwire::error::Error::InvalidArgument(_)) && e.to_string().contains(needle), "{size}: {e}");
        }
        // Only the size field: every default.
        let only_size = [8u64];
        // SAFETY: readable for the 8 bytes it names.
        let got = unsafe { config(only_size.as_ptr().cast()) }.unwrap();
        assert_eq!(got.max_leases, d.max_leases);
    }

    /// Setting each option by name through the C ABI makes the config the Rust table makes
    /// from the same values (so every option lands in its own field, and its range fits
    /// the field's type: `every_option_fits_its_field`).
    #[test]
    fn set_option_sets_what_the_table_sets() {
        let set = |c: &mut tw_peer_config_t, name: &str, v: i64| {
            let n = std::ffi::CString::new(name).unwrap();
            // SAFETY: a live struct of our own size and a C string.
            let r = unsafe { tw_peer_config_set_option(c, n.as_ptr(), v) };
            assert_eq!(r, tw_result_e::TW_OK, "{name} = {v}");
        };
        for (i, o) in CONNECTION_OPTIONS.iter().enumerate() {
            for v in [o.min, o.max, o.default, 1] {
                let mut c = tw_peer_config_t::from_default();
                let mut values: Vec<i64> = CONNECTION_OPTIONS.iter().map(|o| o.default).collect();
                // A GPU ring for the ring's sizes to land in; `cuda_wait` always sets.
                for name in ["cuda_ring_device", "cuda_wait"] {
                    set(&mut c, name, 0);
                    values[CONNECTION_OPTIONS.iter().position(|o| o.name == name).unwrap()] = 0;
                }
                set(&mut c, o.name, v);
                values[i] = v;
                // SAFETY: a live struct of our own size.
                let from_c = unsafe { config(&c) }.unwrap();
                let from_table = tensorwire::peer::options::peer_config_from_options(&values).unwrap();
                assert_eq!(format!("{from_c:?}"), format!("{from_table:?}"), "{} = {v}", o.name);
            }
        }
    }

    /// A refused value, an unknown name, a field past an older header's struct and a NULL
    /// are refused by name, and leave the struct as it was.
    #[test]
    fn set_option_refuses_by_name() {
        let try_set = |c: &mut tw_peer_config_t, name: &str, v: i64| {
            let n = std::ffi::CString::new(name).unwrap();
            // SAFETY: a live struct (at least as long as its size says) and a C string.
            let r = unsafe { tw_peer_config_set_option(c, n.as_ptr(), v) };
            // SAFETY: a static or thread-local NUL-terminated string.
            (r, unsafe { CStr::from_ptr(super::super::tw_last_error_message()) }.to_string_lossy().into_owned())
        };
        let d = tw_peer_config_t::from_default();
        let mut c = d;
        for (name, v, code, needle) in [
            ("max_leases", -1, tw_result_e::TW_ERR_INVALID_ARGUMENT, "tensorwire: max_leases must be in [0, 2^32), got -1"),
            ("cuda_wait", 3, tw_result_e::TW_ERR_INVALID_ARGUMENT, "tensorwire: cuda_wait must be 0 (stream), 1 (host) or 2 (event), got 3"),
            ("nope", 1, tw_result_e::TW_ERR_INVALID_ARGUMENT, "no connection option `nope` (the options: max_leases, "),
        ] {
            let (r, m) = try_set(&mut c, name, v);
            assert_eq!(r, code, "{m}");
            assert!(m.starts_with("tw_peer_config_set_option: ") && m.contains(needle), "{m}");
            assert_eq!(bytemuck::bytes_of(&c), bytemuck::bytes_of(&d));
        }
        // As a caller whose header ended before `cuda_wait_timeout_ms`.
        c.size = std::mem::offset_of!(tw_peer_config_t, cuda_wait_timeout_ms) as u64;
        let (r, m) = try_set(&mut c, "cuda_wait_timeout_ms", 5);
        assert!(r == tw_result_e::TW_ERR_INVALID_ARGUMENT && m.contains("past this struct's size"), "{m}");
        assert_eq!(try_set(&mut c, "max_leases", 3).0, tw_result_e::TW_OK);
        assert_eq!((c.max_leases, c.cuda_wait_timeout_ms), (3, d.cuda_wait_timeout_ms));
        // SAFETY: a live struct; NULL name refused.
        let r = unsafe { tw_peer_config_set_option(&mut c, std::ptr::null(), 1) };
        assert_eq!(r, tw_result_e::TW_ERR_NULL_ARGUMENT);
    }
}
