//! The tables other languages mirror, checked against the one each is generated from.
//!
//! - Result codes: `tw_result_e` (Rust, `src/ffi/mod.rs`) → `include/tensorwire.h`
//!   (cbindgen; `tests/c_header.rs`) → the C++ error prefix (`tw_result_name`, checked here
//!   for every code) → Python's exception classes (`python/tensorwire/errors.py`: every
//!   code in `CODES` or `BASE_CODES`, and nothing else).
//! - Connection options: `PeerConfig` → `tw_peer_config_t` (a struct literal with every
//!   field in `src/ffi/config.rs`: the compiler checks it) → the torch ops' options
//!   (`TW_CONNECTION_OPTIONS` in `cpp/src/common.h`, turned into a config in
//!   `cpp/src/connection.cpp`): every option sets a field the header has, and every field
//!   is an option or named in [`NOT_OPTIONS`] with the reason.
//!
//! A new code or field then fails here until it is placed on every side.

use std::collections::BTreeSet;
use std::ffi::CStr;
use std::path::Path;
use tensorwire::ffi::{tw_result_e, tw_result_name};

fn read(rel: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The text between the first `start` and the first `end` after it.
fn between<'a>(text: &'a str, start: &str, end: &str) -> &'a str {
    let at = text.find(start).unwrap_or_else(|| panic!("`{start}` not found"));
    let rest = &text[at + start.len()..];
    &rest[..rest.find(end).unwrap_or_else(|| panic!("`{end}` not found after `{start}`"))]
}

/// Every `"TW_…"` string literal in `text`.
fn quoted_codes(text: &str) -> BTreeSet<String> {
    text.split('"').skip(1).step_by(2).filter(|s| s.starts_with("TW_")).map(str::to_owned).collect()
}

/// `(name, value)` of every `tw_result_e` enumerator the header declares.
fn header_result_codes() -> Vec<(String, u32)> {
    let header = read("include/tensorwire.h");
    let body = between(&header, "typedef enum {\n  TW_OK", "} tw_result_e;");
    std::iter::once("TW_OK = 0,")
        .chain(body.lines().map(str::trim).filter(|l| l.starts_with("TW_")))
        .map(|l| {
            let (name, value) = l.trim_end_matches(',').split_once(" = ").unwrap_or_else(|| panic!("enumerator `{l}`"));
            (name.to_owned(), value.parse().unwrap_or_else(|_| panic!("value of `{l}`")))
        })
        .collect()
}

/// Fields of `tw_peer_config_t` not offered as torch-op options, each with why.
const NOT_OPTIONS: &[(&str, &str)] = &[
    ("size", "the C ABI's struct version, set by tw_peer_config_default"),
    ("max_peer_table_capacity", "a guard against the peer: the default fits every honest peer"),
    ("max_message", "a guard against the peer"),
    ("max_import_segments", "a guard against the peer"),
    ("max_peer_ring_bytes", "a guard against the peer"),
    ("max_ring_message", "a guard against the peer"),
    ("max_import_mapped_bytes", "a guard against the peer; its default follows the machine"),
    ("ring_spin", "tuning measured per machine; Rust and C only"),
    ("reap_interval_us", "tuning; Rust and C only"),
    ("recv_spin_us", "tuning measured per machine; Rust and C only"),
    ("send_timeout_ms", "Rust and C only: a torch op's send waits the library's default"),
];

#[test]
fn every_result_code_is_named_by_tw_result_name() {
    let codes = header_result_codes();
    assert!(codes.len() > 10, "the header's tw_result_e was not found whole: {codes:?}");
    for (name, value) in codes {
        // SAFETY: `value` is a discriminant of `tw_result_e` as the header generated from
        // it declares it (`tests/c_header.rs` keeps the header current), and the enum is
        // `#[repr(u32)]`.
        let code: tw_result_e = unsafe { std::mem::transmute::<u32, tw_result_e>(value) };
        // SAFETY: tw_result_name returns a static NUL-terminated string for every code.
        let named = unsafe { CStr::from_ptr(tw_result_name(code)) }.to_str().unwrap();
        assert_eq!(named, name, "tw_result_name({value}) names another code (the C++ error prefix uses it)");
    }
}

