// Give the shared library a SONAME so C/C++ consumers record `libtensorwire.so` as a
// normal dependency (CMake then sets RUNPATH for build-tree and install consumers).
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libtensorwire.so");
    println!("cargo:rerun-if-changed=build.rs");
}
