//! A worker's process as the supervisor holds it: one started by `std::process::Command`
//! (exec'd), or one a zygote forked as this process's child (`CLONE_PARENT`), which no
//! `Child` stands for. Both are this process's children: waited for with `waitpid`.

use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ExitStatus};

pub(crate) enum Process {
    Spawned(Child),
    /// Forked by a zygote as our child; `ended` once reaped here.
    Forked { pid: u32, ended: Option<ExitStatus> },
}

impl Process {
    /// Wait for it to end and reap it (its status again once reaped).
    pub(crate) fn wait(&mut self) -> std::io::Result<ExitStatus> {
        match self {
            Process::Spawned(c) => c.wait(),
            Process::Forked { pid, ended } => match ended {
                Some(s) => Ok(*s),
                None => {
                    let s = waitpid(*pid, 0)?;
                    *ended = s;
                    s.ok_or_else(|| std::io::Error::other(format!("waitpid({pid}) returned no status")))
                }
            },
        }
    }

    /// Reap it if it has ended; `None` while it runs.
    pub(crate) fn try_wait(&mut self) -> std::io::Result<Option<ExitStatus>> {
        match self {
            Process::Spawned(c) => c.try_wait(),
            Process::Forked { pid, ended } => {
                if ended.is_none() {
                    *ended = waitpid(*pid, libc::WNOHANG)?;
                }
                Ok(*ended)
            }
        }
    }
}

/// `waitpid(pid, flags)`, retried on `EINTR`; `None`: still running (`WNOHANG`).
fn waitpid(pid: u32, flags: libc::c_int) -> std::io::Result<Option<ExitStatus>> {
    loop {
        let mut status = 0;
        // SAFETY: `status` is writable; `pid` is our unreaped child (only this handle reaps it).
        let r = unsafe { libc::waitpid(pid as libc::pid_t, &mut status, flags) };
        if r == pid as libc::pid_t {
            return Ok(Some(ExitStatus::from_raw(status)));
        }
        if r == 0 {
            return Ok(None);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}
