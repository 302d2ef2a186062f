//! The `tensorwire` command: `tensorwire demo` is the main job (see `demo.rs`).

#[cfg(not(loom))]
mod demo;

#[cfg(not(loom))]
fn main() -> std::process::ExitCode {
    demo::main()
}

// Under `--cfg loom` only the protocol modules exist; the binary is an empty shell so
// that cargo can still build it next to the loom tests.
#[cfg(loom)]
fn main() {}
