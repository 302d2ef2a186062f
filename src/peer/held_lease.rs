//! The consumer's side of one lease (`HeldLease`), which both kinds of import hold, and
//! the accessors both have (`import_accessors!`).

use super::Inner;
use crate::error::{Error, Result};
use crate::lease::LeaseId;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// The consumer's side of one lease: released once, explicitly or on drop.
pub(super) struct HeldLease {
    pub(super) inner: Arc<Inner>,
    pub(super) lease: LeaseId,
    pub(super) released: bool,
}

impl HeldLease {
    /// An explicit release: says `PeerGone` if the peer has gone (one `poll` to know).
    pub(super) fn release(&mut self) -> Result<()> {
        self.release_as(self.inner.conn.is_peer_gone())
    }

    fn release_as(&mut self, gone: bool) -> Result<()> {
        self.released = true;
        if self.inner.stop.load(Ordering::Acquire) || gone {
            return Err(Error::peer_gone("the connection ended before the lease was released"));
        }
        self.inner.imports.table.release(self.lease)
    }
}

impl Drop for HeldLease {
    fn drop(&mut self) {
        if !self.released {
            // Nobody reads this result, so what is already known is enough (asking the
            // kernel would cost a `poll` for every dropped tensor). A release written into
            // the table of a peer that has just died is harmless (the table stays mapped
            // here until we close).
            let _ = self.release_as(self.inner.conn.known_gone());
        }
    }
}

/// The accessors both imports ([`Imported`], [`CudaImported`]) have, over their `desc`
/// and `tag` fields.
macro_rules! import_accessors {
    () => {
        /// The validated descriptor.
        pub fn desc(&self) -> &TensorDesc {
            &self.desc
        }
        /// The view's layout.
        pub fn layout(&self) -> Layout {
            self.desc.layout()
        }
        /// The tag the producer sent with the tensor.
        pub fn tag(&self) -> u64 {
            self.tag
        }
    };
}
pub(super) use import_accessors;
