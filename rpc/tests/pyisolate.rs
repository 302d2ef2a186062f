//! Interop with pyisolate 0.10.2 itself (its JSONSocketTransport + AsyncRPC, in a real
//! Python process with torch): a Python client calls a Rust service, a Rust client calls
//! a Python server, nested calls and callbacks both ways, tensors both ways as
//! file_system `TensorRef`s.
//!
//! Python: `$TW_PYTHON`, else `<repo>/.venv/bin/python` (made by scripts/setup-venv.sh).
//! Without either the tests say so on stderr and pass; scripts/test.sh always sets
//! TW_PYTHON, and then a missing interpreter is a failure.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tensorwire_rpc::*;

fn python() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("TW_PYTHON") {
        assert!(std::path::Path::new(&p).exists(), "TW_PYTHON={p} does not exist");
        return Some(p.into());
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    if p.exists() {
        Some(p)
    } else {
        eprintln!("SKIPPED: no Python venv with pyisolate (run scripts/setup-venv.sh or set TW_PYTHON)");
        None
    }
}

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/interop.py")
}

fn sock_path(tag: &str) -> String {
    let p = std::env::temp_dir().join(format!("tw-rpc-{tag}-{}.sock", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p.display().to_string()
}

fn rust_echo() -> Service {
    Service::new("RustEcho")
        .method_inline("echo", |_, a| Ok(Value::Array(a.args)))
        .method_inline("echo_kw", |_, a| Ok(Value::Object(a.kwargs)))
        .method_inline("add", |_, a| {
            let (x, y) = (a.req(0, "a")?, a.req(1, "b")?);
            Ok(match (x, y) {
                (Value::Int(p), Value::Int(q)) => Value::Int(p + q),
                _ => Value::Float(x.as_f64().unwrap_or(f64::NAN) + y.as_f64().unwrap_or(f64::NAN)),
            })
        })
        .method_inline("fail", |_, a| Err(RpcError::Remote(a.req(0, "msg")?.as_str().unwrap_or("").to_owned())))
        .method("call_back", |ctx, mut a| {
            let cb = a.args.remove(0);
            ctx.invoke(&cb, a.args, a.kwargs)
        })
        .method_inline("parent_seen", |ctx, _| Ok(ctx.parent_call_id.map_or(Value::Null, Value::Int)))
        .method_inline("describe", |_, a| {
            let t = a.req(0, "value")?.as_tensor().ok_or_else(|| RpcError::Remote("not a tensor".into()))?;
            Ok(Value::object([
                ("dtype", Value::Str(format!("torch.{}", t.dtype().name()))),
                ("shape", Value::Array(t.shape().into_iter().map(Value::Int).collect())),
                ("sum", Value::Float(t.to_f64_vec()?.iter().sum())),
            ]))
        })
        .method_inline("make_tensor", |_, _| Ok(Value::from(Tensor::from_f32(&[2, 3], &[1., 2., 3., 4., 5., 6.])?)))
}

#[test]
fn pyisolate_client_calls_rust_service() {
    let Some(py) = python() else { return };
    let path = sock_path("srv");
    let reg = Registry::new();
    reg.register("echo", rust_echo()).unwrap();
    // pyisolate sends CPU tensors as file_system TensorRefs: accepted only when asked.
    let server = Server::bind(&path, reg, RpcConfig { accept_fs_tensors: true, ..RpcConfig::default() }).unwrap();
    let child = Command::new(py).arg(script()).arg("client").arg(&path).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let ep = server.accept().unwrap();
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "python client failed:\n{stdout}");
    assert!(stdout.contains("client: all checks passed"));
    assert!(ep.stats().requests_handled >= 12);
}

fn start_python_server(py: PathBuf, path: &str) -> std::process::Child {
    let child = Command::new(py).arg(script()).arg("server").arg(path).stderr(Stdio::inherit()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !std::path::Path::new(path).exists() {
        assert!(Instant::now() < deadline, "python server did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn rust_client_calls_pyisolate_server() {
    let Some(py) = python() else { return };
    let path = sock_path("cli");
    let mut child = start_python_server(py, &path);
    let reg = Registry::new();
    reg.register("rs", rust_echo()).unwrap();
    let ep = Endpoint::connect(
        &path,
        reg,
        RpcConfig { default_timeout: Wait::For(Duration::from_secs(30)), accept_fs_tensors: true, ..Default::default() },
    )
    .unwrap();
    let py_obj = RemoteObject::new(&ep, "py");

    let r: i64 = py_obj.call("add", (1, 2)).unwrap();
    assert_eq!(r, 3);
    let mut kw = Map::new();
    kw.insert("k".into(), tagged::bytes(b"\x00\x01\xfe"));
    let nested = Value::parse(r#"{"a": [1, 2.5, null, true, "é😀"], "inf": Infinity, "big": 1180591620717411303424}"#.as_bytes()).unwrap();
    let r = ep.call_with("py", "echo", vec![nested.clone(), tagged::bytes(b"raw")], kw, CallOptions::default()).unwrap();
    let r = r.as_array().unwrap();
    assert_eq!(r[0].as_array().unwrap()[0], nested);
    assert_eq!(tagged::as_bytes(&r[0].as_array().unwrap()[1]).unwrap(), b"raw", "bytes come back tagged");
    assert_eq!(tagged::as_bytes(r[1].get("k").unwrap()).unwrap(), b"\x00\x01\xfe");

    match ep.call("py", "fail", vec!["bad input".into()]) {
        Err(RpcError::Remote(m)) => assert_eq!(m, "bad input"),
        other => panic!("{other:?}"),
    }
    let e = ep.call("nope", "x", vec![]).unwrap_err().to_string();
    assert!(e.contains("Object ID nope not registered"), "{e}");
    assert_eq!(ep.call("py", "sync_method", vec![21.into()]).unwrap(), Value::Int(42));

    // A Rust callback passed to Python and invoked with kind "callback".
    let cb = ep.register_callback("mul", |_, a| Ok(Value::Int(a.args[0].as_i64().unwrap() * a.args[1].as_i64().unwrap()))).unwrap();
    assert_eq!(ep.call("py", "call_back", vec![cb, 6.into(), 7.into()]).unwrap(), Value::Int(42));
    // Nested: Python's handler calls Rust ("rs".add) while our call waits.
    assert_eq!(ep.call("py", "nested", vec![5.into()]).unwrap(), Value::Int(1005));
    // Nested three deep: Rust -> Python -> Rust callback -> Python.
    let ep2 = ep.clone();
    let deep = ep
        .register_callback("deep", move |ctx, a| {
            let x = a.args[0].as_i64().unwrap();
            let _ = &ep2;
            ctx.call("py", "add", vec![x.into(), 10.into()], Map::new())
        })
        .unwrap();
    assert_eq!(ep.call("py", "call_back", vec![deep, 1.into()]).unwrap(), Value::Int(11));

    // Tensors: torch -> Rust (file_system TensorRef decoded), Rust -> torch.
    let t = ep.call("py", "make_tensor", vec![]).unwrap();
    let t = t.as_tensor().expect("a tensor");
    assert!(matches!(t, Tensor::File(_)));
    assert_eq!(t.dtype(), tensorwire::DType::Float64);
    assert_eq!(t.shape(), vec![2, 3]);
    assert_eq!(t.to_f64_vec().unwrap(), vec![0., 1., 2., 3., 4., 5.]);
    let mine = Tensor::from_f32(&[4], &[0.5, 1.5, 2.5, 3.5]).unwrap();
    let d = ep.call("py", "describe", vec![Value::from(mine)]).unwrap();
    assert_eq!(d.get("is_tensor"), Some(&Value::Bool(true)), "{d:?}");
    assert_eq!(d.get("dtype").and_then(Value::as_str), Some("torch.float32"));
    assert_eq!(d.get("sum").and_then(Value::as_f64), Some(8.0));

    assert!(!ep.negotiate_native(Duration::from_secs(5)).unwrap(), "pyisolate has no native tensors");
    assert_eq!(ep.call("py", "add", vec![1.into(), 1.into()]).unwrap(), Value::Int(2), "still usable after refusal");

    ep.close(Duration::from_millis(500));
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            assert!(st.success(), "python server exited with {st}");
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("python server did not exit after the close frame");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = std::fs::remove_file(&path);
}
