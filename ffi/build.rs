// Give the shared library a SONAME so C/C++ consumers record `libtensorwire.so` as a
// normal dependency (CMake then sets RUNPATH for build-tree and install consumers). cargo
// names the file after the lib target (libtensorwire_ffi.so); the CMake package installs
// it as libtensorwire.so, the name it answers to.
fn main() {
    println!("cargo:rustc-link-arg-cdylib=-Wl,-soname,libtensorwire.so");
    println!("cargo:rerun-if-changed=build.rs");
}
