//! What a hostile importer can make an exporter do with a forged blob, and what a stalled
//! exporter can do to other imports: named errors, nothing read outside an export, nothing
//! crashes, no other import delayed.
#![cfg(feature = "ucx")]

mod support;

use std::time::{Duration, Instant};

use support::*;
use tensorwire_remote::ucx::{Exporter, Importer};
use tensorwire_remote::{BlobError, ExportBlob, ImportError};

#[test]
fn child_roles() {
    let Some(role) = role() else {
        return;
    };
    match role.as_str() {
        // Export 1 MiB, hand out the blob, serve until stdin closes.
        "exporter" => {
            let exporter = Exporter::new().unwrap();
            let scope = exporter.scope().unwrap();
            let blob = scope.export(pattern(4, 1 << 20)).unwrap();
            say(&hex(&blob.encode()));
            while hear().is_some() {}
        }
        // Export 4 KiB, and keep a canary: say the blob, the canary's address and the
        // exporter's tcp listeners; answer each line with the canary's bytes (hex).
        "victim" => {
            // Were UCX's sockets not close-on-exec (a UCX without our patch), this process
            // would hold those of the test process that spawned it (its exporters', an
            // RMA attacker's), which are not the target.
            let inherited = raw_tcp::sockets();
            let exporter = Exporter::new().unwrap();
            let scope = exporter.scope().unwrap();
            let blob = scope.export(pattern(4, 4096)).unwrap();
            let canary = std::hint::black_box(vec![CANARY; 4096]);
            say(&hex(&blob.encode()));
            say(&format!("{}", canary.as_ptr() as u64));
            let listeners: Vec<String> =
                raw_tcp::listeners(&inherited).iter().map(|a| a.to_string()).collect();
            say(&listeners.join(" "));
            while hear().is_some() {
                say(&hex(std::hint::black_box(&canary)));
            }
        }
        other => panic!("unknown role {other}"),
    }
    std::process::exit(0);
}

const CANARY: u8 = 0x5a;

/// `blob` with the 8 bytes at `offset` replaced (16: length, 8: export id).
fn forge_u64(blob: &ExportBlob, offset: usize, v: u64) -> ExportBlob {
    let mut b = blob.encode();
    b[offset..offset + 8].copy_from_slice(&v.to_le_bytes());
    ExportBlob::decode(&b).unwrap()
}

/// `blob` carrying `key` instead of its own.
fn with_key(blob: &ExportBlob, key: &[u8]) -> ExportBlob {
    let mut b = blob.encode();
    b[24..40].copy_from_slice(key);
    ExportBlob::decode(&b).unwrap()
}

fn import(importer: &Importer, blob: &ExportBlob) -> Result<Vec<u8>, ImportError> {
    importer.import(blob, vec![0u8; blob.length() as usize], Duration::from_secs(5))
}