#[test]
fn python_maps_every_result_code_once() {
    let errors = read("python/tensorwire/errors.py");
    let classes = quoted_codes(between(&errors, "CODES: dict[str, type[Error]] = {", "}"));
    let base = quoted_codes(between(&errors, "BASE_CODES: tuple[str, ...] = (", ")"));
    let header: BTreeSet<String> = header_result_codes().into_iter().map(|(n, _)| n).filter(|n| n != "TW_OK").collect();
    let both: Vec<_> = classes.intersection(&base).collect();
    assert!(both.is_empty(), "errors.py lists {both:?} in both CODES and BASE_CODES");
    let known: BTreeSet<String> = classes.union(&base).cloned().collect();
    let unmapped: Vec<_> = header.difference(&known).collect();
    assert!(unmapped.is_empty(), "result codes with no Python class: add {unmapped:?} to CODES or BASE_CODES in errors.py");
    let unknown: Vec<_> = known.difference(&header).collect();
    assert!(unknown.is_empty(), "errors.py maps {unknown:?}, which tw_result_e does not have");
}

#[test]
fn every_config_field_is_a_torch_option_or_named_as_not_one() {
    let header = read("include/tensorwire.h");
    let config = between(&header, "typedef struct {\n  /*\n   `sizeof(tw_peer_config_t)`", "} tw_peer_config_t;");
    let fields: BTreeSet<String> = config
        .lines()
        .map(str::trim)
        .filter(|l| l.ends_with(';') && !l.starts_with('*'))
        .map(|l| l.trim_end_matches(';').rsplit(' ').next().unwrap().to_owned())
        .collect();
    assert!(fields.contains("size") && fields.contains("cuda_wait"), "tw_peer_config_t's fields not found: {fields:?}");

    let common = read("cpp/src/common.h");
    let options: Vec<String> = between(&common, "#define TW_CONNECTION_OPTIONS(X)", "\n\n")
        .split("X(")
        .skip(1)
        .map(|o| o.split(',').next().unwrap().trim().to_owned())
        .collect();
    // `c.<field> = ...o.<option>...` in peer_config: the field each option sets.
    let connection = read("cpp/src/connection.cpp");
    let body = between(&connection, "tw_peer_config_t peer_config(", "\n}\n");
    let mut set = BTreeSet::new();
    for option in &options {
        let assigned: Vec<&str> = body
            .lines()
            .filter(|l| l.contains(&format!("o.{option})")) || l.contains(&format!("o.{option};")))
            .filter_map(|l| l.split("c.").nth(1)?.split(" = ").next())
            .collect();
        assert_eq!(assigned.len(), 1, "option `{option}` must set exactly one tw_peer_config_t field in peer_config, sets {assigned:?}");
        assert!(fields.contains(assigned[0]), "option `{option}` sets `{}`, which tw_peer_config_t does not have", assigned[0]);
        set.insert(assigned[0].to_owned());
    }
    let excused: BTreeSet<String> = NOT_OPTIONS.iter().map(|(f, _)| (*f).to_owned()).collect();
    let stale: Vec<_> = excused.iter().filter(|f| !fields.contains(*f) || set.contains(*f)).collect();
    assert!(stale.is_empty(), "NOT_OPTIONS names {stale:?}, which are options or not fields");
    let missing: Vec<_> = fields.iter().filter(|f| !set.contains(*f) && !excused.contains(*f)).collect();
    assert!(
        missing.is_empty(),
        "tw_peer_config_t fields {missing:?} are neither torch-op options (TW_CONNECTION_OPTIONS) nor in NOT_OPTIONS"
    );
}
