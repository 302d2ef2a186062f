//! Two network namespaces joined by a veth pair, made for one test or bench run and torn
//! down when dropped: the "two hosts" of the remote tests. Needs root (CAP_NET_ADMIN) and
//! iproute2; where either is missing, `make` says why and the caller skips.

#![allow(dead_code)]

use std::process::Command;

pub struct Pair {
    /// Namespace names (exporter side, importer side).
    pub ns: [String; 2],
    /// The veth ends, one in each namespace.
    pub dev: [String; 2],
    /// Their addresses.
    pub ip: [&'static str; 2],
    /// The shaping applied to both ends, as `tc` was told (or why there is none).
    pub shaping: String,
}

fn run(args: &[&str]) -> Result<(), String> {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .map_err(|e| format!("{}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl Pair {
    /// Makes the namespaces, the veth pair and the addresses, then shapes both ends with
    /// `netem delay <delay> rate <rate>` (falling back to a `tbf` rate limit alone where the
    /// kernel has no netem); `shape = false` leaves the link unshaped.
    pub fn make(tag: &str, shape: bool) -> Result<Pair, String> {
        let id = std::process::id() % 100_000;
        let p = Pair {
            ns: [format!("tw{tag}{id}a"), format!("tw{tag}{id}b")],
            dev: [format!("twv{id}a"), format!("twv{id}b")],
            ip: ["10.77.0.1", "10.77.0.2"],
            shaping: "none".into(),
        };
        let mut p = p;
        // Whatever happens from here on, `Drop` removes what was made.
        run(&["ip", "netns", "add", &p.ns[0]])?;
        run(&["ip", "netns", "add", &p.ns[1]])?;
        run(&["ip", "link", "add", &p.dev[0], "type", "veth", "peer", "name", &p.dev[1]])?;
        for i in 0..2 {
            let (ns, dev) = (p.ns[i].clone(), p.dev[i].clone());
            run(&["ip", "link", "set", &dev, "netns", &ns])?;
            run(&["ip", "-n", &ns, "addr", "add", &format!("{}/24", p.ip[i]), "dev", &dev])?;
            run(&["ip", "-n", &ns, "link", "set", &dev, "up"])?;
            run(&["ip", "-n", &ns, "link", "set", "lo", "up"])?;
        }
        if shape {
            let mut how = Vec::new();
            for i in 0..2 {
                let tc = |q: &[&str]| {
                    let mut a = vec!["ip", "netns", "exec", &p.ns[i], "tc", "qdisc", "add", "dev", &p.dev[i], "root"];
                    a.extend_from_slice(q);
                    run(&a)
                };
                match tc(&["netem", "delay", "1ms", "rate", "1gbit"]) {
                    Ok(()) => how.push("netem delay 1ms rate 1gbit".to_string()),
                    Err(e) => {
                        tc(&["tbf", "rate", "1gbit", "burst", "256kb", "latency", "50ms"])?;
                        how.push(format!(
                            "tbf rate 1gbit (netem refused: {})",
                            e.rsplit(": ").next().unwrap_or("")
                        ));
                    }
                }
            }
            how.dedup();
            p.shaping = how.join("; ");
        }
        Ok(p)
    }

    /// `ip netns exec <ns> <program>`: a command run inside namespace `i`.
    pub fn command(&self, i: usize, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns[i]]).arg(program);
        c
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end inside it, and with it the pair.
        for ns in &self.ns {
            let _ = run(&["ip", "netns", "del", ns]);
        }
    }
}