/// Forged ids, replays after release, another connection's ids and keys, forged lengths:
/// each is a named error from the exporter, which serves the genuine blob afterwards.
#[test]
fn forged_requests_are_named_errors() {
    if role().is_some() {
        return;
    }
    let exporter = Exporter::with_options(&[("TLS", "tcp")]).unwrap();
    let importer = Importer::with_options(&[("TLS", "tcp")]).unwrap();
    let (a, b) = (exporter.scope().unwrap(), exporter.scope().unwrap());
    let blob = a.export(pattern(5, 64 << 10)).unwrap();
    let other = b.export(pattern(6, 64 << 10)).unwrap();
    assert_eq!(import(&importer, &blob).unwrap(), pattern(5, 64 << 10));

    // An id never handed out.
    let forged = forge_u64(&blob, 8, blob.export_id() + 1000);
    assert_eq!(
        import(&importer, &forged).map(|v| v.len()),
        Err(ImportError::UnknownExport(blob.export_id() + 1000))
    );
    // Another connection's export id under our key, and our id under a guessed key.
    let stolen = forge_u64(&blob, 8, other.export_id());
    assert_eq!(
        import(&importer, &stolen).map(|v| v.len()),
        Err(ImportError::UnknownExport(other.export_id()))
    );
    assert_eq!(
        import(&importer, &with_key(&other, &[0u8; 16])).map(|v| v.len()),
        Err(ImportError::UnknownExport(other.export_id()))
    );
    // The other connection's genuine blob still works (for its own holder).
    assert_eq!(import(&importer, &other).unwrap(), pattern(6, 64 << 10));
    // A length the export does not have, larger and smaller: nothing is sent.
    for len in [(64 << 10) + 1, 1 << 30, 100] {
        assert_eq!(
            import(&importer, &forge_u64(&blob, 16, len)).map(|v| v.len()),
            Err(ImportError::ExporterLengthMismatch {
                export: 64 << 10,
                requested: len
            }),
            "{len}"
        );
    }
    // Replayed after its release (the SIGSEGV of the one-sided get): a named error.
    a.release(blob.export_id()).unwrap();
    assert_eq!(
        import(&importer, &blob).map(|v| v.len()),
        Err(ImportError::UnknownExport(blob.export_id()))
    );
    // A destination of the wrong length is refused before anything is sent.
    assert!(matches!(
        importer.import(&other, vec![0u8; 100], Duration::from_secs(1)),
        Err(ImportError::LengthMismatch { .. })
    ));
    // The exporter is alive and serves on.
    let again = a.export(pattern(7, 4096)).unwrap();
    assert_eq!(import(&importer, &again).unwrap(), pattern(7, 4096));
    assert_eq!(importer.parked(), 0);
}

/// Forged worker addresses: an address version UCX would abort on is refused by decode;
/// random bytes behind a valid version are a named error, never a crash.
#[test]
fn forged_worker_addresses() {
    if role().is_some() {
        return;
    }
    let exporter = Exporter::with_options(&[("TLS", "tcp")]).unwrap();
    let importer = Importer::with_options(&[("TLS", "tcp")]).unwrap();
    let scope = exporter.scope().unwrap();
    let blob = scope.export(pattern(5, 4096)).unwrap();
    let bytes = blob.encode();
    let w = blob.worker_address().len();
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed as u8
    };
    for cut in [w, w / 2, 1] {
        let mut forged = bytes[..42].to_vec();
        forged[40..42].copy_from_slice(&(cut as u16).to_le_bytes());
        forged.extend((0..cut).map(|_| rnd()));
        forged[42] = (forged[42] & 0xf0) | 0x0d;
        assert!(matches!(
            ExportBlob::decode(&forged),
            Err(BlobError::BadWorkerAddress(_))
        ));
        let k = 2.min(cut);
        forged[42..42 + k].copy_from_slice(&blob.worker_address()[..k]);
        let Ok(fb) = ExportBlob::decode(&forged) else {
            continue;
        };
        let r = importer.import(&fb, vec![0u8; 4096], Duration::from_secs(2));
        assert!(r.is_err(), "forged address of {cut} bytes imported");
    }
    assert_eq!(
        importer
            .import(&blob, vec![0u8; 4096], Duration::from_secs(5))
            .unwrap(),
        pattern(5, 4096)
    );
}

