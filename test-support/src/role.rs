//! Child roles: a test (or bench) binary re-runs itself as a child that plays a role, named
//! in one environment variable, [`ROLE_ENV`].
//!
//! A test binary's child runs one test `T` (`T --exact --include-ignored`: the same form
//! serves an `#[ignore]`d `child_entry` test and a plain `child_roles` test, which returns
//! at once in the parent's run when [`role`] is `None`); a bench binary (no libtest) runs
//! whole. The builder always sets [`ROLE_ENV`], so a child that starts a child of its own
//! never hands its role down by inheritance.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

/// The environment variable that names a child's role.
pub const ROLE_ENV: &str = "TW_TEST_ROLE";

/// In a child: the role it was started with; `None` in the process the test runner started.
pub fn role() -> Option<String> {
    std::env::var(ROLE_ENV).ok()
}

/// This binary re-run as a child playing a role: a builder of its arguments, environment
/// and stdio, and of the [`Command`] (or the parts another launcher, such as a worker
/// spec, takes).
pub struct RoleCommand {
    role: String,
    test: Option<String>,
    quiet: bool,
    args: Vec<OsString>,
    env: Vec<(OsString, Option<OsString>)>,
    stdin: Option<Stdio>,
    stdout: Option<Stdio>,
    stderr: Option<Stdio>,
}

impl RoleCommand {
    /// This binary as a child playing `role`: the whole binary (a bench), until
    /// [`test`](Self::test) names the one test it runs.
    pub fn new(role: &str) -> RoleCommand {
        RoleCommand {
            role: role.to_string(),
            test: None,
            quiet: false,
            args: Vec::new(),
            env: Vec::new(),
            stdin: None,
            stdout: None,
            stderr: None,
        }
    }

    /// Run only the test `name` (ignored or not), on one thread, its output not captured.
    pub fn test(mut self, name: &str) -> RoleCommand {
        self.test = Some(name.to_string());
        self
    }

    /// libtest's `--quiet`: less of the runner's own text on the child's stdout.
    pub fn quiet(mut self) -> RoleCommand {
        self.quiet = true;
        self
    }

    /// One more argument, after the test selection.
    pub fn arg(mut self, a: impl AsRef<OsStr>) -> RoleCommand {
        self.args.push(a.as_ref().to_owned());
        self
    }

    /// More arguments, after the test selection.
    pub fn args<A: AsRef<OsStr>>(mut self, args: impl IntoIterator<Item = A>) -> RoleCommand {
        self.args.extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self
    }

    /// One more environment variable for the child.
    pub fn env(mut self, k: impl AsRef<OsStr>, v: impl AsRef<OsStr>) -> RoleCommand {
        self.env.push((k.as_ref().to_owned(), Some(v.as_ref().to_owned())));
        self
    }

    /// Environment variables for the child.
    pub fn envs<K: AsRef<OsStr>, V: AsRef<OsStr>>(mut self, vars: impl IntoIterator<Item = (K, V)>) -> RoleCommand {
        for (k, v) in vars {
            self = self.env(k, v);
        }
        self
    }

    /// A variable of this process the child must not inherit.
    pub fn env_remove(mut self, k: impl AsRef<OsStr>) -> RoleCommand {
        self.env.push((k.as_ref().to_owned(), None));
        self
    }

    pub fn stdin(mut self, s: Stdio) -> RoleCommand {
        self.stdin = Some(s);
        self
    }

    pub fn stdout(mut self, s: Stdio) -> RoleCommand {
        self.stdout = Some(s);
        self
    }

    pub fn stderr(mut self, s: Stdio) -> RoleCommand {
        self.stderr = Some(s);
        self
    }

    /// The running binary (what the child executes).
    pub fn program() -> PathBuf {
        std::env::current_exe().expect("the path of the running test binary")
    }

