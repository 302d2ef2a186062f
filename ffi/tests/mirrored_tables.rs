//! The tables other languages still list, checked against the one Rust table each comes
//! from.
//!
//! - Result codes: `tensorwire::error::RESULT_CODES` (number, name, kind, Python class).
//!   `tw_result_e` spells the numbers out for cbindgen: the header's enum must be the
//!   table, both ways; `tw_result_name` reads the table; `tensorwire.errors` builds its
//!   classes from it (`_native.result_codes()`), so it must define every class the table
//!   names, and no Python module may spell a code out.
//! - Connection options: `tensorwire::peer::options::CONNECTION_OPTIONS` (name, range,
//!   default, message, field). The header's `TW_CONNECTION_OPTIONS` X-macro (generated
//!   from the table by `ffi/tests/c_header.rs`; the C++ extension's schemas are made from it)
//!   must list the options in order with their defaults; no C++ source may list them
//!   again; every field of the header's `tw_peer_config_t` is an option's or named in
//!   [`NOT_OPTIONS`] with the reason.
//!
//! A new code, option or field then fails here until every listing agrees.

use std::collections::BTreeSet;
use std::ffi::CStr;
use std::path::Path;
use tensorwire::error::RESULT_CODES;
use tensorwire_ffi::{tw_result_e, tw_result_name};
use tensorwire::peer::options::CONNECTION_OPTIONS;

/// The repository's root: the other languages' listings are the repository's files, not
/// this crate's.
fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("ffi/ lies in the repository")
}

/// The file at `rel` from the repository's root.
fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
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
    let header = read("ffi/include/tensorwire.h");
    let body = between(&header, "typedef enum {\n  TW_OK", "} tw_result_e;");
    std::iter::once("TW_OK = 0,")
        .chain(body.lines().map(str::trim).filter(|l| l.starts_with("TW_")))
        .map(|l| {
            let (name, value) = l.trim_end_matches(',').split_once(" = ").unwrap_or_else(|| panic!("enumerator `{l}`"));
            (name.to_owned(), value.parse().unwrap_or_else(|_| panic!("value of `{l}`")))
        })
        .collect()
}

/// Fields of `tw_peer_config_t` that are no connection option (not offered to the torch
/// ops nor `tw_peer_config_set_option`), each with why.
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
fn the_headers_result_codes_are_the_table() {
    let header = header_result_codes();
    let table: Vec<(String, u32)> = RESULT_CODES.iter().map(|r| (r.name.to_owned(), r.code)).collect();
    assert_eq!(header, table, "ffi/include/tensorwire.h's tw_result_e (ffi/src/lib.rs) and RESULT_CODES (src/error/codes.rs) disagree");
    for (name, value) in header {
        // SAFETY: `value` is a discriminant of `tw_result_e` as the header generated from
        // it declares it (`ffi/tests/c_header.rs` keeps the header current), and the enum is
        // `#[repr(C)]` (an int).
        let code: tw_result_e = unsafe { std::mem::transmute::<u32, tw_result_e>(value) };
        // SAFETY: tw_result_name returns a static NUL-terminated string for every code.
        let named = unsafe { CStr::from_ptr(tw_result_name(code)) }.to_str().unwrap();
        assert_eq!(named, name, "tw_result_name({value}) names another code (the C++ error prefix uses it)");
    }
}

#[test]
fn python_defines_every_class_the_table_names_and_spells_no_code_out() {
    let errors = read("python/tensorwire/errors.py");
    for r in RESULT_CODES.iter().filter(|r| !r.class.is_empty()) {
        assert!(
            errors.contains(&format!("\nclass {}(", r.class)),
            "RESULT_CODES names the Python class `{}` for {}, which python/tensorwire/errors.py does not define",
            r.class,
            r.name
        );
    }
    for file in [
        "python/tensorwire/errors.py",
        "python/tensorwire/_ops.py",
        "python/tensorwire/_cuda_ops.py",
        "python/tensorwire/connection.py",
    ] {
        let spelled = quoted_codes(&read(file));
        assert!(spelled.is_empty(), "{file} spells result codes out ({spelled:?}): read them from _native.result_codes()");
    }
}

#[test]
fn the_headers_option_macro_lists_the_options_in_order() {
    let header = read("ffi/include/tensorwire.h");
    let listed: Vec<(String, i64)> = between(&header, "#define TW_CONNECTION_OPTIONS(X)", "\n\n")
        .split("X(")
        .skip(1)
        .map(|o| {
            let (name, default) = o.split_once(')').unwrap().0.split_once(',').unwrap();
            (name.trim().to_owned(), default.trim().parse().unwrap_or_else(|_| panic!("default of `{o}`")))
        })
        .collect();
    let table: Vec<(String, i64)> = CONNECTION_OPTIONS.iter().map(|o| (o.name.to_owned(), o.default)).collect();
    assert_eq!(
        listed, table,
        "ffi/include/tensorwire.h's TW_CONNECTION_OPTIONS must list CONNECTION_OPTIONS (src/peer/options.rs) in order, with their defaults: regenerate the header (ffi/tests/c_header.rs)"
    );
}

#[test]
fn no_other_source_lists_the_options_or_their_messages() {
    let dir = root().join("cpp/src");
    let mut sources: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| format!("cpp/src/{}", e.unwrap().file_name().to_string_lossy()))
        .collect();
    sources.extend(["python/native/src/config.rs".to_owned(), "python/tensorwire/_ops.py".to_owned()]);
    for file in &sources {
        let text = read(file);
        assert!(!text.contains("#define TW_CONNECTION_OPTIONS("), "{file} defines its own TW_CONNECTION_OPTIONS");
        for o in CONNECTION_OPTIONS {
            let message = format!("tensorwire: {} must be", o.name);
            assert!(!text.contains(&message), "{file} words `{message}` itself: the refusal is the table's");
        }
    }
}

#[test]
fn every_config_field_is_an_option_or_named_as_not_one() {
    let header = read("ffi/include/tensorwire.h");
    let config = between(&header, "typedef struct {\n  /*\n   `sizeof(tw_peer_config_t)`", "} tw_peer_config_t;");
    let fields: BTreeSet<String> = config
        .lines()
        .map(str::trim)
        .filter(|l| l.ends_with(';') && !l.starts_with('*'))
        .map(|l| l.trim_end_matches(';').rsplit(' ').next().unwrap().to_owned())
        .collect();
    assert!(fields.contains("size") && fields.contains("cuda_wait"), "tw_peer_config_t's fields not found: {fields:?}");
    let set: BTreeSet<String> = CONNECTION_OPTIONS.iter().map(|o| o.c_field.to_owned()).collect();
    let unknown: Vec<_> = set.difference(&fields).collect();
    assert!(unknown.is_empty(), "options set {unknown:?}, which tw_peer_config_t does not have");
    let excused: BTreeSet<String> = NOT_OPTIONS.iter().map(|(f, _)| (*f).to_owned()).collect();
    let stale: Vec<_> = excused.iter().filter(|f| !fields.contains(*f) || set.contains(*f)).collect();
    assert!(stale.is_empty(), "NOT_OPTIONS names {stale:?}, which are options or not fields");
    let missing: Vec<_> = fields.iter().filter(|f| !set.contains(*f) && !excused.contains(*f)).collect();
    assert!(
        missing.is_empty(),
        "tw_peer_config_t fields {missing:?} are neither connection options (CONNECTION_OPTIONS) nor in NOT_OPTIONS"
    );
}
