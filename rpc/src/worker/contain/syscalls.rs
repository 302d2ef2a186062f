//! The system-call policy a sandboxed worker applies to itself (every thread, `TSYNC`)
//! after its interpreter started and before the code it serves runs: `execve` must still
//! work for the start itself, and the interpreter's own start-up is trusted code.
//!
//! Three filters: seccompiler's (its architecture check kills a process that makes a
//! system call of another architecture, e.g. `int 0x80` on x86-64; then the deny list
//! below, answered `EPERM`); `clone3` answered `ENOSYS`, so the C library falls back to
//! `clone`, whose namespace flags the first filter can read (`clone3` passes them in
//! memory, out of a filter's reach); and on x86-64 the x32 system-call range refused.

use super::super::Sandbox;
use crate::{Result, RpcError};
use seccompiler::{sock_filter, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule};
use std::collections::BTreeMap;
use std::sync::OnceLock;

/// System calls a worker never needs, refused whatever their arguments: the keyring,
/// kernel extension points (bpf, perf, userfaultfd, io_uring, modules, kexec), namespaces
/// and mounts, other processes' memory and fds, escaping the process group and session,
/// and the host-wide switches (reboot, swap, accounting, quotas, the kernel log).
const DENIED: &[libc::c_long] = &[
    libc::SYS_keyctl,
    libc::SYS_add_key,
    libc::SYS_request_key,
    libc::SYS_bpf,
    libc::SYS_perf_event_open,
    libc::SYS_userfaultfd,
    libc::SYS_io_uring_setup,
    libc::SYS_io_uring_enter,
    libc::SYS_io_uring_register,
    libc::SYS_unshare,
    libc::SYS_setns,
    libc::SYS_mount,
    libc::SYS_umount2,
    libc::SYS_pivot_root,
    libc::SYS_chroot,
    libc::SYS_move_mount,
    libc::SYS_open_tree,
    libc::SYS_fsopen,
    libc::SYS_fsconfig,
    libc::SYS_fsmount,
    libc::SYS_fspick,
    libc::SYS_mount_setattr,
    libc::SYS_ptrace,
    libc::SYS_process_vm_readv,
    libc::SYS_process_vm_writev,
    libc::SYS_pidfd_getfd,
    libc::SYS_kcmp,
    libc::SYS_setsid,
    libc::SYS_setpgid,
    libc::SYS_name_to_handle_at,
    libc::SYS_open_by_handle_at,
    libc::SYS_kexec_load,
    libc::SYS_kexec_file_load,
    libc::SYS_init_module,
    libc::SYS_finit_module,
    libc::SYS_delete_module,
    libc::SYS_reboot,
    libc::SYS_swapon,
    libc::SYS_swapoff,
    libc::SYS_acct,
    libc::SYS_quotactl,
    libc::SYS_syslog,
];

/// Calls that act on another process by pid: refused for any pid but 0 (the caller)
/// when the worker has no pid namespace of its own (in one, no pid names a process
/// outside it, and threads set their own affinity by thread id).
const ON_OTHERS: &[libc::c_long] =
    &[libc::SYS_sched_setaffinity, libc::SYS_sched_setscheduler, libc::SYS_sched_setparam, libc::SYS_sched_setattr, libc::SYS_prlimit64];

/// `clone` flags that create namespaces.
const NEW_NAMESPACE_FLAGS: &[libc::c_int] = &[
    libc::CLONE_NEWNS,
    libc::CLONE_NEWUSER,
    libc::CLONE_NEWPID,
    libc::CLONE_NEWNET,
    libc::CLONE_NEWIPC,
    libc::CLONE_NEWUTS,
    libc::CLONE_NEWCGROUP,
];

fn fail(e: &dyn std::fmt::Display) -> RpcError {
    RpcError::Io(format!("sandbox: seccomp: {e}"))
}