/// An exporter that stops answering (SIGSTOP) holds only the imports from it, each to its
/// own deadline: an import from a healthy exporter on another importer, at the same time,
/// completes at its own pace.
#[test]
fn a_stalled_exporter_delays_no_other_import() {
    if role().is_some() {
        return;
    }
    let mut stalled = spawn_peer("child_roles", "exporter", "tcp");
    let stalled_blob = ExportBlob::decode(&unhex(&stalled.recv().unwrap())).unwrap();
    let healthy = Exporter::with_options(&[("TLS", "tcp")]).unwrap();
    let scope = healthy.scope().unwrap();
    let blob = scope.export(pattern(8, 1 << 20)).unwrap();
    // One importer per connection, as the RPC layer has.
    let slow = Importer::with_options(&[("TLS", "tcp")]).unwrap();
    let fast = Importer::with_options(&[("TLS", "tcp")]).unwrap();
    // Connect both first, so the stop catches an established connection.
    assert_eq!(import(&slow, &stalled_blob).unwrap(), pattern(4, 1 << 20));
    assert_eq!(import(&fast, &blob).unwrap(), pattern(8, 1 << 20));

    // SAFETY: stopping our own child by pid; it is reaped below.
    unsafe { libc::kill(stalled.child.id() as i32, libc::SIGSTOP) };
    wait_stopped(stalled.child.id());
    std::thread::scope(|s| {
        let t = s.spawn(|| {
            let started = Instant::now();
            let r = slow.import(&stalled_blob, vec![0u8; 1 << 20], Duration::from_secs(3));
            (r.map(|_| ()), started.elapsed())
        });
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        for _ in 0..5 {
            assert_eq!(import(&fast, &blob).unwrap(), pattern(8, 1 << 20));
        }
        let took = started.elapsed();
        assert!(
            took < Duration::from_secs(2),
            "5 imports from a healthy exporter took {took:?} beside a stalled one"
        );
        let (r, slow_took) = t.join().unwrap();
        assert_eq!(r, Err(ImportError::Timeout));
        assert!(slow_took < Duration::from_secs(5), "the stalled import took {slow_took:?}");
    });
    // SAFETY: as above.
    unsafe { libc::kill(stalled.child.id() as i32, libc::SIGCONT) };
    stalled.kill();
    assert_eq!(slow.parked(), 0);
}

/// A peer that speaks UCX one-sided RMA at the exporter, as an attacker with a stock UCX
/// would: a context with `UCP_FEATURE_RMA`, an endpoint to the exporter's worker address,
/// and `ucp_get_nbx` of the export's own address and of an unmapped one, with a forged key
/// (UCX's software get over tcp does not check keys). The
/// exporter's context has no RMA feature, so UCX never installs the get handler: nothing
/// is read, no reply comes, and the exporter serves on. With the RMA feature on the
/// exporter's context (the handler installed) the first get returns the export's bytes.
mod raw_rma {
    use std::ffi::c_void;
    use std::mem::MaybeUninit;
    use std::ptr;
    use std::time::{Duration, Instant};
    use ucx_rs::sys;

    pub struct Attacker {
        context: sys::ucp_context_h,
        worker: sys::ucp_worker_h,
        ep: sys::ucp_ep_h,
        rkey: sys::ucp_rkey_h,
    }

    fn zeroed<T>() -> T {
        // SAFETY: only used for UCX parameter structs, whose all-zero value means "no field".
        unsafe { MaybeUninit::zeroed().assume_init() }
    }

    impl Attacker {
        /// Connects to `address` (a worker address, padded with zeros as UCX reads it).
        pub fn connect(address: &[u8]) -> Attacker {
            let mut config: *mut sys::ucp_config_t = ptr::null_mut();
            // SAFETY: null prefix and file read the environment; `config` is an out-pointer.
            assert_eq!(unsafe { sys::ucp_config_read(ptr::null(), ptr::null(), &mut config) }, 0);
            // The exporter's tcp segment sizes: an attacker matches the target's setup.
            for (n, v) in [(c"TLS", c"tcp"), (c"TCP_TX_SEG_SIZE", c"64k"), (c"TCP_RX_SEG_SIZE", c"64k")] {
                // SAFETY: a live config; NUL-terminated strings.
                assert_eq!(unsafe { sys::ucp_config_modify(config, n.as_ptr(), v.as_ptr()) }, 0);
            }
            let mut params: sys::ucp_params_t = zeroed();
            params.field_mask = sys::ucp_params_field_UCP_PARAM_FIELD_FEATURES as u64;
            params.features = sys::ucp_feature_UCP_FEATURE_RMA as u64;
            let mut context = ptr::null_mut();
            // SAFETY: valid params, config and out-pointer.
            let s = unsafe {
                sys::ucp_init_version(sys::UCP_API_MAJOR, sys::UCP_API_MINOR, &params, config, &mut context)
            };
            // SAFETY: released once, after the context copied it.
            unsafe { sys::ucp_config_release(config) };
            assert_eq!(s, 0);
            let wparams: sys::ucp_worker_params_t = zeroed();
            let mut worker = ptr::null_mut();
            // SAFETY: a live context; valid params and out-pointer.
            assert_eq!(unsafe { sys::ucp_worker_create(context, &wparams, &mut worker) }, 0);
            let mut padded = vec![0u8; address.len() + 16 * 1024];
            padded[..address.len()].copy_from_slice(address);
            let mut ep_params: sys::ucp_ep_params_t = zeroed();
            ep_params.field_mask = (sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::ucp_ep_params_field_UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE)
                as u64;
            ep_params.address = padded.as_ptr() as *const sys::ucp_address_t;
            ep_params.err_mode = sys::ucp_err_handling_mode_t_UCP_ERR_HANDLING_MODE_PEER;
            let mut ep = ptr::null_mut();
            // SAFETY: a live worker; the address is padded with zeros; valid out-pointer.
            assert_eq!(unsafe { sys::ucp_ep_create(worker, &ep_params, &mut ep) }, 0);
            // A forged key naming no memory domain (host memory, then zeros where UCX may
            // look for more): over tcp the software get does not need one.
            let key = vec![0u8; 4096];
            let mut rkey = ptr::null_mut();
            // SAFETY: a live endpoint; the key is followed by zeros far past what UCX reads.
            assert_eq!(unsafe { sys::ucp_ep_rkey_unpack(ep, key.as_ptr() as *const c_void, &mut rkey) }, 0);
            Attacker { context, worker, ep, rkey }
        }

