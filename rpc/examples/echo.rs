//! Serve or call the echo service.
//!
//! ```text
//! cargo run -p tensorwire-rpc --example echo -- serve --uds PATH      # or --tcp HOST:PORT
//! cargo run -p tensorwire-rpc --example echo -- call --uds PATH --object-id echo --method add --args '[1, 2]'
//! ```
//!
//! `serve` accepts connections until stopped and serves object ids `echo` and
//! `extension`, each with `echo(*args)`, `add(a, b)`, `fail(msg)`, `call_back(cb, *args)`
//! and `describe(value)`. `call` prints the result as JSON (tensors as their description)
//! and exits 1 with the error on stderr if the call failed. `PYISOLATE_UDS_ADDRESS` is
//! used when no address is given.

use std::time::Duration;
use tensorwire_rpc::{Args, CallCtx, CallOptions, Endpoint, Registry, RpcConfig, RpcError, Server, Service, Value, Wait};

fn add(_: &CallCtx, a: Args) -> tensorwire_rpc::Result<Value> {
    let (x, y) = (a.req(0, "a")?, a.req(1, "b")?);
    match (x, y) {
        (Value::Int(p), Value::Int(q)) => Ok(p.checked_add(*q).map_or(Value::Float(*p as f64 + *q as f64), Value::Int)),
        (Value::Str(p), Value::Str(q)) => Ok(Value::Str(format!("{p}{q}"))),
        _ => match (x.as_f64(), y.as_f64()) {
            (Some(p), Some(q)) => Ok(Value::Float(p + q)),
            _ => Err(RpcError::Remote(format!("unsupported operand type(s) for +: '{}' and '{}'", x.type_name(), y.type_name()))),
        },
    }
}

/// A tensor's dtype, shape and sum; other values' type.
pub fn describe(v: &Value) -> tensorwire_rpc::Result<Value> {
    match v {
        Value::Tensor(t) => {
            let sum: f64 = t.to_f64_vec()?.iter().sum();
            Ok(Value::object([
                ("dtype", Value::Str(format!("torch.{}", t.dtype().name()))),
                ("shape", Value::Array(t.shape().into_iter().map(Value::Int).collect())),
                ("sum", Value::Float(sum)),
            ]))
        }
        other => Ok(Value::object([("type", Value::from(other.type_name()))])),
    }
}

fn service() -> Service {
    Service::new("EchoService")
        .method_inline("echo", |_, a| Ok(Value::Array(a.args)))
        .method_inline("add", add)
        .method_inline("fail", |_, a| {
            let msg = a.get(0, "msg").and_then(Value::as_str).unwrap_or("failed").to_owned();
            Err(RpcError::Remote(msg))
        })
        .method("call_back", |ctx, mut a| {
            if a.args.is_empty() {
                return Err(RpcError::Remote("call_back(cb, *args) needs a callable".into()));
            }
            let cb = a.args.remove(0);
            ctx.invoke(&cb, a.args, a.kwargs)
        })
        .method_inline("describe", |_, a| describe(a.req(0, "value")?))
}

/// Replace tensors by their description so the result prints as JSON.
fn printable(v: Value) -> Value {
    match v {
        Value::Tensor(_) => describe(&v).unwrap_or(Value::Null),
        Value::Array(a) => Value::Array(a.into_iter().map(printable).collect()),
        Value::Object(m) => Value::Object(m.into_iter().map(|(k, x)| (k, printable(x))).collect()),
        o => o,
    }
}

fn usage() -> ! {
    eprintln!(
        "usage: echo serve (--uds PATH | --tcp HOST:PORT)\n       echo call (--uds PATH | --tcp HOST:PORT) --object-id ID --method M [--args JSON] [--kwargs JSON] [--timeout SECS]"
    );
    std::process::exit(2)
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let Some(mode) = argv.first().cloned() else { usage() };
    let mut opt = std::collections::HashMap::new();
    let mut it = argv[1..].iter();
    while let Some(k) = it.next() {
        let Some(v) = it.next() else { usage() };
        opt.insert(k.trim_start_matches("--").to_owned(), v.clone());
    }
    let addr = match (opt.get("uds"), opt.get("tcp")) {
        (Some(p), _) => p.clone(),
        (None, Some(t)) => format!("tcp://{t}"),
        _ => std::env::var("PYISOLATE_UDS_ADDRESS").unwrap_or_else(|_| usage()),
    };
    let r = match mode.as_str() {
        "serve" => serve(&addr),
        "call" => call(&addr, &opt),
        _ => usage(),
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn serve(addr: &str) -> tensorwire_rpc::Result<()> {
    let reg = Registry::new();
    reg.register("echo", service())?;
    reg.register("extension", service())?;
    let server = Server::bind(addr, reg, RpcConfig::default())?;
    eprintln!("serving echo, extension on {}", server.local_addr());
    server.serve_forever()
}

fn call(addr: &str, opt: &std::collections::HashMap<String, String>) -> tensorwire_rpc::Result<()> {
    let object_id = opt.get("object-id").cloned().unwrap_or_else(|| usage());
    let method = opt.get("method").cloned().unwrap_or_else(|| usage());
    let args = match Value::parse(opt.get("args").map_or("[]", String::as_str).as_bytes())? {
        Value::Array(a) => a,
        other => vec![other],
    };
    let kwargs = match Value::parse(opt.get("kwargs").map_or("{}", String::as_str).as_bytes())? {
        Value::Object(m) => m,
        _ => return Err(RpcError::InvalidArgument("--kwargs must be a JSON object".into())),
    };
    let timeout = opt.get("timeout").and_then(|t| t.parse::<f64>().ok()).map(|s| Wait::For(Duration::from_secs_f64(s)));
    let ep = Endpoint::connect(addr, Registry::new(), RpcConfig::default())?;
    let r = ep.call_with(&object_id, &method, args, kwargs, CallOptions { timeout, ..Default::default() });
    ep.close(Duration::from_millis(200));
    println!("{}", printable(r?).to_json()?);
    Ok(())
}
