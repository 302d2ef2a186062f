//! The environment a sandboxed worker starts with: an allow-list of this process's
//! variables (locale, time zone, terminal, temporary directory, thread counts, the GPU's
//! visibility, the loader's path), then what the spec names. Secrets live in the
//! environment (`AWS_*`, tokens, `SSH_AUTH_SOCK`), so nothing else is passed on.

use std::process::Command;

/// Variables passed on by name when this process has them.
pub const KEPT_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "LANG",
    "LANGUAGE",
    "TZ",
    "TERM",
    "TMPDIR",
    "PYTHONHASHSEED",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "LD_LIBRARY_PATH",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "CUDA_MODULE_LOADING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE",
];

/// Variables passed on by prefix: the locale's categories, NVIDIA's container settings
/// and tensorwire's own settings.
pub const KEPT_ENV_PREFIXES: &[&str] = &["LC_", "NVIDIA_", "TENSORWIRE_"];

fn kept(name: &str) -> bool {
    KEPT_ENV.contains(&name) || KEPT_ENV_PREFIXES.iter().any(|p| name.starts_with(p))
}

/// Clear `cmd`'s environment but the allow-listed variables of this process. Variables
/// set on `cmd` afterwards (the spec's, the connection's) are added on top.
pub(super) fn restrict(cmd: &mut Command) {
    let explicit: Vec<(std::ffi::OsString, Option<std::ffi::OsString>)> =
        cmd.get_envs().map(|(k, v)| (k.to_owned(), v.map(|v| v.to_owned()))).collect();
    cmd.env_clear();
    for (k, v) in std::env::vars_os() {
        if k.to_str().is_some_and(kept) {
            cmd.env(k, v);
        }
    }
    for (k, v) in explicit {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::kept;

    #[test]
    fn secrets_are_not_kept_and_the_locale_is() {
        for name in ["AWS_SECRET_ACCESS_KEY", "SSH_AUTH_SOCK", "GITHUB_TOKEN", "DBUS_SESSION_BUS_ADDRESS", "DISPLAY", "PYTHONPATH"] {
            assert!(!kept(name), "{name} must not reach a sandboxed worker unless the spec names it");
        }
        for name in ["PATH", "LANG", "LC_ALL", "NVIDIA_VISIBLE_DEVICES", "TENSORWIRE_CUDA_WAIT"] {
            assert!(kept(name), "{name} is on the allow-list");
        }
    }
}