        /// `ucp_get_nbx` of `len` bytes at `address` in the peer: the bytes, or `None` when
        /// no reply came within `wait`.
        pub fn get(&mut self, address: u64, len: usize, wait: Duration) -> Option<Vec<u8>> {
            let mut dst = vec![0u8; len];
            let param: sys::ucp_request_param_t = zeroed();
            // SAFETY: `dst` outlives the request: we return only after it completed, or
            // after the endpoint was force-closed (which completes it) below.
            let sp = unsafe {
                sys::ucp_get_nbx(self.ep, dst.as_mut_ptr() as *mut c_void, len, address, self.rkey, &param)
            };
            let req = match ucx_rs::decode_status_ptr(sp) {
                Ok(None) => return Some(dst),
                Ok(Some(r)) => r,
                Err(_) => return None,
            };
            let until = Instant::now() + wait;
            loop {
                // SAFETY: a live worker of ours, progressed by this thread only.
                unsafe { sys::ucp_worker_progress(self.worker) };
                // SAFETY: a live request, not yet freed.
                let s = unsafe { sys::ucp_request_check_status(req) };
                if s != sys::ucs_status_t_UCS_INPROGRESS {
                    // SAFETY: completed; freed once.
                    unsafe { sys::ucp_request_free(req) };
                    return (s == 0).then_some(dst);
                }
                if Instant::now() > until {
                    self.close();
                    loop {
                        // SAFETY: as above.
                        unsafe { sys::ucp_worker_progress(self.worker) };
                        // SAFETY: as above.
                        if unsafe { sys::ucp_request_check_status(req) } != sys::ucs_status_t_UCS_INPROGRESS {
                            break;
                        }
                    }
                    // SAFETY: completed (cancelled by the close); freed once.
                    unsafe { sys::ucp_request_free(req) };
                    return None;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }

        fn close(&mut self) {
            if self.ep.is_null() {
                return;
            }
            // SAFETY: the key belongs to this endpoint; destroyed once, before the close.
            unsafe { sys::ucp_rkey_destroy(self.rkey) };
            let mut p: sys::ucp_request_param_t = zeroed();
            p.op_attr_mask = sys::ucp_op_attr_t_UCP_OP_ATTR_FIELD_FLAGS;
            p.flags = sys::ucp_ep_close_flags_t_UCP_EP_CLOSE_FLAG_FORCE;
            // SAFETY: a live endpoint, closed once.
            let sp = unsafe { sys::ucp_ep_close_nbx(self.ep, &p) };
            self.ep = ptr::null_mut();
            if let Ok(Some(r)) = ucx_rs::decode_status_ptr(sp) {
                // SAFETY: progressing our worker until the close completes; freed once.
                unsafe {
                    while sys::ucp_request_check_status(r) == sys::ucs_status_t_UCS_INPROGRESS {
                        sys::ucp_worker_progress(self.worker);
                    }
                    sys::ucp_request_free(r);
                }
            }
        }
    }

    impl Drop for Attacker {
        fn drop(&mut self) {
            self.close();
            // SAFETY: the worker and context are ours, released once, in order.
            unsafe {
                sys::ucp_worker_destroy(self.worker);
                sys::ucp_cleanup(self.context);
            }
        }
    }
}

#[test]
fn one_sided_gets_at_the_exporter_read_nothing() {
    if role().is_some() {
        return;
    }
    let exporter = Exporter::with_options(&[("TLS", "tcp")]).unwrap();
    let scope = exporter.scope().unwrap();
    let secret = pattern(9, 4096);
    let at = secret.as_ptr() as u64;
    let blob = scope.export(secret).unwrap();
    // The export's own address (this test shares the exporter's address space), then an
    // unmapped one.
    let mut attacker = raw_rma::Attacker::connect(exporter.worker_address());
    let got = attacker.get(at, 4096, Duration::from_secs(2));
    assert!(got.is_none(), "a one-sided get read {} bytes of the exporter", got.map_or(0, |g| g.len()));
    drop(attacker);
    let mut attacker = raw_rma::Attacker::connect(exporter.worker_address());
    assert!(attacker.get(0x10, 64, Duration::from_secs(2)).is_none());
    drop(attacker);
    // Alive, and serving the two-sided way.
    let importer = Importer::with_options(&[("TLS", "tcp")]).unwrap();
    assert_eq!(import(&importer, &blob).unwrap(), pattern(9, 4096));
}

/// A peer that writes UCT tcp frames by hand: UCX's tcp transport takes a connection's
/// frames right after its 8-byte magic number, before any handshake, and a `PUT_REQ` frame
/// (its header: address, length, sequence number; then the data) makes a stock UCX 1.22
/// copy the data to that address whatever `TCP_PUT_ENABLE` says. Our UCX
/// (`vendor/ucx-rs/patches`) refuses it where PUT is off, as the engine sets it, and
/// refuses frames longer than its receive buffer.
mod raw_tcp {
    use std::io::{Read, Write};
    use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
    use std::time::Duration;

