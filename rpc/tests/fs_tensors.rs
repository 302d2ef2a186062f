//! File-system tensors (pyisolate's `TensorRef` naming a `/dev/shm` file) from a hostile
//! peer: refused unless the endpoint asked for them; when asked, a file this process did
//! not create is only read — never written, truncated or unlinked — and a key can name
//! nothing but a plain file directly in `/dev/shm`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;
use tensorwire_rpc::*;

/// A `/dev/shm` file "another program" made, laid out as torch's (refcount 1 at offset 0,
/// four float32 at 64), removed when the test ends.
struct OtherProgramsFile {
    key: String,
    bytes: Vec<u8>,
}

static N: AtomicU32 = AtomicU32::new(0);

fn unique(what: &str) -> String {
    format!("tw_{what}_{}_{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

impl OtherProgramsFile {
    fn new() -> OtherProgramsFile {
        let key = format!("/{}", unique("other"));
        let mut bytes = vec![0u8; 64 + 16];
        bytes[..4].copy_from_slice(&1i32.to_ne_bytes());
        for (i, x) in [1.0f32, 2.0, 3.0, 4.5].iter().enumerate() {
            bytes[64 + 4 * i..68 + 4 * i].copy_from_slice(&x.to_ne_bytes());
        }
        std::fs::write(format!("/dev/shm{key}"), &bytes).unwrap();
        OtherProgramsFile { key, bytes }
    }
    fn path(&self) -> PathBuf {
        PathBuf::from(format!("/dev/shm{}", self.key))
    }
    /// Still there, byte for byte as its program wrote it (refcount included).
    fn assert_untouched(&self) {
        let now = std::fs::read(self.path()).unwrap_or_else(|e| panic!("{} is gone: {e}", self.path().display()));
        assert_eq!(now, self.bytes, "{} was written", self.path().display());
    }
}

impl Drop for OtherProgramsFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.path());
    }
}

fn tensor_ref(key: &str, strategy: &str) -> Value {
    Value::parse(
        format!(
            r#"{{"__type__": "TensorRef", "device": "cpu", "strategy": "{strategy}", "manager_path": "", "storage_key": "{key}", "storage_size": 16, "dtype": "torch.float32", "tensor_size": [4], "tensor_stride": [1], "tensor_offset": 0, "requires_grad": false}}"#
        )
        .as_bytes(),
    )
    .unwrap()
}

/// `host` (config `cfg`) connected to a hostile peer whose `give(key, strategy)` answers
/// a `TensorRef` naming any file it likes, and whose `take(x)` accepts anything.
fn host_and_liar(cfg: RpcConfig) -> (Endpoint, Endpoint) {
    let liar = Registry::new();
    liar.register(
        "liar",
        Service::new("Liar")
            .method_inline("give", |_, a| {
                let key = a.req(0, "key")?.as_str().unwrap_or("").to_owned();
                let strategy = a.req(1, "strategy")?.as_str().unwrap_or("").to_owned();
                Ok(tensor_ref(&key, &strategy))
            })
            .method_inline("take", |_, _| Ok(Value::Null)),
    )
    .unwrap();
    let host = Registry::new();
    host.register(
        "host",
        Service::new("Host").method_inline("sum", |_, a| {
            let t = a.req(0, "t")?.as_tensor().ok_or_else(|| RpcError::Remote("not a tensor".into()))?;
            Ok(Value::Float(t.to_f64_vec()?.iter().sum()))
        }),
    )
    .unwrap();
    Endpoint::pair(host, liar, cfg).unwrap()
}

fn accepting() -> RpcConfig {
    RpcConfig { accept_fs_tensors: true, default_timeout: Wait::For(Duration::from_secs(10)), ..RpcConfig::default() }
}

#[test]
fn fs_tensors_are_off_by_default() {
    assert!(!RpcConfig::default().accept_fs_tensors);
}

/// By default a `TensorRef` is refused with an error naming the switch, in a response and
/// in a request alike; the file it names is not opened, written or unlinked.
#[test]
fn a_file_a_peer_names_is_refused_by_default_and_left_untouched() {
    let f = OtherProgramsFile::new();
    let (host, liar) = host_and_liar(RpcConfig { default_timeout: Wait::For(Duration::from_secs(10)), ..RpcConfig::default() });
    for strategy in ["file_system", "file_system_borrowed"] {
        let e = host.call("liar", "give", vec![f.key.as_str().into(), strategy.into()]).unwrap_err();
        assert!(matches!(e, RpcError::Decode(_)), "{e:?}");
        let m = e.to_string();
        assert!(m.contains("accept_fs_tensors") && m.contains("fs_tensors=True") && m.contains(&f.key), "{m}");
        f.assert_untouched();
    }
    // The peer passes one as an argument: its call is answered with the refusal.
    let e = liar.call("host", "sum", vec![tensor_ref(&f.key, "file_system")]).unwrap_err().to_string();
    assert!(e.contains("accept_fs_tensors"), "{e}");
    assert!(!host.is_closed(), "a refused value does not end the connection");
    assert_eq!(host.call("liar", "take", vec![1.into()]).unwrap(), Value::Null);
    drop((host, liar));
    f.assert_untouched();
}

