// Give the shared library a SONAME so C/C++ consumers record `libtensorwire.so` as a
// normal dependency (CMake then sets RUNPATH for build-tree and install consumers).
fn main() {
    // Only with the C ABI: cargo also hands this argument to the cdylibs of packages that
    // depend on this one (the Python binding), which must keep their own names.
    if std::env::var_os("CARGO_FEATURE_C_ABI").is_some() {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libtensorwire.so");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
