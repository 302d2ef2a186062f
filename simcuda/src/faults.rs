//! Fault injection: `SIMCUDA_FAIL="cuIpcOpenMemHandle_v2:3,cuMemcpyDtoDAsync_v2:every=7=CUDA_ERROR_OUT_OF_MEMORY"`
//! makes the 3rd call of the first, and every 7th of the second, return an error (default
//! CUDA_ERROR_UNKNOWN; `=NAME` picks one, with or without the `CUDA_ERROR_` prefix). Calls
//! are named by their ABI symbol. A malformed rule is reported on stderr and ignored.

use crate::result::*;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

#[derive(Clone, Copy)]
enum When {
    Nth(u64),
    Every(u64),
}

struct Rule {
    when: When,
    code: CuResult,
    calls: u64,
}

static INJECTED: AtomicU64 = AtomicU64::new(0);

fn parse_rule(spec: &str) -> Option<(String, Rule)> {
    let (name, rest) = spec.split_once(':')?;
    let (when, code) = match rest.split_once('=') {
        Some(("every", tail)) => match tail.split_once('=') {
            Some((n, e)) => (When::Every(n.parse().ok()?), code_of(e)?),
            None => (When::Every(tail.parse().ok()?), UNKNOWN),
        },
        Some((n, e)) => (When::Nth(n.parse().ok()?), code_of(e)?),
        None => (When::Nth(rest.parse().ok()?), UNKNOWN),
    };
    if matches!(when, When::Nth(0) | When::Every(0)) {
        return None;
    }
    Some((name.trim().to_string(), Rule { when, code, calls: 0 }))
}

fn rules() -> &'static Mutex<HashMap<String, Rule>> {
    static RULES: OnceLock<Mutex<HashMap<String, Rule>>> = OnceLock::new();
    RULES.get_or_init(|| {
        let mut map = HashMap::new();
        for spec in std::env::var("SIMCUDA_FAIL").unwrap_or_default().split(',').filter(|s| !s.trim().is_empty()) {
            match parse_rule(spec.trim()) {
                Some((name, rule)) => {
                    map.insert(name, rule);
                }
                None => eprintln!("simcuda: ignoring malformed SIMCUDA_FAIL rule {spec:?} (want NAME:N, NAME:every=N, optionally =ERRNAME)"),
            }
        }
        Mutex::new(map)
    })
}

/// Count a call of `name`; the error to return if a rule says this call fails.
pub fn hit(name: &str) -> Option<CuResult> {
    let mut rules = rules().lock().unwrap_or_else(|e| e.into_inner());
    let rule = rules.get_mut(name)?;
    rule.calls += 1;
    let fail = match rule.when {
        When::Nth(n) => rule.calls == n,
        When::Every(n) => rule.calls % n == 0,
    };
    if fail {
        // Relaxed: statistics.
        INJECTED.fetch_add(1, Ordering::Relaxed);
        Some(rule.code)
    } else {
        None
    }
}

pub fn injected() -> u64 {
    // Relaxed: statistics.
    INJECTED.load(Ordering::Relaxed)
}
