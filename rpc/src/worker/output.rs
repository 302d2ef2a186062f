//! A worker's stdout and stderr: forwarded line by line after a prefix, or captured (the
//! last bytes of each), by one thread per stream that ends with the stream.

use super::Output;
use parking_lot::Mutex;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Child, Stdio};
use std::sync::Arc;

/// The `Stdio` a spawn gives the child's stdout and stderr for `output`.
pub(crate) fn stdio(output: &Output) -> (Stdio, Stdio) {
    match output {
        Output::Inherit => (Stdio::inherit(), Stdio::inherit()),
        Output::Prefixed(_) | Output::Capture { .. } => (Stdio::piped(), Stdio::piped()),
    }
}

/// What a worker started with `Output::Capture` wrote: the last `max_bytes` of each stream
/// (everything it wrote until now; the threads keep reading while it runs).
#[derive(Clone, Default)]
pub struct Captured {
    stdout: Arc<Mutex<Vec<u8>>>,
    stderr: Arc<Mutex<Vec<u8>>>,
}

impl Captured {
    pub fn stdout(&self) -> Vec<u8> {
        self.stdout.lock().clone()
    }
    pub fn stderr(&self) -> Vec<u8> {
        self.stderr.lock().clone()
    }
}

/// Start the threads that take the child's piped output; the captured bytes, if captured.
pub(crate) fn attach(child: &mut Child, output: &Output, pid: u32) -> Option<Captured> {
    let (out, err) = (child.stdout.take(), child.stderr.take());
    attach_streams(out, err, output, pid)
}

/// A pipe for each of a forked child's stdout and stderr when `output` takes them:
/// `(our read ends, the child's write ends)`.
pub(crate) fn pipes(output: &Output) -> std::io::Result<Option<([OwnedFd; 2], [OwnedFd; 2])>> {
    match output {
        Output::Inherit => Ok(None),
        Output::Prefixed(_) | Output::Capture { .. } => {
            let (r1, w1) = pipe()?;
            let (r2, w2) = pipe()?;
            Ok(Some(([r1, r2], [w1, w2])))
        }
    }
}

/// A close-on-exec pipe: `(read end, write end)`.
fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two fds pipe2 writes.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: both fds are fresh from pipe2 and owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// `attach` for a child whose output pipes were made by `pipes`.
pub(crate) fn attach_fds(read: Option<[OwnedFd; 2]>, output: &Output, pid: u32) -> Option<Captured> {
    let (out, err) = match read {
        Some([o, e]) => (Some(std::fs::File::from(o)), Some(std::fs::File::from(e))),
        None => (None, None),
    };
    attach_streams(out, err, output, pid)
}

fn attach_streams(out: Option<impl Read + Send + 'static>, err: Option<impl Read + Send + 'static>, output: &Output, pid: u32) -> Option<Captured> {
    match output {
        Output::Inherit => None,
        Output::Prefixed(prefix) => {
            if let Some(out) = out {
                forward(out, prefix.clone(), pid, "stdout", || Box::new(std::io::stdout()));
            }
            if let Some(err) = err {
                forward(err, prefix.clone(), pid, "stderr", || Box::new(std::io::stderr()));
            }
            None
        }
        Output::Capture { max_bytes } => {
            let captured = Captured::default();
            if let Some(out) = out {
                capture(out, captured.stdout.clone(), *max_bytes, pid, "stdout");
            }
            if let Some(err) = err {
                capture(err, captured.stderr.clone(), *max_bytes, pid, "stderr");
            }
            Some(captured)
        }
    }
}

fn forward(from: impl Read + Send + 'static, prefix: String, pid: u32, which: &str, to: fn() -> Box<dyn Write>) {
    let spawned = std::thread::Builder::new().name(format!("tensorwire-worker-{pid}-{which}")).spawn(move || {
        let mut lines = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match lines.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let mut sink = to();
                    // One write per line, so lines of several workers do not interleave
                    // within a line; a closed sink (our own stdout gone) drops the line.
                    let mut buf = Vec::with_capacity(prefix.len() + line.len());
                    buf.extend_from_slice(prefix.as_bytes());
                    buf.extend_from_slice(&line);
                    let _ = sink.write_all(&buf);
                }
            }
        }
    });
    // Without the thread the pipe fills and the worker blocks on its next write: say so
    // on our stderr (the worker itself stays usable until then).
    if let Err(e) = spawned {
        eprintln!("tensorwire: no thread to forward worker {pid}'s {which}: {e}");
    }
}

fn capture(from: impl Read + Send + 'static, into: Arc<Mutex<Vec<u8>>>, max_bytes: usize, pid: u32, which: &str) {
    let spawned = std::thread::Builder::new().name(format!("tensorwire-worker-{pid}-{which}")).spawn(move || {
        let mut from = from;
        let mut buf = vec![0u8; 16 << 10];
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let mut kept = into.lock();
                    kept.extend_from_slice(&buf[..n]);
                    if kept.len() > max_bytes {
                        let drop = kept.len() - max_bytes;
                        kept.drain(..drop);
                    }
                }
            }
        }
    });
    if let Err(e) = spawned {
        eprintln!("tensorwire: no thread to capture worker {pid}'s {which}: {e}");
    }
}
