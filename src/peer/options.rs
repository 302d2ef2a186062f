//! The connection options, once: the ten int options the torch ops' opening calls take
//! (`from_fd`, `connect`, `accept`) and the C ABI sets by name
//! (`tw_peer_config_set_option`), each with its range, default, refusal message and what
//! it sets. The Python binding (`_native.connection_options()`, and its checks), the C
//! ABI's setter and, through it, the C++ extension read this table;
//! `ffi/tests/mirrored_tables.rs` checks what still lists the options (the extension's schema
//! macro, the generated header's struct) against it.

use super::PeerConfig;
use crate::cuda::CudaWait;
use crate::cuda::ring::CudaRingConfig;
use crate::error::{Error, Result};
use crate::wait::Wait;
use std::time::Duration;

/// One connection option. Every option is an `int` (i64) in the torch schemas and the C
/// setter.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionOption {
    /// The option's name (a keyword argument of the torch ops, the C setter's `name`).
    pub name: &'static str,
    /// Its type in the torch schemas.
    pub ty: &'static str,
    /// Smallest value accepted.
    pub min: i64,
    /// Largest value accepted.
    pub max: i64,
    /// The schema's default.
    pub default: i64,
    /// True: the default value leaves the library's setting as it is ("0: the default");
    /// false: every value, the default too, sets the option.
    pub keeps: bool,
    /// The names of the values `0, 1, ...` where the option is a choice (empty otherwise).
    pub choices: &'static [&'static str],
    /// What the option means.
    pub doc: &'static str,
    /// The field of the C ABI's `tw_peer_config_t` it sets.
    pub c_field: &'static str,
    /// What a value must be, as a refusal says it.
    rule: &'static str,
    /// Set the option on a config (`value` checked).
    apply: fn(&mut PeerConfig, i64),
}

/// The C convention of a wait in ms: < 0 no limit, 0 do not wait, n > 0 at most n ms.
fn wait_ms(ms: i64) -> Wait {
    match ms {
        ..0 => Wait::Forever,
        0 => Wait::Never,
        ms => Wait::For(Duration::from_millis(ms.unsigned_abs())),
    }
}

const U32: i64 = u32::MAX as i64;