    const MAGIC: u64 = 0xCAFE_BABE_1234_5678;
    /// `UCT_AM_ID_MAX + 1`.
    const PUT_REQ: u8 = 33;

    /// The inodes of this process's sockets.
    pub fn sockets() -> Vec<String> {
        std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter_map(|l| {
                let l = l.to_string_lossy().into_owned();
                Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
            })
            .collect()
    }

    /// This process's listening IPv4 tcp sockets (`/proc/self/net/tcp`, state `0A`,
    /// matched to our own socket fds), but those in `except`.
    pub fn listeners(except: &[String]) -> Vec<SocketAddrV4> {
        let ours: Vec<String> = sockets().into_iter().filter(|s| !except.contains(s)).collect();
        std::fs::read_to_string("/proc/self/net/tcp")
            .unwrap()
            .lines()
            .skip(1)
            .filter_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                if f.get(3) != Some(&"0A") || !ours.iter().any(|i| Some(&i.as_str()) == f.get(9)) {
                    return None;
                }
                let (ip, port) = f[1].split_once(':')?;
                let ip = u32::from_str_radix(ip, 16).ok()?;
                let port = u16::from_str_radix(port, 16).ok()?;
                Some(SocketAddrV4::new(Ipv4Addr::from(u32::from_be(ip)), port))
            })
            .collect()
    }

    /// Connects to `to` and sends the magic number, then `frame`.
    pub fn send(to: SocketAddrV4, frame: &[u8]) -> TcpStream {
        let mut s = TcpStream::connect(to).unwrap();
        s.write_all(&MAGIC.to_le_bytes()).unwrap();
        // The peer may close before all of an oversized frame is in.
        let _ = s.write_all(frame);
        s
    }

