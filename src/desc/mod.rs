//! `TensorDesc`: the fixed-size wire descriptor of a tensor view, and `Layout`, the
//! shape/stride part of it that callers build views with.
//!
//! A descriptor from a peer is untrusted bytes. [`TensorDesc::decode`] copies them into a
//! private value and validates everything before anything else reads a field: version,
//! dtype, device, storage kind, ndim limit, zero padding, non-negative sizes, strides and
//! offset, overflow anywhere in the extent arithmetic, and that the whole strided extent
//! lies inside the storage it names. Whether that storage really is that large is checked
//! again against the actual mapping when the descriptor is resolved.

mod descriptor;
mod dtype;
mod layout;
mod pack;
mod signal;

pub use descriptor::{StorageRef, TensorDesc, DESC_SIZE, FLAG_SIGNAL_WORD};
pub use dtype::{DType, DeviceType, StorageKind};
pub use layout::Layout;
pub use pack::PackCursor;
pub use signal::Signal;

pub use crate::wire::descriptor::{DESC_MAGIC, DESC_VERSION, MAX_NDIM};
