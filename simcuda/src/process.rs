//! Whether another process (an exporter, an importer, an event's recorder) still lives.

/// True if process `pid` exists (a process of another user counts: EPERM).
pub fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(pid as i32, 0) == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM) }
}
