//! A worker written in Rust, for any supervisor — a Rust `WorkerSpec` or a Python host's
//! `tensorwire.rpc.spawn(command=[...])`: it serves `main.add(a, b)`, `main.sum(tensor)`
//! and `main.pid()` until the supervisor closes the connection.
//!
//!     cargo build -p tensorwire-rpc --example worker
//!     python -c 'import tensorwire.rpc as r; print(r.spawn(command=["target/debug/examples/worker"]).call("add", 1, 2))'

use tensorwire_rpc::worker;
use tensorwire_rpc::{Registry, RpcConfig, RpcError, Service, Value};

fn main() {
    let reg = Registry::new();
    let service = Service::new("RustWorker")
        .method_inline("add", |_, a| {
            let (x, y) = (a.req(0, "a")?, a.req(1, "b")?);
            match (x.as_i64(), y.as_i64()) {
                (Some(x), Some(y)) => x.checked_add(y).map(Value::Int).ok_or_else(|| RpcError::Remote("OverflowError: the sum does not fit 64 bits".into())),
                _ => Ok(Value::Float(x.as_f64().unwrap_or(f64::NAN) + y.as_f64().unwrap_or(f64::NAN))),
            }
        })
        .method("sum", |_, a| {
            let t = a.req(0, "t")?.as_tensor().ok_or_else(|| RpcError::Remote("TypeError: sum takes a tensor".into()))?.clone();
            Ok(Value::Float(t.to_f64_vec()?.iter().sum()))
        })
        .method_inline("pid", |_, _| Ok(Value::Int(i64::from(std::process::id()))));
    if let Err(e) = reg.register("main", service) {
        eprintln!("worker: {e}");
        std::process::exit(1);
    }
    if let Err(e) = worker::serve(reg, RpcConfig::default()) {
        eprintln!("worker: {e}");
        std::process::exit(1);
    }
}