/// Asked for, another program's file is read (through a private read-only mapping) and
/// never written or unlinked: not by the `file_system` strategy's transit reference, not
/// when the value is dropped, not when it is sent on, not through `write_storage`.
#[test]
fn with_fs_tensors_on_another_programs_file_is_only_read() {
    let f = OtherProgramsFile::new();
    let (host, liar) = host_and_liar(accepting());
    for strategy in ["file_system", "file_system_borrowed"] {
        let v = host.call("liar", "give", vec![f.key.as_str().into(), strategy.into()]).unwrap();
        let t = v.as_tensor().unwrap();
        assert_eq!(t.to_f64_vec().unwrap(), vec![1.0, 2.0, 3.0, 4.5]);
        let Tensor::File(file) = t else { panic!("{t:?}") };
        assert!(!file.is_own());
        let e = file.write_storage(0, &[0u8; 4]).unwrap_err().to_string();
        assert!(e.contains("read-only"), "{e}");
        f.assert_untouched();
        // Sent on (the liar takes it): a copy in a file of ours goes, not the other
        // program's file.
        assert_eq!(host.call("liar", "take", vec![v.clone()]).unwrap(), Value::Null);
        f.assert_untouched();
        drop(v);
        f.assert_untouched();
    }
    // As an argument of the peer's request, too.
    let sum = liar.call("host", "sum", vec![tensor_ref(&f.key, "file_system")]).unwrap();
    assert_eq!(sum, Value::Float(10.5));
    drop((host, liar));
    f.assert_untouched();
}

/// A key can only name a plain file directly in /dev/shm: `..`, a second `/`, a symlink
/// (even to a file in /dev/shm) and a FIFO (which would block an open) are refused, and
/// what they point at is untouched.
#[test]
fn keys_that_escape_or_point_elsewhere_are_refused() {
    let target = OtherProgramsFile::new();
    let (host, _liar) = host_and_liar(accepting());
    let give = |key: &str| host.call("liar", "give", vec![key.into(), "file_system".into()]);

    /// Removes what the test put in /dev/shm, pass or fail.
    struct Cleanup(Vec<String>);
    impl Drop for Cleanup {
        fn drop(&mut self) {
            for p in &self.0 {
                let _ = std::fs::remove_dir_all(p).or_else(|_| std::fs::remove_file(p));
            }
        }
    }
    let mut cleanup = Cleanup(Vec::new());

    // A directory in /dev/shm holding a file: `/dir/file` has a second '/'.
    let dir = format!("/dev/shm/{}", unique("dir"));
    cleanup.0.push(dir.clone());
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(format!("{dir}/f"), &target.bytes).unwrap();
    let nested = format!("{}/f", dir.trim_start_matches("/dev/shm"));
    // A symlink in /dev/shm to the other program's file.
    let link = format!("/{}", unique("link"));
    cleanup.0.push(format!("/dev/shm{link}"));
    std::os::unix::fs::symlink(target.path(), format!("/dev/shm{link}")).unwrap();
    // A FIFO.
    let fifo = format!("/{}", unique("fifo"));
    cleanup.0.push(format!("/dev/shm{fifo}"));
    let c = std::ffi::CString::new(format!("/dev/shm{fifo}")).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);

    let other_dir = target.key.trim_start_matches('/').to_owned();
    for key in [
        format!("/../shm/{other_dir}"),
        format!("/..{}", target.key),
        "/..".to_owned(),
        "/.".to_owned(),
        nested.clone(),
        link.clone(),
        fifo.clone(),
        format!("/{other_dir}/"),
        "/".to_owned(),
        other_dir.clone(),
    ] {
        let started = std::time::Instant::now();
        let e = match give(&key) {
            Ok(v) => panic!("{key}: opened, {v:?}"),
            Err(e) => e,
        };
        assert!(started.elapsed() < Duration::from_secs(5), "{key}: took {:?}", started.elapsed());
        assert!(matches!(e, RpcError::Decode(_)), "{key}: {e:?}");
    }
    target.assert_untouched();
    assert_eq!(std::fs::read(format!("{dir}/f")).unwrap(), target.bytes);
    assert!(std::fs::symlink_metadata(format!("/dev/shm{link}")).unwrap().file_type().is_symlink());
    // The plain key still works: the refusals above were for the path, not the file.
    assert_eq!(give(&target.key).unwrap().as_tensor().unwrap().to_f64_vec().unwrap(), vec![1.0, 2.0, 3.0, 4.5]);
    target.assert_untouched();
}

/// Our own files keep torch's protocol: a peer that sends one back shares it (the same
/// file, one more reference), and the last reference of this process unlinks it.
#[test]
fn our_own_file_sent_back_is_shared_and_unlinked_when_done() {
    let (host, _liar) = host_and_liar(accepting());
    let ours = Tensor::from_f32(&[4], &[1.0, 2.0, 3.0, 4.5]).unwrap().to_fs().unwrap();
    assert!(ours.is_own());
    let key = ours.key().to_owned();
    let v = host.call("liar", "give", vec![key.as_str().into(), "file_system_borrowed".into()]).unwrap();
    let Tensor::File(back) = v.as_tensor().unwrap() else { panic!() };
    assert!(back.is_own());
    assert_eq!(ours.refcount_now(), 2);
    drop(ours);
    let path = format!("/dev/shm{key}");
    assert!(std::path::Path::new(&path).exists());
    drop(v);
    assert!(!std::path::Path::new(&path).exists(), "the last reference unlinks our file");
}
