//! A line protocol over a child's stdin and stdout: the child [`say`]s lines marked with
//! `@` (libtest may write its own text on the same stdout, even before the child's first
//! line on the same line) and [`hear`]s plain lines; the parent [`Lines::send`]s and
//! [`Lines::recv`]s.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout};

/// What starts a protocol line on the child's stdout.
pub const MARK: char = '@';

/// In the child: write one protocol line to the parent.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{MARK}{line}").unwrap();
    out.flush().unwrap();
}

/// In the child: the next line from the parent; `None` when its end of stdin closed.
pub fn hear() -> Option<String> {
    let mut s = String::new();
    if std::io::stdin().read_line(&mut s).unwrap() == 0 {
        return None;
    }
    Some(s.trim_end().to_string())
}

/// The parent's side: the child, its stdin (if piped) and its stdout (piped).
pub struct Lines {
    pub child: Child,
    pub tx: Option<ChildStdin>,
    pub rx: BufReader<ChildStdout>,
}

impl Lines {
    /// Take `child`'s pipes; its stdout must be piped.
    pub fn new(mut child: Child) -> Lines {
        let tx = child.stdin.take();
        let rx = BufReader::new(child.stdout.take().expect("a line-protocol child needs a piped stdout"));
        Lines { child, tx, rx }
    }

    /// Send one line; panics if stdin was not piped or is closed.
    pub fn send(&mut self, line: &str) {
        let tx = self.tx.as_mut().expect("the child's stdin is not piped, or was closed");
        writeln!(tx, "{line}").unwrap();
        tx.flush().unwrap();
    }

    /// The next protocol line from the child (text before the mark is the harness's own
    /// output, and lines without one are skipped); `None` at EOF.
    pub fn recv(&mut self) -> Option<String> {
        loop {
            let mut s = String::new();
            if self.rx.read_line(&mut s).unwrap() == 0 {
                return None;
            }
            if let Some(at) = s.find(MARK) {
                return Some(s.trim_end()[at + 1..].to_string());
            }
        }
    }

    /// Close the child's stdin (its [`hear`] returns `None`).
    pub fn close(&mut self) {
        drop(self.tx.take());
    }

    /// SIGKILL the child (std's `Child::kill`) and reap it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
