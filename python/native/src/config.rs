//! The connection options of the opening ops (`from_fd`, `connect`, `accept`) as one
//! `PeerConfig`, through the library's table (`tensorwire::peer::options`): its ranges,
//! defaults and refusal messages are the ones the C ABI's `tw_peer_config_set_option`, and
//! through it the C++ extension, use. A bad value is refused under its own name with that
//! message (a plain `tensorwire.Error`, no code, as the extension's check reads after
//! `translate`).

use crate::errors::raise;
use pyo3::prelude::*;
use std::time::Duration;
use tensorwire::peer::options::{peer_config_from_options, CONNECTION_OPTIONS};
use tensorwire::{PeerConfig, Wait};

/// The C convention of a wait in ms: < 0 no limit, 0 do not wait, n > 0 at most n ms.
pub fn wait_ms(ms: i64) -> Wait {
    match ms {
        ..0 => Wait::Forever,
        0 => Wait::Never,
        ms => Wait::For(Duration::from_millis(ms.unsigned_abs())),
    }
}

/// `options` in schema order (`None`: every option at its default).
pub fn peer_config(py: Python<'_>, options: Option<Vec<i64>>) -> PyResult<PeerConfig> {
    let o = options.unwrap_or_else(|| CONNECTION_OPTIONS.iter().map(|o| o.default).collect());
    if o.len() != CONNECTION_OPTIONS.len() {
        return Err(crate::errors::refused(
            py,
            format!("tensorwire: {} connection options, expected {}", o.len(), CONNECTION_OPTIONS.len()),
        ));
    }
    // The value's own message, as the extension's check shows it (no code).
    if let Some(m) = CONNECTION_OPTIONS.iter().zip(&o).find_map(|(opt, &v)| opt.refusal(v)) {
        return Err(raise(py, "Error", None, m));
    }
    peer_config_from_options(&o).map_err(|e| crate::errors::to_py(py, &e))
}

/// Check `options` (schema order) as the opening ops do, opening nothing: `accept` checks
/// them before it looks at its listener handle, as the extension does.
#[pyfunction]
pub fn check_connection_options(py: Python<'_>, options: Vec<i64>) -> PyResult<()> {
    peer_config(py, Some(options)).map(drop)
}

/// One connection option as `_native.connection_options()` lists it.
type OptionRow = (&'static str, &'static str, i64, i64, i64, &'static str, Vec<&'static str>);

/// The connection options, in schema order: `(name, type, min, max, default, doc,
/// choices)` (`choices`: the names of the values 0, 1, ... where the option is a choice).
/// `tensorwire._ops` builds the opening ops' schemas from it, `tensorwire.connection`
/// the names it converts.
#[pyfunction]
pub fn connection_options() -> Vec<OptionRow> {
    CONNECTION_OPTIONS.iter().map(|o| (o.name, o.ty, o.min, o.max, o.default, o.doc.trim(), o.choices.to_vec())).collect()
}