fn cond(arg: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompCondition> {
    SeccompCondition::new(arg, SeccompCmpArgLen::Qword, op, value).map_err(|e| fail(&e))
}

fn rule(conds: Vec<SeccompCondition>) -> Result<SeccompRule> {
    SeccompRule::new(conds).map_err(|e| fail(&e))
}

/// The deny list for `sandbox` (answered `EPERM`).
fn deny_list(sandbox: &Sandbox) -> Result<BTreeMap<i64, Vec<SeccompRule>>> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED.iter().map(|&nr| (nr, Vec::new())).collect();
    let mut clone_rules = Vec::new();
    for &flag in NEW_NAMESPACE_FLAGS {
        clone_rules.push(rule(vec![cond(0, SeccompCmpOp::MaskedEq(flag as u64), flag as u64)?])?);
    }
    rules.insert(libc::SYS_clone, clone_rules);
    // setpriority(which, who, prio): `who` 0 is the caller (its process, group or user).
    let others = |arg| -> Result<Vec<SeccompRule>> { Ok(vec![rule(vec![cond(arg, SeccompCmpOp::Ne, 0)?])?]) };
    rules.insert(libc::SYS_setpriority, others(1)?);
    if !sandbox.namespaces {
        for &nr in ON_OTHERS {
            rules.insert(nr, others(0)?);
        }
    }
    if sandbox.deny_network {
        // Every family: the worker has its connection (and `socketpair` stays), and a
        // Unix socket it could open would reach any listening path (`docker.sock`, an
        // ssh agent, a session bus) or, outside a network namespace, abstract name.
        rules.insert(libc::SYS_socket, Vec::new());
    }
    if sandbox.deny_exec {
        rules.insert(libc::SYS_execve, Vec::new());
        rules.insert(libc::SYS_execveat, Vec::new());
    }
    Ok(rules)
}

fn arch() -> Result<seccompiler::TargetArch> {
    std::env::consts::ARCH.try_into().map_err(|e: seccompiler::BackendError| fail(&e))
}

/// The x32 range refused on x86-64: x32 calls carry the x86-64 architecture tag with bit
/// 30 set in their number, so a filter that checks only the tag and the numbers it lists
/// would let `0x40000000 | nr` through (on kernels built with x32).
fn x32_filter() -> Vec<sock_filter> {
    const AUDIT_ARCH_X86_64: u32 = 0xC000_003E;
    const X32_SYSCALL_BIT: u32 = 0x4000_0000;
    let stmt = |code: u16, k: u32| sock_filter { code, jt: 0, jf: 0, k };
    let jump = |code: u16, k: u32, jt: u8, jf: u8| sock_filter { code, jt, jf, k };
    // Classic BPF opcodes (linux/bpf_common.h): class | size | mode, class | op | source.
    const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
    const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
    const JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
    const RET_K: u16 = 0x06; // BPF_RET | BPF_K
    vec![
        stmt(LD_W_ABS, 4),                             // seccomp_data.arch
        jump(JEQ_K, AUDIT_ARCH_X86_64, 0, 3),          // another architecture: the first filter's
        stmt(LD_W_ABS, 0),                             // seccomp_data.nr
        jump(JGE_K, X32_SYSCALL_BIT, 0, 1),
        stmt(RET_K, libc::SECCOMP_RET_ERRNO | libc::EPERM as u32),
        stmt(RET_K, libc::SECCOMP_RET_ALLOW),
    ]
}

fn compile(rules: BTreeMap<i64, Vec<SeccompRule>>, answer: SeccompAction) -> Result<Vec<sock_filter>> {
    let filter = SeccompFilter::new(rules, SeccompAction::Allow, answer, arch()?).map_err(|e| fail(&e))?;
    filter.try_into().map_err(|e: seccompiler::BackendError| fail(&e))
}

/// Apply `sandbox`'s system-call policy to every thread of this process, once: a
/// second call (the worker entry point applies it before importing its target, and
/// `serve` makes sure) returns the first's result.
pub(crate) fn apply_in_worker(sandbox: &Sandbox) -> Result<()> {
    static APPLIED: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    APPLIED.get_or_init(|| apply(sandbox).map_err(|e| e.to_string())).clone().map_err(RpcError::Io)
}

fn apply(sandbox: &Sandbox) -> Result<()> {
    // SAFETY: prctl with integer arguments; PR_SET_NO_NEW_PRIVS only ever restricts (the
    // launcher set it before exec too; a worker started another way needs it for TSYNC).
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) } != 0 {
        return Err(RpcError::io("prctl(PR_SET_NO_NEW_PRIVS)", std::io::Error::last_os_error()));
    }
    let mut programs = vec![compile(deny_list(sandbox)?, SeccompAction::Errno(libc::EPERM as u32))?];
    programs.push(compile([(libc::SYS_clone3, Vec::new())].into_iter().collect(), SeccompAction::Errno(libc::ENOSYS as u32))?);
    if cfg!(target_arch = "x86_64") {
        programs.push(x32_filter());
    }
    for p in &programs {
        seccompiler::apply_filter_all_threads(p).map_err(|e| fail(&e))?;
    }
    Ok(())
}