    /// The child's arguments: the test selection (if any), then [`arg`](Self::arg)s.
    pub fn argv(&self) -> Vec<OsString> {
        let mut v: Vec<OsString> = Vec::new();
        if let Some(t) = &self.test {
            v.push(t.into());
            for a in ["--exact", "--include-ignored", "--nocapture", "--test-threads=1"] {
                v.push(a.into());
            }
            if self.quiet {
                v.push("--quiet".into());
            }
        }
        v.extend(self.args.iter().cloned());
        v
    }

    /// The variables the child gets on top of this process's: [`ROLE_ENV`] first, then
    /// [`env`](Self::env)'s (removals are left out: for launchers that only add).
    pub fn vars(&self) -> Vec<(OsString, OsString)> {
        let mut v = vec![(OsString::from(ROLE_ENV), OsString::from(&self.role))];
        v.extend(self.env.iter().filter_map(|(k, v)| Some((k.clone(), v.clone()?))));
        v
    }

    /// Add the arguments, environment and stdio to `cmd`, whose program may be another
    /// launcher (`ip netns exec <ns> <this binary>`).
    pub fn apply(self, cmd: &mut Command) {
        cmd.args(self.argv()).env(ROLE_ENV, &self.role);
        for (k, v) in self.env {
            match v {
                Some(v) => cmd.env(k, v),
                None => cmd.env_remove(k),
            };
        }
        if let Some(s) = self.stdin {
            cmd.stdin(s);
        }
        if let Some(s) = self.stdout {
            cmd.stdout(s);
        }
        if let Some(s) = self.stderr {
            cmd.stderr(s);
        }
    }

    /// The command for this binary, ready to spawn (or to add inherited fds to first).
    pub fn command(self) -> Command {
        let mut cmd = Command::new(RoleCommand::program());
        self.apply(&mut cmd);
        cmd
    }

    /// Start the child.
    pub fn spawn(self) -> Child {
        let role = self.role.clone();
        self.command().spawn().unwrap_or_else(|e| panic!("starting the child role {role:?}: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Lines, say};

    const CHILD: &str = "role::tests::child_entry";

    #[test]
    fn argv_selects_one_test_ignored_or_not() {
        let argv = RoleCommand::new("r").test("t").quiet().arg("x").argv();
        assert_eq!(argv, ["t", "--exact", "--include-ignored", "--nocapture", "--test-threads=1", "--quiet", "x"]);
        // A bench binary (no libtest) gets only its own arguments.
        assert_eq!(RoleCommand::new("r").arg("5").argv(), ["5"]);
        let vars = RoleCommand::new("r").env("A", "1").env_remove("B").vars();
        assert_eq!(vars, [(OsString::from(ROLE_ENV), OsString::from("r")), ("A".into(), "1".into())]);
    }

    /// The child: `grandparent` starts a `grandchild` of its own and passes on what it
    /// said; any other role says its name and `TW_TEST_SUPPORT_EXTRA`.
    #[test]
    #[ignore = "entry point of the child roles"]
    fn child_entry() {
        match role().as_deref() {
            None => {}
            Some("grandparent") => {
                let child = RoleCommand::new("grandchild").test(CHILD).stdout(Stdio::piped()).spawn();
                let mut io = Lines::new(child);
                say(&io.recv().expect("the grandchild said nothing"));
                assert!(io.child.wait().unwrap().success());
            }
            Some(r) => say(&format!("{r} {}", std::env::var("TW_TEST_SUPPORT_EXTRA").unwrap_or_default())),
        }
    }

    #[test]
    fn a_child_plays_its_role_and_a_grandchild_its_own() {
        for (role, heard) in [("plain", "plain extra"), ("grandparent", "grandchild extra")] {
            let child =
                RoleCommand::new(role).test(CHILD).env("TW_TEST_SUPPORT_EXTRA", "extra").stdout(Stdio::piped()).spawn();
            let mut io = Lines::new(child);
            assert_eq!(io.recv().as_deref(), Some(heard), "role {role}");
            assert_eq!(io.recv(), None, "role {role}: only one protocol line");
            assert!(io.child.wait().unwrap().success(), "role {role}");
        }
    }
}
