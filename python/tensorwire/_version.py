"""The package's version: the Rust crate's (Cargo.toml), which is also what pyproject.toml
reads for the wheel's metadata; python/tests/test_package.py checks all three agree."""

__version__ = "0.1.0"