/// The options, in schema order, for a macro `$then` that turns them into code: this
/// module's [`CONNECTION_OPTIONS`], the C ABI's field setter. Each entry: doc, name =>
/// the `tw_peer_config_t` field, then range, default, whether the default keeps the
/// library's setting, choices, the refusal's rule and how it sets a [`PeerConfig`]
/// (`cuda_ring_device` before the two GPU ring sizes, which set the ring it made).
/// Exported for the C ABI crate (`tensorwire_ffi`), as
/// `tensorwire::ffi_support::with_connection_options`; no other crate's API.
#[doc(hidden)]
#[macro_export]
macro_rules! with_connection_options {
    ($then:ident) => {
        $then! {
            /// Leases the peer may hold at once (0: the library's default).
            max_leases => max_leases {
                range: 0, U32; default: 0, keeps: true; choices: &[];
                rule: "must be in [0, 2^32)"; apply: |c, v| c.max_leases = v as u32;
            }
            /// Bytes the peer may hold under lease at once (0: no limit).
            max_lease_bytes => max_lease_bytes {
                range: 0, i64::MAX; default: 0, keeps: true; choices: &[];
                rule: "must be >= 0"; apply: |c, v| c.max_lease_bytes = v as u64;
            }
            /// The window (ms) of every export that names none (0: none).
            window_ms => default_window_ms {
                range: 0, i64::MAX; default: 0, keeps: true; choices: &[];
                rule: "must be >= 0"; apply: |c, v| c.default_window = Some(Duration::from_millis(v as u64));
            }
            /// How long (ms) each step of connection setup may wait for the peer (-1: no
            /// limit; 0: the library's default).
            handshake_timeout_ms => handshake_timeout_ms {
                range: -1, i64::MAX; default: 0, keeps: true; choices: &[];
                rule: "must be -1 (no limit), 0 (the default) or > 0"; apply: |c, v| c.handshake_timeout = wait_ms(v);
            }
            /// Data area of this side's send ring, a power of two >= 4096 (0: the
            /// library's default).
            ring_bytes => ring_bytes {
                range: 0, i64::MAX; default: 0, keeps: true; choices: &[];
                rule: "must be >= 0 (0: the default)"; apply: |c, v| c.ring_bytes = v as usize;
            }
            /// Device of this side's GPU bounce ring (-1: no GPU ring); with one, opening
            /// the connection needs a CUDA driver.
            cuda_ring_device => cuda_ring_device {
                range: -1, 255; default: -1, keeps: false; choices: &[];
                rule: "must be -1 (no GPU ring) or a device index";
                apply: |c, v| c.cuda_ring = (v >= 0).then(|| CudaRingConfig { device: v as i32, ..CudaRingConfig::default() });
            }
            /// Bytes per GPU ring slot, a multiple of 256 and at least 4096 (0: the
            /// library's default).
            cuda_ring_slot_bytes => cuda_ring_slot_bytes {
                range: 0, i64::MAX; default: 0, keeps: true; choices: &[];
                rule: "must be >= 0 (0: the default)";
                apply: |c, v| if let Some(r) = &mut c.cuda_ring { r.slot_bytes = v as u64 };
            }
            /// Slots in the GPU ring's arena (0: the library's default).
            cuda_ring_slots => cuda_ring_slots {
                range: 0, U32; default: 0, keeps: true; choices: &[];
                rule: "must be in [0, 2^32) (0: the default)";
                apply: |c, v| if let Some(r) = &mut c.cuda_ring { r.slots = v as u32 };
            }
            /// How this side waits for the peer's CUDA work: 0 stream (the GPU waits), 1
            /// host (the receiving thread waits), 2 event (the stream waits on an IPC
            /// event). Every value sets it, 0 too.
            cuda_wait => cuda_wait {
                range: 0, 2; default: 0, keeps: false; choices: &["stream", "host", "event"];
                rule: "must be 0 (stream), 1 (host) or 2 (event)";
                apply: |c, v| c.cuda_wait = CudaWait::ALL.get(v as usize).copied().unwrap_or_default();
            }
            /// The longest (ms) a wait for the peer's CUDA work may take (-1: no limit; 0:
            /// the library's default).
            cuda_wait_timeout_ms => cuda_wait_timeout_ms {
                range: -1, i64::MAX; default: 0, keeps: true; choices: &[];
                rule: "must be -1 (no limit), 0 (the default) or > 0"; apply: |c, v| c.cuda_wait_timeout = wait_ms(v);
            }
        }
    };
}

macro_rules! option_table {
    ($(
        $(#[doc = $doc:literal])* $name:ident => $field:ident {
            range: $min:expr, $max:expr; default: $default:literal, keeps: $keeps:literal; choices: $choices:expr;
            rule: $rule:literal; apply: $apply:expr;
        }
    )*) => {
        /// Every connection option, in schema order.
        pub const CONNECTION_OPTIONS: &[ConnectionOption] = &[$(ConnectionOption {
            name: stringify!($name),
            ty: "int",
            min: $min,
            max: $max,
            default: $default,
            keeps: $keeps,
            choices: $choices,
            doc: concat!($($doc),*),
            c_field: stringify!($field),
            rule: $rule,
            apply: $apply,
        }),*];
    };
}
with_connection_options!(option_table);

impl ConnectionOption {
    /// The option called `name`.
    pub fn named(name: &str) -> Option<&'static ConnectionOption> {
        CONNECTION_OPTIONS.iter().find(|o| o.name == name)
    }

    /// Why `value` is refused (`"tensorwire: max_leases must be in [0, 2^32), got -1"`),
    /// or `None` when it is in range: the one message every consumer shows.
    pub fn refusal(&self, value: i64) -> Option<String> {
        (!(self.min..=self.max).contains(&value)).then(|| format!("tensorwire: {} {}, got {value}", self.name, self.rule))
    }

    /// `value` checked: `Error::InvalidArgument` with [`refusal`](Self::refusal)'s message.
    pub fn check(&self, value: i64) -> Result<()> {
        self.refusal(value).map_or(Ok(()), |m| Err(Error::InvalidArgument(m)))
    }

    /// Whether `value` (checked) changes a config: the default of a `keeps` option does not.
    pub fn sets(&self, value: i64) -> bool {
        !(self.keeps && value == self.default)
    }
}

