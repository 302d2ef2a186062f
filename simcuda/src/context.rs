//! Devices, primary contexts and the per-thread current-context stack.
//!
//! `SIMCUDA_DEVICES` devices (default 2). Each has one primary context, retained and
//! released by count; a context handle is the address of its (never freed) record. Only
//! primary contexts exist here (`cuCtxCreate` is not provided).

use crate::result::*;
use std::cell::RefCell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

static INIT: AtomicBool = AtomicBool::new(false);

pub fn initialised() -> bool {
    // Acquire: pairs with the Release store in `init`; the device table is built before.
    INIT.load(Ordering::Acquire)
}

/// `cuInit(0)`: any other flag value is CUDA_ERROR_INVALID_VALUE (documented: "Flags
/// must be 0").
pub fn init(flags: u32) -> R {
    if flags != 0 {
        return Err(INVALID_VALUE);
    }
    contexts();
    // Release: pairs with the Acquire load in `initialised`.
    INIT.store(true, Ordering::Release);
    Ok(())
}

/// One device's primary context.
pub struct Context {
    pub device: i32,
    /// Retain count; the context is usable while it is above zero.
    pub refs: AtomicU32,
}

fn contexts() -> &'static [Context] {
    static CTX: OnceLock<Vec<Context>> = OnceLock::new();
    CTX.get_or_init(|| {
        let n = std::env::var("SIMCUDA_DEVICES").ok().and_then(|v| v.parse::<i32>().ok()).unwrap_or(2).clamp(0, 16);
        (0..n).map(|device| Context { device, refs: AtomicU32::new(0) }).collect()
    })
}

pub fn device_count() -> i32 {
    contexts().len() as i32
}

pub fn check_device(dev: i32) -> R<&'static Context> {
    usize::try_from(dev).ok().and_then(|d| contexts().get(d)).ok_or(INVALID_DEVICE)
}

/// The context record behind a handle, if the handle is one of ours.
pub fn from_handle(h: usize) -> Option<&'static Context> {
    contexts().iter().find(|c| std::ptr::from_ref(*c) as usize == h)
}

pub fn handle(c: &'static Context) -> usize {
    std::ptr::from_ref(c) as usize
}

pub fn retain(dev: i32) -> R<usize> {
    let c = check_device(dev)?;
    // Relaxed: a count; the context record itself is immutable.
    c.refs.fetch_add(1, Ordering::Relaxed);
    Ok(handle(c))
}

/// Release one retain; releasing a context nobody retained is CUDA_ERROR_INVALID_CONTEXT
/// (the documentation lists it; the strict choice).
pub fn release(dev: i32) -> R {
    let c = check_device(dev)?;
    // Relaxed: a count (see `retain`).
    c.refs.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| r.checked_sub(1)).map(|_| ()).map_err(|_| INVALID_CONTEXT)
}

pub fn is_active(c: &Context) -> bool {
    // Relaxed: a count (see `retain`).
    c.refs.load(Ordering::Relaxed) > 0
}

/// Sum of all primary-context retain counts.
pub fn live_retains() -> u64 {
    // Relaxed: statistics.
    contexts().iter().map(|c| u64::from(c.refs.load(Ordering::Relaxed))).sum()
}

thread_local! {
    static STACK: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// The context current on this thread, which must be retained (active): else
/// CUDA_ERROR_INVALID_CONTEXT, as the driver answers a call that needs a context.
pub fn current() -> R<&'static Context> {
    let top = STACK.with(|s| s.borrow().last().copied()).ok_or(INVALID_CONTEXT)?;
    let c = from_handle(top).ok_or(INVALID_CONTEXT)?;
    if !is_active(c) {
        return Err(INVALID_CONTEXT);
    }
    Ok(c)
}

/// The handle on top of the stack (0 if none), whatever its state.
pub fn current_handle() -> usize {
    STACK.with(|s| s.borrow().last().copied()).unwrap_or(0)
}

pub fn push(h: usize) -> R {
    let c = from_handle(h).ok_or(INVALID_CONTEXT)?;
    if !is_active(c) {
        return Err(INVALID_CONTEXT);
    }
    STACK.with(|s| s.borrow_mut().push(h));
    Ok(())
}

pub fn pop() -> R<usize> {
    STACK.with(|s| s.borrow_mut().pop()).ok_or(INVALID_CONTEXT)
}

/// `cuCtxSetCurrent`: replace the top of the stack (null pops it).
pub fn set(h: usize) -> R {
    if h == 0 {
        STACK.with(|s| s.borrow_mut().pop());
        return Ok(());
    }
    let c = from_handle(h).ok_or(INVALID_CONTEXT)?;
    if !is_active(c) {
        return Err(INVALID_CONTEXT);
    }
    STACK.with(|s| {
        let mut s = s.borrow_mut();
        s.pop();
        s.push(h);
    });
    Ok(())
}
