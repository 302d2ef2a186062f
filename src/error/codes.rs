//! The result codes, once: each code's number (the C ABI's `tw_result_e`), name, the
//! [`ErrorKind`] it reports and the Python class it raises. The C ABI's names
//! (`tw_result_name`), the Python binding's exceptions and `tensorwire.errors` read this
//! table; `tw_result_e` spells the numbers out for cbindgen, and
//! `ffi/tests/mirrored_tables.rs` checks the generated header against this table.

use super::ErrorKind;
use std::ffi::CStr;

/// One result code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResultCode {
    /// Its number (stable; each area has its own range: 0–99 general, 100–199
    /// connection, 200–299 descriptors and segments, 300–399 leases, 400–499 CUDA).
    pub code: u32,
    /// Its name, as the C header, messages (`"tensorwire (TW_ERR_…): …"`) and Python's
    /// `Error.code` spell it.
    pub name: &'static str,
    /// `name`, NUL-terminated, for the C ABI.
    pub c_name: &'static CStr,
    /// The kind of [`Error`](super::Error) reported with this code; `None` for the codes
    /// that are not a library error (success, a NULL pointer, a panic caught at the C ABI).
    pub kind: Option<ErrorKind>,
    /// The `tensorwire.errors` class (Python) a failure with this code raises.
    pub class: &'static str,
}

/// `stringify!(name)` as a `&CStr`, at compile time.
const fn c_name(with_nul: &'static str) -> &'static CStr {
    match CStr::from_bytes_with_nul(with_nul.as_bytes()) {
        Ok(c) => c,
        Err(_) => panic!("a result code's name has a NUL inside"),
    }
}

macro_rules! result_codes {
    ($($name:ident = $code:literal, $kind:expr, $class:literal;)*) => {
        /// Every result code, by number.
        pub const RESULT_CODES: &[ResultCode] = &[$(ResultCode {
            code: $code,
            name: stringify!($name),
            c_name: c_name(concat!(stringify!($name), "\0")),
            kind: $kind,
            class: $class,
        }),*];
    };
}

result_codes! {
    TW_OK = 0, None, "";
    TW_ERR_NULL_ARGUMENT = 1, None, "Refused";
    TW_ERR_INVALID_ARGUMENT = 2, Some(ErrorKind::InvalidArgument), "Refused";
    TW_ERR_PANIC = 3, None, "Error";
    TW_ERR_IO = 4, Some(ErrorKind::Io), "Error";
    TW_ERR_TIMEOUT = 5, Some(ErrorKind::Timeout), "Timeout";
    TW_ERR_RESOURCE = 6, Some(ErrorKind::Resource), "ResourceExhausted";
    TW_ERR_PEER_GONE = 100, Some(ErrorKind::PeerGone), "PeerGone";
    TW_ERR_PROTOCOL = 101, Some(ErrorKind::Protocol), "Refused";
    TW_ERR_INVALID_DESCRIPTOR = 200, Some(ErrorKind::InvalidDescriptor), "Refused";
    TW_ERR_INVALID_SEGMENT = 201, Some(ErrorKind::InvalidSegment), "Refused";
    TW_ERR_STALE_LEASE = 300, Some(ErrorKind::StaleLease), "Refused";
    TW_ERR_QUOTA_EXCEEDED = 301, Some(ErrorKind::QuotaExceeded), "QuotaExceeded";
    TW_ERR_CUDA_UNAVAILABLE = 400, Some(ErrorKind::CudaUnavailable), "CudaUnavailable";
    TW_ERR_CUDA = 401, Some(ErrorKind::Cuda), "Error";
}

impl ResultCode {
    /// The code with this number.
    pub fn by_code(code: u32) -> Option<&'static ResultCode> {
        RESULT_CODES.iter().find(|r| r.code == code)
    }

    /// The code a failure of `kind` is reported with.
    pub fn of_kind(kind: ErrorKind) -> &'static ResultCode {
        RESULT_CODES
            .iter()
            .find(|r| r.kind == Some(kind))
            // Every kind has its code (tested below); a kind newer than the table is an
            // I/O failure, as the Python side reads an unknown code as the base class.
            .unwrap_or_else(|| ResultCode::by_code(4).unwrap_or(&RESULT_CODES[0]))
    }
}

impl super::Error {
    /// The result code this failure is reported with (C ABI, messages, Python classes).
    pub fn code(&self) -> &'static ResultCode {
        ResultCode::of_kind(self.kind())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind, listed by an exhaustive match so a new kind fails to compile here until
    /// it is added (and then the test needs its code in the table).
    fn all_kinds() -> Vec<ErrorKind> {
        use ErrorKind::*;
        let all = [Io, PeerGone, Timeout, InvalidDescriptor, InvalidSegment, Protocol, StaleLease, QuotaExceeded,
                   InvalidArgument, CudaUnavailable, Cuda, Resource];
        for k in all {
            match k {
                Io | PeerGone | Timeout | InvalidDescriptor | InvalidSegment | Protocol | StaleLease | QuotaExceeded
                | InvalidArgument | CudaUnavailable | Cuda | Resource => {}
            }
        }
        all.to_vec()
    }

    #[test]
    fn every_kind_has_exactly_one_code_and_codes_are_unique() {
        for k in all_kinds() {
            let n = RESULT_CODES.iter().filter(|r| r.kind == Some(k)).count();
            assert_eq!(n, 1, "{k:?} is the kind of {n} result codes");
            assert_eq!(ResultCode::of_kind(k).kind, Some(k));
        }
        for (i, r) in RESULT_CODES.iter().enumerate() {
            assert!(RESULT_CODES[..i].iter().all(|o| o.code != r.code && o.name != r.name), "{} twice", r.name);
            assert_eq!(r.c_name.to_str().unwrap(), r.name);
            assert!(r.name.starts_with(if r.code == 0 { "TW_OK" } else { "TW_ERR_" }), "{}", r.name);
            assert_eq!(r.class.is_empty(), r.code == 0, "{}: only TW_OK has no class", r.name);
        }
    }
}