/// A config from every option's value, in schema order, over [`PeerConfig::default`]:
/// each value is checked (the first out of range is refused with its
/// [`refusal`](ConnectionOption::refusal) message), then set.
pub fn peer_config_from_options(values: &[i64]) -> Result<PeerConfig> {
    if values.len() != CONNECTION_OPTIONS.len() {
        return Err(Error::InvalidArgument(format!(
            "tensorwire: {} connection options, expected {}",
            values.len(),
            CONNECTION_OPTIONS.len()
        )));
    }
    for (o, &v) in CONNECTION_OPTIONS.iter().zip(values) {
        o.check(v)?;
    }
    let mut c = PeerConfig::default();
    for (o, &v) in CONNECTION_OPTIONS.iter().zip(values) {
        if o.sets(v) {
            (o.apply)(&mut c, v);
        }
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(set: &[(&str, i64)]) -> Vec<i64> {
        CONNECTION_OPTIONS.iter().map(|o| set.iter().find(|(n, _)| *n == o.name).map_or(o.default, |s| s.1)).collect()
    }

    #[test]
    fn every_option_is_checked_by_its_range_with_its_own_message() {
        for o in CONNECTION_OPTIONS {
            assert!(o.min <= o.default && o.default <= o.max, "{}'s default is out of its range", o.name);
            for bad in [o.min.checked_sub(1), o.max.checked_add(1)].into_iter().flatten() {
                let e = peer_config_from_options(&values(&[(o.name, bad)])).unwrap_err();
                let want = format!("tensorwire: {} {}, got {bad}", o.name, o.rule);
                assert!(matches!(&e, Error::InvalidArgument(m) if *m == want), "{}: {e}", o.name);
            }
            for good in [o.min, o.max] {
                peer_config_from_options(&values(&[(o.name, good)])).unwrap();
            }
        }
        assert_eq!(
            ConnectionOption::named("max_leases").unwrap().refusal(-1).unwrap(),
            "tensorwire: max_leases must be in [0, 2^32), got -1"
        );
        let e = peer_config_from_options(&[0; 3]).unwrap_err();
        assert!(e.to_string().contains("3 connection options, expected 10"), "{e}");
    }

    #[test]
    fn the_defaults_keep_the_librarys_config_and_values_reach_their_fields() {
        let d = PeerConfig::default();
        let c = peer_config_from_options(&values(&[])).unwrap();
        assert_eq!(format!("{c:?}"), format!("{:?}", PeerConfig { cuda_wait: CudaWait::Stream, ..d.clone() }));
        let c = peer_config_from_options(&values(&[
            ("max_leases", 7),
            ("max_lease_bytes", 8),
            ("window_ms", 9),
            ("handshake_timeout_ms", -1),
            ("ring_bytes", 8192),
            ("cuda_ring_device", 2),
            ("cuda_ring_slot_bytes", 65536),
            ("cuda_ring_slots", 3),
            ("cuda_wait", 1),
            ("cuda_wait_timeout_ms", 5),
        ]))
        .unwrap();
        assert_eq!((c.max_leases, c.max_lease_bytes, c.default_window), (7, 8, Some(Duration::from_millis(9))));
        assert_eq!((c.handshake_timeout, c.ring_bytes), (Wait::Forever, 8192));
        let r = c.cuda_ring.unwrap();
        assert_eq!((r.device, r.slot_bytes, r.slots), (2, 65536, 3));
        assert_eq!((c.cuda_wait, c.cuda_wait_timeout), (CudaWait::Host, Wait::For(Duration::from_millis(5))));
        // The ring's sizes need a ring: without a device they set nothing.
        let c = peer_config_from_options(&values(&[("cuda_ring_slots", 3)])).unwrap();
        assert!(c.cuda_ring.is_none());
    }

    #[test]
    fn the_cuda_wait_choices_are_the_policies() {
        let o = ConnectionOption::named("cuda_wait").unwrap();
        let names: Vec<_> = CudaWait::ALL.iter().map(|w| w.name()).collect();
        assert_eq!(o.choices, names.as_slice());
        assert_eq!(o.max as usize + 1, names.len());
        for (i, w) in CudaWait::ALL.iter().enumerate() {
            assert_eq!(*w as usize, i);
        }
    }
}