    /// A `PUT_REQ` frame: write `data` at `address`.
    pub fn put_req(address: u64, data: &[u8]) -> Vec<u8> {
        let mut f = vec![PUT_REQ];
        f.extend(20u32.to_le_bytes());
        f.extend(address.to_le_bytes());
        f.extend((data.len() as u64).to_le_bytes());
        f.extend(1u32.to_le_bytes());
        f.extend(data);
        f
    }

    /// An active-message frame whose header claims `claimed` bytes, followed by `sent`.
    pub fn oversized(claimed: u32, sent: usize) -> Vec<u8> {
        let mut f = vec![1u8];
        f.extend(claimed.to_le_bytes());
        f.extend(std::iter::repeat_n(0xeeu8, sent));
        f
    }

    /// A frame of `am_id` claiming exactly the `payload` that follows.
    pub fn frame(am_id: u8, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![am_id];
        f.extend((payload.len() as u32).to_le_bytes());
        f.extend(payload);
        f
    }

    /// Whether the peer closes `s` within `within` (reading and dropping what it sends).
    pub fn closed_by_peer(s: &mut TcpStream, within: Duration) -> bool {
        s.set_read_timeout(Some(within)).unwrap();
        let mut buf = [0u8; 256];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

/// Raw tcp frames at an exporter in another process (`victim`): a `PUT_REQ` aimed at its
/// canary and a frame longer than its receive buffer. Each connection is closed with a
/// named UCX error, the canary is untouched, and the exporter serves on.
#[test]
fn raw_tcp_frames_write_nothing() {
    if role().is_some() {
        return;
    }
    let log = std::env::temp_dir().join(format!("tw-victim-{}.log", std::process::id()));
    // UCX logs to stdout unless told otherwise, and stdout is the control connection; its
    // stderr is unbuffered, and goes to a file here.
    let mut cmd = std::process::Command::new(tensorwire_test_support::RoleCommand::program());
    cmd.stderr(std::fs::File::create(&log).unwrap());
    let mut victim = spawn_peer_with(cmd, "child_roles", "victim", "tcp", &[("UCX_LOG_FILE", "stderr")]);
    let blob = ExportBlob::decode(&unhex(&victim.recv().unwrap())).unwrap();
    let canary: u64 = victim.recv().unwrap().parse().unwrap();
    let listeners: Vec<std::net::SocketAddrV4> =
        victim.recv().unwrap().split_whitespace().map(|a| a.parse().unwrap()).collect();
    assert!(!listeners.is_empty(), "the victim's exporter has no IPv4 tcp listener");
    let mut canary_now = || {
        victim.send("canary");
        unhex(&victim.recv().expect("the victim died"))
    };
    let importer = Importer::with_options(&[("TLS", "tcp")]).unwrap();
    let wait_for_log = |what: &str, n: usize| {
        let until = Instant::now() + Duration::from_secs(5);
        loop {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if text.matches(what).count() >= n {
                return;
            }
            assert!(Instant::now() < until, "the victim's log names no refusal ({what:?} {n} times): {text}");
            std::thread::sleep(Duration::from_millis(10));
        }
    };

    for (i, to) in listeners.iter().enumerate() {
        let mut s = raw_tcp::send(*to, &raw_tcp::put_req(canary + 64, &[0xee; 64]));
        let closed = raw_tcp::closed_by_peer(&mut s, Duration::from_secs(3));
        let now = canary_now();
        let written = now.iter().filter(|&&b| b != CANARY).count();
        assert_eq!(written, 0, "a raw PUT_REQ to {to} wrote {written} bytes of the victim's canary");
        assert!(closed, "the victim kept the connection of a raw PUT_REQ to {to} open");
        wait_for_log("refused a PUT request", i + 1);

        let mut s = raw_tcp::send(*to, &raw_tcp::oversized(u32::MAX - 16, 4 << 20));
        assert!(
            raw_tcp::closed_by_peer(&mut s, Duration::from_secs(3)),
            "the victim kept the connection of an oversized frame to {to} open"
        );
        wait_for_log("longer than the receive segment", i + 1);
        // Alive and serving, on another connection.
        assert_eq!(canary_now(), vec![CANARY; 4096]);
        assert_eq!(import(&importer, &blob).unwrap(), pattern(4, 4096));
    }
    victim.close();
    assert!(victim.child.wait().unwrap().success());
    let _ = std::fs::remove_file(&log);
}

/// Raw tcp frames shorter than the header their id implies, and ids UCX does not define,
/// at an exporter in another process. UCX's handlers would read past such a frame, which
/// nothing outside the victim can observe, so what this checks is the refusal: each
/// connection is closed, the victim's log names the refusal, and the exporter serves on.
#[test]
fn raw_tcp_short_and_unknown_frames_are_refused() {
    if role().is_some() {
        return;
    }
    // `UCT_AM_ID_MAX` (32) is the connection manager's id, 34 `PUT_ACK`, 35 keepalive.
    const CM: u8 = 32;
    const PUT_ACK: u8 = 34;
    // A connection event no UCX sends: a frame taken as a connection frame logs it and
    // keeps the connection, so only a refusal of the id itself closes it.
    let no_event = 0x10u32.to_le_bytes();
    let frames: [(&str, Vec<u8>, &str); 6] = [
        ("an empty PUT_ACK", raw_tcp::frame(PUT_ACK, &[]), "refused a PUT ACK"),
        ("a 2-byte PUT_ACK", raw_tcp::frame(PUT_ACK, &[7, 0]), "refused a PUT ACK"),
        ("an empty connection frame", raw_tcp::frame(CM, &[]), "refused a connection frame"),
        ("a 2-byte connection frame", raw_tcp::frame(CM, &[1, 0]), "refused a connection frame"),
        // CONN_REQ (event 1) without its flags, id and address.
        ("a short connection request", raw_tcp::frame(CM, &1u32.to_le_bytes()), "refused a connection frame"),
        ("am_id 36", raw_tcp::frame(36, &no_event), "refused a frame with unknown am_id"),
    ];
    let log = std::env::temp_dir().join(format!("tw-victim-short-{}.log", std::process::id()));
    let mut cmd = std::process::Command::new(tensorwire_test_support::RoleCommand::program());
    cmd.stderr(std::fs::File::create(&log).unwrap());
    let mut victim = spawn_peer_with(cmd, "child_roles", "victim", "tcp", &[("UCX_LOG_FILE", "stderr")]);
    let blob = ExportBlob::decode(&unhex(&victim.recv().unwrap())).unwrap();
    let _canary: u64 = victim.recv().unwrap().parse().unwrap();
    let listeners: Vec<std::net::SocketAddrV4> =
        victim.recv().unwrap().split_whitespace().map(|a| a.parse().unwrap()).collect();
    assert!(!listeners.is_empty(), "the victim's exporter has no IPv4 tcp listener");
    let importer = Importer::with_options(&[("TLS", "tcp")]).unwrap();
    let logged = |what: &str| std::fs::read_to_string(&log).unwrap_or_default().matches(what).count();
    let logged_more = |what: &str, before: usize| {
        let until = Instant::now() + Duration::from_secs(5);
        while logged(what) <= before {
            if Instant::now() >= until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        true
    };

    // Every frame is tried, and all that pass unrefused are named together.
    let mut unrefused = Vec::new();
    for to in &listeners {
        for (name, frame, refusal) in &frames {
            let before = logged(refusal);
            let mut s = raw_tcp::send(*to, frame);
            if !raw_tcp::closed_by_peer(&mut s, Duration::from_secs(3)) {
                unrefused.push(format!("{name} to {to}: the connection stayed open"));
            }
            if !logged_more(refusal, before) {
                unrefused.push(format!("{name} to {to}: the log has no new {refusal:?}"));
            }
            // Alive and serving, on another connection.
            victim.send("canary");
            assert_eq!(unhex(&victim.recv().expect("the victim died")), vec![CANARY; 4096]);
            assert_eq!(import(&importer, &blob).unwrap(), pattern(4, 4096));
        }
    }
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(unrefused.is_empty(), "frames the victim did not refuse:\n{}\nits log: {text}", unrefused.join("\n"));
    victim.close();
    assert!(victim.child.wait().unwrap().success());
    let _ = std::fs::remove_file(&log);
}
