//! The file-system allow-list (landlock), built in the supervisor and enforced by the
//! worker before it execs, so every thread of the worker is under it from its first
//! instruction (landlock binds the threads that exist when it is enforced, and an
//! interpreter that imported torch already has more than one).
//!
//! Readable (and executable): what the spec names, the program, and the system's
//! libraries and loader configuration; writable: what the spec names. A GPU worker also
//! gets the NVIDIA device files (with their ioctls), what the driver reads as it starts
//! and the driver library's directory. Every other path
//! is denied, for every right the running kernel's landlock knows (best effort, with the
//! ABI reported by `probe`); with `deny_network`, TCP bind and connect are denied too
//! (ABI 4), and from ABI 6 the worker can neither signal nor reach an abstract Unix
//! socket outside its own domain.

use super::super::Sandbox;
use crate::{Result, RpcError};
use landlock::{
    path_beneath_rules, Access, AccessFs, AccessNet, CompatLevel, Compatible, Ruleset, RulesetAttr, RulesetCreatedAttr, Scope, ABI,
};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

/// The newest rights this build knows; older kernels enforce what they have.
const NEWEST: ABI = ABI::V6;

/// Read (and execute) for every worker: the dynamic loader, the C library and the system's
/// other libraries, the loader's cache, the time zone, and the CPU's description (torch
/// reads the topology). Nothing here holds a user's data.
pub(super) const SYSTEM_READ: &[&str] = &[
    "/usr",
    "/lib",
    "/lib64",
    "/lib32",
    "/bin",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/proc/cpuinfo",
    "/sys/devices/system/cpu",
    "/dev/urandom",
];

/// Read and write for every worker: the null device.
const SYSTEM_WRITE: &[&str] = &["/dev/null"];

/// Read for a GPU worker: what the NVIDIA driver reads as it starts (its parameters and
/// the devices' PCI description). No user data.
const GPU_READ: &[&str] = &["/proc/driver/nvidia", "/proc/devices", "/sys/bus/pci", "/sys/devices", "/sys/module/nvidia"];

/// A GPU worker's device files (read, write and their ioctls): the control and UVM
/// devices, every GPU (`/dev/nvidiaN`) and the capability devices (MIG). The worker still
/// sees only the GPUs `CUDA_VISIBLE_DEVICES` names to it.
fn gpu_devices() -> Vec<PathBuf> {
    let Ok(dir) = std::fs::read_dir("/dev") else { return Vec::new() };
    let mut devices: Vec<PathBuf> = dir
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.starts_with("nvidia")))
        .collect();
    devices.sort();
    devices
}

/// The directories of the CUDA driver library (`libcuda.so.1`) as the worker's loader will
/// find it through `LD_LIBRARY_PATH` (kept in its environment): a driver outside the
/// system's library directories (a compat package, a simulated driver) must be readable.
fn driver_library_dirs() -> Vec<PathBuf> {
    let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") else { return Vec::new() };
    let mut dirs = Vec::new();
    for dir in std::env::split_paths(&paths).filter(|d| d.is_absolute()) {
        let lib = dir.join("libcuda.so.1");
        if lib.exists() {
            if let Some(real) = std::fs::canonicalize(&lib).ok().and_then(|r| r.parent().map(Path::to_path_buf)) {
                dirs.push(real);
            }
            dirs.push(dir);
        }
    }
    dirs
}

fn existing<'a>(paths: impl IntoIterator<Item = &'a Path>) -> Vec<PathBuf> {
    paths.into_iter().filter(|p| p.exists()).map(Path::to_path_buf).collect()
}

/// The ruleset for `sandbox` (not yet enforced: the worker does that).
pub(super) fn ruleset(sandbox: &Sandbox, program: &Path) -> Result<OwnedFd> {
    let fail = |e: &dyn std::fmt::Display| RpcError::Io(format!("sandbox: landlock: {e}"));
    let program = which(program);
    let mut read = existing(SYSTEM_READ.iter().map(Path::new));
    read.extend(existing(sandbox.read.iter().map(PathBuf::as_path)));
    read.extend(program);
    let mut write = existing(SYSTEM_WRITE.iter().map(Path::new));
    if sandbox.gpu {
        read.extend(existing(GPU_READ.iter().map(Path::new)));
        read.extend(driver_library_dirs());
        write.extend(gpu_devices());
    }
    for p in &sandbox.write {
        if !p.exists() {
            return Err(RpcError::InvalidArgument(format!("sandbox: the writable path {} does not exist", p.display())));
        }
        write.push(p.clone());
    }
    let mut rs = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(AccessFs::from_all(NEWEST))
        .map_err(|e| fail(&e))?;
    if sandbox.deny_network {
        rs = rs.handle_access(AccessNet::from_all(NEWEST)).map_err(|e| fail(&e))?;
    }
    let created = rs
        .scope(Scope::AbstractUnixSocket | Scope::Signal)
        .map_err(|e| fail(&e))?
        .create()
        .map_err(|e| fail(&e))?
        .add_rules(path_beneath_rules(&read, AccessFs::from_read(NEWEST)))
        .map_err(|e| fail(&e))?
        .add_rules(path_beneath_rules(&write, AccessFs::from_all(NEWEST)))
        .map_err(|e| fail(&e))?;
    let fd: Option<OwnedFd> = created.into();
    fd.ok_or_else(|| RpcError::Unsupported("sandbox: this kernel cannot enforce a file-system allow-list (landlock is not available)".into()))
}

/// The program's file: as given when it has a `/`, else found on `PATH` as exec would.
fn which(program: &Path) -> Option<PathBuf> {
    if program.components().count() > 1 {
        return Some(program.to_path_buf());
    }
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).map(|d| d.join(program)).find(|c| c.is_file()))
        .unwrap_or(None)
}
